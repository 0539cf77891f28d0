"""Issue 65's hostile checks, against one server and against the cluster's edge (serverkit.FRONTS:
the edge over two in-process replicas; test_cluster.py repeats the first through Ray): keyless
slow bodies beside a keyed user, heads past the limit, a storm of fast 4xx with long prompts,
two keys at a small queue, and the edge's own headers from a client.

Before the edge, the cluster's front door was Ray's proxy: 16 keyless slow bodies at
--max-connections 16 made /health time out, and a storm of fast 404s left router slots counted
for good, shutting the cluster while its engines sat idle.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import time
from typing import Any

import pytest
from serverkit import (
    API_KEY,
    AUTH,
    FRONTS,
    GOOD,
    JSON,
    EdgeServer,
    FakeTokenizer,
    Server,
    bearer,
    front_server,
    metric,
    wait_for,
)

pytestmark = pytest.mark.slow  # seconds of a live server's traffic: `make test` runs them


def _attacker(port: int, head: bytes) -> socket.socket:
    """A connection from 127.0.0.2 (another client than the test's) that sends `head`."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0))
    c.sendall(head)
    return c


SLOW_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)


def _timed(srv: Server, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    status, _, _ = srv.request(method, path, body, **kw)
    return status, time.perf_counter() - t0


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("connections", [16, 256])
def test_keyless_slow_bodies_leave_health_and_a_keyed_user_alone(front: str, connections: int):
    srv = front_server(front, api_key=API_KEY, delay=0.01, max_connections=connections)
    socks: list[socket.socket] = []
    try:
        _, usual = _timed(srv, "POST", "/v1/completions", GOOD, headers=AUTH)
        for _ in range(connections):
            try:
                socks.append(_attacker(srv.port, SLOW_BODY))
            except OSError:  # refused past its share: what the cap is for
                break
        for _ in range(3):
            status, took = _timed(srv, "GET", "/health")
            assert status == 200 and took < 1.0, (status, took)
            status, took = _timed(srv, "POST", "/v1/completions", GOOD, headers=AUTH)
            assert status == 200 and took < usual + 2.0, (status, took, usual)
            time.sleep(0.3)
    finally:
        for c in socks:
            c.close()
        srv.close()


@pytest.mark.parametrize("front", FRONTS)
def test_a_head_or_url_past_the_limit_is_refused_and_the_connection_closed(front: str) -> None:
    srv = front_server(front)
    try:
        heads = [  # whole, in one write: h11 alone bounds only a head still arriving
            (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000, 431),
            (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1", 414),
            (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1" + b"\r\nX-Many: b" * 2000, 431),
            (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000, 431),
        ]
        for head, code in heads:
            head += b"\r\n\r\n"
            with _attacker(srv.port, head) as c:
                answer = b""
                while chunk := c.recv(65536):  # read to the close
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 %d" % code), answer[:80]
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == ("uri_too_long" if code == 414 else "header_too_large")
        assert srv.request("GET", "/health")[0] == 200
    finally:
        srv.close()


@pytest.mark.parametrize("front", FRONTS)
def test_a_storm_of_fast_4xx_leaves_nothing_running(front: str) -> None:
    srv = front_server(front, api_key=API_KEY, parallel=1, delay=0.005)
    try:
        wrong = {**GOOD, "model": "nope", "prompt": "x" * 70_000}

        def one(_: int) -> int:
            return srv.request("POST", "/v1/completions", wrong, AUTH)[0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(one, range(64)))
        assert set(statuses) <= {404, 429} and statuses.count(404) >= 16, statuses
        status, took = _timed(srv, "POST", "/v1/completions", GOOD, headers=AUTH)
        assert status == 200 and took < 2.0, took
        text = srv.metrics()
        assert _total(text, "specdec:num_requests_running") == 0
        if front == "edge":
            assert metric(text, "specdec_edge_waiting") == 0
            held = [ln for ln in text.splitlines() if ln.startswith("specdec_edge_slots_held")]
            assert held and all(ln.endswith(" 0") for ln in held), held
    finally:
        srv.close()


@pytest.mark.parametrize("front", FRONTS)
def test_a_second_key_waits_at_most_one_generation_of_the_first(front: str) -> None:
    keys = ("key-flood", "key-other")
    srv = front_server(
        front, api_keys=keys, metrics_key="key-op", parallel=1, max_queue=4, delay=0.02
    )
    try:
        long = {**GOOD, "max_tokens": 24, "temperature": 0}
        _, one_generation = _timed(srv, "POST", "/v1/completions", long, headers=bearer(keys[0]))
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            flood = [
                pool.submit(srv.request, "POST", "/v1/completions", long, bearer(keys[0]))
                for _ in range(10)
            ]
            wait_for(lambda: _waiting(srv, front) >= 1, 10, "the flood never queued")
            status, took = _timed(srv, "POST", "/v1/completions", long, headers=bearer(keys[1]))
            statuses = [f.result()[0] for f in flood]
        assert status == 200
        # a generation running ahead of it, then its own (and a loaded host's slack)
        assert took < 2 * one_generation + 1.0, (took, one_generation)
        assert 429 in statuses and 200 in statuses, statuses  # the flood met its key's share
    finally:
        srv.close()


def _total(text: str, name: str) -> float:
    """A gauge summed over its series (the edge's /metrics has one per replica); a test that
    reads it must see it at least once."""
    values = [
        float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith((name + " ", name + "{"))
    ]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def _waiting(srv: Server, front: str) -> float:
    name = "specdec_edge_waiting" if front == "edge" else "specdec:num_requests_waiting"
    return metric(srv.request("GET", "/metrics", headers=bearer("key-op"))[2], name)


def test_the_edges_own_headers_from_a_client_are_not_taken() -> None:
    """x-specdec-deadline-s tells a replica what is left of a request's time: only the edge
    sets it. A client's (0 s) would time its request out at once; it is dropped."""
    srv = front_server("edge", api_key=API_KEY)
    try:
        headers = {**AUTH, **JSON, "X-Specdec-Deadline-S": "0", "X-Request-Timeout-Seconds": "0"}
        status, _, r = srv.request("POST", "/v1/completions", GOOD, headers)
        assert status == 200, r
    finally:
        srv.close()


def test_a_request_past_its_deadline_at_the_edge_gets_the_json_504() -> None:
    """The deadline runs from arrival at the edge: waiting there counts."""
    srv = front_server("edge", parallel=1, delay=0.05, request_timeout=1.0)
    try:
        long = {**GOOD, "max_tokens": 200, "stream": True}
        conns = []
        for _ in range(2):  # both replicas' one slot, for longer than the deadline
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            c.request("POST", "/v1/completions", json.dumps(long), JSON)
            conns.append(c)
        wait_for(lambda: _total(srv.metrics(), "specdec:num_requests_running") == 2, 10)
        t0 = time.perf_counter()
        status, _, err = srv.request("POST", "/v1/completions", GOOD)
        assert status == 504 and err["error"]["code"] == "timeout", err
        assert time.perf_counter() - t0 < 3.0
        for c in conns:  # the running ones end at their deadline with an error event
            raw = c.getresponse().read()
            assert b'"code": "timeout"' in raw or b'"code":"timeout"' in raw, raw[-300:]
            c.close()
    finally:
        srv.close()


@pytest.mark.parametrize("front", FRONTS)
def test_echo_of_a_token_id_out_of_the_vocabulary_is_a_400(front: str) -> None:
    """Issue 65: echo decoded the prompt's ids before they were checked: -1 was a 500
    (OverflowError) with a traceback."""
    srv = front_server(front, tokenizer=FakeTokenizer(), with_draft=False)
    try:
        for ids in ([-1], [1, 10**6]):
            status, _, err = srv.request(
                "POST", "/v1/completions", {**GOOD, "prompt": ids, "echo": True}
            )
            assert status == 400 and err["error"]["param"] == "prompt", err
        assert srv.request("POST", "/v1/completions", {**GOOD, "echo": True})[0] == 200
    finally:
        srv.close()


def test_a_dead_replica_leaves_the_edge_and_its_metrics_and_the_other_serves() -> None:
    """Issue 65: /metrics kept a dead replica's name for 10 s after Ray restarted it."""
    srv = front_server("edge")
    try:
        assert isinstance(srv, EdgeServer)
        srv.replicas.kill("r0")
        door = srv.uv.config.app.state.specdec.door
        wait_for(lambda: list(door.known) == ["r1"], 10, "the dead replica is still known")
        text = srv.metrics()
        assert 'replica="r0"' not in text and 'replica="r1"' in text
        for _ in range(4):
            status, head, _ = srv.request("POST", "/v1/completions", GOOD)
            assert status == 200 and head["x-specdec-replica"] == "r1"
    finally:
        srv.close()


@pytest.mark.parametrize("front", FRONTS)
def test_infill_is_a_generation_on_both_fronts(front: str) -> None:
    """/infill reaches the engine through either front (the edge counts it as a generation);
    the mock's vocabulary has no FIM tokens: 501 naming it, as llama.cpp's server answers."""
    srv = front_server(front, tokenizer=FakeTokenizer(), with_draft=False)
    try:
        body = {"input_prefix": "a", "input_suffix": "b"}
        status, _, err = srv.request("POST", "/infill", body)
        assert status == 501 and "fill-in-the-middle" in err["error"]["message"], err
        status, _, err = srv.request("POST", "/infill", {"input_prefix": "a"})
        assert status == 400 and err["error"]["param"] == "input_suffix", err
    finally:
        srv.close()
