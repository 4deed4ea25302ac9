"""Shared fixtures. GPU tests need a wgpu adapter: lavapipe in CI.

Without an adapter they skip on a developer machine, but FAIL when the
environment variable CI is set, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "service", ROOT / "client", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
# The test servers (in process, and the processes that inherit this environment) warm
# no kernels at start unless a test asks (test_warmup.py; test_cli.py's servers keep the
# default): a warm-up on lavapipe takes seconds, up to a minute with Mesa's cache empty.
os.environ.setdefault("ATTNSERVE_WARMUP", "none")

from _core import core_engine, no_adapter  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    from attnserve.gpu.device import DeviceError

    try:
        eng = core_engine()
    except DeviceError as e:
        no_adapter(str(e))
    yield eng
    eng.close()


@pytest.fixture
def rng(request):
    # Fresh random inputs every run; the seed is printed on failure to replay.
    seed = int(os.environ.get("ATTNSERVE_TEST_SEED", np.random.SeedSequence().entropy % (1 << 32)))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (ATTNSERVE_TEST_SEED={seed} replays it)")
    return np.random.default_rng(seed)


@pytest.fixture(
    params=[
        "split",
        "split-long",
        "tiled",
        "tiled-rb",
        "tiled-rb-generic",
        "single",
    ]
)
def kernel_path(request, engine):
    """Run a test through each attention kernel family: the split-KV kernels
    (split + merge) with short splits (one tile, many splits) and with the longest
    splits they allow (many tiles per split), the query-block tiled prefill kernels
    (for f32 both attention_prefill_tiled and, as "tiled-rb*", attention_prefill_rb
    in its default and generic-pipeline variants), and the single-pass
    seed-derived kernels."""
    import dataclasses

    p = request.param
    saved = engine.policy
    engine.policy = dataclasses.replace(
        saved,
        force="tiled" if p.startswith("tiled") else p if p == "single" else "split",
        prefill_f32="rb" if p.startswith("tiled-rb") else "tiled",
        prefill_f16="rb" if p.startswith("tiled-rb") else "tiled",
        # the register-blocked kernel's generic pipeline (shape from params, no
        # override constants)
        prefill_rb_specialize=p != "tiled-rb-generic",
        target_workgroups=1 if p.endswith("long") else saved.target_workgroups,
    )
    yield p
    engine.policy = saved
