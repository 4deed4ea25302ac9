"""Pieces of loadtest/loadtest.py and deploy/healthcheck.py that need no server (the
warm-up left out of the measurements, the report's and the plot's labels), and the
load test's several-target and sharded modes against the two real replicas of
``topology`` (tests/deploy/conftest.py)."""

from __future__ import annotations

import http.server
import importlib.util
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from loadtest import loadtest  # the checkout's package (installed: attnserve.loadtest)
from loadtest.report import git_commit, plot_title

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


healthcheck = _load("attnserve_healthcheck", ROOT / "deploy" / "healthcheck.py")


def test_percentile_is_linear_interpolation():
    rng = np.random.default_rng(0)
    xs = sorted(rng.exponential(size=101).tolist())
    for q in (0, 1, 50, 90, 99, 100):
        assert loadtest.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(loadtest.percentile([], 50))
    stats = loadtest.op_stats([0.001, 0.002, 0.003])
    assert stats == {"count": 3, "p50_ms": 2.0, "p90_ms": 2.8, "p99_ms": 2.98, "max_ms": 3.0, "mean_ms": 2.0}


def test_prometheus_text_and_deltas():
    text = """# HELP attnserve_requests_total x
# TYPE attnserve_requests_total counter
attnserve_requests_total{route="/v1/sessions/{session_id}",method="PUT",status="201"} 20
attnserve_build_info{version="0.1.0",adapter="llvmpipe (LLVM 15.0.6, 256 bits)",backend="Vulkan"} 1
attnserve_gpu_jobs_total 7 1700000000000
attnserve_ready 1
garbage line
"""
    parsed = loadtest.parse_prometheus(text)
    assert parsed['attnserve_requests_total{route="/v1/sessions/{session_id}",method="PUT",status="201"}'] == 20
    assert (
        parsed['attnserve_build_info{version="0.1.0",adapter="llvmpipe (LLVM 15.0.6, 256 bits)",backend="Vulkan"}'] == 1
    )
    assert parsed["attnserve_gpu_jobs_total"] == 7
    assert len(parsed) == 4
    after = dict(parsed, attnserve_gpu_jobs_total=10.0, attnserve_new_total=2.0)
    assert loadtest.metric_delta(parsed, after) == {"attnserve_gpu_jobs_total": 3.0, "attnserve_new_total": 2.0}


@pytest.mark.parametrize("url", ["http://127.0.0.1:8421", "http://localhost:1", "http://127.3.2.1:80"])
def test_loopback_targets_are_accepted(url):
    loadtest.check_loopback([url])


@pytest.mark.parametrize(
    "url", ["http://10.1.2.3:8421", "http://192.168.0.10:80", "https://8.8.8.8", "http://[2001:db8::1]:80"]
)
def test_other_targets_are_refused_before_any_traffic(url):
    with pytest.raises(loadtest.UsageError, match="not a loopback address"):
        loadtest.check_loopback([url])


def test_main_refuses_a_remote_url_with_exit_2(capsys):
    start = time.monotonic()
    assert loadtest.main(["--url", "http://10.9.8.7:8421", "--duration", "1"]) == 2
    assert time.monotonic() - start < 5
    assert "not a loopback address" in capsys.readouterr().err


def test_usage_errors_exit_2():
    for argv in (
        ["--mode", "open"],
        ["--kv-heads", "3"],
        ["--verify", "0.5", "--kv-format", "turboquant"],
        ["--sessions", "0"],
        ["--url", "http://127.0.0.1:1", "--url", "http://127.0.0.1:1"],
        ["--shards", "2", "--batched"],
        ["--shards", "2", "--create", "post"],
        ["--shards", "2", "--decode-steps", "0"],
        ["--shard-tokens", "-1"],
        ["--warmup-s", "-1"],
    ):
        with pytest.raises(SystemExit) as info:
            loadtest.parse_args(argv)
        assert info.value.code == 2, argv


def test_several_targets_repeated_or_comma_separated():
    cfg = loadtest.parse_args(["--url", "http://127.0.0.1:1/,http://127.0.0.1:2", "--url", "http://127.0.0.1:3"])
    assert cfg.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert cfg.url == cfg.urls[0] and cfg.metrics_urls == cfg.urls  # every target's /metrics by default
    assert not cfg.sharded
    assert loadtest.parse_args([]).urls == ["http://127.0.0.1:8421"]
    # a session of 20 + 10 timesteps in 4 shards: 8 timesteps each; or as given
    sharded = loadtest.parse_args(["--shards", "4", "--prefill", "20", "--decode-steps", "10"])
    assert sharded.sharded and sharded.shard_size() == 8
    assert loadtest.parse_args(["--shard-tokens", "5", "--decode-steps", "0"]).shard_size() == 5


def test_help_names_the_formats_and_no_empty_defaults():
    from attnserve.formats import KV_FORMATS

    r = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "loadtest.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},  # one line per option
    )
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "(default: None)" not in text and "(default: [])" not in text, text
    assert "never shown" in text  # --api-key still says where its default comes from
    assert "(default: 30.0)" in text  # a real default is still shown
    kv_format = next(line for line in text.splitlines() if line.strip().startswith("--kv-format"))
    for name in KV_FORMATS:
        assert re.search(rf"\b{re.escape(name)}\b", kv_format), (name, kv_format)


def test_reference_decode_matches_a_plain_loop():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 16)).astype(np.float32)
    k = rng.standard_normal((13, 2, 16)).astype(np.float32)
    v = rng.standard_normal((13, 2, 16)).astype(np.float32)
    got = loadtest.reference_decode(q, k, v)
    for h in range(8):
        s = k[:, h // 4].astype(np.float64) @ q[h] / 4.0
        w = np.exp(s - s.max())
        np.testing.assert_allclose(got[h], (w / w.sum()) @ v[:, h // 4], rtol=1e-12, atol=1e-12)


def test_error_kinds():
    from attnserve_client import APIConnectionError, parse_problem

    err = parse_problem(404, b'{"type":"/problems/session-not-found","title":"t","status":404}', {})
    assert loadtest.error_kind(err) == "session-not-found"
    assert loadtest.error_kind(APIConnectionError("refused")) == "APIConnectionError"
    assert loadtest.error_kind(loadtest.WrongResult("x")) == "wrong-result"


class _Probe(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_exit_codes():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Probe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/readyz"
    try:
        _Probe.status = 200
        assert healthcheck.main(["hc", url]) == 0
        _Probe.status = 503
        assert healthcheck.main(["hc", url]) == 1
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert healthcheck.main(["hc", f"http://127.0.0.1:{closed}/readyz"]) == 1


@pytest.mark.parametrize(
    "create, expected",
    [
        ("put", {"session_id": "sid-1", "server_assigned_id": False}),
        ("post", {"session_id": None, "server_assigned_id": True}),
    ],
)
def test_create_mode_picks_put_or_post(create, expected):
    import asyncio

    from attnserve_client import AttnServeError

    seen = {}

    class FakeClient:
        async def create_session(self, **kw):
            seen.update(kw)
            raise AttnServeError("stop here")

    cfg = loadtest.parse_args(["--create", create, "--duration", "1"])
    lt = loadtest.LoadTest(cfg, run_id="r", seed=1, t0=time.perf_counter())
    try:
        asyncio.run(lt._session(FakeClient(), np.random.default_rng(0), "sid-1", 0.1))
    except AttnServeError:
        pass
    assert {k: seen[k] for k in expected} == expected


# -- the warm-up, the report and the plot's title, of a run made up here ------------

URL = "http://127.0.0.1:1"
INFO = {
    "version": "0.1.0",
    "backend": "Vulkan",
    "adapter": {"name": "NVIDIA H200", "backend": "Vulkan", "adapter_type": "DiscreteGPU"},
}


def _made_up_report(warmup: float = 2.0) -> dict:
    """The report of a run of ``warmup`` s of warm-up and 10 s of load, as its
    recorder saw it: each second one decode step of 4 attends (one layer of 4
    sessions) that started 0.1 s in, slow (0.5 s) in the warm-up, 10 ms after it."""
    import datetime

    cfg = loadtest.parse_args(["--url", URL, "--warmup-s", str(warmup), "--duration", "10", "--prefill", "128"])
    t0 = 1000.0
    rec = loadtest.driver.Recorder(t0, cfg.warmup_s)
    for second in range(int(warmup) + 10):
        if second == warmup:
            rec.end_warmup()
        rec.ok("decode_step", t0 + second + 0.1, 0.5 if second < warmup else 0.01)
        rec.ok("decode", t0 + second + 0.1, 0.5 if second < warmup else 0.01, URL)
        rec.attends += 4
        rec.decode_tokens += 4
        rec.target(URL).attends += 4
        rec.target(URL).decode_tokens += 4
    load_end = t0 + warmup + 10
    outcome = loadtest.driver.Outcome(rec, "duration", False, load_end, load_end + 0.5)
    started = datetime.datetime(2026, 12, 5, 19, 30, tzinfo=datetime.timezone.utc)
    return loadtest.summarize(cfg, outcome, "run", 1, INFO, {}, {}, started)


def test_the_warm_up_is_not_measured():
    report = _made_up_report(warmup=2.0)
    decode_step = report["operations"]["decode_step"]
    assert decode_step["count"] == 10 and decode_step["max_ms"] == 10.0  # none of the slow warm-up steps
    assert report["warmup"] == {"seconds": 2.0, "requests": 4, "by_operation": {"decode_step": 2, "decode": 2}}
    assert report["load_seconds"] == 10.0
    # rates and totals over the 10 s after the warm-up: 4 attends and 4 decode tokens a second
    assert report["throughput"]["attends_per_s"] == 4.0 and report["throughput"]["decode_tokens_per_s"] == 4.0
    assert report["totals"]["attends"] == 40 and report["totals"]["decode_tokens"] == 40
    target = report["targets"][URL]
    assert target["attends_per_s"] == 4.0 and target["operations"]["decode"]["count"] == 10
    assert "a 2 s warm-up (4 requests not measured), then 10.0 s of load (stopped by duration)" in (
        loadtest.format_report(report)
    )
    assert loadtest.exit_code(report) == 0
    # none: everything measured
    report = _made_up_report(warmup=0.0)
    assert report["operations"]["decode_step"]["count"] == 10 and report["warmup"]["requests"] == 0
    assert "decode steps; no warm-up, then 10.0 s of load" in loadtest.format_report(report)


def test_a_run_stopped_in_its_warm_up_measured_nothing():
    rec = loadtest.driver.Recorder(0.0, 5.0)
    rec.ok("decode", 1.0, 0.1)
    rec.attends += 1
    rec.end_warmup()  # the run stopped: what it did is the warm-up's
    rec.end_warmup()  # only the first call counts
    rec.attends += 1
    assert rec.measured("attends") == 1 and rec.samples["decode"] == [] and rec.warmup_requests == {"decode": 1}


def test_the_plot_title_names_each_quantity_and_where_and_when():
    report = _made_up_report()
    title = plot_title(report).splitlines()
    assert len(title) == 3, title
    assert "prefill 128 tokens in chunks of 64" in title[0] and "64 decode steps per session" in title[0]
    assert title[1].startswith("decode tokens/s 4.0 | attends/s 4.0 | prefill tokens/s 0.0 | errors 0")
    assert "10 s measured after a 2 s warm-up" in title[1]
    commit = report["client"]["commit"]
    assert title[2] == (
        f"NVIDIA H200 (Vulkan, DiscreteGPU) | server attnserve 0.1.0 | "
        f"load test at commit {commit or '? (not run from a git checkout)'} | 2026-12-05"
    )


def test_the_commit_is_the_checkouts():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    commit = git_commit()
    assert commit is not None and head.stdout.startswith(commit.removesuffix("-dirty")), (commit, head.stdout)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra; deploy/smoke-loadtest.sh installs it
    report = _made_up_report()
    report["_samples"] = {op: [] for op in report["operations"]}
    report["_samples"]["decode_step"] = [(2.1 + s, 0.01) for s in range(10)]
    loadtest.write_plot(report, str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- several targets and sharded sessions, against the two replicas of ``topology`` --


def _live_run(topology, *extra: str) -> dict:
    import asyncio

    urls = [r.url for r in topology.replicas]
    args = ["--url", ",".join(urls), "--duration", "3", "--layers", "2", "--prefill", "20", "--chunk", "8"]
    args += ["--decode-steps", "6", "--qo-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seed", "5"]
    cfg = loadtest.parse_args([*args, "--progress", "off", "--verify", "0.5", "--warmup-s", "1", *extra])
    report = asyncio.run(loadtest.run(cfg))
    assert report["error_count"] == 0, (report["errors"], report["error_examples"])
    assert report["warmup"]["seconds"] == 1 and report["warmup"]["requests"] > 0, report["warmup"]
    assert all(t >= 1 for op in report["_samples"].values() for t, _ in op)  # measured: started after it
    assert report["verify"]["checked"] > 0 and report["verify"]["failed"] == 0
    assert loadtest.exit_code(report) == 0
    assert set(report["targets"]) == set(urls) == set(report["server_metrics"])
    for url in urls:  # every target attended query rows of the run (HTTP or stream), by its own metrics
        delta = report["server_metrics"][url]["delta"]
        assert any(key.startswith("attnserve_rows_total{") and 'kind="query"' in key for key in delta), url
    return report


def test_sessions_spread_over_several_replicas(topology):
    report = _live_run(topology, "--sessions", "4")
    targets = report["targets"]
    # users 0, 2 on the first target, 1, 3 on the second; each reported on its own
    assert all(t["sessions"] >= 2 and t["attends_per_s"] > 0 and t["shards"] == 0 for t in targets.values())
    assert sum(t["sessions"] for t in targets.values()) == report["totals"]["sessions_started"]
    decodes = sum(t["operations"]["decode"]["count"] for t in targets.values())
    assert decodes == report["operations"]["decode"]["count"] > 0
    assert "2 targets" in loadtest.format_report(report)


def test_sharded_sessions_over_several_replicas(topology):
    # 26 timesteps per session in 3 shards of 9: every decode step attends 2 or 3
    # shards, on both replicas, merged; verified against float64
    report = _live_run(topology, "--sessions", "2", "--shards", "3")
    assert report["shard_tokens"] == 9
    shards = {url: t["shards"] for url, t in report["targets"].items()}
    assert all(n > 0 for n in shards.values()), shards
    totals = report["totals"]  # a session the end of the run cut short holds fewer shards
    assert 3 * totals["sessions_completed"] <= sum(shards.values()) <= 3 * totals["sessions_started"], (shards, totals)
    assert totals["sessions_completed"] > 0
    assert "sessions sharded in 9 timesteps" in loadtest.format_report(report)


def test_batched_steps_over_several_replicas(topology):
    # one cohort of 4 sessions, 2 on each replica: every step is one stacked step per
    # replica, over each replica's stream
    report = _live_run(topology, "--sessions", "4", "--batched")
    assert all(t["sessions"] >= 2 and t["decode_tokens_per_s"] > 0 for t in report["targets"].values())
    assert report["operations"]["decode_batch"]["count"] > 0
