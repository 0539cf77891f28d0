"""The checks at the server's door, for the single server (serve.app) and the cluster's edge
(serve.edge) alike, so that every way in meets the same ones: the Host header (DNS rebinding)
and the headers every response carries (middleware); the body's Content-Type, size and arrival
deadline; the operator's key on /metrics.

The routes' context on `app.state.specdec` (serve.app's or serve.edge's) carries what these
read: `keys` and `operator`, the KeyRings of the API keys and of the operator's key. Starlette
only (FastAPI's Request and JSONResponse are Starlette's): the edge imports this module
without FastAPI, pydantic or torch.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.serve.errors import ApiError
from specdec.serve.keys import unauthorized


# ------------------------------------------------------------------------------ middleware
class HostCheck:
    """Refuse requests whose Host header is not served (DNS rebinding: a page on evil.example
    that resolves its own name to 127.0.0.1 reaches a loopback server with Host: evil.example)."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if _host_name(host) not in self.names:
                err = ApiError(400, f"the Host header {host!r} is not served", code="invalid_host")
                await JSONResponse(err.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ResponseHeaders:
    """Every response echoes the request's x-request-id (a router's or client's trace id; one
    is made when none or a malformed one came) and names the replica that answered."""

    def __init__(self, app: ASGIApp, replica: str | None) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = dict(scope["headers"]).get(b"x-request-id", b"")
        if not _REQUEST_ID.fullmatch(rid):
            rid = uuid.uuid4().hex.encode()
        extra = [(b"x-request-id", rid)]
        if self.replica is not None:
            extra.append((b"x-specdec-replica", self.replica.encode()))

        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with)


#: An x-request-id echoed as it came: printable ASCII without spaces, at most 128 bytes.
_REQUEST_ID = re.compile(rb"[!-~]{1,128}")


def _host_name(host: str) -> str:
    """ "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


# ------------------------------------------------------------------------------ the body
async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, at most `limit` bytes, within `timeout` seconds (408 after)."""
    return await read_within(_read_all(request, limit), timeout)


async def read_within(read: Awaitable[bytes], timeout: float) -> bytes:
    """`read` (a body being read) within `timeout` seconds: 408 after (serve.edge reads its
    requests that are no generation with it too)."""
    try:
        return await asyncio.wait_for(read, timeout)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read_all(request: Request, limit: int) -> bytes:
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {media or 'none'!r}",
            code="unsupported_media_type",
        )
    return await read_at_most(request, limit)


async def read_at_most(request: Request, limit: int) -> bytes:
    """The request body; 413 past `limit` bytes, declared or sent (serve.edge reads with it
    too)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body of {declared} bytes exceeds the limit of {limit} bytes",
            code="request_too_large",
        )
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(
                413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
    return bytes(body)


# ------------------------------------------------------------------------------ the operator
def check_operator(request: Request) -> None:
    """/metrics counts every tenant's requests (their prompt tokens, cache and pool hits, one
    request at a time when traffic is light), so it is the operator's: their key where one is
    set (--metrics-key-file; a tenant's key gets 403), else the key of a server with one API
    key, whose one tenant is its operator; with several keys and no operator key, nobody's
    (403). A server without keys serves it to anyone, as it does /v1. 401 for a key that is
    none of these."""
    ctx = request.app.state.specdec
    auth = request.headers.get("authorization", "")
    if ctx.operator is None and len(ctx.keys) <= 1:
        ctx.keys.tenant(auth)  # 401 without the one key
        return
    if ctx.operator is not None and ctx.operator.matches(auth):
        return
    if not ctx.keys.matches(auth):
        raise unauthorized()
    raise ApiError(
        403,
        "/metrics describes every API key's requests and needs the operator's key "
        "(specdec serve --metrics-key-file)",
        type="permission_error",
        code="operator_key_required",
    )
