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
read-ahead      uvicorn stops reading a connection when pipelined bytes arrive while a response
                is running, and only a read sees the client close: a client that pipelined
                a request and left kept its running generation going to the end (the app
                sees a disconnect only through connection_lost). The connection is read on,
                up to `read_ahead` bytes past the running request (one request of the
                largest size served, with its headers); past that it waits, as before.
framing         A request with both Content-Length and Transfer-Encoding gets 400 and the
                connection is closed (RFC 9112 6.1: its body's end is ambiguous, the lever of
                request smuggling behind a proxy that reads the other header). h11 would
                serve it chunked and keep the connection.
head size       A request target past MAX_TARGET_BYTES gets 414, a request line and headers
                past MAX_HEAD_BYTES 431, each with the server's JSON error, and the connection
                is closed. h11 bounds only a head still arriving (16 KiB), so a whole one of any
                size came through in one read.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import h11

#: A slow client may hold a connection this long while sending headers (and as long again while
#: sending its body: --body-timeout); then it is cut. 1 MiB takes well under a second on any
#: link a model server is reached over.
HEADER_TIMEOUT_S = 10.0
#: The most bytes of a request's target (its path and query), and of its whole head.
MAX_TARGET_BYTES = 8 * 1024
MAX_HEAD_BYTES = 16 * 1024
#: Seconds a response may wait for its client to take any of it (see the module docstring).
DEFAULT_WRITE_TIMEOUT_S = 30.0
#: Seconds uvicorn waits for open connections at shutdown. The engine fails waiting requests
#: and cancels the running one first, so they close at once; this bounds the rest (slow clients).
GRACEFUL_SHUTDOWN_S = 5
#: Bytes a request's headers may take in the read-ahead past the running request, besides the
#: largest body served (h11 refuses headers past 16 KiB by default).
READ_AHEAD_HEADERS = 64 * 1024
#: The read-ahead when the server's body limit is not given (protocol's default).
DEFAULT_READ_AHEAD = (1 << 20) + READ_AHEAD_HEADERS


def _error_body(message: str, type_: str, code: str) -> bytes:
    """An error in the server's OpenAI shape (serve.errors.ApiError.body), as bytes."""
    error = {"message": message, "type": type_, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


_REFUSED_BODY = _error_body(
    "too many connections from this address", "server_error", "too_many_connections"
)
#: What a connection past its client's cap gets before it is closed: it may not have sent a
#: request yet, so the answer is written at once, as raw bytes.
REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\n"
    b"content-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n"
) + _REFUSED_BODY


def uvicorn_server(app: Any, **config: Any) -> Any:
    """A uvicorn.Server for `app` (serve.app.create_app) whose shutdown first drains the
    engine, so waiting requests get their 503 and the running one is cancelled before uvicorn
    waits for connections; its connections as the module docstring says."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.specdec.drain()
            await super().shutdown(sockets)

    cfg = app.state.specdec.cfg
    config.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    config.setdefault("limit_concurrency", cfg.max_connections)
    # asyncio's loop, not uvloop where it is installed (Ray brings it): one loop on every host
    config.setdefault("loop", "asyncio")
    read_ahead = cfg.max_body_bytes + READ_AHEAD_HEADERS
    config.setdefault(
        "http",
        protocol(HEADER_TIMEOUT_S, cfg.write_timeout, cfg.connections_per_client(), read_ahead),
    )
    return _Server(uvicorn.Config(app, **config))


_TOO_LONG = f"the request target exceeds the server's limit of {MAX_TARGET_BYTES} bytes"
_TOO_LARGE = f"the request line and headers exceed the server's limit of {MAX_HEAD_BYTES} bytes"
_AMBIGUOUS = (
    "a request may not have both Content-Length and Transfer-Encoding (RFC 9112 section 6.1)"
)
#: The requests refused with the server's JSON error (code: status, reason, message).
_REFUSALS = {
    "ambiguous_framing": (400, b"Bad Request", _AMBIGUOUS),
    "uri_too_long": (414, b"URI Too Long", _TOO_LONG),
    "header_too_large": (431, b"Request Header Fields Too Large", _TOO_LARGE),
}


class _FramedConnection(h11.Connection):
    """h11's server connection, refusing a request with both Content-Length and
    Transfer-Encoding, or a target or head past its bound, as h11 refuses other bad framing:
    RemoteProtocolError, on which uvicorn answers (send_400_response) before any application
    runs."""

    refused: str | None = None  # the _REFUSALS code of the request refused, if any

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:  # h11's own: a head still arriving past its bound
            self.refused = "header_too_large" if e.error_status_hint == 431 else None
            raise
        if isinstance(event, h11.Request):
            head = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
            names = {name for name, _ in event.headers}  # h11 lowercases header names
            if len(event.target) > MAX_TARGET_BYTES:
                self._refuse("uri_too_long")
            if head > MAX_HEAD_BYTES:
                self._refuse("header_too_large")
            if b"content-length" in names and b"transfer-encoding" in names:
                self._refuse("ambiguous_framing")
        return event

    def _refuse(self, code: str) -> None:
        self.refused = code
        status, _, message = _REFUSALS[code]
        raise h11.RemoteProtocolError(message, error_status_hint=status)


class _ReadAhead:
    """The read-ahead past a running request and the framing check (the module docstring), for
    uvicorn's H11Protocol: a mixin, as `protocol` subclasses that class where uvicorn is
    imported."""

    read_ahead = DEFAULT_READ_AHEAD  # bytes read past the running request, at most
    _ahead = 0  # bytes buffered past the running request (while _pipelining())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        limits = {} if size is None else {"max_incomplete_event_size": size}
        self.conn = _FramedConnection(h11.SERVER, **limits)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next (pipelined) request at once
        self._read_on(measure=True)

    def data_received(self, data: bytes) -> None:
        pipelined = self._pipelining()
        if pipelined:
            self._ahead += len(data)
        super().data_received(data)  # uvicorn pauses reading if this is past a request
        self._read_on(measure=not pipelined)

    def _pipelining(self) -> bool:
        """Is a response running while its request has been read to its end (so any byte
        that comes is the next request's)?"""
        cycle = self.cycle
        return (
            cycle is not None
            and not cycle.response_complete
            and not cycle.disconnected
            and self.conn.their_state is h11.DONE
        )

    def _read_on(self, measure: bool) -> None:
        """Resume the reads uvicorn paused for a pipelined request, while the bytes past the
        running one fit in `read_ahead`: only a read sees the client close, and the closing
        is what cancels the running request (connection_lost). `measure`: the running
        request has just ended; count what h11 holds past it (once per request: it copies)."""
        if not self._pipelining() or self.transport.is_closing():
            return
        if measure:
            self._ahead = len(self.conn.trailing_data[0])
        if self._ahead <= self.read_ahead:
            self.flow.resume_reading()

    def send_400_response(self, msg: str) -> None:
        conn = self.conn
        code = conn.refused if isinstance(conn, _FramedConnection) else None
        if code is None:
            super().send_400_response(msg)
            return
        status, reason, message = _REFUSALS[code]
        body = _error_body(message, "invalid_request_error", code)
        # The server's JSON error rather than uvicorn's text; the connection is closed
        # after it (the rest of the stream cannot be framed).
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reply = h11.Response(status_code=status, headers=headers, reason=reason)
        for event in (reply, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(conn.send(event) or b"")
        self.transport.close()


def protocol(
    header_timeout: float,
    write_timeout: float,
    per_client: int,
    read_ahead: int = DEFAULT_READ_AHEAD,
) -> type:
    """uvicorn's h11 protocol with the header and write-progress deadlines, the cap per client
    address (one count per server: each call makes a class of its own), the read-ahead past a
    running request and the framing check (the module docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_from: collections.Counter[str] = collections.Counter()  # address -> connections open

    class _Protocol(_ReadAhead, H11Protocol):
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
            super().on_response_complete()  # may start the next (pipelined) request at once
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

    _Protocol.read_ahead = read_ahead
    return _Protocol
