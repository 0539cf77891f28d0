"""The server's connections: uvicorn, with the deadlines and the cap per client it lacks.

headers         HEADER_TIMEOUT_S for a request's headers, from the connection's start or
                the previous response's end: a client sending a header byte every few
                seconds would hold its connection forever.
write progress  `write_timeout` (--write-timeout): a client that stops reading fills the
                socket's buffers, and uvicorn then waits for it with no deadline (six
                clients that pipelined GET /static/playground.js x200 and never read stayed
                connected >= 60 s with 2.8 MB queued each; issue 33). Once writing has been
                paused that long with no byte taken, the connection is reset: its queued
                bytes would never be read, and a graceful close would wait to send them.
                A slow reader that keeps taking bytes resumes the writes and is never cut.
per client      `per_client` (--max-connections-per-client): connections open at once from
                one address; the next gets 503 and is closed. uvicorn's limit_concurrency
                (--max-connections) answers 503 to everyone past it, so without this one
                address could hold every place and /health would fail for the rest. Behind
                a reverse proxy every client has the proxy's address: set it to
                --max-connections and cap clients at the proxy.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

#: A slow client may hold a connection this long while sending headers (and as long again while
#: sending its body: --body-timeout); then it is cut. 1 MiB takes well under a second on any
#: link a model server is reached over.
HEADER_TIMEOUT_S = 10.0
#: Seconds a response may wait for its client to take any of it (see the module docstring).
DEFAULT_WRITE_TIMEOUT_S = 30.0
#: Seconds uvicorn waits for open connections at shutdown. The engine fails waiting requests
#: and cancels the running one first, so they close at once; this bounds the rest (slow clients).
GRACEFUL_SHUTDOWN_S = 5

_REFUSED_BODY = json.dumps(
    {
        "error": {
            "message": "too many connections from this address",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
#: What a connection past its client's cap gets before it is closed: it may not have sent a
#: request yet, so the answer is written at once, as raw bytes.
REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n"
) + _REFUSED_BODY


def uvicorn_server(app: Any, **config: Any) -> Any:
    """A uvicorn.Server for `app` (serve.app.create_app) whose shutdown first drains the
    engine, so waiting requests get their 503 and the running one is cancelled before uvicorn
    waits for connections; its connections as the module docstring says."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.specdec.engine.drain()
            await super().shutdown(sockets)

    cfg = app.state.specdec.cfg
    config.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    config.setdefault("limit_concurrency", cfg.max_connections)
    config.setdefault(
        "http", protocol(HEADER_TIMEOUT_S, cfg.write_timeout, cfg.connections_per_client())
    )
    return _Server(uvicorn.Config(app, **config))


def protocol(header_timeout: float, write_timeout: float, per_client: int) -> type:
    """uvicorn's h11 protocol with the header and write-progress deadlines and the cap per
    client address (one count per server: each call makes a class of its own)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_from: collections.Counter[str] = collections.Counter()  # address -> connections open

    class _Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _address: str | None = None  # counted in open_from while this is set

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            address = self.client[0] if self.client else None
            if address is not None:
                if open_from[address] >= per_client:
                    transport.write(REFUSED)
                    transport.close()
                    return
                self._address = address
                open_from[address] += 1
            self._arm_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_headers()  # the next request's headers get their own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            if self._address is not None:
                open_from[self._address] -= 1
                if open_from[self._address] <= 0:
                    del open_from[self._address]
                self._address = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_stalled(self) -> None:
            self._write_timer = None
            self.transport.abort()  # connection_lost follows: the request sees a disconnect

        def _arm_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            # No request in flight (none yet, or the last one answered): its headers are late.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return _Protocol
