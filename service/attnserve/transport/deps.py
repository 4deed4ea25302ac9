"""The typed FastAPI dependencies every HTTP router shares: the data plane's
(``transport/http.py``) and the control plane's above it (``routes/``: sessions,
snapshots, probes), with :func:`merge_responses` for their OpenAPI answers.

Routes get the app's :class:`~attnserve.runtime.Runtime`, and everything derived
from it, through ``Annotated`` dependencies (``RuntimeDep``, ``WireDep``,
``EngineDep``, ``OwnerDep``, ``SessionDep``), so a test swaps one function to
change behaviour everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Optional

from fastapi import Depends, Path, Request

from ..codec import Wire, negotiate
from ..engine import Engine
from ..runtime import OWNER_KEY, Runtime
from ..store import Session

__all__ = [
    "Runtime",
    "get_runtime",
    "get_owner",
    "get_wire",
    "get_engine",
    "get_session",
    "RuntimeDep",
    "OwnerDep",
    "WireDep",
    "EngineDep",
    "SessionDep",
    "SessionIdPath",
    "LayerPath",
    "StepPath",
    "merge_responses",
]


# ── dependencies ─────────────────────────────────────────────────────────────


# The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency on a
# worker thread, a thread hop per dependency per request for work of microseconds.


def merge_responses(*parts: Mapping[int, Any]) -> dict[int | str, dict[str, Any]]:
    """A route's OpenAPI ``responses``: ``parts`` (``contract.ok``, ``contract.problems``,
    literal entries) merged in order, as ``{**a, **b}`` would, typed as FastAPI takes them."""
    return {status: doc for part in parts for status, doc in part.items()}


async def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_owner(request: Request) -> str | None:
    """The tenant a request acts for: its API key's id (set by the middleware, which
    already refused the request with 401 if keys are configured and it has none
    valid), or ``None`` without keys. Sessions record it; list, get and every
    session route see only the owner's sessions."""
    return request.scope.get(OWNER_KEY)


OwnerDep = Annotated[Optional[str], Depends(get_owner)]


async def get_wire(request: Request, rt: RuntimeDep) -> Wire:
    """Encodings of the request and its answer; 415 and a declared-length 413 here,
    before anything else (and before any byte of the body is read)."""
    return negotiate(request, rt.settings.max_body_bytes)


WireDep = Annotated[Wire, Depends(get_wire)]


async def get_engine(rt: RuntimeDep) -> Engine:
    return rt.ready_engine()


EngineDep = Annotated[Engine, Depends(get_engine)]

SessionIdPath = Annotated[str, Path(description="The session's id.", examples=["my-session-1"])]
LayerPath = Annotated[str, Path(pattern=r"^[0-9]{1,10}$", description="Layer index, 0..num_layers-1.", examples=["0"])]
StepPath = Annotated[
    str, Path(pattern=r"^[0-9]{1,18}$", description="A step's handle (POST /v1/steps answers it).", examples=["1"])
]


async def get_session(session_id: SessionIdPath, rt: RuntimeDep, owner: OwnerDep) -> Session:
    return rt.store.get(session_id, owner)


SessionDep = Annotated[Session, Depends(get_session)]
