"""API keys: who a request acts for.

With keys configured (``ATTNSERVE_API_KEYS`` and/or ``ATTNSERVE_API_KEYS_FILE``),
every ``/v1`` request carries ``Authorization: Bearer <key>``, and each key is a
tenant. A tenant is named by its *key id*, ``sha256("attnserve-key-id\\0" + key)``
cut to 24 hex digits: sessions, snapshot files, metrics labels and logs hold the
key id, never the key. Keys are compared in constant time: the presented token's
SHA-256 is compared with every configured key's SHA-256 by
:func:`hmac.compare_digest`, all of them, whichever matches.

Without keys there is one tenant, ``None``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from .errors import Unauthorized

__all__ = ["KeyRing", "key_id", "REALM"]

REALM = "attnserve"
_ID_PREFIX = b"attnserve-key-id\0"


def key_id(key: str) -> str:
    """The tenant id of ``key``: 24 hex digits of a domain-separated SHA-256."""
    return hashlib.sha256(_ID_PREFIX + key.encode("utf-8")).hexdigest()[:24]


class KeyRing:
    """The configured keys, kept only as digests, and the bearer-token check."""

    def __init__(self, keys: Iterable[str]):
        self._entries = [(hashlib.sha256(k.encode("utf-8")).digest(), key_id(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def key_ids(self) -> list[str]:
        return [kid for _, kid in self._entries]

    def authenticate(self, authorization: bytes | None) -> str:
        """The key id for an ``Authorization`` header value.

        Raises:
            Unauthorized: missing, not ``Bearer``, or no configured key (with a
                ``WWW-Authenticate`` challenge, RFC 6750). ``reason`` in the
                exception's ``extra_reason`` attribute: "missing" or "invalid".
        """
        token = _bearer(authorization)
        if token is None:
            err = Unauthorized(
                "this server needs an API key: send Authorization: Bearer <key>",
                headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'},
            )
            err.reason = "missing"  # type: ignore[attr-defined]
            raise err
        digest = hashlib.sha256(token).digest()
        found: str | None = None
        for stored, kid in self._entries:  # no early exit: the time does not depend on which key
            if hmac.compare_digest(digest, stored):
                found = kid
        if found is None:
            err = Unauthorized(
                "the API key is not valid",
                headers={"WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token"'},
            )
            err.reason = "invalid"  # type: ignore[attr-defined]
            raise err
        return found


def _bearer(value: bytes | None) -> bytes | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token
