"""The documentation names only files that exist: every relative Markdown link
resolves, every path to a .md file in backticks is in the repository, and every
bare ``name.md`` is some file of the repository."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "client" / "README.md"])
REPO_MD = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts and ".git" not in p.parts}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_names_only_files_that_exist(doc):
    text = doc.read_text()
    missing = []
    for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        target = m.group(1)
        if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
            missing.append(target)
    for m in re.finditer(r"`([\w.-]+(?:/[\w.-]+)+\.md)`", text):
        if not ((doc.parent / m.group(1)).exists() or (ROOT / m.group(1)).exists()):
            missing.append(m.group(1))
    for m in re.finditer(r"(?<![\w/.-])([\w-]+\.md)\b", text):
        if m.group(1) not in REPO_MD:
            missing.append(m.group(1))
    assert missing == []


FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the text as rendered (links, images and
    emphasis reduced to their text), lowercased, every character that is not a
    letter, digit, underscore, hyphen or space dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every anchor of the headings of ``doc``, duplicates numbered -1, -2 as GitHub
    numbers them; headings inside fenced code blocks are not headings."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m is None:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_github_slug_follows_github_rules():
    assert github_slug("Decode variants side by side (bench/probes/decode_sweep.py)") == (
        "decode-variants-side-by-side-benchprobesdecode_sweeppy"
    )
    assert github_slug("Restarts: the snapshot directory") == "restarts-the-snapshot-directory"
    assert github_slug("The `tq4o` format, **bold** and [a link](x.md)") == "the-tq4o-format-bold-and-a-link"
    doc_text = "# A\n## Same\n```\n## Same\n```\n## Same\n### Same\n"
    tmp = ROOT / "tests" / ".anchors-probe.md"
    try:
        tmp.write_text(doc_text)
        assert anchors(tmp) == {"a", "same", "same-1", "same-2"}
    finally:
        tmp.unlink()


def citing_files(suffixes: set[str] = frozenset()) -> list[Path]:
    """The repository's code, scripts and configuration (and Markdown outside
    ``DOCS``; and files ending in ``suffixes``), without virtual environments, git's
    own files and this file."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in {".venv", ".git", "node_modules", "__pycache__"}]
        for name in files:
            path = Path(folder) / name
            if path.suffix in {".py", ".sh", ".yml", ".conf", ".md", ".toml", *suffixes} and path not in DOCS:
                found.append(path)
    return sorted(set(found) - {Path(__file__).resolve()})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_anchors_resolve(doc):
    """Every ``[text](#fragment)`` names a heading of the same page, and every
    ``[text](other.md#fragment)`` a heading of that page."""
    text = doc.read_text()
    own = anchors(doc)
    dead = []
    for m in re.finditer(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        target, fragment = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        if target == "":
            ok = fragment in own
        else:
            path = doc.parent / target
            ok = path.suffix != ".md" or (path.exists() and fragment in anchors(path))
        if not ok:
            dead.append(f"{target}#{fragment}")
    assert dead == []


def test_code_citing_doc_anchors_resolves():
    """Code, scripts and configuration that cite ``docs/name.md#fragment`` name a
    heading that exists."""
    dead = []
    for path in citing_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in re.finditer(r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)", text):
            target = ROOT / m.group(1)
            if not target.exists():
                target = path.parent / m.group(1)
            if not (target.exists() and m.group(2) in anchors(target)):
                dead.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert dead == []


def test_code_citing_doc_headings_by_name_resolves():
    """Code, scripts and result files that cite a heading by its name
    (``docs/deploy.md, "Health check start period"``, across comment lines too) name
    a heading that exists."""
    cited = re.compile(r"""((?:[\w.-]+/)*[\w-]+\.md)[,:]?\s+(["'])([^"'\n]{3,120})\2""")
    dead = []
    found = 0
    for path in citing_files(suffixes={".json"}):
        try:
            text = re.sub(r"\n\s*#\s*", " ", path.read_text())
        except UnicodeDecodeError:
            continue
        for m in cited.finditer(text):
            target = ROOT / m.group(1)
            if not target.exists():
                target = path.parent / m.group(1)
            if not target.exists():
                continue  # a file name in a sentence; the link tests cover names
            found += 1
            if github_slug(m.group(3)) not in anchors(target):
                dead.append(f"{path.relative_to(ROOT)}: {m.group(1)} {m.group(3)!r}")
    assert found > 0
    assert dead == []
