"""The server's first hardening round (issue 11), on mock servers of their own: what /health
shows, and what a client that leaves, a request that times out in the queue, a slow prefill or
tokenization, a lone surrogate, a shutdown and a dead worker do to the server. Each was a leak,
a 500, a stall, a held slot or a wrong count before; after each, the next request is still
exactly `generate()`'s.

The findings checked on the shared mock server are in tests/serve/test_app.py; the later rounds in
tests/serve/test_input_bounds.py (issue 21) and tests/serve/test_tenants.py (issue 33).
"""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverkit import (
    GOOD,
    JSON,
    MOCK_SPEC,
    FakeTokenizer,
    Server,
    SlowMock,
    V,
    assert_good_request_exact,
    error_of,
    expected,
    metric,
    mock_server,
    open_stream,
    serve_models,
    wait_for,
)

from specdec.backends.mock import MockModel
from specdec.serve.connections import GRACEFUL_SHUTDOWN_S


class SlowPrefillMock(MockModel):
    """A MockModel whose prompt prefill takes `prefill_delay` seconds per chunk (a long prompt on
    a real model), while its decode rounds are fast."""

    prefill_delay = 0.0

    def _prefill(self, ids: list[int]) -> None:
        time.sleep(self.prefill_delay)
        super()._prefill(ids)


def _send_and_leave(srv: Server, body: dict) -> http.client.HTTPConnection:
    """Send a request without reading the answer; closing the connection is a disconnect."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), JSON)
    return conn


LONG = {"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 1000, "temperature": 0.8}


def test_health_shows_no_paths_and_there_is_no_openapi_schema() -> None:
    """Low: /health (no key needed) showed the absolute model path; /openapi.json was on."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    srv = serve_models(target, spec="llamacpp:/home/someone/private/model.gguf")
    try:
        status, _, health = srv.request("GET", "/health")
        assert status == 200 and health["model"] == "llamacpp:model.gguf", health
        assert "/home" not in json.dumps(health)
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert srv.request("GET", path)[0] == 404, path
        assert_good_request_exact(srv)
    finally:
        srv.close()


def test_disconnect_during_a_slow_prefill_frees_the_engine_within_a_chunk() -> None:
    """Item 5: cancellation was checked only between rounds, after the whole prefill."""
    target = SlowPrefillMock(V, seed=0, name=MOCK_SPEC)
    srv = serve_models(target, SlowPrefillMock.near(target, noise=0.7, seed=1))
    target.prefill_delay = 1.0  # per 512-token chunk: a 2048-token prompt prefills in 4 s
    try:
        before = metric(srv.metrics(), "specdec_generations_total", outcome="cancelled")
        body = {"model": MOCK_SPEC, "prompt": [i % V for i in range(2048)], "max_tokens": 8}
        conn = _send_and_leave(srv, body)
        wait_for(lambda: srv.engine.busy, 10, "the request never started")
        time.sleep(0.3)  # inside the first prefill chunk
        conn.close()
        t0 = time.monotonic()
        srv.wait_idle()
        assert time.monotonic() - t0 < 2.0  # one chunk (1 s) at most, not the 3 s left
        after = metric(srv.metrics(), "specdec_generations_total", outcome="cancelled")
        assert after == before + 1
        assert_good_request_exact(srv)
    finally:
        srv.close()


def test_tokenization_runs_off_the_event_loop() -> None:
    """Item 6: a long prompt's tokenization blocked the event loop: no other request (not even
    /health) was answered meanwhile."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = FakeTokenizer()
    srv = serve_models(target)
    try:
        body = {"model": MOCK_SPEC, "prompt": "slow prompt", "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(srv.request, "POST", "/v1/completions", body)
            time.sleep(0.3)  # the slow request is being tokenized now (1.5 s)
            t0 = time.monotonic()
            assert srv.request("GET", "/health")[0] == 200
            assert time.monotonic() - t0 < 0.5
            status, _, r = slow.result()
        assert status == 200, r
        want = expected(srv, FakeTokenizer()("slow prompt")["input_ids"], 3).tokens
        assert r["choices"][0]["text"] == FakeTokenizer().decode(want)
    finally:
        srv.close()


def test_a_whole_answer_is_built_off_the_event_loop(monkeypatch) -> None:
    """Issue 53: a non-streamed answer was built and serialized on the event loop (n = 16
    samples of 4,000 tokens with top_logprobs 20: hundreds of MB, seconds), so nobody else was
    answered meanwhile. Here building it takes 1.5 s, and /health answers during it."""
    from specdec.serve.answers import Reply

    real = Reply.completion

    def slow(self, choices):
        time.sleep(1.5)
        return real(self, choices)

    monkeypatch.setattr(Reply, "completion", slow)
    srv = mock_server()
    try:
        body = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(srv.request, "POST", "/v1/completions", body)
            time.sleep(0.5)  # the answer is being built now
            t0 = time.monotonic()
            assert srv.request("GET", "/health")[0] == 200
            assert time.monotonic() - t0 < 0.5
            status, _, r = answer.result()
        assert status == 200 and r["choices"][0]["text"], r
    finally:
        srv.close()


def test_a_lone_surrogate_in_a_text_prompt_is_400_not_500() -> None:
    """Low: the tokenizer raised UnicodeEncodeError on the surrogate: a 500."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = FakeTokenizer()
    srv = serve_models(target)
    try:
        raw = b'{"model": "%s", "prompt": "ab\\ud800", "max_tokens": 2}' % MOCK_SPEC.encode()
        status, _, body = srv.request("POST", "/v1/completions", raw)
        assert status == 400 and error_of(status, body, "invalid_text")
        ok = {"model": MOCK_SPEC, "prompt": "abc", "max_tokens": 4, "temperature": 0}
        status, _, r = srv.request("POST", "/v1/completions", ok)
        want = expected(srv, FakeTokenizer()("abc")["input_ids"], 4).tokens
        assert status == 200 and r["choices"][0]["text"] == FakeTokenizer().decode(want)
    finally:
        srv.close()


def test_a_request_abandoned_in_the_queue_frees_its_place_at_once() -> None:
    """Low: a cancelled job kept its place in the queue (429s) until the worker reached it."""
    srv = mock_server(delay=0.02, max_queue=1, with_draft=False)
    try:
        running, _ = open_stream(srv, LONG)
        waiting = _send_and_leave(srv, {**LONG, "max_tokens": 4})
        wait_for(lambda: srv.engine.queue_depth == 1, 10, "the second request was not queued")
        waiting.close()  # its client goes away while it waits
        wait_for(lambda: srv.engine.queue_depth == 0, 5, "the abandoned job kept its place")
        with ThreadPoolExecutor(max_workers=1) as pool:
            body = {**GOOD, "temperature": 0, "return_token_ids": True}
            third = pool.submit(srv.request, "POST", "/v1/completions", body)
            wait_for(lambda: srv.engine.queue_depth == 1 or third.done(), 10, "not queued")
            running.close()  # now the engine is free for it
            status, _, r = third.result()
        assert status == 200, r  # not 429: the place was free
        assert r["choices"][0]["token_ids"] == expected(srv, GOOD["prompt"], 4).tokens
    finally:
        srv.close()


def test_a_request_that_times_out_while_queued_counts_as_timeout() -> None:
    """Low: it was counted as cancelled (the event loop's cancel was all the worker saw)."""
    srv = mock_server(delay=0.02, request_timeout=0.6, with_draft=False)
    try:
        before = srv.metrics()
        with ThreadPoolExecutor(max_workers=2) as pool:
            body = {**LONG, "max_tokens": 400}
            got = list(pool.map(lambda _: srv.request("POST", "/v1/completions", body), range(2)))
        assert [g[0] for g in got] == [504, 504]
        srv.wait_idle()
        after = srv.metrics()
        for outcome, n in (("timeout", 2), ("cancelled", 0)):
            was = metric(before, "specdec_generations_total", outcome=outcome)
            assert metric(after, "specdec_generations_total", outcome=outcome) == was + n, outcome
        assert_good_request_exact(srv)
    finally:
        srv.close()


def test_shutdown_fails_the_queue_cancels_the_running_request_and_is_bounded() -> None:
    """Item 7: shutdown waited for every queued connection without limit, so the engine's 503
    drain never ran, and the running request went on to its last token."""
    srv = mock_server(delay=0.02, max_queue=8, with_draft=False)
    with ThreadPoolExecutor(max_workers=3) as pool:
        conn, stream = open_stream(srv, LONG)  # 1000 tokens: ~20 s if left running
        queued = [
            pool.submit(srv.request, "POST", "/v1/completions", {**GOOD, "max_tokens": 8})
            for _ in range(3)
        ]
        wait_for(lambda: srv.engine.queue_depth == 3, 10, "the requests were not queued")
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < GRACEFUL_SHUTDOWN_S
        for q in queued:
            status, _, body = q.result(timeout=10)
            assert status == 503 and error_of(status, body, "shutting_down")
        rest = stream.read().decode()  # the stream ends with the error event, promptly
        assert "shutting_down" in rest and "[DONE]" not in rest
        conn.close()
    # The models are fine: a new server on them is exact.
    fresh = serve_models(srv.engine.models.target)
    try:
        assert_good_request_exact(fresh)
    finally:
        fresh.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_fails_requests_at_once() -> None:
    """Low: submit did not check the worker, so requests waited for their deadline (504)."""

    class Fatal(MockModel):
        armed = False

        def _prefill(self, ids: list[int]) -> None:
            if self.armed:
                raise SystemExit("the worker thread dies")  # a BaseException: not caught
            super()._prefill(ids)

    target = Fatal(V, seed=0, name=MOCK_SPEC)
    srv = serve_models(target, request_timeout=30)
    target.armed = True
    try:
        t0 = time.monotonic()
        body = {**GOOD, "prompt": [1, 2, 3, 4]}
        assert srv.request("POST", "/v1/completions", body)[0] == 500
        wait_for(lambda: not srv.engine.alive, 5, "the worker is still alive")
        status, _, err = srv.request("POST", "/v1/completions", GOOD)
        assert status == 503 and error_of(status, err)["code"] in (
            "engine_stopped",
            "shutting_down",
        )
        assert srv.request("GET", "/health")[0] == 503
        assert time.monotonic() - t0 < 10  # not the 30 s deadline
    finally:
        srv.close()
    target.armed = False
    fresh = serve_models(target)
    try:
        assert_good_request_exact(fresh)
    finally:
        fresh.close()


def test_a_delivery_that_raises_fails_that_request_alone(monkeypatch) -> None:
    """Issue 53: an exception while one request's round was handed over (its text, its stop
    strings) failed every request of the round; now it fails that one with a 500 at once, and
    its neighbour in the same passes ends with exactly `generate()`'s tokens."""
    from specdec.serve.cycle import Cycle

    srv = mock_server(delay=0.002, parallel=2)
    real = Cycle._deliver

    def deliver(self, r, ids):
        if r.gen.prompt[:3] == [7, 7, 7] and len(r.gen.tokens) > 3:
            raise RuntimeError("a delivery bug")
        return real(self, r, ids)

    monkeypatch.setattr(Cycle, "_deliver", deliver)
    try:
        poisoned = {**LONG, "prompt": [7, 7, 7], "max_tokens": 400}
        good = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0.0}
        good["return_token_ids"] = True
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(srv.request, "POST", "/v1/completions", poisoned)
            time.sleep(0.05)
            ok = pool.submit(srv.request, "POST", "/v1/completions", good)
            status, _, body = bad.result(timeout=30)
            assert status == 500 and error_of(status, body)["code"] == "engine_error"
            status, _, body = ok.result(timeout=30)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected(srv, [1, 2, 3], 60).tokens
    finally:
        srv.close()


def test_an_admission_that_raises_is_told_to_its_client_at_once(monkeypatch) -> None:
    """Issue 53: the worker's last-resort catch around admission logged an unexpected error and
    sent the job nothing, so its client waited for its request timeout. Now it gets a 500 at
    once, and the next request is served exactly."""
    from specdec.serve.cycle import Cycle

    real = Cycle._admit

    def admit(self, r):
        if r.params.prompt_ids[:3] == [7, 7, 7]:
            raise RuntimeError("an admission bug")
        return real(self, r)

    monkeypatch.setattr(Cycle, "_admit", admit)
    srv = mock_server(request_timeout=60)
    try:
        t0 = time.monotonic()
        body = {"model": MOCK_SPEC, "prompt": [7, 7, 7], "max_tokens": 3}
        status, _, err = srv.request("POST", "/v1/completions", body)
        assert status == 500 and error_of(status, err)["code"] == "engine_error", err
        assert time.monotonic() - t0 < 10  # not the 60 s timeout
        assert_good_request_exact(srv)
    finally:
        srv.close()
