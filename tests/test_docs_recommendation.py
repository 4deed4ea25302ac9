"""One answer to "what do I choose" (issue 52): the docs name the default kv format and
the recommended compressed setting that ``attnserve.formats`` holds
(``DEFAULT_KV_FORMAT``, ``RECOMMENDED``), and no other; they quote the recommended
setting's figures as docs/fidelity.md's headline row gives them; the README's
quickstart creates its session with it; and the pages that compare transports name
shared memory. No GPU.

The pages are read clause by clause (a table row, or a sentence of a paragraph or list
item): a claim and what it is about sit in one clause, so wording elsewhere does not
matter."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from attnserve.formats import DEFAULT_KV_FORMAT, KV_FORMATS, RECOMMENDED, TQ_SPECS

ROOT = Path(__file__).resolve().parents[1]
#: The pages that say what to choose: each names the default and the recommendation.
PAGES = ["README.md", "docs/concepts.md", "docs/api.md", "docs/fidelity.md", "docs/benchmarks.md"]
#: Every user doc: none may call another format recommended or the default.
ALL_DOCS = sorted(
    str(p.relative_to(ROOT)) for p in [ROOT / "README.md", ROOT / "client" / "README.md", *ROOT.glob("docs/*.md")]
)
#: The pages that compare transports, and the section that does (None: the page):
#: each names shared memory beside the others.
TRANSPORT_PAGES = {
    "README.md": "## What to choose",
    "docs/concepts.md": "## Transports",
    "docs/api.md": None,
    "docs/benchmarks.md": "### Service throughput and latency per transport",
    "docs/client.md": "## Streams",
    "docs/transformers.md": "## What it does",
    "docs/deploy.md": "## The load test",
}

# a kv format's name as a word (the longest first: tq4v3 before tq4)
FORMAT = re.compile(
    r"(?<![\w-])(" + "|".join(sorted(map(re.escape, KV_FORMATS), key=len, reverse=True)) + r")(?![\w-])"
)
SINKS = re.compile(r"(\d+) (?:exact )?sinks|sinks[:=]? *(\d+)|sinks\W{0,3}(\d+)")
WINDOW = re.compile(r"window of (\d+)|window[:=]? *(\d+)|window\W{0,3}(\d+)")
DEFAULT_CLAIM = re.compile(r"\bdefault (?:kv[ _]format|`kv_format`|format)\b|\(the default(?: kv format)?\)")


def clauses(doc: str) -> list[str]:
    """The table rows and the sentences of ``doc``, code blocks left out."""
    text = re.sub(r"^```.*?^```", "", (ROOT / doc).read_text(), flags=re.M | re.S)
    out: list[str] = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |\|))", text):
        block = " ".join(block.split())
        if block.startswith("|"):
            out.append(block)
        else:  # sentences: a full stop (not of "e.g.", "i.e.") before a capital, a backtick or a bracket
            out += re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z`*(\[])", block)
    return [c for c in out if c]


def formats_in(clause: str) -> set[str]:
    return set(FORMAT.findall(clause))


def numbers(pattern: re.Pattern[str], clause: str) -> set[int]:
    return {int(next(g for g in m.groups() if g)) for m in pattern.finditer(clause)}


def defaults(clause: str) -> list[str]:
    """The formats ``clause`` calls the default: the one named next after "default kv
    format" (or "default format", "default `kv_format`"), the one just before "(the
    default)"."""
    out = []
    for m in DEFAULT_CLAIM.finditer(clause):
        if m.group(0).startswith("("):
            named = FORMAT.findall(clause[: m.start()])[-1:]
        else:
            named = FORMAT.findall(clause[m.end() :])[:1]
        out += named
    return out


def names_recommended(clause: str) -> bool:
    """``clause`` names the recommended setting: its format, sinks and window, with
    their numbers."""
    return (
        RECOMMENDED.kv_format in formats_in(clause)
        and numbers(SINKS, clause) == {RECOMMENDED.sinks}
        and numbers(WINDOW, clause) == {RECOMMENDED.window}
    )


def headline() -> dict[str, float]:
    """docs/fidelity.md's figures of the recommended setting: its row in the table of
    "Current figures" marked (recommended)."""
    section = (ROOT / "docs/fidelity.md").read_text().split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("|") and "(recommended)" in r]
    assert len(rows) == 1, rows
    assert names_recommended(rows[0]), rows[0]
    cells = [c.strip().strip("*") for c in rows[0].strip("|").split("|")]
    bits, top1, kl, dppl = map(float, cells[1:5])
    return {"bits": bits, "top1": top1, "kl": kl, "dppl": dppl}


def test_the_one_place_holds_a_valid_setting():
    assert DEFAULT_KV_FORMAT in KV_FORMATS and RECOMMENDED.kv_format in TQ_SPECS
    assert RECOMMENDED.sinks > 0 and RECOMMENDED.window > 0
    # the headline's bits are the setting's, counted at 32k timesteps and head_dim 128
    assert headline()["bits"] == round(RECOMMENDED.bits_per_element(128, 32768), 2)


@pytest.mark.parametrize("doc", PAGES)
def test_the_page_names_the_default_and_the_recommended_setting(doc):
    found = clauses(doc)
    default = [c for c in found if DEFAULT_KV_FORMAT in defaults(c)]
    assert default, f"{doc}: no clause says the default kv format is {DEFAULT_KV_FORMAT}"
    recommended = [c for c in found if re.search(r"recommended", c, re.I) and names_recommended(c)]
    assert recommended, f"{doc}: no clause names the recommended setting, {RECOMMENDED}"


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_no_page_recommends_or_defaults_to_another(doc):
    bad = []
    for c in clauses(doc):
        if re.search(r"default compressed", c, re.I):
            bad.append(("a default compressed format (there is none)", c))
        named = formats_in(c)
        if re.search(r"recommend", c, re.I) and named and RECOMMENDED.kv_format not in named:
            bad.append((f"recommends {sorted(named)}, not {RECOMMENDED.kv_format}", c))
        if re.search(r"recommend", c, re.I) and RECOMMENDED.kv_format in named:
            for what, pattern, want in (("sinks", SINKS, RECOMMENDED.sinks), ("window", WINDOW, RECOMMENDED.window)):
                if numbers(pattern, c) - {want}:
                    bad.append((f"recommends {what} {sorted(numbers(pattern, c))}, not {want}", c))
        for fmt in defaults(c):
            if fmt != DEFAULT_KV_FORMAT:
                bad.append((f"calls {fmt} the default kv format, not {DEFAULT_KV_FORMAT}", c))
    assert not bad, f"{doc}:\n" + "\n".join(f"  {why}: {c[:300]}" for why, c in bad)


@pytest.mark.parametrize("doc", [d for d in ALL_DOCS if d != "docs/fidelity.md"])
def test_the_recommended_settings_figures_are_fidelitys(doc):
    """Where a page quotes the bits or the KL of the recommended setting (from a
    mention of its format with sinks and a window to the next format named or the
    clause's end), they are the headline's. docs/fidelity.md itself is the source,
    with its other measures of the setting (another model run, decoded positions)."""
    want = headline()
    bad = []
    for c in clauses(doc):
        for cell in c.split("|"):
            spans = [m for m in FORMAT.finditer(cell)]
            for i, m in enumerate(spans):
                if m.group(1) != RECOMMENDED.kv_format:
                    continue
                span = cell[m.start() : spans[i + 1].start() if i + 1 < len(spans) else len(cell)]
                if not ("sink" in span and "window" in span):
                    continue  # the format alone
                for bits in re.findall(r"(\d+\.\d+) bits", span):
                    if float(bits) != want["bits"]:
                        bad.append((f"{bits} bits, not {want['bits']}", span))
                for kl in re.findall(r"KL (?:of )?(\d+\.\d+)", span):
                    if float(kl) != want["kl"]:
                        bad.append((f"KL {kl}, not {want['kl']}", span))
    assert not bad, f"{doc}:\n" + "\n".join(f"  {why}: {c[:300]}" for why, c in bad)


def test_the_client_defaults_to_the_default_kv_format():
    # the client package cannot import the server's: its default is its own copy
    from attnserve_client import Client

    assert inspect.signature(Client._create_flow).parameters["kv_format"].default == DEFAULT_KV_FORMAT


def test_the_readme_quickstart_creates_the_recommended_setting():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert code is not None, "README.md: no Python example"
    calls = [
        node
        for node in ast.walk(ast.parse(code.group(1)))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "create_session"
    ]
    assert len(calls) == 1, "README.md's first Python example creates one session"
    given = {kw.arg: ast.literal_eval(kw.value) for kw in calls[0].keywords if kw.arg in RECOMMENDED.fields()}
    assert given == RECOMMENDED.fields()


def section(doc: str, heading: str | None) -> str:
    """The text of ``doc`` under ``heading`` (to the next heading of its level or
    above), or all of it."""
    text = (ROOT / doc).read_text()
    if heading is None:
        return text
    assert f"\n{heading}\n" in text, f"{doc}: no heading {heading!r}"
    level = heading.split()[0]
    after = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"^#{{1,{len(level)}}} ", after, maxsplit=1, flags=re.M)[0]


@pytest.mark.parametrize(("doc", "heading"), TRANSPORT_PAGES.items())
def test_pages_that_compare_transports_name_shared_memory(doc, heading):
    text = section(doc, heading)
    kinds = {
        "websocket": re.search(r"/v1/stream|WebSocket", text),
        "frames": re.search(r"frame transport|transport=\"frames\"|--frames-port", text),
        "shm": re.search(r"shared memory|shared-memory|transport=\"shm\"|--shm-socket", text, re.I),
    }
    assert kinds["websocket"] and kinds["frames"], f"{doc} ({heading}) compares no transports: take it off the list"
    assert kinds["shm"], f"{doc} ({heading}) compares the transports without shared memory"


def test_the_benchmarks_table_of_transports_has_shared_memory():
    text = section("docs/benchmarks.md", "### Service throughput and latency per transport")
    header = next(line for line in text.splitlines() if line.startswith("| measure |"))
    assert "shared memory" in header, header
