"""The problem types of the API contract (docs/api.md, "Errors"): the one list of them.

An error answer is a problem document whose ``type`` is ``"/problems/<slug>"``,
with the ``status`` and ``title`` given here; :data:`PROBLEM_HELP` says when each
happens and what to do, the page the server answers at that ``type`` URI. The server's error classes
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
    "ProblemHelp",
    "PROBLEM_HELP",
    "MALFORMED_BODY",
    "UNAUTHORIZED",
    "FORBIDDEN",
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
    "STEP_NOT_FOUND",
    "SESSION_IN_STEP",
    "STEP_LAYER_CALLED",
    "STEP_BROKEN",
]


class ProblemType(NamedTuple):
    """One problem type: its HTTP status, its slug (``type`` is ``/problems/<slug>``)
    and its title."""

    status: int
    slug: str
    title: str


MALFORMED_BODY = ProblemType(400, "malformed-body", "Malformed body")
UNAUTHORIZED = ProblemType(401, "unauthorized", "Unauthorized")
FORBIDDEN = ProblemType(403, "forbidden", "Forbidden")
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
STEP_NOT_FOUND = ProblemType(404, "step-not-found", "Step not found")
SESSION_IN_STEP = ProblemType(409, "session-in-step", "Session in a step")
STEP_LAYER_CALLED = ProblemType(409, "step-layer-called", "Layer already called this token")
STEP_BROKEN = ProblemType(409, "step-broken", "Step broken")

#: every problem type of the contract, by slug
PROBLEM_TYPES: dict[str, ProblemType] = {
    p.slug: p
    for p in (
        MALFORMED_BODY,
        UNAUTHORIZED,
        FORBIDDEN,
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
        STEP_NOT_FOUND,
        SESSION_IN_STEP,
        STEP_LAYER_CALLED,
        STEP_BROKEN,
    )
}


class ProblemHelp(NamedTuple):
    """What a problem type's page says: when it happens, and what to do about it."""

    when: str
    action: str


#: when each problem type happens and what to do, by slug (the server's page at
#: ``/problems/<slug>``)
PROBLEM_HELP: dict[str, ProblemHelp] = {
    MALFORMED_BODY.slug: ProblemHelp(
        "The body could not be decoded as its declared Content-Type: bad MessagePack or JSON, a truncated "
        "body, trailing bytes, or an empty body with a declared type. Nothing was changed.",
        "Send a complete body that matches its Content-Type (application/msgpack or application/json).",
    ),
    UNAUTHORIZED.slug: ProblemHelp(
        "API keys are configured and the /v1 request carried no Authorization: Bearer header with one of them.",
        "Send one of the server's API keys as a bearer token (Authorization: Bearer <key>).",
    ),
    FORBIDDEN.slug: ProblemHelp(
        "A connection to the shared-memory transport's socket came from a process of another user than the "
        "server's (or root); it was closed.",
        "Run the client as the server's user, or use the HTTP port, the stream or the frame transport.",
    ),
    SESSION_NOT_FOUND.slug: ProblemHelp(
        "No session has this id, or it belongs to another API key's tenant (deleted, expired after idling, "
        "or never created).",
        "Create the session (PUT or POST /v1/sessions), or check the id and the API key.",
    ),
    LAYER_NOT_FOUND.slug: ProblemHelp(
        "The layer in the path is not an integer from 0 to num_layers - 1 of the session.",
        "Use a layer index below the session's num_layers (the num_layers member says how many it has).",
    ),
    NOT_FOUND.slug: ProblemHelp(
        "No route has this path.",
        "Check the URL against the API description at /openapi.json (or /docs).",
    ),
    METHOD_NOT_ALLOWED.slug: ProblemHelp(
        "The route exists but not with this HTTP method; the Allow header lists the methods it has.",
        "Use one of the methods of the Allow header.",
    ),
    BODY_TIMEOUT.slug: ProblemHelp(
        "The request body stopped arriving before it was complete; the connection was closed and nothing was changed.",
        "Send the whole body without long pauses; retrying the request is safe.",
    ),
    OFFSET_MISMATCH.slug: ProblemHelp(
        "The request's offset is not the layer's current length (another append came first, or one was "
        "lost); nothing was appended.",
        "Resend with offset set to the length member of the problem, after appending any rows you are missing.",
    ),
    SESSION_EXISTS.slug: ProblemHelp(
        "A PUT (of a session or of a snapshot) named an id that is already in use.",
        "Pick another id, or delete the existing session first.",
    ),
    CAPACITY_EXCEEDED.slug: ProblemHelp(
        "The append (or an attend's fused append) would take the layer past the session's max_tokens.",
        "Create the session with a larger max_tokens, or fork or restart the sequence.",
    ),
    PAYLOAD_TOO_LARGE.slug: ProblemHelp(
        "The body is larger than the server's max_body_bytes (the max_body_bytes member says how large it may be).",
        "Split the work into smaller requests (fewer rows or items per request).",
    ),
    UNSUPPORTED_MEDIA_TYPE.slug: ProblemHelp(
        "The body has a Content-Type the route does not take, or none.",
        "Send application/msgpack or application/json (a snapshot: application/msgpack).",
    ),
    INVALID_SNAPSHOT.slug: ProblemHelp(
        "The snapshot blob is not one this server can restore (format, version, configuration or sizes); "
        "nothing was created.",
        "Send a snapshot taken by GET /v1/sessions/{id}/snapshot of a compatible server, unmodified.",
    ),
    INVALID_REQUEST.slug: ProblemHelp(
        "A field is unknown, missing or of the wrong type, shape or dtype; a value is out of range or not "
        "finite; or the request is too large for the GPU. The detail names the field.",
        "Fix the request as the detail says; the API reference lists every field and limit.",
    ),
    INTERNAL_ERROR.slug: ProblemHelp(
        "A bug in the server. No traceback is sent; the detail names a request id found in the server's log.",
        "Report it with the request id from the detail.",
    ),
    GPU_ERROR.slug: ProblemHelp(
        "The GPU device failed while running the request. The detail names a request id found in the log.",
        "Retry later; report it with the request id if it persists.",
    ),
    OVERLOADED.slug: ProblemHelp(
        "The server's GPU queue is full; nothing was done.",
        "Retry after the Retry-After header's seconds, or send fewer requests at once.",
    ),
    NOT_READY.slug: ProblemHelp(
        "The GPU device is not open yet, or the server is draining before it stops.",
        "Retry after the Retry-After header's seconds (or on another replica).",
    ),
    TIMEOUT.slug: ProblemHelp(
        "The request waited in the GPU queue past the server's request timeout and was dropped; nothing was applied.",
        "Retry after the Retry-After header's seconds; retrying is safe.",
    ),
    OUT_OF_MEMORY.slug: ProblemHelp(
        "The request would pass the GPU memory budget, the device could not allocate, the session limit is "
        "reached, or the API key's quota (of sessions or bytes) is.",
        "Delete sessions you no longer need, use a smaller kv_format or max_tokens, or raise the limit named "
        "in the problem's members.",
    ),
    STEP_NOT_FOUND.slug: ProblemHelp(
        "No open step has this handle for this API key: it was never opened, it was closed (by DELETE or "
        "step_close, by the end of the connection that opened it, or after idling past the step idle timeout), "
        "or another key's tenant opened it.",
        "Open a step (POST /v1/steps or a stream's step_open) and use the handle it answers.",
    ),
    SESSION_IN_STEP.slug: ProblemHelp(
        "The session is in an open step, which owns its append positions: an append, attend or batch naming it "
        "from outside the step, a second step over it, or its DELETE is refused. Nothing was changed.",
        "Call the session through its step, or close the step first (a fork or a snapshot of it is allowed).",
    ),
    STEP_LAYER_CALLED.slug: ProblemHelp(
        "The step's layer was already called for the current token, or a call of it is still in flight; each "
        "layer is called once a token, and the token advances once every layer has been.",
        "Call the step's other layers first; the step's token and lengths are at GET /v1/steps/{step}.",
    ),
    STEP_BROKEN.slug: ProblemHelp(
        "A call of the step applied to some of its sessions and failed for others, so the sessions no longer "
        "stand at one token; the detail names the first failure (layer, token, item and its problem).",
        "Close the step, look at the sessions' lengths (GET /v1/sessions/{id}), and open a new step.",
    ),
}
