"""The exception tree of attnserve_client, and the mapping from problem details to it.

Every exception the client raises on purpose derives from :class:`AttnServeError`:

- :class:`InvalidInput` (also a ``ValueError``): refused before anything was sent.
  A mistake the server would refuse too raises the class its answer maps to, as
  an instance that is also an :class:`InvalidInput` (see :func:`refused`): a layer
  out of range is a :class:`LayerNotFound` whether the client or the server
  catches it.
- :class:`APIConnectionError`, :class:`APITimeoutError`: no answer came.
- :class:`InvalidResponse`: an answer came but is not what the contract says.
- :class:`APIError`: the server answered with an error; one subclass per problem
  type of the contract (``"/problems/<slug>"``, the slugs from
  :mod:`attnserve_client.problems`) that a client handles, :class:`APIStatusError`
  for any other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar

from . import problems

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AttnServeError",
    "CapacityExceeded",
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
    "Overloaded",
    "PayloadTooLarge",
    "SessionExists",
    "SessionInStep",
    "SessionNotFound",
    "StepBroken",
    "StepLayerCalled",
    "StepNotFound",
    "Unauthorized",
    "UnsupportedMediaType",
    "parse_problem",
    "parse_retry_after",
    "refused",
]


class AttnServeError(Exception):
    """Base of every error raised by attnserve_client.

    Attributes:
        status: the HTTP status of the answer, or ``None`` when there was none.
        problem: the problem details body (``{}`` when there was none).
    """

    status: int | None
    problem: dict[str, Any]

    def __init__(self, message: str, *, status: int | None = None, problem: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.problem = dict(problem or {})

    @property
    def type(self) -> str | None:
        """The problem's ``type`` (``"/problems/<slug>"``), if any."""
        value = self.problem.get("type")
        return value if isinstance(value, str) else None

    @property
    def title(self) -> str | None:
        value = self.problem.get("title")
        return value if isinstance(value, str) else None

    @property
    def detail(self) -> str | None:
        value = self.problem.get("detail")
        return value if isinstance(value, str) else None


class InvalidInput(AttnServeError, ValueError):
    """An argument was refused by the client before any request was sent."""


class APIConnectionError(AttnServeError):
    """The request failed without an answer (connection refused or dropped, ...).

    The underlying httpx exception is the ``__cause__``.
    """


class APITimeoutError(APIConnectionError):
    """The request timed out (connect, write, read or pool timeout)."""


class InvalidResponse(AttnServeError):
    """The server answered with a success status but a body the contract does not allow."""


class APIError(AttnServeError):
    """The server answered with an error status.

    Attributes:
        status: the HTTP status.
        problem: the RFC 9457 problem details (``type``, ``title``, ``status``,
            ``detail`` and any extra members).
        headers: the answer's headers (lower-case names).
        retry_after: seconds from a ``Retry-After`` header, or ``None``.
    """

    slug: ClassVar[str | None] = None
    status: int

    def __init__(
        self,
        message: str,
        *,
        status: int,
        problem: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, status=status, problem=problem)
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.retry_after = parse_retry_after(self.headers.get("retry-after"))


class APIStatusError(APIError):
    """An error answer whose problem type this client does not know, or that is no problem."""


class MalformedBody(APIError):
    """400: the body could not be decoded as its declared content type."""

    slug = problems.MALFORMED_BODY.slug


class Unauthorized(APIError):
    """401: API keys are configured and the bearer token is missing or wrong."""

    slug = problems.UNAUTHORIZED.slug


class Forbidden(APIError):
    """403: the shared-memory transport refused a process of another user."""

    slug = problems.FORBIDDEN.slug


class SessionNotFound(APIError):
    """404: unknown session id (or one that belongs to another API key)."""

    slug = problems.SESSION_NOT_FOUND.slug


class LayerNotFound(APIError):
    """404: the layer index is outside ``0..num_layers-1``."""

    slug = problems.LAYER_NOT_FOUND.slug


class OffsetMismatch(APIError):
    """409: the ``offset`` sent is not the layer's length; nothing was appended.

    ``length`` is the layer's actual length, as the server reported it.
    """

    slug = problems.OFFSET_MISMATCH.slug

    @property
    def length(self) -> int | None:
        value = self.problem.get("length")
        return value if type(value) is int else None


class SessionExists(APIError):
    """409: a session with this id exists already."""

    slug = problems.SESSION_EXISTS.slug


class CapacityExceeded(APIError):
    """409: the append would take the layer past the session's ``max_tokens``."""

    slug = problems.CAPACITY_EXCEEDED.slug


class PayloadTooLarge(APIError):
    """413: the body is larger than the server accepts."""

    slug = problems.PAYLOAD_TOO_LARGE.slug


class UnsupportedMediaType(APIError):
    """415: the request's content type is not MessagePack or JSON."""

    slug = problems.UNSUPPORTED_MEDIA_TYPE.slug


class InvalidSnapshot(APIError):
    """422: a snapshot blob is truncated, corrupted, of another version or too large."""

    slug = problems.INVALID_SNAPSHOT.slug


class InvalidRequest(APIError):
    """422: a field, shape, dtype, byte count or value is not allowed (see ``detail``)."""

    slug = problems.INVALID_REQUEST.slug


class Overloaded(APIError):
    """503: the server's queue is full; ``retry_after`` says when to come back."""

    slug = problems.OVERLOADED.slug


class NotReady(APIError):
    """503: the device is not ready, or the server is draining."""

    slug = problems.NOT_READY.slug


class BodyTimeout(APIError):
    """408: the server stopped waiting for the rest of the request body; nothing changed."""

    slug = problems.BODY_TIMEOUT.slug


class RequestTimeout(APIError):
    """503: the request waited too long for the GPU and was dropped unapplied
    (server setting ``ATTNSERVE_REQUEST_TIMEOUT_S``); safe to retry."""

    slug = problems.TIMEOUT.slug


class OutOfMemory(APIError):
    """507: the GPU memory budget (or the key's quota) cannot hold the request."""

    slug = problems.OUT_OF_MEMORY.slug


class StepNotFound(APIError):
    """404: no open step has this handle for this API key (closed, expired after
    idling, its connection closed, or another key's)."""

    slug = problems.STEP_NOT_FOUND.slug


class SessionInStep(APIError):
    """409: the session is in an open step, which owns its append positions: call it
    through the step, or close the step first (``problem["step"]``: its handle, when
    the server names it)."""

    slug = problems.SESSION_IN_STEP.slug


class StepLayerCalled(APIError):
    """409: the step's layer was already called this token (or a call of it is in
    flight); call the step's other layers first."""

    slug = problems.STEP_LAYER_CALLED.slug


class StepBroken(APIError):
    """409: a call of the step applied to some of its sessions and failed for others;
    the step refuses further calls (close it and open another; ``detail`` names the
    first failure)."""

    slug = problems.STEP_BROKEN.slug


_BY_SLUG: dict[str, type[APIError]] = {
    cls.slug: cls
    for cls in (
        MalformedBody,
        Unauthorized,
        Forbidden,
        SessionNotFound,
        LayerNotFound,
        OffsetMismatch,
        SessionExists,
        CapacityExceeded,
        PayloadTooLarge,
        UnsupportedMediaType,
        InvalidSnapshot,
        InvalidRequest,
        Overloaded,
        NotReady,
        BodyTimeout,
        RequestTimeout,
        OutOfMemory,
        StepNotFound,
        SessionInStep,
        StepLayerCalled,
        StepBroken,
    )
    if cls.slug is not None
}

# Statuses that name one problem type only: used when an answer (e.g. from a proxy
# in front of the server) has that status but no problem body.
_BY_STATUS: dict[int, type[APIError]] = {
    401: Unauthorized,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    507: OutOfMemory,
}

_MAX_SHOWN = 500

_LOCAL: dict[type[APIError], type[APIError]] = {}


def refused(cls: type[APIError], message: str) -> APIError:
    """The error for a mistake caught before sending that the server would answer
    with problem type ``cls``: an instance of ``cls`` that is also an
    :class:`InvalidInput`, with ``status`` None (nothing was sent) and the problem's
    ``type`` and ``detail``, so one ``except`` catches the mistake wherever it was found."""
    local = _LOCAL.get(cls)
    if local is None:
        local = _LOCAL[cls] = type(
            cls.__name__,
            (cls, InvalidInput),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
        )
    return local(message, status=None, problem={"type": f"/problems/{cls.slug}", "detail": message})  # type: ignore[arg-type]


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP date), or ``None``."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def _decode_body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        pass
    from . import wire  # local: errors.py stays importable on its own

    try:
        return wire.unpackb(body, max_bytes=max(len(body), 1))
    except wire.WireError:
        return None


def parse_problem(
    status: int,
    body: bytes | Mapping[str, Any] | None,
    headers: Mapping[str, str] | None = None,
) -> APIError:
    """Build the exception for an error answer.

    Args:
        status: the HTTP status.
        body: the raw body (problem+json, or MessagePack, or anything) or the
            already decoded problem.
        headers: the answer's headers, for ``Retry-After``.

    Returns:
        An instance of the :class:`APIError` subclass whose slug is the last path
        segment of the problem's ``type``; :class:`APIStatusError` for an unknown
        type, or for a body that is not a problem (then the subclass that the status
        alone names, if only one does, e.g. 401 -> :class:`Unauthorized`).
    """
    decoded: Any = body if isinstance(body, Mapping) else (_decode_body(body) if body else None)
    problem: dict[str, Any]
    cls: type[APIError]
    if isinstance(decoded, Mapping) and isinstance(decoded.get("type"), str):
        problem = dict(decoded)
        slug = problem["type"].rstrip("/").rsplit("/", 1)[-1]
        cls = _BY_SLUG.get(slug, APIStatusError)
        text = problem.get("detail") or problem.get("title") or slug
        message = f"{status} {slug}: {text}"
    else:
        problem = dict(decoded) if isinstance(decoded, Mapping) else {}
        if not problem and body:
            raw = body if isinstance(body, bytes) else b""
            shown = raw[:_MAX_SHOWN].decode("utf-8", "replace")
            if shown:
                problem["detail"] = shown
        cls = _BY_STATUS.get(status, APIStatusError)
        message = f"{status} error" + (f": {problem['detail']}" if problem.get("detail") else "")
    return cls(message, status=status, problem=problem, headers=headers)
