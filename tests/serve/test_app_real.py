"""`specdec serve` on a real model pair through real HTTP, driven by the real `openai` client:
the chat template, real detokenization, stop strings, a disconnect mid-stream, concurrent chat
clients and Predicted Outputs, each against `specdec.generate` on the server's own models.

The pair is the `smoke` pair: llama.cpp smollm2-135m target + HF smollm2-135m draft, the
session's models (conftest), fetched if they are not cached. The server runs in-process
(tests/serverkit.py); tests/serve/test_app.py has the same surface on mock models.
"""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serverkit import Server, expected, metric

from specdec.backends import chat as prompting
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine

SMOKE_TARGET = "llamacpp:smollm2-135m"
SMOKE_DRAFT = "hf:smollm2-135m"
SMOKE_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def smoke(_smol_llamacpp_session, _smol_hf_session) -> Server:
    """The session's smollm2 pair (conftest: fetched if missing, one load per session)."""
    target, draft = _smol_llamacpp_session, _smol_hf_session
    target.reset()
    draft.reset()
    cfg = ServeConfig(target=SMOKE_TARGET, draft=SMOKE_DRAFT, k=4, draft_pool="off")
    srv = Server(Engine(target, draft, cfg), cfg)
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
    tok = smoke.engine.models.tokenizer
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
    tok = smoke.engine.models.tokenizer
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
    tok = smoke.engine.models.tokenizer
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
    tok = smoke.engine.models.tokenizer
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


def test_metrics_say_what_share_of_the_machine_the_passes_get(smoke: Server) -> None:
    from support import TEST_THREADS

    _chat(smoke, "Name three colors.", max_tokens=8, temperature=0)
    text = smoke.metrics()
    assert metric(text, "specdec_threads") == TEST_THREADS  # the session model's fixed pool
    assert metric(text, "specdec_pass_pace") >= 1.0  # no pass beats the fastest of its size
    assert metric(text, "specdec_other_cores") >= 0.0  # measured: this is Linux
