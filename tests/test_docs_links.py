"""The documentation names only files that exist: every relative Markdown link
resolves, every path to a .md file in backticks is in the repository, and every
bare ``name.md`` is some file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "client" / "README.md"])
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
