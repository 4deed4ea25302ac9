"""The package's public surface and its installability without the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import attnserve_client

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

CLIENT = Path(__file__).resolve().parents[2] / "client"

PUBLIC = {
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncSession",
    "AsyncShardedSession",
    "AsyncStream",
    "AsyncStreamOpening",
    "AsyncShmStream",
    "AttendItem",
    "Attention",
    "BatchError",
    "Stream",
    "ShmStream",
    "AttnServeError",
    "CapacityExceeded",
    "Client",
    "Forbidden",
    "InvalidInput",
    "InvalidRequest",
    "InvalidResponse",
    "InvalidSnapshot",
    "LayerNotFound",
    "MalformedBody",
    "NotReady",
    "OffsetMismatch",
    "OutOfMemory",
    "RequestTimeout",
    "BodyTimeout",
    "Overloaded",
    "PayloadTooLarge",
    "Session",
    "SessionExists",
    "SessionInfo",
    "SessionNotFound",
    "ShardedSession",
    "ShardLost",
    "Step",
    "AsyncStep",
    "StreamStep",
    "AsyncStreamStep",
    "StepNotFound",
    "SessionInStep",
    "StepLayerCalled",
    "StepBroken",
    "Unauthorized",
    "UnsupportedMediaType",
    "WireError",
    "merge",
    "new_session_id",
    "__version__",
    "parse_problem",
    "wire",
}


def test_all_is_exactly_the_public_api_and_resolves():
    assert set(attnserve_client.__all__) == PUBLIC
    assert len(attnserve_client.__all__) == len(PUBLIC)
    for name in attnserve_client.__all__:
        assert getattr(attnserve_client, name) is not None
    namespace: dict = {}
    exec("from attnserve_client import *", namespace)
    assert PUBLIC <= set(namespace)


def test_submodule_all_resolves():
    from attnserve_client import _client, _steps, _types, errors, wire

    for module in (_client, _steps, _types, errors, wire):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_requirements_are_numpy_msgpack_httpx_websockets_only():
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "attnserve-client"
    assert project["requires-python"] == ">=3.10"
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert names == {"numpy", "msgpack", "httpx", "websockets"}
    assert (CLIENT / "attnserve_client" / "py.typed").exists()


def test_import_pulls_in_no_server_dependency():
    code = (
        "import sys, attnserve_client\n"
        "bad = [m for m in ('fastapi', 'uvicorn', 'wgpu', 'attnserve', 'pydantic') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CLIENT)
