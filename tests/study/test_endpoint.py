"""The endpoint client, bench and gate (study/engines/endpoint.py, issue 12) against real HTTP
servers: specdec's own server on mock models, and a misbehaving stub for every failure an engine
can show.

The gate's power is shown here: between specdec's speculative server and a target-only server it
passes; when the server under test samples from the draft instead of the target it fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from serverkit import MOCK_SPEC, FakeTokenizer, SlowMock, V, serve_models

from specdec.core.config import Warp
from specdec.serve.validation import validate_request
from specdec.serve.wire import CompletionRequest, parse_request
from specdec.study.artifacts import BenchArtifact
from specdec.study.engines import endpoint, stream
from specdec.study.run import together
from specdec.study.run.bench import run_bench
from specdec.study.run.bench_settings import BenchConfig
from specdec.study.run.gate import MIN_PROMPTS, GateSettings, run_endpoint_gate

N_PROMPTS = 32
N_TOK = 24
SETTINGS = GateSettings(prompts=N_PROMPTS, max_new_tokens=N_TOK, greedy_prompts=3, greedy_tokens=20)


def _models() -> tuple[SlowMock, SlowMock]:
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    # a loose draft (acceptance ~15%): sampling from it instead of the target is a gross error
    draft = SlowMock.near(target, noise=2.0, seed=1)
    return target, draft


def _serve(target: SlowMock, draft: SlowMock | None = None) -> Any:
    """A server reading text with FakeTokenizer (given to the engine, not the models, so the
    pair check still sees two mock vocabularies)."""
    srv = serve_models(target, draft)
    srv.engine.models.tokenizer = FakeTokenizer()
    return srv


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    target, draft = _models()
    spec = _serve(target, draft)
    base = _serve(SlowMock(V, seed=0, name=MOCK_SPEC))
    wrong = _serve(_models()[1])  # a "speculative" server that samples from the draft
    try:
        yield {"spec": spec, "base": base, "wrong": wrong}
    finally:
        for s in (spec, base, wrong):
            s.close()


def _client(srv: Any, api: str = "completions", **kw: Any) -> endpoint.Client:
    return endpoint.Client(endpoint.Endpoint(f"http://127.0.0.1:{srv.port}", api=api, **kw))


def _prompts(n: int) -> list[tuple[str, str]]:
    g = torch.Generator().manual_seed(0)
    dec = FakeTokenizer().decode
    return [(f"e{i:02d}", dec(torch.randint(0, V, (3,), generator=g).tolist())) for i in range(n)]


# ------------------------------------------------------------------------------ the client
def test_base_url_normalizes_and_refuses_non_urls() -> None:
    assert endpoint.base_url("http://h:8000/v1/") == "http://h:8000"
    assert endpoint.base_url("https://h/prefix/v1") == "https://h/prefix"
    for bad in ("localhost:8000", "ftp://h", "not a url", ""):
        with pytest.raises(ValueError, match="http"):
            endpoint.Endpoint(bad)


def test_stream_reads_text_usage_and_timing_and_matches_the_non_streamed_answer(servers) -> None:
    srv = servers["spec"]
    with _client(srv) as c:
        reply = c.stream(endpoint.Request("abc", 12, Warp(0.0), seed=0))
    assert reply.model == MOCK_SPEC  # found through /v1/models
    assert reply.usage["completion_tokens"] == len(FakeTokenizer()(reply.text)["input_ids"])
    assert reply.finish_reason in ("length", "stop")
    assert 0 < reply.ttft_s <= reply.wall_s
    body = {"model": MOCK_SPEC, "prompt": "abc", "max_tokens": 12, "temperature": 0}
    status, _, whole = srv.request("POST", "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["text"] == reply.text
    rec = endpoint.run_record(reply, c.endpoint, FakeTokenizer())
    assert rec["usage_source"] == "usage" and rec["generated"] == 12 == len(rec["tokens"])
    # specdec serve's own counters reach the record, as llama-server's `timings` do
    assert rec["drafted"] == reply.spec["drafted"] > 0
    assert rec["accepted"] == reply.spec["accepted"]


@pytest.mark.parametrize(
    "warp",
    [Warp(0.0), Warp(0.7, top_k=5, top_p=0.9), Warp(1.0, min_p=0.05, typical_p=0.8)],
    ids=["greedy", "top", "min-typical"],
)
def test_a_request_sends_its_warp_and_the_server_reads_back_the_same(warp: Warp) -> None:
    """The client sends every Warp field that is set under its own name, the server's request
    fields are those names (serve.wire): what specdec serve samples with is the bench's
    Warp, whichever fields it sets."""
    ep = endpoint.Endpoint("http://127.0.0.1:1", model="m", api="completions")
    with endpoint.Client(ep) as c:
        body = c.body(endpoint.Request("c", 8, warp, 0))
    sent = {f.name for f in dataclasses.fields(Warp) if getattr(warp, f.name) is not None}
    assert sent <= set(body) and not ({f.name for f in dataclasses.fields(Warp)} - sent) & set(body)
    body = {**body, "prompt": [1, 2, 3]}  # the server's ids for the text
    params = validate_request(parse_request(CompletionRequest, body), 64, V)
    assert params.warp == warp


# ------------------------------------------------------------------------------ the gate
@pytest.mark.stats
def test_endpoint_gate_passes_specdec_speculative_server_against_target_only(servers) -> None:
    with _client(servers["spec"]) as a, _client(servers["base"]) as b:
        res = run_endpoint_gate(
            a, b, _prompts(N_PROMPTS), SETTINGS, tokenizer=FakeTokenizer(), progress=False
        )
    s = res.sampled
    assert s.n_prompts == N_PROMPTS and s.failed is None
    assert s.tokens_speculative == s.tokens_baseline == N_PROMPTS * N_TOK
    assert s.dof >= 20, "too few bins for the test to mean anything"
    assert s.passed and s.p_value_permutation > 0.01
    assert res.greedy.passed and res.passed


@pytest.mark.stats
def test_endpoint_gate_fails_a_server_that_samples_from_the_draft(servers) -> None:
    with _client(servers["wrong"]) as a, _client(servers["base"]) as b:
        res = run_endpoint_gate(
            a, b, _prompts(N_PROMPTS), SETTINGS, tokenizer=FakeTokenizer(), progress=False
        )
    assert not res.sampled.passed and res.sampled.p_value_permutation < 0.01
    assert not res.greedy.passed and not res.passed


def test_endpoint_gate_records_a_dead_endpoint_and_cannot_pass_on_it(servers) -> None:
    dead = endpoint.Client(endpoint.Endpoint(f"http://127.0.0.1:{_closed_port()}", retries=0))
    with dead, _client(servers["base"]) as b:
        res = run_endpoint_gate(
            dead,
            b,
            _prompts(MIN_PROMPTS),
            GateSettings(prompts=MIN_PROMPTS, greedy_prompts=1),
            tokenizer=FakeTokenizer(),
            progress=False,
        )
    assert res.sampled.n_prompts == 0 and len(res.sampled.failed) == MIN_PROMPTS
    assert "cannot connect" in res.sampled.failed[0]["error"]
    assert not res.sampled.passed and not res.greedy.passed
    assert res.greedy.rows[0].error is not None


# ------------------------------------------------------------------------------ the bench
def _bench_cfg(**kw: Any) -> BenchConfig:
    base = dict(
        name="custom",
        draft=MOCK_SPEC,
        target=MOCK_SPEC,
        k=4,
        temperature=0.0,
        n_prompts=4,
        warmup=1,
        max_new_tokens=10,
        endpoint_api="completions",
    )
    return BenchConfig.from_json({**base, **kw})


def test_bench_between_two_endpoints_writes_the_usual_artifact(servers, tmp_path) -> None:
    target = _tokenized_target()
    cfg = _bench_cfg(
        endpoint=f"http://127.0.0.1:{servers['spec'].port}/v1",
        endpoint_baseline=f"http://127.0.0.1:{servers['base'].port}",
    )
    art = run_bench(cfg, tmp_path, progress=False, models=(None, target))
    assert art.complete and art.failed is None and len(art.rows) == 3
    for row in art.rows:
        for m in ("baseline", "speculative"):
            run = row.run(m)
            assert run["generated"] == 10 and run["usage_source"] == "usage"
        # greedy on both servers: the same text (the bench is interleaved, nothing crossed)
        assert row.baseline["text"] == row.speculative["text"]
    assert art.config["engines"]["speculative"]["url"].endswith(str(servers["spec"].port))
    assert art.aggregates.speedup is not None
    again = BenchArtifact.from_json(json.loads(art.path.read_text()))
    assert again.rows[0].speculative["tokens"] == art.rows[0].speculative["tokens"]


def test_concurrency_bench_against_an_endpoint_is_the_load_test(servers, tmp_path) -> None:
    """`specdec bench --concurrency 2 --endpoint URL`: what scripts/loadtest.py's load mode
    reported, per method: latency and TTFT percentiles, errors, and the acceptance and tokens
    per round of the server's `spec` objects."""
    cfg = _bench_cfg(endpoint=f"http://127.0.0.1:{servers['spec'].port}", warmup=0)
    record = together.run_together(cfg, 2, tmp_path, progress=False)
    m = record["methods"]["endpoint"]
    assert m["errors"] == 0 and m["answers"] == 4 and m["tokens_per_s"] > 0
    assert 0 < m["latency_p50_s"] <= m["latency_p95_s"]
    assert 0 < m["ttft_p50_s"] <= m["ttft_p95_s"] <= m["latency_p95_s"]
    assert 0 <= m["acceptance_rate"] <= 1 and m["tokens_per_round"] >= 1
    reqs = [q for row in record["rows"] for q in row["requests"]]
    assert all(q["tokens"] == 10 and q["rounds"] and q["drafted"] >= q["accepted"] for q in reqs)
    accepted = sum(q["accepted"] for q in reqs)
    assert m["acceptance_rate"] == accepted / sum(q["drafted"] for q in reqs)
    assert "lat p50/p95 s" in together.format_table(record)
    with open(record["path"]) as f:
        assert json.load(f)["methods"] == record["methods"]


def test_bench_endpoint_against_in_process_baseline_keeps_going_past_failures(
    tmp_path,
) -> None:
    """Every failure an endpoint can show is a per-prompt error; the run finishes."""
    target = _tokenized_target()
    with _Stub() as stub:
        cfg = _bench_cfg(endpoint=stub.url, n_prompts=_Stub.PROMPTS, warmup=0)
        art = run_bench(cfg, tmp_path, progress=False, models=(None, target))
        assert stub.requests == len(_Stub.PLAN)
    kinds = [f["kind"] for f in art.failed]
    assert kinds == ["bad_body", "cut", "stream_error", "http", "http"], art.failed
    assert "not JSON" in art.failed[0]["error"] and "without [DONE]" in art.failed[1]["error"]
    assert "the engine died" in art.failed[2]["error"]
    assert "answered 404" in art.failed[3]["error"] and "boom" in art.failed[4]["error"]
    assert [f["index"] for f in art.failed] == [1, 2, 3, 4, 5]
    assert art.complete and [r.index for r in art.rows] == [0, 6]
    assert [r.speculative["attempts"] for r in art.rows] == [2, 1]
    assert all(r.speculative["text"] == "012" for r in art.rows)
    assert all(r.speculative["usage_source"] == "retokenized" for r in art.rows)  # no usage


def test_bench_with_a_refused_connection_records_every_prompt(tmp_path) -> None:
    target = _tokenized_target()
    url = f"http://127.0.0.1:{_closed_port()}"
    cfg = _bench_cfg(endpoint=url, n_prompts=3, warmup=0)
    art = run_bench(cfg, tmp_path, progress=False, models=(None, target))
    assert art.complete and not art.rows and len(art.failed) == 3
    assert all(f["kind"] == "connect" and url in f["error"] for f in art.failed)


# ------------------------------------------------------------------------------ helpers
def _tokenized_target() -> SlowMock:
    """The in-process target of a bench (its tokenizer counts an endpoint's tokens)."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = FakeTokenizer()
    return target


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def _sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


_GOOD = _sse(
    {"choices": [{"text": "01", "finish_reason": None}]},
    {"choices": [{"text": "2", "finish_reason": "length"}]},
)


class _Stub:
    """A loopback HTTP server whose n-th completion request gets PLAN[n]: (status, body)."""

    BOOM = (500, b'{"error": {"message": "boom"}}')
    PLAN: tuple[tuple[int, bytes], ...] = (
        (503, b"busy"),  # prompt 0: retried ...
        (200, _GOOD),  # ... and answered
        (200, b"data: {not json\n\n"),  # 1
        (200, _sse({"choices": [{"text": "0"}]}, done=False)),  # 2: cut mid-stream
        (200, _sse({"error": {"message": "the engine died"}})),  # 3
        (404, b"no such route"),  # 4: not retried
        BOOM,  # 5: three attempts (retries=2), all 500
        BOOM,
        BOOM,
        (200, _GOOD),  # 6
    )
    PROMPTS = 7

    def __enter__(self) -> _Stub:
        plan = iter(self.PLAN)
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # /v1/models
                self._send(200, json.dumps({"data": [{"id": "stub"}]}).encode())

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                stub.requests += 1
                self._send(*next(plan))

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.requests = 0
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_two_endpoints_without_a_tokenizer_is_a_clear_error(tmp_path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    cfg = _bench_cfg(endpoint=url, endpoint_baseline=url)  # mock target: no tokenizer
    with pytest.raises(ValueError, match="need a target with a tokenizer"):
        run_bench(cfg, tmp_path, progress=False)


# ------------------------------------------------------------------------------ a hostile upstream
class _Hostile:
    """A loopback TCP server that reads one request and then runs `script(conn)`: whatever a
    broken or malicious upstream might send (issue 21)."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.sent = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.script(self, conn)

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.sock.close()


_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"


def _hostile_stream(script: Any, timeout_s: float = 2.0) -> tuple[endpoint.EndpointError, float]:
    """Stream one request from a hostile upstream; the EndpointError it must end with, and when."""
    srv = _Hostile(script)
    try:
        ep = endpoint.Endpoint(
            srv.url, model="m", api="completions", timeout_s=timeout_s, retries=0
        )
        with endpoint.Client(ep) as c:
            t0 = time.perf_counter()
            with pytest.raises(endpoint.EndpointError) as info:
                c.stream(endpoint.Request("hi", 4, Warp(0.0), 0))
            return info.value, time.perf_counter() - t0
    finally:
        srv.close()


def _trickle(piece: bytes, head: bytes = _SSE_HEAD) -> Any:
    def script(srv: _Hostile, conn: socket.socket) -> None:
        srv.send(conn, head)
        for _ in range(200):  # 60 s of it, far past the deadline
            srv.send(conn, piece)
            time.sleep(0.3)

    return script


@pytest.mark.parametrize(
    "script",
    [
        _trickle(b": keep-alive\n\n"),  # comments forever: every read succeeds
        _trickle(b"X", head=b"HTTP/1.1 200 OK\r\n"),  # headers, one byte at a time
        _trickle(b'data: {"choices": [{"text": "a"}]}\n\n'),  # text forever, never [DONE]
    ],
    ids=["keep-alives", "trickled-headers", "endless-text"],
)
def test_the_client_ends_a_trickling_upstream_at_its_deadline(script) -> None:
    err, took = _hostile_stream(script, timeout_s=1.0)
    assert err.kind == "timeout", err
    assert 0.6 < took < 2.0  # the deadline, +- 1 s (it was unbounded: httpx times each read)


def test_the_client_caps_lines_streams_and_error_bodies(monkeypatch) -> None:
    monkeypatch.setattr(stream, "MAX_EVENT_BYTES", 1 << 16)
    monkeypatch.setattr(stream, "MAX_STREAM_BYTES", 1 << 20)
    endless = b"x" * (1 << 16)

    def no_newline(srv: _Hostile, conn: socket.socket) -> None:
        srv.send(conn, _SSE_HEAD + b"data: ")
        for _ in range(4096):  # 256 MiB if nobody stopped reading
            srv.send(conn, endless)

    err, _ = _hostile_stream(no_newline, timeout_s=20)
    assert err.kind == "bad_body" and "line exceeds" in str(err)

    def many_lines(srv: _Hostile, conn: socket.socket) -> None:
        srv.send(conn, _SSE_HEAD)
        for _ in range(4096):
            srv.send(conn, b": " + endless[:1000] + b"\n")

    err, _ = _hostile_stream(many_lines, timeout_s=20)
    assert err.kind == "bad_body" and "stream exceeds" in str(err)

    def huge_error(srv: _Hostile, conn: socket.socket) -> None:
        srv.send(conn, b"HTTP/1.1 500 Oops\r\nContent-Length: 419430400\r\n\r\n")
        for _ in range(4096):
            srv.send(conn, endless)

    srv_sent: list[int] = []

    def counted(srv: _Hostile, conn: socket.socket) -> None:
        try:
            huge_error(srv, conn)
        finally:
            srv_sent.append(srv.sent)

    err, _ = _hostile_stream(counted, timeout_s=20)
    assert err.kind == "http" and err.status == 500
    time.sleep(0.2)
    # the client read its 64 KiB and hung up: the upstream could not push 256 MiB into it
    assert srv_sent and srv_sent[0] < 64 << 20


@pytest.mark.parametrize(
    "event",
    [
        "[" * 100_000,  # a RecursionError in json
        '{"choices": [{"delta": "x"}]}',
        '{"choices": [{"text": 5}]}',
        '{"choices": 5}',
        '{"choices": [{"text": "a", "finish_reason": []}]}',
        "[1, 2]",
    ],
    ids=["deep", "delta-str", "text-int", "choices-int", "finish-list", "array"],
)
def test_every_malformed_event_is_a_bad_body(event) -> None:
    def script(srv: _Hostile, conn: socket.socket) -> None:
        srv.send(conn, _SSE_HEAD + b"data: " + event.encode() + b"\n\ndata: [DONE]\n\n")

    err, _ = _hostile_stream(script)
    assert err.kind == "bad_body", err


def test_absurd_counts_are_not_counts() -> None:
    """A 401-digit completion_tokens (OverflowError in tokens/s), a string draft_n (ValueError in
    the gate's int()): the record falls back to retokenizing, and drops the draft counts."""
    reply = endpoint.Reply(
        "abc",
        "stop",
        0.1,
        0.5,
        [],
        {"completion_tokens": 10**400, "prompt_tokens": "9"},
        {"draft_n": "12", "draft_n_accepted": 3, "t": float("nan")},
        1,
        "m",
    )
    rec = endpoint.run_record(reply, endpoint.Endpoint("http://h"), None)
    assert rec["usage_source"] == "retokenized" and rec["generated"] == 0
    assert rec["prompt_tokens"] is None and "drafted" not in rec
    assert rec["server_timings"] == {"draft_n_accepted": 3}
    assert endpoint.count(True) is None and endpoint.count(-1) is None and endpoint.count(7) == 7
