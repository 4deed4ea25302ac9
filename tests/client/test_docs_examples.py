"""Every Python example of the user docs runs as pasted, against a live server.

The fenced blocks of README.md, client/README.md, docs/client.md and
docs/transformers.md, by their info string:

- ```` ```python ````: a program of its own. It runs in a fresh namespace with
  ``ATTNSERVE_BASE_URL`` naming the live server (the examples connect with
  ``Client()``, which reads it, as a user's shell would), and must leave no session
  behind on the server.
- ```` ```python continuation ````: the next part of the program above it (the
  same namespace): a program whose steps the text explains one by one.
- ```` ```python notest ````: a sketch that cannot run as it is (a signature, or
  code that needs a CUDA GPU or several servers); not run.

The server serves the frame and shared-memory transports too (``frames_port``,
``shm_socket``), as the streams examples need. An example that imports a module this environment lacks (torch,
transformers, the SmolLM2 GGUF) is skipped on a developer machine and fails under
CI (``CI`` set), where everything is installed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from attnserve_client import Client

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "client/README.md", "docs/client.md", "docs/transformers.md"]
FENCE = re.compile(r"^```python(?:[ \t]+(\S+))?[ \t]*$")
KINDS = {None: "program", "continuation": "continuation", "notest": "notest"}

# What some programs print, by (doc, a text of their first block): a regex searched in it.
PRINTS = {
    ("README.md", "Client()"): r"^\(1, 8, 64\) 17\n\(1, 8, 64\) 18\n\(1, 8, 64\) 19\n$",
    ("docs/transformers.md", "model.generate("): r"^\[.*Paris",  # two continuations, the first names Paris
}


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    kind: str
    code: str


def blocks(doc: str) -> list[Block]:
    """The ```python blocks of ``doc``, in order."""
    found: list[Block] = []
    lines = (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        i += 1
        if m is None:
            continue
        assert m.group(1) in KINDS, f"{doc}:{i}: ```python {m.group(1)}: expected one of continuation, notest"
        start = i
        while not lines[i].startswith("```"):
            i += 1
        found.append(Block(doc, start, KINDS[m.group(1)], "\n".join(lines[start:i]) + "\n"))
        i += 1
    return found


def programs() -> list[list[Block]]:
    """Each program: a ``python`` block and the continuations after it."""
    out: list[list[Block]] = []
    for doc in DOCS:
        for block in blocks(doc):
            if block.kind == "program":
                out.append([block])
            elif block.kind == "continuation":
                assert out and out[-1][0].doc == doc, f"{doc}:{block.line}: a continuation of no program"
                out[-1].append(block)
    return out


PROGRAMS = programs()


def test_every_doc_has_examples_that_run():
    # the files above have runnable examples (a renamed file, or a fence info string
    # that hides them all, fails here); README's and the guide's first ones are programs
    assert {p[0].doc for p in PROGRAMS} == set(DOCS)
    assert [b.kind for b in blocks("README.md")][0] == "program"
    assert [b.kind for b in blocks("docs/client.md")][:2] == ["program", "program"]
    for (doc, marker), _ in PRINTS.items():
        assert any(p[0].doc == doc and marker in p[0].code for p in PROGRAMS), (doc, marker)


@pytest.fixture(scope="module")
def server_url(start_live_server, tmp_path_factory):
    server = start_live_server(frames_port=0, shm_socket=str(tmp_path_factory.mktemp("shm") / "attnserve.sock"))
    try:
        yield server.url
    finally:
        server.stop()


def real_model(program: list[Block]) -> bool:
    """Whether a program loads a real model (transformers' from_pretrained: SmolLM2)."""
    return any("from_pretrained(" in block.code for block in program)


# A real model's program generates for minutes on a busy 2-core machine: slow (`-m
# "not slow"` leaves it out), with a timeout of its own. CI runs it.
@pytest.mark.parametrize(
    "program",
    [pytest.param(p, marks=[pytest.mark.slow, pytest.mark.timeout(1800)] if real_model(p) else []) for p in PROGRAMS],
    ids=[f"{p[0].doc}:{p[0].line}" for p in PROGRAMS],
)
def test_the_example_runs_as_pasted(program, server_url, monkeypatch, capsys):
    monkeypatch.setenv("ATTNSERVE_BASE_URL", server_url)
    with Client(server_url) as client:
        before = {s.session_id for s in client.list_sessions()}
        namespace = {"__name__": "__main__"}
        try:
            for block in program:
                exec(compile(block.code, f"{block.doc}:{block.line}", "exec"), namespace)
        except ModuleNotFoundError as exc:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"the example needs {exc.name}, not installed here")
        assert {s.session_id for s in client.list_sessions()} == before  # it cleaned up after itself
    printed = capsys.readouterr().out
    for (doc, marker), pattern in PRINTS.items():
        if program[0].doc == doc and marker in program[0].code:
            assert re.search(pattern, printed, re.S), printed
