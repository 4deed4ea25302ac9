"""Logs on stderr: one JSON object per line (what a deployment collects), or text
lines where stderr is a terminal (``log_format`` auto, the default).

``configure_logging(level, fmt)`` installs the handler on the root logger (so
uvicorn's own messages come out the same way). Fields given with
``extra={...}`` become members of the line. The access log is one line per
request, written by the app's middleware to the ``attnserve.access`` logger:
method, route template, path, status, latency in ms, session id, request id;
never bodies nor headers such as ``Authorization``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["JsonFormatter", "configure_logging"]

# Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, object] = {
            "ts": ts,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}
        if extra:
            base += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return base


def _resolve_format(fmt: str) -> str:
    """``json`` or ``text``: ``auto`` is text when stderr is a terminal, else JSON."""
    if fmt != "auto":
        return fmt
    isatty = getattr(sys.stderr, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Log to stderr as JSON lines (``fmt="json"``), plain text (``"text"``), or
    whichever suits stderr (``"auto"``: text on a terminal, else JSON)."""
    handler = logging.StreamHandler(sys.stderr)
    if _resolve_format(fmt) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    # Our access log replaces uvicorn's.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
