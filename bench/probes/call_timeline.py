#!/usr/bin/env python3
"""Where one layer call's time goes, stage by stage, on both sides of the frame
transport (issue 43 item 3: "show where each of the 1.17 ms goes").

The probe serves this checkout in a child process whose stage functions are
wrapped to stamp their entry and exit (``time.perf_counter``: CLOCK_MONOTONIC on
Linux, one clock for both processes), drives it with the client over the frames,
stamps the client's own stages the same way, and lines the stamps up call by call.
Each row of the output is the p50 over the calls of the time from the call's start
to a stage boundary, and of each stage's length:

    client  call ........ the client starts the call (builds the frame)
            sent ........ its frame is in the socket
    loop    frame ....... the event loop has the whole frame; parse
            queue ....... the checks and the reservation (``step.plan.queue_request``)
    GPU     take ........ the GPU thread has the job
            plan ........ the commands planned (a later layer runs its step's plan)
            encode ...... recorded and submitted (the compiled call)
            readback .... the wait for the GPU and the copy out of the readback
            finish ...... the items' results set (the loop is woken)
    loop    send ........ the answer made and written
    client  recv ........ the client's reader has the whole answer frame
            settle ...... the answer decoded into arrays, the caller woken
            end

    python bench/probes/call_timeline.py [--adapter nvidia] [--forms one,stacked]
        [--batches 1,32] [--shape 32,8,128] [--context 4096] [--layers 30]
        [--calls 300] [--dtype f32] [--kv-format f32] [--json-out FILE]

A call's steps go through the layers in turn, as an engine's decode does (a step's
plan is made on layer 0 and run on the others). The wraps cost about a
microsecond a stamp; the probe says where the time goes, ``bench/service.py``
says how long a call takes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client"), str(ROOT)]

#: (module, owner of the function or None for a module function, name, stage)
SERVER_STAMPS = (
    ("attnserve.transport.frames", "_Connection", "_frame_done", "frame"),
    ("attnserve.transport.frames", "_Connection", "send", "send"),
    ("attnserve.transport.ops", None, "queue_request", "queue"),
    ("attnserve.gpu.device", "GpuWorker", "_take", "take"),
    ("attnserve.gpu.device", "GpuWorker", "_submit_batch", "plan"),
    ("attnserve.gpu.batch", "Batch", "encode", "encode"),
    ("attnserve.gpu.batch", "Batch", "read_back", "readback"),
    ("attnserve.gpu.device", "GpuWorker", "_settle", "finish"),
)
CLIENT_STAMPS = (
    ("attnserve_client._streams", None, "_send_all", "sent"),
    ("attnserve_client._streams", None, "_frame_document", "recv"),
    ("attnserve_client._streams", None, "_settle", "settle"),
)
#: the stage boundaries, in order: (name, stamp, "<" entry or ">" exit)
BOUNDARIES = (
    ("sent", "sent", ">"),
    ("frame", "frame", "<"),
    ("queue", "queue", "<"),
    ("queued", "queue", ">"),
    ("take", "take", ">"),
    ("plan", "plan", "<"),
    ("planned", "encode", "<"),
    ("encoded", "encode", ">"),
    ("read back", "readback", ">"),
    ("finished", "finish", ">"),
    ("send", "send", "<"),
    ("written", "send", ">"),
    ("recv", "recv", "<"),
    ("settled", "settle", ">"),
)
#: the boundaries that are the exit of a function which wakes the call's caller before
#: it returns (the GPU worker's ``_settle`` sets the futures, the loop's ``send`` writes
#: the answer, the client's ``_settle`` sets the call's future): a call's may come after
#: its end, in the next call's span, so each is the first exit after the call's own
#: entry, not the first exit in its span (which may be the previous call's)
AFTER_ENTRY = {"finished", "written", "settled"}


def stamp_all(stamps: tuple[tuple[str, str | None, str, str], ...], events: list[tuple[float, str]]) -> None:
    """Wrap each function of ``stamps`` to append ``(time, stage + "<" or ">")`` to
    ``events`` at its entry and exit (list.append holds the GIL: safe from any thread)."""
    import importlib

    for module_name, owner_name, name, stage in stamps:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        fn = getattr(owner, name)

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _stage: str = stage, **k: Any) -> Any:
            events.append((time.perf_counter(), _stage + "<"))
            try:
                return _fn(*a, **k)
            finally:
                events.append((time.perf_counter(), _stage + ">"))

        setattr(owner, name, functools.wraps(fn)(wrapped))
        if owner_name is None:  # a module function named elsewhere by an import: there too
            for other in list(sys.modules.values()):
                if other is not module and getattr(other, name, None) is fn:
                    setattr(other, name, getattr(owner, name))


def serve_stamped(port: int, out: str) -> int:
    """The server, its stages stamped; the stamps written to ``out`` every 0.2 s."""
    sys.path[:0] = [str(ROOT / "service")]
    import attnserve.step.plan  # noqa: F401  (imported before the wraps: ops names its function)
    import attnserve.transport.frames  # noqa: F401

    events: list[tuple[float, str]] = []
    stamp_all(SERVER_STAMPS, events)

    def dump() -> None:
        while True:
            time.sleep(0.2)
            at = time.perf_counter()  # every stamp made before it is in the copy
            Path(out + ".tmp").write_text(json.dumps({"at": at, "events": events[:]}))
            os.replace(out + ".tmp", out)

    threading.Thread(target=dump, daemon=True).start()
    from attnserve.cli import main as cli_main

    return cli_main(["serve", "--host", "127.0.0.1", "--port", str(port)])


def timeline(calls: list[tuple[float, float]], events: list[tuple[float, str]]) -> dict[str, Any]:
    """Per boundary, the p50 of (its first stamp within a call - the call's start),
    in ms; per stage (between consecutive boundaries), the p50 of its length."""
    events.sort()
    times = np.array([t for t, _ in events])
    names = [n for _, n in events]
    per_call: list[dict[str, float]] = []
    for t0, t1 in calls:
        lo, hi = np.searchsorted(times, t0), np.searchsorted(times, t1)
        first: dict[str, int] = {}
        for i in range(lo, hi):
            first.setdefault(names[i], i)
        marks = {"call": 0.0}
        for name, stage, edge in BOUNDARIES:
            at = first.get(stage + edge)
            if name in AFTER_ENTRY:
                entry = first.get(stage + "<")
                exits = (i for i in range(entry or 0, len(names)) if names[i] == stage + ">")
                at = None if entry is None else next(exits, None)
            if at is not None:
                marks[name] = times[at] - t0
        marks["end"] = t1 - t0
        per_call.append(marks)
    order = ["call", *[b[0] for b in BOUNDARIES], "end"]
    at = {
        n: round(1e3 * float(np.median([m[n] for m in per_call if n in m])), 3)
        for n in order
        if any(n in m for m in per_call)
    }
    present = [n for n in order if n in at]
    stages = {}
    for a, b in zip(present, present[1:]):
        gaps = [m[b] - m[a] for m in per_call if a in m and b in m]
        stages[f"{a} -> {b}"] = round(1e3 * float(np.median(gaps)), 3)
    return {"at_ms": at, "stages_ms": stages, "calls": len(calls)}


def _returned(events: list[tuple[float, str]], stages: set[str]) -> bool:
    """Whether every call of a function of ``stages`` stamped in ``events`` has returned."""
    names = [n for _, n in events]
    return all(names.count(stage + "<") == names.count(stage + ">") for stage in stages)


def _stamps_of(out: str, end: float, events: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """The server's stamps once they hold every call up to the last's ``end``: a dump
    made after it, in which every stamped function has returned (the GPU worker's
    ``_take``, waiting for the next job, aside), and the client's own likewise (its
    reader may still be in ``_settle``)."""
    server_stages = {stage for *_, stage in SERVER_STAMPS} - {"take"}
    client_stages = {stage for *_, stage in CLIENT_STAMPS}
    deadline = time.monotonic() + 60
    while True:
        try:
            dump = json.loads(Path(out).read_text())
        except (OSError, ValueError):  # not written yet
            dump = {"at": -np.inf, "events": []}
        server_events = [tuple(e) for e in dump["events"]]
        if dump["at"] > end and _returned(server_events, server_stages) and _returned(events, client_stages):
            return server_events  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise SystemExit("the server's stamps of the last call did not come in 60 s")
        time.sleep(0.05)


def drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    from attnserve_client import Client

    from tools.common import as_dtype, free_port

    H, HKV, D = (int(x) for x in args.shape.split(","))
    port, out = free_port(), f"/tmp/attnserve-call-timeline-{os.getpid()}.json"
    env = dict(
        os.environ,
        ATTNSERVE_ADAPTER=args.adapter,
        ATTNSERVE_LOG_LEVEL="warning",
        ATTNSERVE_FRAMES_PORT=str(free_port()),
        XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"),
    )
    server = subprocess.Popen([sys.executable, __file__, "--serve-stamped", str(port), out], env=env)
    events: list[tuple[float, str]] = []
    stamp_all(CLIENT_STAMPS, events)
    results = []
    try:
        with Client(f"http://127.0.0.1:{port}", timeout=120) as c:
            for _ in range(1200):
                try:
                    if c.ready():
                        break
                except Exception:  # not listening yet
                    pass
                if server.poll() is not None:
                    raise SystemExit("the server exited")
                time.sleep(0.1)
            rng = np.random.default_rng(0)
            for batch in (int(b) for b in args.batches.split(",")):
                sessions = [
                    c.create_session(
                        num_qo_heads=H, num_kv_heads=HKV, head_dim=D, kv_format=args.kv_format, num_layers=args.layers
                    )
                    for _ in range(batch)
                ]
                rows = rng.standard_normal((args.context, HKV, D), dtype=np.float32)
                for s in sessions:
                    for layer in range(args.layers):
                        s.append(layer, rows, rows)
                q = as_dtype(rng.standard_normal((batch, 1, H, D), dtype=np.float32), args.dtype)
                k = as_dtype(rng.standard_normal((batch, 1, HKV, D), dtype=np.float32), args.dtype)
                for form in args.forms.split(","):
                    if form == "one" and batch != 1:
                        continue
                    calls: list[tuple[float, float]] = []
                    with c.stream(transport="frames") as fr:
                        for i in range(args.calls + args.layers):
                            layer = i % args.layers
                            t0 = time.perf_counter()
                            if form == "one":
                                fr.attend(sessions[0], layer, q[0], k=k[0], v=k[0])
                            else:
                                fr.attend_stacked(sessions, layer, q, k=k, v=k)
                            if i >= args.layers:  # the first token's calls make the plans
                                calls.append((t0, time.perf_counter()))
                    server_events = _stamps_of(out, calls[-1][1], events)
                    row = {
                        "form": form, "batch": batch, "shape": [H, HKV, D], "context": args.context,
                        "layers": args.layers, "dtype": args.dtype, "kv_format": args.kv_format,
                        **timeline(calls, events + server_events),  # type: ignore[arg-type]
                    }  # fmt: skip
                    print(json.dumps(row), flush=True)
                    results.append(row)
                for s in sessions:
                    s.delete()
    finally:
        server.terminate()
        server.wait(30)
        Path(out).unlink(missing_ok=True)
    return results


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-stamped":
        raise SystemExit(serve_stamped(int(sys.argv[2]), sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=os.environ.get("ATTNSERVE_ADAPTER", ""))
    ap.add_argument("--forms", default="one,stacked", help="one (an attend) and stacked (attend_batch)")
    ap.add_argument("--batches", default="1,32", help="sessions per call, comma-separated")
    ap.add_argument("--shape", default="32,8,128", help="q heads, KV heads, head dim")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dtype", default="f32", choices=("f32", "f16", "bf16"), help="the arrays' dtype")
    ap.add_argument("--kv-format", default="f32")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    results = drive(args)
    from tools.common import write_result

    write_result(args.json_out, {"probe": "call_timeline", "args": vars(args) | {"json_out": None}, "rows": results})


if __name__ == "__main__":
    main()
