"""One exception tree for the service; ``app.py`` maps it to problem+json in one place.

Every error a client can cause is an :class:`ApiError` with an HTTP status, a
problem ``slug`` (``type`` is ``/problems/<slug>``), a title and a detail, plus
optional extra members for the problem body (``length`` for offset-mismatch, ...)
and headers (``Retry-After``, ``WWW-Authenticate``).
"""

from __future__ import annotations

from typing import Any

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
    "Overloaded",
    "NotReady",
    "OutOfMemory",
    "RequestTimeout",
    "GpuError",
    "RouteNotFound",
    "MethodNotAllowed",
    "InternalError",
]


class ApiError(Exception):
    status: int = 500
    slug: str = "internal-error"
    title: str = "Internal server error"

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


def _error(name: str, status: int, slug: str, title: str) -> type[ApiError]:
    return type(name, (ApiError,), {"status": status, "slug": slug, "title": title, "__doc__": title})


MalformedBody = _error("MalformedBody", 400, "malformed-body", "Malformed body")
# the client stopped sending its body (codec.BODY_IDLE_TIMEOUT_S without a byte)
BodyTimeout = _error("BodyTimeout", 408, "body-timeout", "Body timeout")
SessionNotFound = _error("SessionNotFound", 404, "session-not-found", "Session not found")
LayerNotFound = _error("LayerNotFound", 404, "layer-not-found", "Layer not found")
OffsetMismatch = _error("OffsetMismatch", 409, "offset-mismatch", "Offset mismatch")
SessionExists = _error("SessionExists", 409, "session-exists", "Session exists")
CapacityExceeded = _error("CapacityExceeded", 409, "capacity-exceeded", "Capacity exceeded")
PayloadTooLarge = _error("PayloadTooLarge", 413, "payload-too-large", "Payload too large")
UnsupportedMediaType = _error(
    "UnsupportedMediaType", 415, "unsupported-media-type", "Unsupported media type"
)
InvalidSnapshot = _error("InvalidSnapshot", 422, "invalid-snapshot", "Invalid snapshot")
InvalidRequest = _error("InvalidRequest", 422, "invalid-request", "Invalid request")
Unauthorized = _error("Unauthorized", 401, "unauthorized", "Unauthorized")
Overloaded = _error("Overloaded", 503, "overloaded", "Overloaded")
NotReady = _error("NotReady", 503, "not-ready", "Not ready")
RequestTimeout = _error("RequestTimeout", 503, "timeout", "Request timed out")
OutOfMemory = _error("OutOfMemory", 507, "out-of-memory", "Out of GPU memory")
GpuError = _error("GpuError", 500, "gpu-error", "GPU error")
RouteNotFound = _error("RouteNotFound", 404, "not-found", "Not found")
MethodNotAllowed = _error("MethodNotAllowed", 405, "method-not-allowed", "Method not allowed")
InternalError = _error("InternalError", 500, "internal-error", "Internal server error")
