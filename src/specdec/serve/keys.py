"""API keys, held as keyed digests: which key a request presented, as a tenant id.

A server may accept several keys (`specdec serve --api-keys-file`), one per tenant; what a tenant
may read server-side (its draft pool: serve.draft_pools) is scoped by the key it authenticated
with. The keys themselves are not kept: `KeyRing` holds HMAC-SHA256(secret, key) under a secret
drawn at start-up, so neither a tenant id (in memory, in a log) nor the ring reveals a key, and
a short key cannot be brute-forced from its id without the secret. Ids are stable for the life
of the process, which is as long as anything scoped by them lives (the pools are in memory).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from specdec.serve.errors import ApiError

#: The tenant of every request on a server without API keys (a Bearer token sent anyway
#: authenticates nothing there, so it chooses nothing either).
ANONYMOUS = "anonymous"
#: Bytes of the digest a tenant id shows (hex): 128 bits, collision-free for any key count.
_ID_BYTES = 16


class KeyRing:
    """The server's API keys (none: no key is required), as keyed digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._secret = secrets.token_bytes(32)
        self._digests = tuple(dict.fromkeys(self._digest(k.encode("utf-8")) for k in keys))

    def _digest(self, key: bytes) -> bytes:
        return hmac.new(self._secret, key, hashlib.sha256).digest()

    def __len__(self) -> int:
        return len(self._digests)

    def _find(self, authorization: str) -> bytes | None:
        """The digest of the key in an `Authorization: Bearer KEY` header value, if it is one
        of the ring's."""
        scheme, _, token = authorization.partition(" ")
        # Starlette decodes headers as latin-1: encoding back gives the bytes the client sent.
        given = self._digest(token.strip().encode("latin-1"))
        found = None
        for known in self._digests:  # all of them: the time taken says nothing of which matched
            if hmac.compare_digest(given, known):
                found = known
        return found if scheme.lower() == "bearer" else None

    def matches(self, authorization: str) -> bool:
        """True when the header holds one of the ring's keys (never for an empty ring)."""
        return self._find(authorization) is not None

    def tenant(self, authorization: str) -> str:
        """The tenant id of the key in an `Authorization: Bearer KEY` header value: ANONYMOUS
        when the server has no keys; ApiError 401 when it has and the header holds none of
        them."""
        if not self._digests:
            return ANONYMOUS
        found = self._find(authorization)
        if found is None:
            raise unauthorized()
        return found[:_ID_BYTES].hex()


def unauthorized() -> ApiError:
    """The 401 of a request without an accepted key."""
    return ApiError(
        401,
        "missing or incorrect API key (Authorization: Bearer KEY)",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
