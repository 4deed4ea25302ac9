"""loadtest.py's report: the summary of a run (JSON), its text form, the PNG plot
and the exit code."""

from __future__ import annotations

import datetime as _dt
import math
import platform
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

import attnserve_client

from .config import EXIT_ERRORS, EXIT_OK, OPERATIONS, Config
from .driver import RATE_TOTALS, Outcome, TargetStats, op_stats, percentile
from .prometheus import metric_delta


def git_commit() -> str | None:
    """The commit of the checkout the load test runs from (``-dirty`` with changes
    not committed), or None: installed from a wheel, or no git."""
    here = Path(__file__).resolve().parent
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", Path(__file__).name], cwd=here, capture_output=True, timeout=10
        )
        if tracked.returncode != 0:  # not a file of a checkout (a wheel installed in one's .venv)
            return None
        r = subprocess.run(
            # the commit's hash even where a tag names it (--exclude: no tag)
            ["git", "describe", "--always", "--dirty", "--exclude=*"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def summarize(
    cfg: Config,
    outcome: Outcome,
    run_id: str,
    seed: int,
    info: dict[str, Any],
    before: dict[str, Any],
    after: dict[str, Any],
    started_at: _dt.datetime | None = None,
) -> dict[str, Any]:
    """The report of a run that started at ``started_at`` (default: now)."""
    rec = outcome.rec
    end = outcome.end
    stop_at = outcome.load_end - rec.t0
    # Throughput over the load phase: from the end of the warm-up until the stop
    # (the requests that finish after it count too; the final deletes are not load).
    measured = {name: rec.measured(name) for name in RATE_TOTALS}
    load_seconds = max(stop_at - cfg.warmup_s, 0.0)
    window = max(load_seconds, 1e-9)
    ops = {op: op_stats([lat for _, lat in rec.samples[op]]) for op in OPERATIONS}
    for op in OPERATIONS:
        ops[op]["errors"] = rec.errors_by_op.get(op, 0)
    metrics: dict[str, Any] = {}
    for base in cfg.metrics_urls:
        b, a = before.get(base, {}), after.get(base, {})
        entry: dict[str, Any] = {"instance_before": b.get("instance"), "instance_after": a.get("instance")}
        if "samples" in b and "samples" in a:
            entry["before"] = b["samples"]
            entry["after"] = a["samples"]
            entry["delta"] = metric_delta(b["samples"], a["samples"])
        else:
            entry["error"] = b.get("error") or a.get("error")
        metrics[base] = entry
    timeline = []
    seconds = int(math.ceil(end - rec.t0))
    by_second: dict[int, list[float]] = defaultdict(list)
    for t, lat in rec.samples["decode_step"]:
        by_second[int(t + lat)].append(lat)
    attends_by_second: Counter[int] = Counter(
        int(t + lat) for op in ("decode", "prefill_chunk") for t, lat in rec.samples[op]
    )
    errors_by_second: Counter[int] = Counter(int(t) for t in rec.error_times)
    for s in range(seconds):
        lats = sorted(by_second.get(s, []))
        timeline.append(
            {
                "t": s,
                "decode_steps": len(lats),
                "attends": attends_by_second.get(s, 0),
                "step_p50_ms": None if not lats else round(percentile(lats, 50) * 1000, 3),
                "step_p99_ms": None if not lats else round(percentile(lats, 99) * 1000, 3),
                "errors": errors_by_second.get(s, 0),
            }
        )
    errors = dict(rec.errors)
    targets = {}
    for url in cfg.urls:  # each target's share (sharded sessions: the shards it held)
        t = rec.targets.get(url) or TargetStats()
        targets[url] = {
            "sessions": t.sessions,
            "errors": t.errors,
            "attends_per_s": round(t.measured("attends") / window, 2),
            "decode_tokens_per_s": round(t.measured("decode_tokens") / window, 2),
            "shards": t.shards,
            "operations": {op: op_stats(lats) for op, lats in t.samples.items()},
        }
    return {
        "tool": "attnserve-loadtest",
        "report_version": 2,  # 2: a warm-up, not measured (load_seconds, rates and totals after it)
        "started_at": (started_at or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        "config": cfg.public(),
        "seed": seed,
        "run_id": run_id,
        "client": {
            "python": platform.python_version(),
            "host": platform.node(),
            "attnserve_client": getattr(attnserve_client, "__version__", None),
            "commit": git_commit(),
        },
        "server": info,
        "stop_reason": outcome.stop_reason,
        "interrupted": outcome.interrupted,
        # what the percentiles, rates and the measured totals leave out
        "warmup": {
            "seconds": cfg.warmup_s,
            "requests": sum(rec.warmup_requests.values()),
            "by_operation": dict(rec.warmup_requests),
        },
        "load_seconds": round(load_seconds, 3),
        "total_seconds": round(end - rec.t0, 3),
        "operations": ops,
        "throughput": {
            "attends_per_s": round(measured["attends"] / window, 2),
            "decode_tokens_per_s": round(measured["decode_tokens"] / window, 2),
            "prefill_tokens_per_s": round(measured["prefill_tokens"] / window, 2),
            "kv_rows_per_s": round(measured["kv_rows"] / window, 2),
            "requests_per_s": round(sum(len(rec.samples[op]) for op in OPERATIONS if op != "decode_step") / window, 2),
        },
        "totals": {  # attends to kv_rows: after the warm-up; sessions: the whole run
            **measured,
            "sessions_started": rec.sessions_started,
            "sessions_completed": rec.sessions_completed,
        },
        "errors": errors,
        "error_count": sum(errors.values()),
        "error_examples": rec.error_examples,
        "verify": {"fraction": cfg.verify, "checked": rec.verified, "failed": rec.verify_failed},
        "shard_tokens": cfg.shard_size() if cfg.sharded else None,
        "targets": targets,
        "server_metrics": metrics,
        "timeline": timeline,
        "_samples": rec.samples,  # for the plot; dropped from the JSON
    }


# ── output ──────────────────────────────────────────────────────────────────

# Server metrics worth a line in the text report (deltas of counters; gauges after).
_METRIC_LINES = re.compile(
    r"^attnserve_(requests_total|errors_total|gpu_|batch|sessions|kv_bytes|memory_used_bytes|"
    r"request_duration_seconds_(sum|count))"
)


def warmup_text(report: dict[str, Any]) -> str:
    """``a 5 s warm-up (123 requests not measured)``, or ``no warm-up``."""
    warmup = report.get("warmup") or {}
    if not warmup.get("seconds"):
        return "no warm-up"
    return f"a {warmup['seconds']:g} s warm-up ({warmup['requests']} requests not measured)"


def hardware(report: dict[str, Any]) -> str:
    """The first target's adapter as its /v1/info names it: ``NVIDIA H200 (Vulkan, DiscreteGPU)``."""
    server = report.get("server") or {}
    adapter = server.get("adapter") or {}
    kind = ", ".join(x for x in (server.get("backend") or adapter.get("backend"), adapter.get("adapter_type")) if x)
    return f"{adapter.get('name') or '?'}{f' ({kind})' if kind else ''}"


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = []
    urls = cfg.get("urls") or [cfg["url"]]
    where = urls[0] if len(urls) == 1 else f"{len(urls)} targets"
    sharded = f", sessions sharded in {report['shard_tokens']} timesteps" if report.get("shard_tokens") else ""
    lines.append(
        f"attnserve load test: {where}{sharded} ({hardware(report)}), "
        f"{cfg['mode']} loop{' at %.1f steps/s' % cfg['rate'] if cfg['mode'] == 'open' else ''}, "
        f"{cfg['sessions']} sessions, concurrency {cfg['concurrency']}"
        f"{', %d load processes' % cfg['workers'] if cfg.get('workers', 1) > 1 else ''}"
    )
    lines.append(
        f"  {cfg['layers']} layers, {cfg['qo_heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, "
        f"{cfg['kv_format']}, prefill {cfg['prefill']} in chunks of {cfg['chunk']}, "
        f"{cfg['decode_steps'] or 'unbounded'} decode steps; {warmup_text(report)}, then "
        f"{report['load_seconds']:.1f} s of load (stopped by {report['stop_reason']})"
    )
    lines.append("")
    lines.append(
        f"  {'operation':<14}{'count':>9}{'errors':>8}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}"
    )
    for op, st in report["operations"].items():
        cell = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
        lines.append(
            f"  {op:<14}{st['count']:>9}{st['errors']:>8}{cell(st['p50_ms'])}{cell(st['p90_ms'])}"
            f"{cell(st['p99_ms'])}{cell(st['max_ms'])}"
        )
    th = report["throughput"]
    lines.append("")
    lines.append(
        f"  attends/s {th['attends_per_s']:.1f} | decode tokens/s {th['decode_tokens_per_s']:.1f} | "
        f"prefill tokens/s {th['prefill_tokens_per_s']:.1f} | KV rows/s {th['kv_rows_per_s']:.1f} | "
        f"requests/s {th['requests_per_s']:.1f}"
    )
    tot = report["totals"]
    lines.append(
        f"  sessions: {tot['sessions_started']} started, {tot['sessions_completed']} ran all their decode steps"
    )
    if report["verify"]["fraction"]:
        v = report["verify"]
        lines.append(f"  verified {v['checked']} decode outputs against float64: {v['failed']} wrong")
    if report["errors"]:
        lines.append(
            "  errors: " + ", ".join(f"{k} {n}" for k, n in sorted(report["errors"].items(), key=lambda x: -x[1]))
        )
        for ex in report["error_examples"][:5]:
            lines.append(f"    e.g. {ex.get('op')}: {ex.get('message')}")
    else:
        lines.append("  errors: none")
    targets = report.get("targets") or {}
    if len(targets) > 1 or report.get("shard_tokens"):
        lines.append("")
        lines.append(f"  {'target':<32}{'sessions':>9}{'shards':>8}{'errors':>8}{'attends/s':>11}{'tokens/s':>10}"
                     f"{'decode p50':>11}{'p99 ms':>8}")  # fmt: skip
        for url, t in targets.items():
            decode = (t.get("operations") or {}).get("decode") or {}
            cell = lambda v, w: f"{v:{w}.2f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
            lines.append(
                f"  {url:<32}{t['sessions']:>9}{t['shards']:>8}{t['errors']:>8}{t['attends_per_s']:>11.1f}"
                f"{t['decode_tokens_per_s']:>10.1f}{cell(decode.get('p50_ms'), 11)}{cell(decode.get('p99_ms'), 8)}"
            )
    for base, m in report["server_metrics"].items():
        lines.append("")
        who = m.get("instance_after") or m.get("instance_before")
        lines.append(f"  server metrics {base}/metrics{' (instance ' + who + ')' if who else ''}:")
        if "error" in m:
            lines.append(f"    unavailable: {m['error']}")
            continue
        shown = 0
        keys = [k for k in sorted(m["delta"]) if _METRIC_LINES.match(k) and "_bucket" not in k]
        width = min(max((len(k) for k in keys), default=0), 100)
        for key in keys:
            before = m["before"].get(key, 0.0)
            lines.append(f"    {key:<{width}} {before:>12.6g} -> {m['after'][key]:<12.6g} (+{m['delta'][key]:.6g})")
            shown += 1
            if shown >= 40:
                lines.append("    ...")
                break
        if not shown:
            lines.append("    (no attnserve_* series changed)")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["_samples"]
    colors = {
        "create": "tab:green",
        "prefill_chunk": "tab:orange",
        "prefill_batch": "tab:brown",
        "decode": "tab:blue",
        "decode_batch": "tab:cyan",
        "decode_step": "tab:purple",
        "delete": "tab:gray",
    }
    fig, (ax_h, ax_t) = plt.subplots(2, 1, figsize=(11, 8.5))
    all_lat = [lat for op in OPERATIONS for _, lat in samples[op]]
    if all_lat:
        lo = max(min(all_lat) * 1000, 1e-3)
        hi = max(max(all_lat) * 1000, lo * 1.01)
        bins = np.logspace(math.log10(lo), math.log10(hi), 60)
        for op in OPERATIONS:
            lats = [lat * 1000 for _, lat in samples[op]]
            if lats:
                st = report["operations"][op]
                ax_h.hist(
                    lats,
                    bins=bins,
                    histtype="step",
                    linewidth=1.5,
                    color=colors[op],
                    label=f"{op} (n={len(lats)}, p50 {st['p50_ms']:.1f}, p99 {st['p99_ms']:.1f} ms)",
                )
        ax_h.set_xscale("log")
        ax_h.set_yscale("log")
        ax_h.legend(fontsize=8)
    ax_h.set_xlabel("latency (ms)")
    ax_h.set_ylabel("requests")
    ax_h.set_title("latency histogram (requests after the warm-up)")
    rng = np.random.default_rng(0)
    for op in OPERATIONS:
        pts = samples[op]
        if not pts:
            continue
        if len(pts) > 20000:  # keep the PNG light
            idx = rng.choice(len(pts), 20000, replace=False)
            pts = [pts[i] for i in sorted(idx)]
        ax_t.scatter(
            [t + lat for t, lat in pts],
            [lat * 1000 for _, lat in pts],
            s=2,
            alpha=0.35,
            color=colors[op],
            label=op,
            rasterized=True,
        )
    tl = [row for row in report["timeline"] if row["step_p99_ms"] is not None]
    if tl:
        xs = [r["t"] + 0.5 for r in tl]
        ax_t.plot(xs, [r["step_p50_ms"] for r in tl], color="black", linewidth=1.2, label="decode_step p50 (1 s)")
        ax_t.plot(xs, [r["step_p99_ms"] for r in tl], color="red", linewidth=1.2, label="decode_step p99 (1 s)")
    err_t = [row["t"] + 0.5 for row in report["timeline"] if row["errors"]]
    for t in err_t:
        ax_t.axvline(t, color="red", alpha=0.15, linewidth=3)
    warmup = (report.get("warmup") or {}).get("seconds") or 0
    if warmup:
        ax_t.axvspan(0, warmup, color="gray", alpha=0.15, linewidth=0)
    ax_t.axvline(warmup + report["load_seconds"], color="gray", linestyle="--", linewidth=1)
    if any(samples[op] for op in OPERATIONS):
        ax_t.set_yscale("log")
    ax_t.set_xlabel(
        "time since the start (s); grey: warm-up (not measured), dashed: end of load, red bands: seconds with errors"
    )
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_title("latency over time")
    ax_t.legend(fontsize=8, markerscale=4, loc="upper right")
    fig.suptitle(plot_title(report), fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_title(report: dict[str, Any]) -> str:
    """The plot's title: what ran, what it measured (each quantity named as it is),
    and where and when: the adapter, the versions and the commit, the date."""
    cfg, th = report["config"], report["throughput"]
    server = report.get("server") or {}
    client = report.get("client") or {}
    loop = f"{cfg['mode']} loop" + (f" at {cfg['rate']:g} decode steps/s" if cfg["mode"] == "open" else "")
    loop += ", batched" if cfg.get("batched") else ""
    what = (
        f"attnserve load test: {loop}, {cfg['sessions']} sessions x {cfg['layers']} layers, "
        f"{cfg['qo_heads']}/{cfg['kv_heads']} heads x {cfg['head_dim']}, {cfg['kv_format']}, "
        f"prefill {cfg['prefill']} tokens in chunks of {cfg['chunk']}, "
        f"{cfg['decode_steps'] or 'unbounded'} decode steps per session"
    )
    measured = (
        f"decode tokens/s {th['decode_tokens_per_s']:.1f} | attends/s {th['attends_per_s']:.1f} | "
        f"prefill tokens/s {th['prefill_tokens_per_s']:.1f} | errors {report['error_count']} | "
        f"{report['load_seconds']:.0f} s measured after {warmup_text(report)}"
    )
    where = (
        f"{hardware(report)} | server attnserve {server.get('version', '?')} | "
        f"load test at commit {client.get('commit') or '? (not run from a git checkout)'} | "
        f"{str(report['started_at'])[:10]}"
    )
    return "\n".join((what, measured, where))


def exit_code(report: dict[str, Any]) -> int:
    if report["error_count"] or report["interrupted"]:
        return EXIT_ERRORS
    if report["totals"]["attends"] == 0:
        return EXIT_ERRORS  # nothing was measured: not a pass
    return EXIT_OK
