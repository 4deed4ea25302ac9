"""One exception tree for the service; ``app.py`` maps it to problem+json in one place.

Every error a client can cause is an :class:`ApiError` with an HTTP status, a
problem ``slug`` (``type`` is ``/problems/<slug>``), a title and a detail, plus
optional extra members for the problem body (``length`` for offset-mismatch, ...)
and headers (``Retry-After``, ``WWW-Authenticate``). The slugs, statuses and titles
come from the one list of the contract's problem types,
:mod:`attnserve_client.problems`, which the client's exception classes share.
"""

from __future__ import annotations

from typing import Any

from attnserve_client import problems

__all__ = [
    "ApiError",
    "MalformedBody",
    "BodyTimeout",
    "SessionNotFound",
    "LayerNotFound",
    "OffsetMismatch",
    "SessionExists",
    "CapacityExceeded",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "InvalidSnapshot",
    "InvalidRequest",
    "Unauthorized",
    "Forbidden",
    "Overloaded",
    "NotReady",
    "OutOfMemory",
    "RequestTimeout",
    "GpuError",
    "RouteNotFound",
    "MethodNotAllowed",
    "InternalError",
    "StepNotFound",
    "SessionInStep",
    "StepLayerCalled",
    "StepBroken",
]


class ApiError(Exception):
    """Base of every error a client can cause; answered as ``internal-error`` unless a
    subclass (or, for an HTTP error of the framework, ``app.py``) says otherwise."""

    status: int = problems.INTERNAL_ERROR.status
    slug: str = problems.INTERNAL_ERROR.slug
    title: str = problems.INTERNAL_ERROR.title

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(detail)
        self.detail = detail
        self.headers = dict(headers or {})
        self.extra = extra

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"/problems/{self.slug}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            body["instance"] = instance
        body.update(self.extra)
        return body


class MalformedBody(ApiError):
    """400: the body is not decodable as its declared content type."""

    status, slug, title = problems.MALFORMED_BODY


class BodyTimeout(ApiError):
    """408: the client stopped sending its body (``codec.BODY_IDLE_TIMEOUT_S`` without a byte)."""

    status, slug, title = problems.BODY_TIMEOUT


class SessionNotFound(ApiError):
    """404: unknown session id, or another tenant's session."""

    status, slug, title = problems.SESSION_NOT_FOUND


class LayerNotFound(ApiError):
    """404: the layer index is not an integer in ``0..num_layers-1``."""

    status, slug, title = problems.LAYER_NOT_FOUND


class OffsetMismatch(ApiError):
    """409: the ``offset`` sent is not the layer's length (extra member ``length``)."""

    status, slug, title = problems.OFFSET_MISMATCH


class SessionExists(ApiError):
    """409: a session with this id exists already."""

    status, slug, title = problems.SESSION_EXISTS


class CapacityExceeded(ApiError):
    """409: the append would take the layer past the session's ``max_tokens``."""

    status, slug, title = problems.CAPACITY_EXCEEDED


class PayloadTooLarge(ApiError):
    """413: the body is over ``max_body_bytes``."""

    status, slug, title = problems.PAYLOAD_TOO_LARGE


class UnsupportedMediaType(ApiError):
    """415: a body of another content type than MessagePack or JSON, or of none."""

    status, slug, title = problems.UNSUPPORTED_MEDIA_TYPE


class InvalidSnapshot(ApiError):
    """422: a snapshot blob is truncated, corrupted, of another version or too large."""

    status, slug, title = problems.INVALID_SNAPSHOT


class InvalidRequest(ApiError):
    """422: a field, shape, dtype, byte count or value is not allowed."""

    status, slug, title = problems.INVALID_REQUEST


class Unauthorized(ApiError):
    """401: API keys are configured and the bearer token is missing or wrong."""

    status, slug, title = problems.UNAUTHORIZED


class Forbidden(ApiError):
    """403: the peer of a shared-memory connection runs as another user."""

    status, slug, title = problems.FORBIDDEN


class Overloaded(ApiError):
    """503: the GPU queue is full."""

    status, slug, title = problems.OVERLOADED


class NotReady(ApiError):
    """503: the device is not open, the kernels are warming up, or the server is
    draining; every one tells the client to try again in a second (Retry-After: 1)."""

    status, slug, title = problems.NOT_READY

    def __init__(self, detail: str, **extra: Any):
        super().__init__(detail, headers={"Retry-After": "1"}, **extra)


class RequestTimeout(ApiError):
    """503: the request waited in the GPU queue too long and was dropped unapplied."""

    status, slug, title = problems.TIMEOUT


class OutOfMemory(ApiError):
    """507: the GPU memory budget, the session limit or the key's quota cannot hold the request."""

    status, slug, title = problems.OUT_OF_MEMORY


class GpuError(ApiError):
    """500: the device failed."""

    status, slug, title = problems.GPU_ERROR


class RouteNotFound(ApiError):
    """404: no such route."""

    status, slug, title = problems.NOT_FOUND


class MethodNotAllowed(ApiError):
    """405: the route exists, the method does not."""

    status, slug, title = problems.METHOD_NOT_ALLOWED


class InternalError(ApiError):
    """500: a bug; the detail names a request id found in the log."""

    status, slug, title = problems.INTERNAL_ERROR


class StepNotFound(ApiError):
    """404: no open step has this handle for the caller (closed, expired, or another tenant's)."""

    status, slug, title = problems.STEP_NOT_FOUND


class SessionInStep(ApiError):
    """409: the session is in an open step, which owns its append positions (extra
    member ``step``: its handle)."""

    status, slug, title = problems.SESSION_IN_STEP


class StepLayerCalled(ApiError):
    """409: the step's layer was already called this token, or a call of it is in flight."""

    status, slug, title = problems.STEP_LAYER_CALLED


class StepBroken(ApiError):
    """409: a call of the step applied to some sessions and failed for others (extra
    member ``failure``: the first one)."""

    status, slug, title = problems.STEP_BROKEN
