"""`specdec serve` through real HTTP on loopback, driven by the real `openai` client.

Each server runs in-process (uvicorn in a background thread, on a socket bound to 127.0.0.1:0)
so the tests can compare its output with `specdec.generate` on the very same model objects
(taking `engine.lock`, as the server's worker does). Two kinds of engine:

    mock    MockModel pairs (no tokenizer): /v1/completions with token-id prompts; the text is
            the ids joined by spaces. Fast, so used for concurrency, 429, timeouts, bad input.
            `SlowMock` sleeps in every forward pass to make requests overlap.
    smoke   llama.cpp smollm2-135m target + HF smollm2-135m draft (the `smoke` pair), for the
            chat template, real detokenization and stop strings: the session's models
            (conftest), fetched if they are not cached.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from specdec.backends import chat as prompting
from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import generate
from specdec.serve.app import GRACEFUL_SHUTDOWN_S, ServeConfig, create_app, uvicorn_server
from specdec.serve.engine import Engine
from specdec.serve.text import TextAssembler

V = 48
MOCK_SPEC = "mock:vocab=48,seed=0"
API_KEY = "test-key"
SMOKE_TARGET = "llamacpp:smollm2-135m"
SMOKE_DRAFT = "hf:smollm2-135m"
SMOKE_MAX_TOKENS = 8


class SlowMock(MockModel):
    """A MockModel whose forward passes take `delay` seconds, like a real model's."""

    delay = 0.0

    def _extend(self, ids: list[int]) -> Any:
        time.sleep(self.delay)
        return super()._extend(ids)


class Server:
    """uvicorn serving `create_app(engine, cfg)` on a fresh loopback port, in a thread."""

    def __init__(self, engine: Engine, cfg: ServeConfig) -> None:
        self.engine = engine
        self.api_key = cfg.api_key
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.uv = uvicorn_server(create_app(engine, cfg), log_level="warning", lifespan="on")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """Raw HTTP (for what the openai client will not send): status, headers, parsed body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        ctype = resp.getheader("content-type", "")
        parsed = json.loads(raw) if ctype.startswith("application/json") else raw.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed

    def metrics(self) -> str:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return self.request("GET", "/metrics", headers=auth)[2]

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.busy or self.engine.queue_depth:
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.02)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def mock_server(**cfg_kw: Any) -> Server:
    delay = cfg_kw.pop("delay", 0.0)
    n_ctx = cfg_kw.pop("n_ctx", 4096)
    with_draft = cfg_kw.pop("with_draft", True)
    spec = SpecConfig(**cfg_kw.pop("engine_kwargs", {}))
    target = SlowMock(V, seed=0, n_ctx=n_ctx, name=MOCK_SPEC)
    target.delay = delay
    draft = None
    if with_draft:
        draft = SlowMock.near(target, noise=0.7, seed=1)
        draft.delay = delay
    cfg = ServeConfig(target=MOCK_SPEC, **cfg_kw)
    engine = Engine(target, draft, model_id=MOCK_SPEC, spec=spec, max_queue=cfg.max_queue)
    engine.warm_up()
    return Server(engine, cfg)


def expected(
    srv: Server, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> Any:
    """What `specdec generate` gives for this request, on the server's own models."""
    e = srv.engine
    with e.lock:
        return generate(
            e.target,
            prompt_ids,
            draft=e.draft,
            spec=e.spec,
            warp=Warp(temperature),
            max_new_tokens=max_tokens,
            seed=seed,
            stop_ids=e.stop_ids,
        )


# ---------------------------------------------------------------------------- pure: text assembly
def _pieces_decode(pieces: dict[int, str]):
    return lambda ids: "".join(pieces[i] for i in ids)


def test_text_assembler_holds_back_partial_stop_and_cuts_at_it() -> None:
    pieces = {1: "Hello", 2: " wor", 3: "ld", 4: " EN", 5: "D here", 6: " more"}
    a = TextAssembler(_pieces_decode(pieces), stop=("END",))
    out = [a.push([1]), a.push([2, 3]), a.push([4])]
    assert out == ["Hello", " world", " "]  # "EN" may start "END": held back
    assert not a.stopped
    out.append(a.push([5]))
    assert a.stopped and out[-1] == ""
    assert "".join(out) == a.text == "Hello world "


def test_text_assembler_releases_a_false_alarm_and_flushes() -> None:
    pieces = {1: "a E", 2: "Nd", 3: "\ufffd", 4: "é"}
    a = TextAssembler(_pieces_decode(pieces), stop=("END",))
    assert a.push([1]) == "a "
    assert a.push([2]) == "ENd"  # not the stop string after all
    assert a.push([3]) == ""  # an incomplete UTF-8 character waits
    assert a.flush() == "\ufffd"
    b = TextAssembler(_pieces_decode(pieces))
    assert b.push([1, 2]) + b.flush() == "a ENd"


def test_text_assembler_stop_inside_one_chunk_and_earliest_of_several() -> None:
    a = TextAssembler(lambda ids: "one two three four", stop=("four", "two"))
    assert a.push([0]) == "one " and a.stopped


# ---------------------------------------------------------------------------- mock engine
@pytest.fixture(scope="module")
def mock() -> Server:
    srv = mock_server(delay=0.002, api_key=API_KEY, max_body_bytes=4096)
    yield srv
    srv.close()


def test_completions_token_prompt_greedy_and_sampled_match_generate(mock: Server) -> None:
    client = mock.client(API_KEY)
    for temperature, seed in ((0.0, 0), (0.9, 123)):
        want = expected(mock, [5, 6, 7], 20, temperature, seed)
        r = client.completions.create(
            model=MOCK_SPEC,
            prompt=[5, 6, 7],
            max_tokens=20,
            temperature=temperature,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.token_ids == want.tokens
        assert choice.text == " ".join(map(str, want.tokens))
        assert choice.finish_reason == want.stop_reason == "length"
        assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 3
        st = want.stats
        assert r.spec["drafted"] == st.drafted > 0 and r.spec["accepted"] == st.accepted
        assert r.spec["tokens_per_round"] == pytest.approx(st.tokens_per_round)


def test_twenty_concurrent_clients_nothing_lost_or_crossed(mock: Server) -> None:
    client = mock.client(API_KEY)
    jobs = [
        {
            "prompt": [i % V, (3 * i + 1) % V, (7 * i + 2) % V],
            "temperature": 0.0 if i % 2 else 0.8,
            "seed": 1000 + i,
            "max_tokens": 12 + i % 5,
            "stream": i % 3 == 0,
        }
        for i in range(20)
    ]
    wants = [
        expected(mock, j["prompt"], j["max_tokens"], j["temperature"], j["seed"]).tokens
        for j in jobs
    ]
    assert len({tuple(w) for w in wants}) == 20  # distinct outputs, so a crossing would show

    def run(j: dict) -> list[int]:
        kw = dict(
            model=MOCK_SPEC,
            prompt=j["prompt"],
            max_tokens=j["max_tokens"],
            temperature=j["temperature"],
            seed=j["seed"],
            extra_body={"return_token_ids": True},
        )
        if not j["stream"]:
            c = client.completions.create(**kw).choices[0]
            assert c.text == " ".join(map(str, c.token_ids))
            return c.token_ids
        ids: list[int] = []
        for chunk in client.completions.create(stream=True, **kw):
            if chunk.choices:
                ids += chunk.choices[0].token_ids
        return ids

    before = metric(mock.metrics(), "specdec_generations_total", outcome="finished")
    with ThreadPoolExecutor(max_workers=20) as pool:
        got = list(pool.map(run, jobs))
    assert got == wants
    after = metric(mock.metrics(), "specdec_generations_total", outcome="finished")
    assert after - before == 20


def _error_of(status: int, body: Any, code: str | None = None) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


GOOD = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 4}
AUTH = {"Authorization": f"Bearer {API_KEY}"}

BAD_INPUTS = [
    # (id, path, body (bytes: sent as is), headers, status, param)
    ("prediction-str", "/v1/completions", {**GOOD, "prediction": "abc"}, AUTH, 400, "prediction"),
    (
        "prediction-type",
        "/v1/completions",
        {**GOOD, "prediction": {"type": "diff", "content": "x"}},
        AUTH,
        400,
        "prediction",
    ),
    (
        "prediction-parts",
        "/v1/completions",
        {**GOOD, "prediction": {"type": "content", "content": [{"type": "image", "x": 1}]}},
        AUTH,
        400,
        "prediction",
    ),
    (
        "prediction-no-tokenizer",  # the mock model has none to read text with
        "/v1/completions",
        {**GOOD, "prediction": {"type": "content", "content": "def f(): pass"}},
        AUTH,
        400,
        "prediction",
    ),
    ("malformed-json", "/v1/completions", b'{"model": "x", ', AUTH, 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2]", AUTH, 400, None),
    ("not-utf8", "/v1/completions", b'{"a": "\xff"}', AUTH, 400, None),
    (
        "temperature-str",
        "/v1/completions",
        {**GOOD, "temperature": "hot"},
        AUTH,
        400,
        "temperature",
    ),
    ("max-tokens-str", "/v1/completions", {**GOOD, "max_tokens": "8"}, AUTH, 400, "max_tokens"),
    ("max-tokens-float", "/v1/completions", {**GOOD, "max_tokens": 8.5}, AUTH, 400, "max_tokens"),
    ("stream-str", "/v1/completions", {**GOOD, "stream": "yes"}, AUTH, 400, "stream"),
    ("seed-bool", "/v1/completions", {**GOOD, "seed": True}, AUTH, 400, "seed"),
    ("prompt-number", "/v1/completions", {**GOOD, "prompt": 5}, AUTH, 400, "prompt"),
    (
        "messages-str",
        "/v1/chat/completions",
        {"model": MOCK_SPEC, "messages": "hi"},
        AUTH,
        400,
        "messages",
    ),
    ("missing-model", "/v1/completions", {"prompt": [1]}, AUTH, 400, "model"),
    ("unknown-model", "/v1/completions", {**GOOD, "model": "gpt-4"}, AUTH, 404, "model"),
    (
        "max-tokens-beyond-ctx",
        "/v1/completions",
        {**GOOD, "max_tokens": 62},
        AUTH,
        400,
        "max_tokens",
    ),
    ("prompt-fills-ctx", "/v1/completions", {**GOOD, "prompt": [1] * 64}, AUTH, 400, "prompt"),
    ("max-tokens-zero", "/v1/completions", {**GOOD, "max_tokens": 0}, AUTH, 400, "max_tokens"),
    (
        "negative-temperature",
        "/v1/completions",
        {**GOOD, "temperature": -0.1},
        AUTH,
        400,
        "temperature",
    ),
    (
        "nan-temperature",
        "/v1/completions",
        b'{"model": "%s", "prompt": [1], "temperature": NaN}' % MOCK_SPEC.encode(),
        AUTH,
        400,
        None,  # NaN is not JSON (RFC 8259): refused as the body is parsed
    ),
    ("top-p-zero", "/v1/completions", {**GOOD, "top_p": 0}, AUTH, 400, "top_p"),
    ("top-p-above-one", "/v1/completions", {**GOOD, "top_p": 1.5}, AUTH, 400, "top_p"),
    ("top-k-zero", "/v1/completions", {**GOOD, "top_k": 0}, AUTH, 400, "top_k"),
    ("token-outside-vocab", "/v1/completions", {**GOOD, "prompt": [1, V]}, AUTH, 400, "prompt"),
    ("empty-prompt", "/v1/completions", {**GOOD, "prompt": []}, AUTH, 400, "prompt"),
    ("n-two", "/v1/completions", {**GOOD, "n": 2}, AUTH, 400, "n"),
    ("empty-stop", "/v1/completions", {**GOOD, "stop": [""]}, AUTH, 400, "stop"),
    ("batched-prompts", "/v1/completions", {**GOOD, "prompt": [[1], [2]]}, AUTH, 400, "prompt"),
    (
        "chat-without-template",
        "/v1/chat/completions",
        {"model": MOCK_SPEC, "messages": [{"role": "user", "content": "hi"}]},
        AUTH,
        400,
        "messages",
    ),
    (
        "bad-role",
        "/v1/chat/completions",
        {"model": MOCK_SPEC, "messages": [{"role": "wizard", "content": "hi"}]},
        AUTH,
        400,
        None,
    ),
    ("missing-key", "/v1/completions", GOOD, {}, 401, None),
    ("wrong-key", "/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401, None),
    ("not-bearer", "/v1/completions", GOOD, {"Authorization": API_KEY}, 401, None),
    ("too-large", "/v1/completions", {**GOOD, "user": "x" * 5000}, AUTH, 413, None),
    ("unknown-route", "/v1/embeddings", GOOD, AUTH, 404, None),
    # issue 11: each of these was a 500, a silent success or a wedge on the old server
    (
        "too-many-stops",
        "/v1/completions",
        {**GOOD, "stop": list("abcdefghijklmnopq")},
        AUTH,
        400,
        "stop",
    ),
    ("stop-1000-chars", "/v1/completions", {**GOOD, "stop": "x" * 1000}, AUTH, 400, "stop"),
    ("auth-non-ascii", "/v1/completions", GOOD, {"Authorization": "Bearer \xff"}, 401, None),
    ("text-plain", "/v1/completions", GOOD, {**AUTH, "Content-Type": "text/plain"}, 415, None),
    ("no-content-type", "/v1/completions", GOOD, {**AUTH, "Content-Type": ""}, 415, None),
    ("foreign-host", "/v1/completions", GOOD, {**AUTH, "Host": "evil.example"}, 400, None),
    (
        "temperature-above-2",
        "/v1/completions",
        {**GOOD, "temperature": 2.5},
        AUTH,
        400,
        "temperature",
    ),
    ("deep-nesting", "/v1/completions", b"[" * 3000, AUTH, 400, None),
    (
        "lone-surrogate",
        "/v1/completions",
        json.dumps({**GOOD, "user": "\ud800"}).encode(),  # ensure_ascii: sent as \\ud800
        AUTH,
        400,
        None,
    ),
    ("logprobs", "/v1/completions", {**GOOD, "logprobs": 2}, AUTH, 400, "logprobs"),
    ("tools", "/v1/completions", {**GOOD, "tools": [{"type": "function"}]}, AUTH, 400, "tools"),
    (
        "response-format",
        "/v1/completions",
        {**GOOD, "response_format": {"type": "json_object"}},
        AUTH,
        400,
        "response_format",
    ),
    ("logit-bias", "/v1/completions", {**GOOD, "logit_bias": {"1": 100}}, AUTH, 400, "logit_bias"),
]


@pytest.fixture(scope="module")
def small_ctx() -> Server:
    srv = mock_server(api_key=API_KEY, max_body_bytes=4096, n_ctx=64)
    yield srv
    srv.close()


@pytest.mark.parametrize(
    "path,body,headers,status,param", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_an_openai_error_and_the_server_keeps_serving(
    small_ctx: Server, path: str, body: Any, headers: dict, status: int, param: str | None
) -> None:
    got, hdrs, resp = small_ctx.request("POST", path, body, headers)
    assert got == status, resp
    err = _error_of(got, resp)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    if status == 401:
        assert err["code"] == "invalid_api_key" and hdrs["www-authenticate"] == "Bearer"
    assert_good_request_exact(small_ctx, AUTH)


def assert_good_request_exact(srv: Server, headers: dict[str, str] | None = None) -> None:
    """A greedy request after a bad one: still served, and still exactly `generate()`'s."""
    body = {**GOOD, "temperature": 0, "seed": 1, "return_token_ids": True}
    ok, _, good = srv.request("POST", "/v1/completions", body, headers)
    assert ok == 200, good
    want = expected(srv, GOOD["prompt"], GOOD["max_tokens"]).tokens
    assert good["choices"][0]["token_ids"] == want
    assert good["choices"][0]["text"] == " ".join(map(str, want))


def test_wrong_method_and_client_side_error_classes(small_ctx: Server) -> None:
    status, _, body = small_ctx.request("GET", "/v1/completions", None, AUTH)
    assert status == 405
    _error_of(status, body)
    with pytest.raises(openai.AuthenticationError):
        small_ctx.client("wrong").completions.create(model=MOCK_SPEC, prompt=[1], max_tokens=2)
    client = small_ctx.client(API_KEY)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=[1], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MOCK_SPEC, prompt=[1], max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=MOCK_SPEC, prompt=[1], max_tokens=1000)


def test_queue_overflow_returns_429_with_retry_after() -> None:
    srv = mock_server(delay=0.05, max_queue=1, with_draft=False)
    try:
        body = {"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 16, "temperature": 0}
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(
                pool.map(lambda _: srv.request("POST", "/v1/completions", body), range(6))
            )
        statuses = sorted(r[0] for r in results)
        # one generating + one waiting fit; the rest of a burst of 6 must be turned away
        assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
        want = " ".join(map(str, expected(srv, [1, 2], 16).tokens))
        for status, hdrs, resp in results:
            if status == 429:
                assert _error_of(status, resp, "queue_full")["type"] == "rate_limit_error"
                assert int(hdrs["retry-after"]) >= 1
            else:
                assert resp["choices"][0]["text"] == want
        srv.wait_idle()
        assert srv.request("POST", "/v1/completions", body)[0] == 200  # still serving
        text = srv.metrics()
        assert metric(text, "specdec_requests_total", code="429", endpoint="/v1/completions") >= 1
        assert metric(text, "specdec_queue_capacity") == 1
    finally:
        srv.close()


def test_request_timeout_gives_504_and_a_stream_error_then_recovers() -> None:
    srv = mock_server(delay=0.02, request_timeout=0.5, with_draft=False)
    try:
        client = srv.client()
        with pytest.raises(openai.APIStatusError) as ei:
            client.completions.create(model=MOCK_SPEC, prompt=[1], max_tokens=200)
        assert ei.value.status_code == 504
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in client.completions.create(
                model=MOCK_SPEC, prompt=[1], max_tokens=200, stream=True
            ):
                pass
        srv.wait_idle()
        r = client.completions.create(model=MOCK_SPEC, prompt=[1], max_tokens=3, temperature=0)
        assert r.choices[0].text == " ".join(map(str, expected(srv, [1], 3).tokens))
        assert metric(srv.metrics(), "specdec_generations_total", outcome="timeout") >= 1
    finally:
        srv.close()


@pytest.mark.parametrize(
    "engine_kwargs", [{"drafter": "lookup"}, {"drafter": "composite", "k": "auto", "k_max": 4}]
)
def test_drafter_and_k_options_pass_through_greedy_exact(engine_kwargs: dict) -> None:
    srv = mock_server(engine_kwargs=engine_kwargs, with_draft=engine_kwargs["drafter"] != "lookup")
    try:
        prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repeats: prompt lookup has matches
        r = srv.client().completions.create(
            model=MOCK_SPEC,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        target_only = generate(
            srv.engine.target,
            prompt,
            max_new_tokens=16,
            warp=Warp(temperature=0),
        )
        assert r.choices[0].token_ids == target_only.tokens
    finally:
        srv.close()


def test_models_health_and_metrics(mock: Server) -> None:
    models = mock.client(API_KEY).models.list()
    assert [m.id for m in models.data] == [MOCK_SPEC]
    status, _, health = mock.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == MOCK_SPEC
    mock.request("POST", "/v1/completions", GOOD, AUTH)
    assert mock.request("GET", "/metrics")[0] == 401  # its counters describe others' requests
    status, hdrs, text = mock.request("GET", "/metrics", headers=AUTH)
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    for name in (
        "specdec_requests_total",
        "specdec_drafts_total",
        "specdec_draft_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_accepted_per_position_total",
        "specdec_acceptance_length",
        "specdec_time_to_first_token_seconds",
        "specdec_inter_token_latency_seconds",
    ):
        assert re.search(rf"^# HELP {name} \S.*", text, re.M), name
        assert re.search(rf"^# TYPE {name} (counter|histogram)$", text, re.M), name
    drafted = metric(text, "specdec_draft_tokens_total")
    accepted = metric(text, "specdec_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    per_pos = [
        metric(text, "specdec_accepted_per_position_total", position=str(i)) for i in range(1, 5)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert metric(text, "specdec_drafts_total") == metric(
        text, "specdec_drafted_per_position_total", position="1"
    )
    buckets = [
        float(v) for v in re.findall(r"^specdec_acceptance_length_bucket\{.*\} (\S+)$", text, re.M)
    ]
    assert buckets == sorted(buckets) and buckets[-1] == metric(
        text, "specdec_acceptance_length_count"
    )
    # acceptance length: drafting rounds only (vLLM's); tokens per round: every round
    assert metric(text, "specdec_acceptance_length_count") == metric(text, "specdec_drafts_total")
    assert metric(text, "specdec_tokens_per_round_count") == metric(text, "specdec_rounds_total")
    assert metric(text, "specdec_tokens_per_round_sum") == metric(
        text, "specdec_generated_tokens_total"
    )


@pytest.mark.slow
def test_cli_serve_subprocess_binds_loopback() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli.main",
        "serve",
        "--target",
        MOCK_SPEC,
        "--draft",
        "mock:vocab=48,seed=1",
        "-k",
        "3",
        "--port",
        str(port),
        "--max-queue",
        "2",
    ]
    # The key from the environment (issue 11, Low: it could only be given on the command line,
    # where `ps` shows it).
    env = {**os.environ, "SPECDEC_API_KEY": "env-key"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "specdec serve did not come up"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                health = json.loads(conn.getresponse().read())
                break
            except OSError:
                time.sleep(0.2)
        assert health["status"] == "ok" and health["model"] == MOCK_SPEC
        url = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="x", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key="env-key", max_retries=0)
        r = client.completions.create(model=MOCK_SPEC, prompt=[1, 2], max_tokens=5, temperature=0)
        assert len(r.choices[0].text.split()) == 5 and r.spec["drafted"] > 0
        assert r.spec["drafting_rounds"] >= 1 and r.spec["mean_acceptance_length"] >= 1
        proc.terminate()  # SIGTERM: a graceful shutdown, bounded
        # uvicorn re-raises the signal once it has shut down, so the status is -SIGTERM
        assert proc.wait(GRACEFUL_SHUTDOWN_S + 10) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# ---------------------------------------------------------------------------- hardening (issue 11)
class SlowPrefillMock(MockModel):
    """A MockModel whose prompt prefill takes `prefill_delay` seconds per chunk (a long prompt on
    a real model), while its decode rounds are fast."""

    prefill_delay = 0.0

    def _prefill(self, ids: list[int]) -> None:
        time.sleep(self.prefill_delay)
        super()._prefill(ids)


class FakeTokenizer:
    """The slice of the HF tokenizer interface the server uses, over the mock's 48 ids: one
    character per token. Like the Rust tokenizers it refuses text with a lone surrogate, and a
    prompt starting with "slow" takes `delay` seconds to encode (a 1 MiB body's worth)."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None
    delay = 1.5

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate, as tokenizers raises
        if text.startswith("slow"):
            time.sleep(self.delay)
        return {"input_ids": [ord(c) % V for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("0") + i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(ord("0") + i): i for i in range(V)}


def serve_models(target: MockModel, draft: MockModel | None = None, **cfg_kw: Any) -> Server:
    """A server over these models (the engine warmed up, as `specdec serve` does)."""
    cfg = ServeConfig(target=cfg_kw.pop("spec", MOCK_SPEC), **cfg_kw)
    engine = Engine(target, draft, model_id=MOCK_SPEC, max_queue=cfg.max_queue)
    engine.warm_up()
    return Server(engine, cfg)


def _open_stream(srv: Server, body: dict) -> tuple[http.client.HTTPConnection, Any]:
    """A streaming request, read up to its first chunk with generated text."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON)
    resp = conn.getresponse()
    assert resp.status == 200
    while b'"text":"' not in (line := resp.readline()) or b'"text":""' in line:
        assert line, "the stream ended before any text"
    return conn, resp


def _send_and_leave(srv: Server, body: dict) -> http.client.HTTPConnection:
    """Send a request without reading the answer; closing the connection is a disconnect."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), JSON)
    return conn


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


JSON = {"Content-Type": "application/json"}
LONG = {"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 1000, "temperature": 0.8}


def test_unknown_paths_without_a_key_add_at_most_one_metrics_series(mock: Server) -> None:
    """Item 1: each distinct /v1 path, 404 before the key check, was a new series forever."""

    def series() -> set[str]:
        lines = mock.metrics().splitlines()
        return {x.rsplit(" ", 1)[0] for x in lines if x.startswith("specdec_requests_total{")}

    before = series()
    for i in range(50):
        status, _, body = mock.request("POST", f"/v1/probe-{i}/{i * 7919}", GOOD)
        assert status == 404 and _error_of(status, body, "not_found")
    assert len(series() - before) <= 1
    assert_good_request_exact(mock, AUTH)


def test_temperature_1e_minus_39_is_greedy(mock: Server) -> None:
    """Item 9: logits / 1e-39 overflowed to NaN, a 500 blamed on the model."""
    body = {**GOOD, "temperature": 1e-39, "max_tokens": 12, "return_token_ids": True}
    status, _, r = mock.request("POST", "/v1/completions", body, AUTH)
    assert status == 200, r
    assert r["choices"][0]["token_ids"] == expected(mock, GOOD["prompt"], 12).tokens
    assert_good_request_exact(mock, AUTH)


def test_stream_null_and_fields_that_ask_for_nothing_are_accepted(mock: Server) -> None:
    body = {
        **GOOD,
        "temperature": 0,
        "stream": None,
        "logprobs": None,
        "presence_penalty": 0,
        "logit_bias": {},
        "return_token_ids": True,
    }
    status, _, r = mock.request("POST", "/v1/completions", body, AUTH)
    assert status == 200, r
    assert r["choices"][0]["token_ids"] == expected(mock, GOOD["prompt"], GOOD["max_tokens"]).tokens


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
        _wait_for(lambda: srv.engine.busy, 10, "the request never started")
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


def test_a_lone_surrogate_in_a_text_prompt_is_400_not_500() -> None:
    """Low: the tokenizer raised UnicodeEncodeError on the surrogate: a 500."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = FakeTokenizer()
    srv = serve_models(target)
    try:
        raw = b'{"model": "%s", "prompt": "ab\\ud800", "max_tokens": 2}' % MOCK_SPEC.encode()
        status, _, body = srv.request("POST", "/v1/completions", raw)
        assert status == 400 and _error_of(status, body, "invalid_text")
        ok = {"model": MOCK_SPEC, "prompt": "abc", "max_tokens": 4, "temperature": 0}
        status, _, r = srv.request("POST", "/v1/completions", ok)
        want = expected(srv, FakeTokenizer()("abc")["input_ids"], 4).tokens
        assert status == 200 and r["choices"][0]["text"] == FakeTokenizer().decode(want)
    finally:
        srv.close()


def test_a_request_abandoned_in_the_queue_frees_its_slot_at_once() -> None:
    """Low: a cancelled job kept its queue slot (429s) until the worker reached it."""
    srv = mock_server(delay=0.02, max_queue=1, with_draft=False)
    try:
        running, _ = _open_stream(srv, LONG)
        waiting = _send_and_leave(srv, {**LONG, "max_tokens": 4})
        _wait_for(lambda: srv.engine.queue_depth == 1, 10, "the second request was not queued")
        waiting.close()  # its client goes away while it waits
        _wait_for(lambda: srv.engine.queue_depth == 0, 5, "the abandoned job kept its slot")
        with ThreadPoolExecutor(max_workers=1) as pool:
            body = {**GOOD, "temperature": 0, "return_token_ids": True}
            third = pool.submit(srv.request, "POST", "/v1/completions", body)
            _wait_for(lambda: srv.engine.queue_depth == 1 or third.done(), 10, "not queued")
            running.close()  # now the engine is free for it
            status, _, r = third.result()
        assert status == 200, r  # not 429: the slot was free
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
        conn, stream = _open_stream(srv, LONG)  # 1000 tokens: ~20 s if left running
        queued = [
            pool.submit(srv.request, "POST", "/v1/completions", {**GOOD, "max_tokens": 8})
            for _ in range(3)
        ]
        _wait_for(lambda: srv.engine.queue_depth == 3, 10, "the requests were not queued")
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < GRACEFUL_SHUTDOWN_S
        for q in queued:
            status, _, body = q.result(timeout=10)
            assert status == 503 and _error_of(status, body, "shutting_down")
        rest = stream.read().decode()  # the stream ends with the error event, promptly
        assert "shutting_down" in rest and "[DONE]" not in rest
        conn.close()
    # The models are fine: a new server on them is exact.
    fresh = serve_models(srv.engine.target)
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
        _wait_for(lambda: not srv.engine.alive, 5, "the worker is still alive")
        status, _, err = srv.request("POST", "/v1/completions", GOOD)
        assert status == 503 and _error_of(status, err)["code"] in (
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


# ---------------------------------------------------------------------------- smoke engine
@pytest.fixture(scope="module")
def smoke(_smol_llamacpp_session, _smol_hf_session) -> Server:
    """The session's smollm2 pair (conftest: fetched if missing, one load per session)."""
    target, draft = _smol_llamacpp_session, _smol_hf_session
    target.reset()
    draft.reset()
    engine = Engine(target, draft, model_id=SMOKE_TARGET)
    srv = Server(engine, ServeConfig(target=SMOKE_TARGET, draft=SMOKE_DRAFT))
    yield srv
    srv.close()


def _chat(srv: Server, text: str, **kw: Any) -> Any:
    return srv.client().chat.completions.create(
        model=SMOKE_TARGET, messages=[{"role": "user", "content": text}], **kw
    )


def _chat_stream(srv: Server, text: str, **kw: Any) -> tuple[str, list, str | None]:
    parts, ids, finish = [], [], None
    for chunk in _chat(srv, text, stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            ids += getattr(c, "token_ids", None) or []
            finish = c.finish_reason or finish
    return "".join(parts), ids, finish


def _assert_greedy_chat_equals_generate(smoke: Server, text: str) -> Any:
    tok = smoke.engine.tokenizer
    prompt_ids = prompting.encode(tok, text)  # the path `specdec generate` takes
    want = expected(smoke, prompt_ids, SMOKE_MAX_TOKENS)
    r = _chat(
        smoke,
        text,
        max_tokens=SMOKE_MAX_TOKENS,
        temperature=0,
        seed=3,
        extra_body={"return_token_ids": True},
    )
    assert r.prompt_token_ids == prompt_ids
    assert r.choices[0].token_ids == want.tokens
    assert r.choices[0].message.content == prompting.decode(tok, want.tokens)
    assert r.choices[0].finish_reason == want.stop_reason
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.spec["drafted"] == want.stats.drafted > 0
    assert r.spec["acceptance_rate"] == pytest.approx(want.stats.acceptance_rate)
    return r


def test_chat_greedy_equals_generate_token_for_token(smoke: Server) -> None:
    text = "Name three colors."
    r = _assert_greedy_chat_equals_generate(smoke, text)
    # the bare model name (no backend prefix) is accepted as the model id too
    r2 = smoke.client().chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": text}],
        max_tokens=SMOKE_MAX_TOKENS,
        temperature=0,
    )
    assert r2.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_stream_concatenates_to_nonstreamed_text(smoke: Server, temperature: float) -> None:
    kw = dict(
        max_tokens=SMOKE_MAX_TOKENS,
        temperature=temperature,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    full = _chat(smoke, "Write a haiku about rain.", **kw)
    streamed, ids, finish = _chat_stream(smoke, "Write a haiku about rain.", **kw)
    assert streamed == full.choices[0].message.content and streamed
    assert ids == full.choices[0].token_ids
    assert finish == full.choices[0].finish_reason


def test_completions_text_prompt_stream_and_not(smoke: Server) -> None:
    tok = smoke.engine.tokenizer
    prompt = "The capital of France is"
    want = expected(smoke, prompting.encode(tok, prompt, chat=False), SMOKE_MAX_TOKENS)
    client = smoke.client()
    kw = dict(model=SMOKE_TARGET, prompt=prompt, max_tokens=SMOKE_MAX_TOKENS, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].text == prompting.decode(tok, want.tokens)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(want.tokens)


def test_stop_string_cuts_the_text_and_stops_generating(smoke: Server) -> None:
    text = "Count from one to ten in words."
    kw = dict(max_tokens=12, temperature=0)
    full = _chat(smoke, text, **kw).choices[0].message.content
    mid = len(full) // 2
    stop = full[mid : mid + 3]  # three characters in the middle of the greedy output
    cut = full[: full.find(stop)]
    assert 0 < len(cut) < len(full), full
    r = _chat(smoke, text, stop=[stop, "never-appears"], **kw)
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12  # generation stopped, not just the text
    streamed, _, finish = _chat_stream(smoke, text, stop=stop, **kw)
    assert streamed == cut and finish == "stop"


def test_disconnect_mid_stream_frees_the_engine_without_leaking(smoke: Server) -> None:
    before = metric(smoke.metrics(), "specdec_generations_total", outcome="cancelled")
    body = {
        "model": SMOKE_TARGET,
        "max_tokens": 200,
        "temperature": 0.7,
        "seed": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    conn = http.client.HTTPConnection("127.0.0.1", smoke.port, timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(1000):  # read until the first chunk with generated text
        line = resp.readline()
        assert line, "the stream ended before any text"
        if b'"content":"' in line and b'"content":""' not in line:
            break
    resp.close()
    conn.close()  # the TCP connection goes away mid-stream
    t0 = time.monotonic()
    smoke.wait_idle(timeout=60)
    assert time.monotonic() - t0 < 20  # stopped within a round or so, not after 200 tokens
    text = smoke.metrics()
    assert metric(text, "specdec_generations_total", outcome="cancelled") == before + 1
    # the next request sees none of the abandoned one's state
    _assert_greedy_chat_equals_generate(smoke, "Name three colors.")


def test_concurrent_chat_clients_get_their_own_answers(smoke: Server) -> None:
    tok = smoke.engine.tokenizer
    texts = ["Say hi.", "Name a fruit.", "What is 2+2?", "Name a planet."]
    wants = [
        prompting.decode(tok, expected(smoke, prompting.encode(tok, t), 4).tokens) for t in texts
    ]
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        got = list(
            pool.map(
                lambda t: _chat(smoke, t, max_tokens=4, temperature=0).choices[0].message.content,
                texts,
            )
        )
    assert got == wants


def test_prediction_is_drafted_from_exact_and_counted_in_usage(smoke: Server) -> None:
    """OpenAI's Predicted Outputs on a real model: a prediction that the answer repeats is
    drafted from (accepted prediction tokens in usage, streamed and not), and the answer is
    exactly generate()'s without it; a prediction too long for the context is a 400."""
    tok = smoke.engine.tokenizer
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    prompt_ids = prompting.encode(tok, text)
    want = expected(smoke, prompt_ids, SMOKE_MAX_TOKENS)
    answer = prompting.decode(tok, want.tokens)
    kw = dict(max_tokens=SMOKE_MAX_TOKENS, temperature=0, seed=3)
    pred = {"prediction": {"type": "content", "content": answer}, "return_token_ids": True}
    r = _chat(smoke, text, extra_body=pred, **kw)
    assert r.choices[0].token_ids == want.tokens
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    parts = [{"type": "text", "text": answer[:5]}, {"type": "text", "text": answer[5:]}]
    chunks = list(
        _chat(
            smoke,
            text,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"prediction": {"type": "content", "content": parts}},
            **kw,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    last = chunks[-1].usage.completion_tokens_details
    assert last.accepted_prediction_tokens == details.accepted_prediction_tokens
    status, _, body = smoke.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": SMOKE_TARGET,
            "messages": [{"role": "user", "content": text}],
            "prediction": {"type": "content", "content": "word " * 5000},
        },
    )
    assert status == 400 and body["error"]["param"] == "prediction", body
    assert body["error"]["code"] == "context_length_exceeded"
    assert _chat(smoke, text, extra_body={"return_token_ids": True}, **kw).choices[0].token_ids == (
        want.tokens
    )


_MAIN_THREAD_SERVE = """
import sys, threading
from specdec.backends.mock import MockModel
from specdec.serve import app

seen = set()
extend = MockModel.extend
def recording_extend(self, ids):
    seen.add(threading.current_thread() is threading.main_thread())
    return extend(self, ids)
MockModel.extend = recording_extend
code = app.serve(app.ServeConfig(target="mock:vocab=48,seed=0", port=int(sys.argv[1])))
print("DECODED_IN_MAIN_THREAD", sorted(seen), flush=True)
sys.exit(code)
"""


@pytest.mark.slow
def test_cli_serve_decodes_in_the_main_thread_and_stops_on_sigterm() -> None:
    """`specdec serve` runs the engine's worker in the main thread (serve/engine.py: llama.cpp's
    OpenMP barriers stop spinning for a decode started from any other thread, +40% per token),
    and SIGTERM still ends it cleanly with status 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN_THREAD_SERVE, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve did not come up"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                body = json.dumps({"model": MOCK_SPEC, "prompt": [1, 2], "max_tokens": 3})
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                assert conn.getresponse().status == 200
                break
            except OSError:
                time.sleep(0.2)
        proc.terminate()
        assert proc.wait(GRACEFUL_SHUTDOWN_S + 10) == 0
        out = proc.stdout.read()
        # the warm-up and the request, all in the main thread
        assert "DECODED_IN_MAIN_THREAD [True]" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
def test_cli_serve_on_a_taken_port_exits_with_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec.cli.main",
                "serve",
                "--target",
                MOCK_SPEC,
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode == 1, res.stderr[-2000:]
