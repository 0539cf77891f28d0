"""serve.connections on the wire, with raw sockets (what no HTTP client library sends): a client
that pipelines a request and leaves cancels the running one, and a request framed by both
Content-Length and Transfer-Encoding is refused and its connection closed.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from serverkit import (
    MOCK_SPEC,
    Server,
    V,
    assert_good_request_exact,
    error_of,
    metric,
    mock_server,
    serve_models,
    wait_for,
)

from specdec.backends.mock import MockModel
from specdec.serve import connections as serve_connections

#: Seconds a cancellation may take once the client has gone: one prefill chunk (SLOW_CHUNK_S) or
#: a few decode rounds, with room for a loaded machine; the generations below run far longer.
CANCEL_WITHIN_S = 4.0
SLOW_CHUNK_S = 1.0
#: The most asyncio reads from a socket at once (selector_events' max_size).
ASYNCIO_READ = 256 * 1024


class _SlowPrefill(MockModel):
    """A MockModel whose prompt prefill takes SLOW_CHUNK_S per chunk (a long prompt on a real
    model): a streaming request writes nothing meanwhile, so only a read can see its client go."""

    def _prefill(self, ids: list[int]) -> None:
        time.sleep(SLOW_CHUNK_S)
        super()._prefill(ids)


def _post(body: dict, extra: bytes = b"") -> bytes:
    """POST /v1/completions as raw HTTP/1.1 bytes (`extra`: more header lines)."""
    data = json.dumps(body).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )


def _generations(srv: Server) -> float:
    """Requests that reached the engine, all outcomes."""
    text = srv.metrics()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("specdec_generations_total{")
    )


def _connected(srv: Server, port: int) -> bool:
    """Does the server still hold the connection from this client port?"""
    return any(p.client and p.client[1] == port for p in list(srv.uv.server_state.connections))


def _pipeline_and_leave(srv: Server, first: dict) -> None:
    """Send `first`, then (once it runs, in a segment of its own, as a client that pipelines
    while waiting sends it) a second request; close the socket; the engine must cancel `first`
    within CANCEL_WITHIN_S, and the second must never reach it."""
    cancelled = metric(srv.metrics(), "specdec_generations_total", outcome="cancelled")
    total = _generations(srv)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.sendall(_post(first))
    wait_for(lambda: srv.engine.busy, 10, "the first request never started")
    second = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 4}
    sock.sendall(_post(second))
    time.sleep(0.2)  # the second request is in the server's buffer, behind the first
    port = sock.getsockname()[1]
    held = _connected(srv, port)
    sock.close()
    t0 = time.monotonic()
    assert held, "the server closed the connection early"

    def _cancelled() -> bool:
        now = metric(srv.metrics(), "specdec_generations_total", outcome="cancelled")
        return now == cancelled + 1

    wait_for(_cancelled, CANCEL_WITHIN_S, "the running request was not cancelled")
    assert time.monotonic() - t0 < CANCEL_WITHIN_S
    wait_for(lambda: not _connected(srv, port), 10, "the server kept the connection")
    srv.wait_idle()
    assert _generations(srv) == total + 1  # the pipelined request never started
    assert_good_request_exact(srv)


def test_a_client_that_leaves_with_a_pipelined_request_cancels_the_running_one() -> None:
    """uvicorn stopped reading once the pipelined bytes came, so it never saw the close: the
    generation (here one that writes nothing until its end) ran to its end."""
    srv = mock_server(delay=0.01)
    try:
        long = {"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 3000, "temperature": 0.8}
        _pipeline_and_leave(srv, long)
    finally:
        srv.close()


def test_a_pipelined_request_does_not_hide_a_disconnect_during_a_streams_prefill() -> None:
    """The same with a streaming request: nothing is written during its prefill, so no failed
    write shows the client gone either."""
    target = _SlowPrefill(V, seed=0, name=MOCK_SPEC)
    srv = serve_models(target, _SlowPrefill.near(target, noise=0.7, seed=1))
    try:
        body = {"model": MOCK_SPEC, "prompt": [i % V for i in range(3072)], "max_tokens": 8}
        _pipeline_and_leave(srv, {**body, "stream": True})  # 6 chunks: 6 s of prefill
    finally:
        srv.close()


def test_the_read_ahead_past_a_running_request_is_bounded() -> None:
    """A client that pipelines more than a request's worth is not read on without end: past
    `read_ahead` bytes the reads pause again (uvicorn's own flow control)."""
    srv = mock_server(delay=0.01, max_body_bytes=64 * 1024)
    read_ahead = 64 * 1024 + serve_connections.READ_AHEAD_HEADERS
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        port = sock.getsockname()[1]
        long = {"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 3000, "temperature": 0.8}
        sock.sendall(_post(long))
        wait_for(lambda: srv.engine.busy, 10, "the first request never started")
        (proto,) = [p for p in list(srv.uv.server_state.connections) if p.client[1] == port]
        sock.setblocking(False)
        junk, deadline = b"x" * 65536, time.monotonic() + 20
        while not (proto.flow.read_paused and proto._ahead > read_ahead):
            assert time.monotonic() < deadline, "the server never paused its reads"
            try:
                sock.send(junk)
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(0.2)  # whatever the server would still read, it reads now
        assert proto.flow.read_paused and proto._ahead <= read_ahead + ASYNCIO_READ
        sock.close()
    finally:
        srv.close()


def test_pipelined_requests_are_still_answered_in_order() -> None:
    """Reading ahead past the running request changes nothing for a client that stays."""
    srv = mock_server()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            bodies = [{"model": MOCK_SPEC, "prompt": [1, 2, n], "max_tokens": 3} for n in (3, 4)]
            sock.sendall(b"".join(_post(b) for b in bodies))
            reader = sock.makefile("rb")
            for _ in bodies:
                status = reader.readline()
                assert status.startswith(b"HTTP/1.1 200"), status
                length = 0
                while (line := reader.readline()) != b"\r\n":
                    name, _, value = line.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                assert json.loads(reader.read(length))["object"] == "text_completion"
    finally:
        srv.close()


@pytest.mark.parametrize("order", ["cl-te", "te-cl"])
def test_content_length_with_transfer_encoding_is_400_and_the_connection_closes(
    order: str,
) -> None:
    """RFC 9112 6.1: h11 served it (chunked) and kept the connection for the next request."""
    srv = mock_server()
    try:
        data = json.dumps({"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        framing = [b"Content-Length: 5", b"Transfer-Encoding: chunked"]
        if order == "te-cl":
            framing.reverse()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n" + b"\r\n".join(framing) + b"\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
        )
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(request + _post({"model": MOCK_SPEC, "prompt": [1], "max_tokens": 1}))
            reply = b""
            while chunk := sock.recv(65536):  # to the server's close: it must close
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        assert lines[0].startswith("HTTP/1.1 400"), lines[0]
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close"
        assert len(body) == int(headers["content-length"])  # one response: the second unanswered
        err = error_of(400, json.loads(body), "ambiguous_framing")
        assert err["type"] == "invalid_request_error" and err["param"] is None
        assert _generations(srv) == 0
        assert_good_request_exact(srv)
    finally:
        srv.close()
