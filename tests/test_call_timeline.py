"""bench/probes/call_timeline.py (issue 43 item 3: where a layer call's time goes)
stamps what it says it stamps: run small on the tests' adapter, every stage boundary
of both forms is found, in the order a call passes them wherever one stamp causes
the next, the stages are the gaps between the boundaries, and the whole call is at
least each part that lies within it, so the probe cannot silently report an empty or
shuffled timeline.

The boundaries are stamped by four threads in two processes: the client's caller
(call, sent, end) and reader (recv, settled), the server's event loop (frame, queue,
queued, send, written) and GPU worker (take ... finished). Each thread's own stamps
come in its order in every call; across threads only what a stamp causes is ordered
(the frame is built after the call starts, the job is taken after it is queued, the
answer is sent after it is read back, read after it is sent, and returned after it
is read). The rest race, and no order between them is asserted: "written" (the
server's send() returning) against "recv" (the client reading the frame; first in
139 of 300 calls on a 2-core machine), "sent" against "frame", "queued" against
"take", "finished" against "send", "settled" against "end". What holds in every call
holds for the p50s the probe reports, as each call's boundaries are its own (a late
exit too, below) and all there (the probe waits for the last call's): a median of
values each at most another's is at most its median."""

from __future__ import annotations

import importlib.util
import json

import pytest

from script_helpers import ROOT, run_script

#: the boundaries a call passes, in order (the probe's BOUNDARIES, and its ends)
ORDER = [
    "call", "sent", "frame", "queue", "queued", "take", "plan", "planned", "encoded", "read back", "finished",
    "send", "written", "recv", "settled", "end",
]  # fmt: skip
#: each thread's boundaries, in the order it stamps them in every call
THREADS = {
    "client caller": ["call", "sent", "end"],
    "client reader": ["recv", "settled"],
    "server loop": ["frame", "queue", "queued", "send", "written"],
    "GPU worker": ["take", "plan", "planned", "encoded", "read back", "finished"],
}
#: (a, b) across threads: a causes b, so a comes first in every call
CAUSED = [("call", "frame"), ("queue", "take"), ("read back", "send"), ("send", "recv"), ("recv", "end")]
#: every (a, b) with a at or before b in every call
BEFORE = [pair for order in THREADS.values() for pair in zip(order, order[1:])] + CAUSED
#: the boundaries that may come after the call's end (a function's return after it woke
#: the caller): the probe's AFTER_ENTRY
LATE = {"finished", "written", "settled"}


@pytest.mark.gpu
def test_call_timeline_stamps_every_stage_in_order(engine, tmp_path):  # engine: an adapter is there
    out = tmp_path / "timeline.json"
    r = run_script(
        "bench/probes/call_timeline.py", "--batches", "1,3", "--shape", "4,2,16", "--context", "20",
        "--layers", "3", "--calls", "24", "--json-out", str(out), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["probe"] == "call_timeline"
    rows = doc["rows"]
    assert [(row["form"], row["batch"]) for row in rows] == [("one", 1), ("stacked", 1), ("stacked", 3)]
    assert [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")] == rows
    for row in rows:
        assert row["calls"] == 24 and row["shape"] == [4, 2, 16] and row["layers"] == 3
        at = row["at_ms"]
        assert list(at) == ORDER, row  # every boundary found
        assert at["call"] == 0.0 < at["end"], row
        for a, b in BEFORE:
            assert at[a] <= at[b], (a, b, row)
        stages = row["stages_ms"]
        assert list(stages) == [f"{a} -> {b}" for a, b in zip(ORDER, ORDER[1:])]
        for a, b in zip(ORDER, ORDER[1:]):
            if (a, b) in BEFORE:  # the rest race: their gap has no sign
                assert stages[f"{a} -> {b}"] >= 0, (a, b, row)
            if not {a, b} & LATE:  # p50s of parts do not add up exactly, but no part passes the whole
                assert stages[f"{a} -> {b}"] <= at["end"], (a, b, row)


def _probe():
    spec = importlib.util.spec_from_file_location("call_timeline", ROOT / "bench/probes/call_timeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_late_exit_is_its_own_calls_not_the_next_ones():
    """A call's "written" (the server's send() returning), "finished" (the GPU worker's
    _settle returning) and "settled" (the client's) can come after the call's end, as
    the answer is on its way before they return, inside the next call's span: each
    call's is the exit of its own entry, never another call's that lands first in its
    span. Made-up stamps, no server: a call stamps one event a millisecond."""
    probe = _probe()
    assert probe.AFTER_ENTRY == LATE
    ORDERED = ["sent<", "sent>", "frame<", "frame>", "queue<", "take>", "queue>", "plan<", "encode<", "encode>",
               "plan>", "finish<", "readback<", "readback>", "finish>", "send<", "send>", "recv<", "recv>",
               "settle<", "settle>"]  # fmt: skip
    span = 1e-3 * (len(ORDERED) + 1)  # a call from t0 to t0 + span, its events 1 ms apart

    def stamps(t0: float) -> list[tuple[float, str]]:
        return [(t0 + 1e-3 * (i + 1), name) for i, name in enumerate(ORDERED)]

    in_time = probe.timeline([(0.0, span)], stamps(0.0))["at_ms"]
    for name, stamp in (("finished", "finish>"), ("written", "send>"), ("settled", "settle>")):
        assert in_time[name] == ORDERED.index(stamp) + 1, in_time
        # the first call's exit 0.5 ms into the second call's span
        events = [(t, n) for t, n in stamps(0.0) if n != stamp] + [(1.0005, stamp)] + stamps(1.0)
        assert probe.timeline([(0.0, span)], events)["at_ms"][name] == 1000.5, name
        assert probe.timeline([(1.0, 1.0 + span)], events)["at_ms"] == in_time, name
