"""The problem types of the API contract (docs/api.md, "Errors"): the one list of them.

An error answer is a problem document whose ``type`` is ``"/problems/<slug>"``,
with the ``status`` and ``title`` given here. The server's error classes
(``attnserve.errors``, the server depends on this package) take their slug,
status and title from these constants, the client's exception classes
(:mod:`attnserve_client.errors`) their slug, so that each slug is written once.

Not every problem type has a client exception class of its own: ``not-found``,
``method-not-allowed``, ``internal-error`` and ``gpu-error`` (a wrong URL, a bug,
a device failure) come back as :class:`~attnserve_client.errors.APIStatusError`.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ProblemType",
    "PROBLEM_TYPES",
    "MALFORMED_BODY",
    "UNAUTHORIZED",
    "SESSION_NOT_FOUND",
    "LAYER_NOT_FOUND",
    "NOT_FOUND",
    "METHOD_NOT_ALLOWED",
    "BODY_TIMEOUT",
    "OFFSET_MISMATCH",
    "SESSION_EXISTS",
    "CAPACITY_EXCEEDED",
    "PAYLOAD_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "INVALID_SNAPSHOT",
    "INVALID_REQUEST",
    "INTERNAL_ERROR",
    "GPU_ERROR",
    "OVERLOADED",
    "NOT_READY",
    "TIMEOUT",
    "OUT_OF_MEMORY",
]


class ProblemType(NamedTuple):
    """One problem type: its HTTP status, its slug (``type`` is ``/problems/<slug>``)
    and its title."""

    status: int
    slug: str
    title: str


MALFORMED_BODY = ProblemType(400, "malformed-body", "Malformed body")
UNAUTHORIZED = ProblemType(401, "unauthorized", "Unauthorized")
SESSION_NOT_FOUND = ProblemType(404, "session-not-found", "Session not found")
LAYER_NOT_FOUND = ProblemType(404, "layer-not-found", "Layer not found")
NOT_FOUND = ProblemType(404, "not-found", "Not found")  # no such route
METHOD_NOT_ALLOWED = ProblemType(405, "method-not-allowed", "Method not allowed")
BODY_TIMEOUT = ProblemType(408, "body-timeout", "Body timeout")
OFFSET_MISMATCH = ProblemType(409, "offset-mismatch", "Offset mismatch")
SESSION_EXISTS = ProblemType(409, "session-exists", "Session exists")
CAPACITY_EXCEEDED = ProblemType(409, "capacity-exceeded", "Capacity exceeded")
PAYLOAD_TOO_LARGE = ProblemType(413, "payload-too-large", "Payload too large")
UNSUPPORTED_MEDIA_TYPE = ProblemType(415, "unsupported-media-type", "Unsupported media type")
INVALID_SNAPSHOT = ProblemType(422, "invalid-snapshot", "Invalid snapshot")
INVALID_REQUEST = ProblemType(422, "invalid-request", "Invalid request")
INTERNAL_ERROR = ProblemType(500, "internal-error", "Internal server error")
GPU_ERROR = ProblemType(500, "gpu-error", "GPU error")
OVERLOADED = ProblemType(503, "overloaded", "Overloaded")
NOT_READY = ProblemType(503, "not-ready", "Not ready")
TIMEOUT = ProblemType(503, "timeout", "Request timed out")
OUT_OF_MEMORY = ProblemType(507, "out-of-memory", "Out of GPU memory")

#: every problem type of the contract, by slug
PROBLEM_TYPES: dict[str, ProblemType] = {
    p.slug: p
    for p in (
        MALFORMED_BODY,
        UNAUTHORIZED,
        SESSION_NOT_FOUND,
        LAYER_NOT_FOUND,
        NOT_FOUND,
        METHOD_NOT_ALLOWED,
        BODY_TIMEOUT,
        OFFSET_MISMATCH,
        SESSION_EXISTS,
        CAPACITY_EXCEEDED,
        PAYLOAD_TOO_LARGE,
        UNSUPPORTED_MEDIA_TYPE,
        INVALID_SNAPSHOT,
        INVALID_REQUEST,
        INTERNAL_ERROR,
        GPU_ERROR,
        OVERLOADED,
        NOT_READY,
        TIMEOUT,
        OUT_OF_MEMORY,
    )
}
