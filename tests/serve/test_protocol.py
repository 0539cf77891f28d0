"""The serve package's parts without an app: request validation, JSON parsing, text assembly,
metrics labels and the engine's admission. The HTTP behaviour is tested through
tests/serverkit.py's servers (test_server*.py and the files beside them)."""

from __future__ import annotations

import asyncio
import math

import pytest

from specdec.backends.mock import MockModel
from specdec.cli.serve import API_KEY_ENV, resolve_api_key
from specdec.core.config import K_MAX_FREE, K_MAX_MODEL, WARP_FIELDS, SpecConfig
from specdec.core.metrics import Round
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine
from specdec.serve.errors import ApiError
from specdec.serve.metrics import Metrics
from specdec.serve.origins import OriginTracker
from specdec.serve.requests import Request
from specdec.serve.speculation import (
    NO_DRAFTER,
    SpecDefaults,
    Speculation,
    resolve_speculation,
)
from specdec.serve.text import TextAssembler
from specdec.serve.validation import MAX_STOP_CHARS, MAX_STOPS, validate_request
from specdec.serve.wire import ChatRequest, CompletionRequest, parse_json, parse_request

V = 48
N_CTX = 64


def _completion(**fields: object) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2, 3], **fields})


def _refused(fields: dict, param: str | None, code: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as ei:
        validate_request(
            parse_request(CompletionRequest, {"model": "m", "prompt": [1], **fields}), N_CTX, V
        )
    e = ei.value
    assert e.status == 400 and e.param == param, e.body()
    if code is not None:
        assert e.code == code, e.body()
    return e


# ---------------------------------------------------------------------------- validate_request
def test_validate_request_resolves_defaults_without_an_app() -> None:
    p = validate_request(_completion(temperature=0, seed=7, stop="x"), N_CTX, V)
    assert p.prompt_ids == [1, 2, 3] and p.seed == 7 and p.stop == ("x",)
    assert p.max_tokens == N_CTX - 3  # the room left, below DEFAULT_MAX_TOKENS
    assert p.warp.greedy and p.warp.temperature == 0
    assert validate_request(_completion(top_k=10_000), N_CTX, V).warp.top_k == V
    chat = parse_request(
        ChatRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5},
    )
    assert validate_request(chat, N_CTX, V, prompt_ids=[4, 5]).max_tokens == 5
    with pytest.raises(TypeError):  # a text prompt must be tokenized by the caller
        validate_request(_completion(prompt="text"), N_CTX, V)


def test_tiny_temperature_is_greedy_and_temperature_is_bounded_to_openai_range() -> None:
    """Issue 11, item 9: 1e-39 overflowed logits / T to NaN (500); now greedy, and T <= 2."""
    p = validate_request(_completion(temperature=1e-39), N_CTX, V)
    assert p.warp.greedy
    assert validate_request(_completion(temperature=2.0), N_CTX, V).warp.temperature == 2.0
    _refused({"temperature": 2.5}, "temperature")
    _refused({"temperature": -0.5}, "temperature")  # Warp's own rule, its message
    _refused({"temperature": math.nan}, "temperature")
    _refused({"top_p": 0.0}, "top_p")
    _refused({"top_k": 0}, "top_k")


def test_stop_strings_are_capped() -> None:
    """Issue 11, item 2: no limit on stop strings let one request pin the worker."""
    ok = validate_request(_completion(stop=["a" * MAX_STOP_CHARS] * MAX_STOPS), N_CTX, V)
    assert len(ok.stop) == MAX_STOPS
    _refused({"stop": [str(i) for i in range(MAX_STOPS + 1)]}, "stop")
    _refused({"stop": "x" * 1000}, "stop")
    _refused({"stop": ["ok", ""]}, "stop")


@pytest.mark.parametrize(
    "fields",
    [
        {"best_of": 2},
        {"functions": [{"name": "f"}]},  # deprecated for tools, which are served
        {"audio": {"voice": "x"}},
    ],
    ids=lambda f: next(iter(f)),
)
def test_unsupported_openai_fields_are_refused(fields: dict) -> None:
    """Issue 11 (Low): these were silently ignored, so a client got an answer it did not ask for."""
    name = next(iter(fields))
    with pytest.raises(ApiError) as ei:
        _completion(**fields)
    assert ei.value.status == 400 and ei.value.code == "unsupported_parameter"
    assert ei.value.param == name


def test_a_suffix_is_a_completions_field_and_refused_on_chat() -> None:
    """Issue 62: completions take `suffix` (fill-in-the-middle: serve.models builds the FIM
    prompt); chat has no gap to fill."""
    assert _completion(suffix="tail").suffix == "tail"
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "suffix": "tail"}
    with pytest.raises(ApiError) as ei:
        parse_request(ChatRequest, chat)
    assert ei.value.code == "unsupported_parameter" and ei.value.param == "suffix"


def test_new_sampling_fields_are_validated_into_params() -> None:
    """Issue 43: penalties, logit_bias, min_p, logprobs, echo, n and response_format are served;
    each out-of-range value is a 400 that names its field."""
    p = validate_request(
        _completion(
            presence_penalty=0.5,
            frequency_penalty=-1,
            repetition_penalty=1.2,
            logit_bias={"3": -100, "7": 2.5},
            min_p=0.1,
            logprobs=2,
            n=3,
            seed=5,
            response_format={"type": "json_object"},
        ),
        N_CTX,
        V,
    )
    assert p.penalties is not None and p.penalties.bias == ((3, -100.0), (7, 2.5))
    assert (p.penalties.presence, p.penalties.frequency, p.penalties.repetition) == (0.5, -1, 1.2)
    assert p.warp.min_p == 0.1 and p.logprobs == 2 and p.n == 3
    assert p.structure is not None and p.structure.schema is None  # any JSON object
    plain = validate_request(_completion(presence_penalty=0, logit_bias={}), N_CTX, V)
    assert plain.penalties is None and plain.logprobs is None and plain.structure is None
    for fields, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(V): 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": 1, "echo": True}, "echo"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ]:
        _refused(fields, param)


def test_every_warp_field_is_a_request_field_checked_by_warp() -> None:
    """The sampling fields are core.config.Warp's by name: typical_p (llama.cpp's and
    transformers') reaches GenParams.warp as sent, and out of (0, 1] it is Warp's 400, naming
    it; every Warp field is a request field, so a new one is served once it is declared."""
    p = validate_request(_completion(typical_p=0.9, min_p=0.05, top_p=0.8), N_CTX, V)
    assert (p.warp.typical_p, p.warp.min_p, p.warp.top_p) == (0.9, 0.05, 0.8)
    assert validate_request(_completion(), N_CTX, V).warp.typical_p is None  # off
    for bad_value in (0, 1.5, -0.1):
        _refused({"typical_p": bad_value}, "typical_p")
    with pytest.raises(ApiError, match=r"typical_p must be in \(0, 1\]"):
        validate_request(_completion(typical_p=0), N_CTX, V)
    for name in WARP_FIELDS:
        assert name in ChatRequest.model_fields and name in CompletionRequest.model_fields


def test_chat_logprobs_and_tool_choice_rules() -> None:
    def chat(**fields: object) -> ChatRequest:
        msgs = [{"role": "user", "content": "hi"}]
        return parse_request(ChatRequest, {"model": "m", "messages": msgs, **fields})

    def refused(param: str, **fields: object) -> None:
        with pytest.raises(ApiError) as ei:
            validate_request(chat(**fields), N_CTX, V, [1, 2])
        assert ei.value.status == 400 and ei.value.param == param, ei.value

    assert validate_request(chat(logprobs=True, top_logprobs=3), N_CTX, V, [1]).logprobs == 3
    assert validate_request(chat(logprobs=True), N_CTX, V, [1]).logprobs == 0
    refused("top_logprobs", top_logprobs=2)  # needs logprobs: true
    refused("top_logprobs", logprobs=True, top_logprobs=21)
    # the entries one response may carry: n x max_tokens x (top_logprobs + 1) <= 2**18
    many = {"logprobs": True, "top_logprobs": 20, "n": 16}
    assert validate_request(chat(**many, max_tokens=780), 4096, V, [1]).logprobs == 20
    with pytest.raises(ApiError) as ei:
        validate_request(chat(**many, max_tokens=781), 4096, V, [1])
    assert ei.value.param == "top_logprobs" and "262,144" in ei.value.message, ei.value
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused("tools", tools=tools)  # no tool format known for this model
    refused("tool_choice", tool_choice="required")  # no tools
    # tool_choice "none": the tools are neither rendered nor read, so no format is needed
    assert validate_request(chat(tools=tools, tool_choice="none"), N_CTX, V, [1]).tools is None


def test_fields_that_ask_for_nothing_are_accepted_and_stream_null_is_false() -> None:
    req = _completion(
        logprobs=None,
        echo=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        response_format={"type": "text"},
        best_of=1,
        stream=None,
        user="someone",
    )
    assert req.streaming is False and not req.include_usage


# ---------------------------------------------------------------------------- the JSON body
def test_parse_json_refuses_deep_nesting_and_lone_surrogates() -> None:
    """Issue 11 (Low): RecursionError and lone surrogates were 500s."""
    assert parse_json(b'{"a": [1, "\\u00e9"]}') == {"a": [1, "é"]}
    for body in (b"[" * 100_000, b'{"prompt": "\\ud800"}', b'{"\\udfff": 1}', b'{"a": "\xff"}'):
        with pytest.raises(ApiError) as ei:
            parse_json(body)
        assert ei.value.status == 400, body[:20]


# ---------------------------------------------------------------------------- text assembly
def test_text_assembler_decodes_incrementally() -> None:
    """Issue 11, item 6: the whole output was re-decoded every round (O(T^2))."""
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return "".join(f"<{i}>" for i in ids)

    a = TextAssembler(decode, stop=("<999>",))
    out = "".join(a.push([i % 50]) for i in range(2000)) + a.flush()
    assert out == a.text == "".join(f"<{i % 50}>" for i in range(2000))
    assert max(seen) <= 2  # a window: the new token and its context, never the whole output


def test_text_assembler_does_not_assume_decode_of_a_prefix_is_a_prefix() -> None:
    """Issue 11 (Low): with clean_up_tokenization_spaces, decode("Hello", " ") = "Hello " but
    decode("Hello", " ", ".") = "Hello.": the old assembler then lost the "."."""
    pieces = {1: "Hello", 2: " ", 3: ".", 4: " Bye"}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace(" .", ".")

    a = TextAssembler(decode)
    deltas = [a.push([1, 2]), a.push([3]), a.push([4])]
    deltas.append(a.flush())
    assert "".join(deltas) == a.text
    assert a.text.startswith("Hello") and "." in a.text and a.text.endswith(" Bye")


def test_text_assembler_holds_a_split_character_until_it_completes() -> None:
    raw = "naïve".encode()
    pieces = {i: raw[i : i + 1] for i in range(len(raw))}  # one byte per token

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    a = TextAssembler(decode, stop=("ve!",))
    out = [a.push([i]) for i in range(len(raw))]
    assert "\ufffd" not in "".join(out)
    assert "".join(out) + a.flush() == "naïve"


# ---------------------------------------------------------------------------- metrics, engine
def test_request_metrics_are_labelled_by_route_not_by_path() -> None:
    """Issue 11, item 1: every distinct /v1 path added a series, kept forever."""
    m = Metrics()
    for i in range(50):
        m.count_request(f"/v1/nope/{i}", 404)
    m.count_request("/v1/completions", 200)
    m.count_request("/favicon.ico", 404)  # outside /v1: not counted at all
    series = [x for x in m.render({}).splitlines() if x.startswith("specdec_requests_total{")]
    assert series == [
        'specdec_requests_total{code="200",endpoint="/v1/completions"} 1',
        'specdec_requests_total{code="404",endpoint="other"} 50',
    ]


def test_submit_to_an_engine_whose_worker_is_not_running_is_503_at_once() -> None:
    """Issue 11 (Low): the job sat in the queue until its deadline (504)."""
    engine = Engine(MockModel(V), None, ServeConfig(target="m", max_queue=2))  # never started
    loop = asyncio.new_event_loop()
    try:
        job = Request(validate_request(_completion(), N_CTX, V), loop, 0.0, math.inf)
        with pytest.raises(ApiError) as ei:
            engine.submit(job)
    finally:
        loop.close()
    assert ei.value.status == 503 and ei.value.code == "engine_stopped"
    assert engine.queue_depth == 0


# ---------------------------------------------------------------------------- speculation
def test_speculation_defaults_come_from_the_start_up_flags() -> None:
    no_flags = SpecDefaults(SpecConfig(k="auto"), has_draft=False)
    assert no_flags.drafter is None and no_flags.config.k == "auto"
    assert SpecDefaults() == no_flags  # the server's default K is auto
    # no drafter flag: a request's prediction is drafted from, else the target decodes alone
    sp = resolve_speculation(None, no_flags, has_prediction=True)
    assert sp.config.drafter == "prediction"
    assert resolve_speculation(None, no_flags, has_prediction=False) == Speculation()
    with_draft = SpecDefaults(SpecConfig(k=4, p_min=0.2), has_draft=True)
    got = resolve_speculation({}, with_draft, has_prediction=False).config
    assert got == SpecConfig("model", 4, None, 0.2)
    # a request's fields override the flags, one by one; --k-max bounds only the named K
    flags = SpecDefaults(SpecConfig("lookup", "auto", 16), has_draft=True)
    assert resolve_speculation({"k": 3}, flags, False) == Speculation(SpecConfig("lookup", 3))
    assert resolve_speculation({"drafter": "model"}, flags, False).config.k_max == 16
    assert resolve_speculation({"k_max": 5}, flags, False).config.k_max == 5
    got = resolve_speculation({"drafter": None, "k": None}, flags, False).config
    assert got.drafter == "lookup"


def test_the_wire_none_is_cores_no_drafter() -> None:
    """ "none" is the API's word alone: inside, a request without a drafter is core's None."""
    flags = SpecDefaults(SpecConfig("lookup", 4), has_draft=False)
    sp = resolve_speculation({"drafter": NO_DRAFTER}, flags, has_prediction=True)
    assert sp == Speculation() and sp.config.drafter is None and not sp.drafts
    assert sp.drafter_name == NO_DRAFTER
    assert sp.settings() == {"drafter": NO_DRAFTER, "k": None, "k_max": None}


def test_speculation_runs_as_the_core_config_it_names() -> None:
    # "prediction" runs as itself with the request's prediction (core.generate.make_drafter:
    # lookup with the prediction drafted first), and as prompt lookup without one: decided once
    predicted = Speculation(SpecConfig("prediction", "auto"), has_prediction=True)
    assert predicted.run_config() == SpecConfig("prediction", "auto")
    assert predicted.settings()["drafter"] == "prediction"
    alone = Speculation(SpecConfig("prediction", "auto"))
    assert alone.run_config() == SpecConfig("lookup", "auto")
    assert alone.settings()["drafter"] == "prediction"
    flags = SpecDefaults(SpecConfig("prediction", "auto"))
    assert resolve_speculation(None, flags, True).run_config().drafter == "prediction"
    assert resolve_speculation(None, flags, False).run_config().drafter == "lookup"
    assert Speculation().run_config() == SpecConfig()  # none: no drafter, no draft model
    # p_min is a draft model's setting only
    flags = SpecDefaults(SpecConfig(k=2, p_min=0.3), has_draft=True)
    assert resolve_speculation({"drafter": "lookup"}, flags, False).config.p_min is None
    assert resolve_speculation({"drafter": "model"}, flags, False).config.p_min == 0.3
    assert resolve_speculation({"drafter": "composite"}, flags, False).config.p_min == 0.3
    assert Speculation(SpecConfig("lookup", "auto")).settings()["k_max"] == K_MAX_FREE
    assert Speculation(SpecConfig("composite", "auto")).settings()["k_max"] == K_MAX_MODEL
    three = Speculation(SpecConfig("model", 3)).settings()
    assert three == {"drafter": "model", "k": 3, "k_max": None}


def test_include_speculation_is_off_by_default_and_needs_a_stream() -> None:
    assert not validate_request(_completion(), N_CTX, V).origins
    p = validate_request(
        _completion(stream=True, stream_options={"include_speculation": True}), N_CTX, V
    )
    assert p.origins
    _refused({"stream_options": {"include_speculation": True}}, "stream_options")


def test_origins_follow_from_each_round() -> None:
    tracker = OriginTracker(lambda ids: "".join(chr(ord("a") + i) for i in ids))
    table = [
        (Round("lookup3", 4, 2, 3), ["accepted", "accepted", "corrected"]),
        (Round("none", 0, 0, 1), ["target"]),
        (Round("model", 2, 2, 3), ["accepted", "accepted", "bonus"]),
        (Round("lookup3", 4, 4, 2), ["accepted", "accepted"]),  # cut by the budget
        (Round("model", 3, 0, 1), ["corrected"]),  # the first draft rejected
    ]
    for i, (r, want) in enumerate(table):
        tracker.observe(r)
        rec = tracker.record(list(range(r.n_emitted)))
        assert [t["origin"] for t in rec["tokens"]] == want
        assert (rec["round"], rec["k"], rec["accepted"]) == (i + 1, r.k, r.n_accepted)
        assert rec["source"] == (r.source if r.k else None)
    with pytest.raises(RuntimeError, match="on_round"):
        tracker.record([1])  # a chunk whose round was never heard
    # a round whose first 2 drafts a grammar forced, then lookup's: each accepted token says
    # which source it came from (the playground colours them apart)
    tracker.observe(Round("lookup3", 5, 3, 4, forced=2))
    rec = tracker.record([1, 2, 3, 4])
    assert [t.get("source") for t in rec["tokens"]] == ["grammar", "grammar", "lookup3", None]
    assert rec["forced"] == 2


# ---------------------------------------------------------------------------- CLI: the API key
def test_api_key_from_flag_file_or_environment(tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    env = {API_KEY_ENV: " from-env "}
    assert resolve_api_key("from-flag", None, env) == "from-flag"
    assert resolve_api_key(None, str(key_file), env) == "from-file"
    assert resolve_api_key(None, None, env) == "from-env"
    assert resolve_api_key(None, None, {}) is None
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, str(tmp_path / "empty"), {})
