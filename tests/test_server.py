"""`specdec serve` through real HTTP on loopback, driven by the real `openai` client.

Each server runs in-process (uvicorn in a background thread, on a socket bound to 127.0.0.1:0)
so the tests can compare its output with `specdec.generate` on the very same model objects
(taking `engine.lock`, as the server's worker does). Two kinds of engine:

    mock    MockModel pairs (no tokenizer): /v1/completions with token-id prompts; the text is
            the ids joined by spaces. Fast, so used for concurrency, 429, timeouts, bad input.
            `SlowMock` sleeps in every forward pass to make requests overlap.
    smoke   llama.cpp smollm2-135m target + HF smollm2-135m draft (the `smoke` pair), for the
            chat template, real detokenization and stop strings. Loaded once; skipped if the
            GGUF is not in the cache.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import uvicorn

from specdec.backends import chat as prompting
from specdec.backends import registry
from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import generate
from specdec.serve.app import Engine, ServeConfig, TextAssembler, create_app

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
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(engine, cfg), log_level="warning", lifespan="on")
        self.uv = uvicorn.Server(config)
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
        return self.request("GET", "/metrics")[2]

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
        "temperature",
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
    ok, _, good = small_ctx.request("POST", "/v1/completions", GOOD, AUTH)
    assert ok == 200 and good["choices"][0]["text"], good


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
    status, hdrs, text = mock.request("GET", "/metrics")
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
    assert metric(text, "specdec_acceptance_length_sum") == metric(
        text, "specdec_generated_tokens_total"
    )


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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MOCK_SPEC, prompt=[1, 2], max_tokens=5, temperature=0)
        assert len(r.choices[0].text.split()) == 5 and r.spec["drafted"] > 0
    finally:
        proc.terminate()
        proc.wait(30)


# ---------------------------------------------------------------------------- smoke engine
def _smoke_available() -> bool:
    try:
        return registry.is_fetched("smollm2-135m")
    except registry.ModelFetchError:
        return False


@pytest.fixture(scope="module")
def smoke() -> Server:
    if not _smoke_available():
        pytest.skip("smollm2-135m is not in the model cache (specdec models fetch smollm2-135m)")
    from specdec.backends import load_model

    # One thread per model: on a shared machine llama.cpp with all cores contends badly.
    target = load_model(SMOKE_TARGET, n_threads=1)
    draft = load_model(SMOKE_DRAFT, n_threads=1)
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
