"""bench/probes/call_timeline.py (issue 43 item 3: where a layer call's time goes)
stamps what it says it stamps: run small on the tests' adapter, every stage boundary
of both forms is found in every call, in the order a call passes them, the stages
are the gaps between the boundaries, and the whole call is at least their sum's
largest part, so the probe cannot silently report an empty or shuffled timeline."""

from __future__ import annotations

import json

import pytest

from script_helpers import run_script

pytestmark = pytest.mark.gpu

#: the boundaries a call passes, in order (the probe's BOUNDARIES, and its ends)
ORDER = [
    "call", "sent", "frame", "queue", "queued", "take", "plan", "planned", "encoded", "read back", "finished",
    "send", "written", "recv", "settled", "end",
]  # fmt: skip


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
        assert list(at) == ORDER, row  # every boundary found, in the order a call passes them
        offsets = [at[name] for name in ORDER]
        assert offsets == sorted(offsets) and offsets[0] == 0.0 < offsets[-1], row
        stages = row["stages_ms"]
        assert list(stages) == [f"{a} -> {b}" for a, b in zip(ORDER, ORDER[1:])]
        assert all(v >= 0 for v in stages.values()), row
        # p50s of parts do not add up exactly, but no part passes the whole
        assert max(stages.values()) <= at["end"], row
