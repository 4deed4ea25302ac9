#!/usr/bin/env python3
"""Load test of an attnserve server (or of the router in front of its replicas).

Each virtual user holds one session at a time and runs it through the life of a
sequence in a model with ``--layers`` layers:

1. create it (``PUT /v1/sessions/{id}`` with an id of its own, so it also works
   through the router; ``--create post`` uses ``POST``);
2. prefill a prompt of ``--prefill`` tokens in chunks of ``--chunk``: each chunk
   is one fused attend (q, k and v of ``chunk`` rows) per layer, chunk by chunk;
3. run fused decode steps: one attend with q, k, v of one row per layer, layer
   after layer, ``--decode-steps`` times (0: until the end of the run);
4. delete it, and start over with a new session.

Closed loop (default): a user sends its next request when the last one answered.
Open loop (``--mode open --rate R``): decode steps arrive as a Poisson process of
R steps per second over all users; a step's latency counts from when it was due,
so queueing behind a slow server is measured, not hidden. ``--concurrency`` caps
the requests in flight over all users.

The first ``--warmup-s`` seconds (default 5) are a warm-up: the users run as they
will after it, but the requests that start in it are not measured (the server's
first-use kernel compiles, cold caches); the ``--duration`` seconds after it are.

It prints a live progress line, then p50/p90/p99/max latency per operation,
attends and tokens per second, errors by type and the server's own metrics
(``/metrics``) before and after; ``--json-out`` writes all of it as JSON and
``--plot`` a PNG (latency histogram and latency over time, titled with the
adapter, the versions, the commit and the date). It stops by itself after the
warm-up and ``--duration`` seconds (then deletes its sessions), and exits 1 on
any error, warm-up included (an error answer, a transport failure, a wrong result
with ``--verify``), 2 on a usage or setup problem.

``--url`` may name several targets (repeated, or comma-separated: N replicas or N
routers): user ``i``'s sessions go to target ``i % N`` and the report gives each
target's share beside the totals. ``--shards S`` makes every session a
``ShardedSession`` of S shards spread over the targets (one logical sequence over
several servers, attended on all of them at once).

Traffic goes only to the addresses given with ``--url`` (and any ``--metrics-url``),
which must be a loopback address unless ``--allow-remote`` is given; proxies from
the environment are ignored and redirects are not followed.

    attnserve-loadtest --url http://127.0.0.1:8421 --sessions 16 --duration 60 \\
        --prefill 512 --kv-format turboquant --json-out out/run.json --plot out/run.png

``attnserve-loadtest`` is installed with the server (``pip install .``); from a
checkout, ``python loadtest/loadtest.py`` runs the same.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # python loadtest/loadtest.py in a checkout: this file runs as the module
    # loadtest.loadtest of the checkout's package (PEP 366), with the checkout's
    # client and server packages where they are not installed. Installed, this is
    # attnserve.loadtest.loadtest, run by the command attnserve-loadtest.
    ROOT = Path(__file__).resolve().parents[1]
    sys.path[0] = str(ROOT)  # the repository root, not this folder: its modules are no top-level ones
    for _package, _folder in (("attnserve_client", "client"), ("attnserve", "service")):
        if importlib.util.find_spec(_package) is None:
            sys.path.insert(1, str(ROOT / _folder))
    __package__ = "loadtest"

import httpx  # noqa: E402

from attnserve_client import AsyncClient, AttnServeError  # noqa: E402

# what the tests and other tools use of the modules, under this module's name too
from .config import EXIT_USAGE, Config, UsageError, check_loopback, parse_args  # noqa: E402
from . import driver  # noqa: E402,F401  (tests patch driver.BATCH_BYTES)
from .driver import (  # noqa: E402,F401
    LoadTest,
    WrongResult,
    _http,
    drive,
    error_kind,
    op_stats,
    percentile,
    reference_decode,
    run_workers,
    scrape,
)
from .prometheus import metric_delta, parse_prometheus  # noqa: E402,F401
from .report import exit_code, format_report, summarize, write_plot  # noqa: E402

__all__ = ["main", "parse_args", "run", "summarize"]


async def run(cfg: Config) -> dict[str, Any]:
    """Run the load test; return the report (see :func:`summarize`)."""
    if not cfg.allow_remote:
        check_loopback([*cfg.urls, *cfg.metrics_urls])
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with _http(cfg, 4) as http:
        infos = []
        for url in cfg.urls:  # every target must answer, and offer the kv format
            client = AsyncClient(
                url, api_key=cfg.api_key, timeout=httpx.Timeout(cfg.timeout), max_retries=0, http_client=http
            )
            try:
                info = await client.info()
            except AttnServeError as exc:
                raise UsageError(f"{url}: the server does not answer GET /v1/info: {exc}") from None
            formats = info.get("kv_formats")
            if isinstance(formats, list) and cfg.kv_format not in formats:
                raise UsageError(f"--kv-format {cfg.kv_format!r}: {url} offers {formats}")
            infos.append(info)
        before = await scrape(http, cfg.metrics_urls, headers)

    started_at = _dt.datetime.now(_dt.timezone.utc)
    run_id = f"{random.getrandbits(32):08x}"
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1 << 32)
    mode = cfg.progress
    if mode == "auto":
        mode = "line" if sys.stderr.isatty() else "log"
    if cfg.workers > 1 and cfg.sessions > 1:
        outcome = await run_workers(cfg, run_id, seed, mode)
    else:
        lt = LoadTest(cfg, run_id=run_id, seed=seed, t0=time.perf_counter())
        outcome = await drive(cfg, lt, mode)

    async with _http(cfg, 4) as http:
        after = await scrape(http, cfg.metrics_urls, headers)
    return summarize(cfg, outcome, run_id, seed, infos[0], before, after, started_at)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        report = asyncio.run(run(cfg))
    except UsageError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_report(report))
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in report.items() if not k.startswith("_")}
        Path(cfg.json_out).write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"\n  report: {cfg.json_out}")
    if cfg.plot:
        write_plot(report, cfg.plot)
        print(f"  plot: {cfg.plot}")
    code = exit_code(report)
    if code:
        if report["error_count"]:
            why = f"{report['error_count']} errors"
        else:
            why = "interrupted" if report["interrupted"] else "no attend measured after the warm-up"
        print(f"\nloadtest: FAILED ({why})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
