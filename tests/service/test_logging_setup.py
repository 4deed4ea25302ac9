"""Log format: JSON lines for a deployment's collector, text lines on a terminal
(log_format auto, the default), either one when asked for."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from attnserve.config import Settings
from attnserve.logging_setup import configure_logging


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def root_logging():
    """The root logger's handlers and level, put back after the test (configure_logging replaces them)."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    uvicorn_loggers = {name: logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    saved_uvicorn = {name: (list(lg.handlers), lg.propagate, lg.level) for name, lg in uvicorn_loggers.items()}
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, (handlers, propagate, level) in saved_uvicorn.items():
        lg = uvicorn_loggers[name]
        lg.handlers[:], lg.propagate = handlers, propagate
        lg.setLevel(level)


def _logged(monkeypatch, fmt: str, tty: bool) -> str:
    err = _Stderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging("info", fmt)
    logging.getLogger("attnserve").info("ready", extra={"port": 8421})
    return err.getvalue()


@pytest.mark.usefixtures("root_logging")
@pytest.mark.parametrize("fmt, tty, json_lines", [
    ("auto", False, True),  # a pipe, a file, a container's log: what a collector reads
    ("auto", True, False),  # a terminal: a person reads it
    ("json", True, True),
    ("text", False, False),
])  # fmt: skip
def test_log_format(monkeypatch, fmt, tty, json_lines):
    out = _logged(monkeypatch, fmt, tty)
    assert out.endswith("\n") and out.count("\n") == 1, out
    if json_lines:
        line = json.loads(out)
        assert (line["level"], line["logger"], line["msg"], line["port"]) == ("info", "attnserve", "ready", 8421)
    else:
        with pytest.raises(json.JSONDecodeError):
            json.loads(out)
        assert out.rstrip("\n").endswith(" INFO attnserve: ready port=8421"), out


def test_auto_is_the_default_and_json_and_text_stay_choices():
    assert Settings().log_format == "auto"
    assert Settings(log_format="JSON").log_format == "json" and Settings(log_format="text").log_format == "text"
    with pytest.raises(ValueError):
        Settings(log_format="yaml")
