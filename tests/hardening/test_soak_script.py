"""soak/soak.py's pieces that need no server (the soak itself runs in CI through
soak/ci-soak.sh: about a minute against a real server on lavapipe)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("attnserve_soak", ROOT / "soak" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attnserve_soak"] = module
    spec.loader.exec_module(module)
    return module


soak = _load()


def test_usage_and_loopback_only(capsys):
    with pytest.raises(SystemExit) as e:
        soak.main(["--help"])
    assert e.value.code == 0 and "--duration" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        soak.main(["--url", "http://127.0.0.1:1", "--spawn"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="not a loopback address"):
        soak.check_loopback("http://192.0.2.1:8421")
    soak.check_loopback("http://127.0.0.1:8421")
    soak.check_loopback("http://[::1]:8421")


def test_metrics_and_percentiles():
    text = (
        '# HELP x\nattnserve_kv_bytes{kv_format="f32"} 4096\nattnserve_kv_bytes{kv_format="turboquant"} 5e2\n'
        "attnserve_memory_used_bytes 4596\nattnserve_sessionsX 3\n"
    )
    m = soak.parse_prometheus(text)
    assert soak.metric_sum(m, "attnserve_kv_bytes") == 4596 and m["attnserve_memory_used_bytes"] == 4596
    assert soak.metric_sum(m, "attnserve_sessions") == 0
    xs = list(np.random.default_rng(0).exponential(size=101))
    for q in (0, 50, 99, 100):
        assert soak.pct(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_session_bookkeeping():
    s = soak.Sess("a", 0, "f32", 4, 2, 8, 2)
    k = np.ones((3, 2, 8), np.float32)
    s.add(1, k, k)
    c = s.copy("b")
    c.add(0, k[:1], k[:1])
    assert s.lengths == [0, 3] and c.lengths == [1, 3] and c.sid == "b"
