"""attnserve_client: the Python client of the attnserve attention service.

    from attnserve_client import Client

    with Client() as client:  # $ATTNSERVE_BASE_URL, else http://127.0.0.1:8421
        with client.create_session(num_qo_heads=8, num_kv_heads=2, head_dim=64) as session:
            session.append(0, k, v)        # k, v: [m, 2, 64] float arrays
            out = session.attend(0, q)     # q: [n, 8, 64] -> out: [n, 8, 64] float32
        # the session is deleted here

See ``docs/client.md`` for the whole guide.
"""

from . import wire
from ._client import (
    DEFAULT_BASE_URL,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    AsyncClient,
    AsyncSession,
    Client,
    Session,
    new_session_id,
)
from ._steps import AttendItem, BatchError
from ._step_handles import AsyncStep, AsyncStreamStep, Step, StreamStep
from ._streams import AsyncStream, AsyncStreamOpening, Stream
from ._shm import AsyncShmStream, ShmStream
from ._types import SessionInfo
from ._version import __version__
from .merge import Attention, merge
from .sharded import AsyncShardedSession, ShardedSession, ShardLost
from .errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AttnServeError,
    CapacityExceeded,
    Forbidden,
    InvalidInput,
    InvalidRequest,
    InvalidResponse,
    InvalidSnapshot,
    LayerNotFound,
    MalformedBody,
    NotReady,
    RequestTimeout,
    BodyTimeout,
    OffsetMismatch,
    OutOfMemory,
    Overloaded,
    PayloadTooLarge,
    SessionExists,
    SessionInStep,
    SessionNotFound,
    StepBroken,
    StepLayerCalled,
    StepNotFound,
    Unauthorized,
    UnsupportedMediaType,
    parse_problem,
)
from .wire import WireError

__all__ = [
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
    "AsyncShmStream",
    "AsyncStep",
    "AsyncStream",
    "AsyncStreamOpening",
    "AsyncStreamStep",
    "AttendItem",
    "Attention",
    "BatchError",
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
    "RequestTimeout",
    "BodyTimeout",
    "OffsetMismatch",
    "OutOfMemory",
    "Overloaded",
    "PayloadTooLarge",
    "Session",
    "SessionExists",
    "SessionInStep",
    "SessionInfo",
    "SessionNotFound",
    "ShardedSession",
    "ShardLost",
    "ShmStream",
    "Step",
    "StepBroken",
    "StepLayerCalled",
    "StepNotFound",
    "Stream",
    "StreamStep",
    "Unauthorized",
    "UnsupportedMediaType",
    "WireError",
    "__version__",
    "merge",
    "new_session_id",
    "parse_problem",
    "wire",
]
