"""``X-Attnserve-Instance``: which replica answered, on every response.

Behind the router (``deploy/nginx/attnserve.conf``) several replicas answer under
one address; this header names the one that did, so a client, a load test or an
operator can see where a session lives. The name comes from the environment
variable ``ATTNSERVE_INSTANCE_NAME`` (the compose file sets ``attnserve-0``,
``attnserve-1``, ...), else the host name (a container's id under Docker).

Pure ASGI (no Starlette ``BaseHTTPMiddleware``): it only rewrites the
``http.response.start`` message, so it neither buffers bodies nor breaks
streaming. Two ways to install it::

    app.add_middleware(InstanceHeaderMiddleware)   # every answer but an unhandled-exception 500
    asgi_app = InstanceHeaderMiddleware(app)       # every answer (wraps Starlette's ServerErrorMiddleware too)
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["HEADER", "ENV_VAR", "InstanceHeaderMiddleware", "instance_name"]

HEADER = "X-Attnserve-Instance"
ENV_VAR = "ATTNSERVE_INSTANCE_NAME"

_HEADER_KEY = HEADER.lower().encode("ascii")
# A header value may hold visible ASCII and spaces; anything else becomes "_".
_UNSAFE = re.compile(r"[^\x21-\x7e ]")
_MAX_LEN = 128

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def instance_name(name: str | None = None) -> str:
    """The instance name: ``name``, else ``$ATTNSERVE_INSTANCE_NAME``, else the host
    name; made safe for a header value (visible ASCII, at most 128 characters)."""
    if name is None or not name.strip():
        name = os.environ.get(ENV_VAR, "")
    if not name.strip():
        name = socket.gethostname()
    safe = _UNSAFE.sub("_", name.strip())[:_MAX_LEN]
    return safe or "unknown"


class InstanceHeaderMiddleware:
    """Adds ``X-Attnserve-Instance: <name>`` to every HTTP response.

    Args:
        app: the ASGI application to wrap.
        name: the instance name; default :func:`instance_name` (environment, then
            host name), read once when the middleware is built.
    """

    def __init__(self, app: ASGIApp, name: str | None = None) -> None:
        self.app = app
        self.name = instance_name(name)
        self._header = (_HEADER_KEY, self.name.encode("ascii"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if bytes(k).lower() != _HEADER_KEY]
                headers.append(self._header)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
