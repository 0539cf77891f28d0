"""A parsed request checked against the models: `validate_request(req, n_ctx, vocab)` turns a
`ChatRequest` or `CompletionRequest` (serve.wire) into the `GenParams` the worker generates from
(serve.gen_params), and raises `ApiError` (OpenAI's error body, serve.errors) naming the field
it cannot serve. Nothing here needs an app, an engine or a model.

The sampling fields (temperature, top_k, top_p, min_p, typical_p) are `core.config.Warp`'s, by
name, with its checks (one place for each); what is added here is OpenAI's own bound on the
temperature, [0, 2], and the server's limits on stop strings, samples and logprobs.
"""

from __future__ import annotations

import json
import re
import secrets

from specdec.backends.grammar import schema_of
from specdec.core.checks import shown
from specdec.core.config import WARP_FIELDS, Warp
from specdec.core.prediction import PredictionDrafter, PredictionIndex
from specdec.core.processing import Penalties
from specdec.serve.errors import bad
from specdec.serve.gen_params import GenParams, Structure
from specdec.serve.speculation import SpecDefaults, resolve_speculation
from specdec.serve.tools import ToolFormat
from specdec.serve.wire import ChatRequest, CompletionRequest, RequestBody, ToolChoice

DEFAULT_MAX_TOKENS = 512  # when a request names none (capped by the room left in the context)
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts
#: OpenAI's documented range for temperature. Above ~2 sampling is noise; bounding it also keeps
#: 1/T finite for every float a client can send.
TEMPERATURE_MAX = 2.0
#: Stop strings: OpenAI allows 4. The assembler searches only the new tail of the text, but the
#: hold-back check costs O(count x length) per round, so both are capped (issue 11, item 2).
MAX_STOPS = 16
MAX_STOP_CHARS = 256

#: OpenAI's caps: top_logprobs <= 20 on chat, logprobs <= 5 on completions (vLLM allows more;
#: each costs a top-k over the vocabulary per token). n: OpenAI allows 128; each sample is a
#: generation of its own here, so the cap is the queue's scale.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_N = 16
#: Logprob entries (n x max_tokens x (top + 1)) one response may carry: each is a few hundred
#: bytes of Python objects and JSON, so n = 16, top_logprobs = 20, max_tokens = 4,000 (1.3M)
#: would build a response of hundreds of MB; 262,144 still lets n = 1 run to a 12k context.
MAX_LOGPROB_ENTRIES = 1 << 18


def validate_request(
    req: RequestBody,
    n_ctx: int,
    vocab: int,
    prompt_ids: list[int] | None = None,
    prediction_ids: list[int] | None = None,
    defaults: SpecDefaults = SpecDefaults(),  # noqa: B008 - frozen
    tool_format: ToolFormat | None = None,
) -> GenParams:
    """Check `req` against a context window of `n_ctx` tokens and a vocabulary of `vocab`.

    `prompt_ids` is the tokenized prompt; it may be left out for a completion whose prompt is
    already token ids. `prediction_ids`: the request's prediction, tokenized (required when it
    has one). `defaults`: the server's speculation flags, which the request's `speculation`
    overrides. `tool_format`: the chat template's (serve.tools; None: it has none). Raises
    ApiError 400 naming the offending field.
    """
    if prompt_ids is None:
        prompt = req.single_prompt() if isinstance(req, CompletionRequest) else None
        if not isinstance(prompt, list):
            raise TypeError("a text or chat prompt must be tokenized first: pass prompt_ids")
        prompt_ids = prompt
    prompt_param = "messages" if isinstance(req, ChatRequest) else "prompt"
    if isinstance(req, CompletionRequest) and req.tools not in (None, []):
        raise bad("tools are served on /v1/chat/completions, not on /v1/completions", "tools")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {n}", "n")
    warp = _warp(req, vocab)
    if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
        raise bad(f"seed must be in [-2**63, 2**64), got {req.seed}", "seed")
    stops = _stops(req.stop)
    _check_prompt(prompt_ids, vocab, prompt_param)
    max_tokens = _max_tokens(req, len(prompt_ids), n_ctx, prompt_param)
    prediction = _prediction(req, prediction_ids, n_ctx - len(prompt_ids), vocab)
    speculation = resolve_speculation(req.speculation, defaults, req.prediction is not None)
    if req.include_speculation and not req.streaming:
        raise bad(
            "stream_options.include_speculation needs stream: true; a whole response carries "
            "its speculation in usage.speculation",
            "stream_options",
        )
    # No seed: a fresh one per request (OpenAI's behaviour), never a fixed default.
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    structure, tools = _structure(req, tool_format)
    return GenParams(
        list(prompt_ids),
        max_tokens,
        warp,
        seed,
        stops,
        # checked either way; carried only where something drafts from it
        prediction if speculation.drafts else None,
        speculation=speculation,
        origins=req.include_speculation,
        penalties=_penalties(req, vocab),
        logprobs=_logprob_budget(req, n, max_tokens),
        n=n,
        echo=bool(getattr(req, "echo", False)),
        structure=structure,
        tools=tools,
    )


def _penalties(req: RequestBody, vocab: int) -> Penalties | None:
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"logit_bias keys are token ids, got {shown(key)}", "logit_bias") from None
        if not 0 <= token < vocab:
            raise bad(f"logit_bias token id {token} is outside [0, {vocab})", "logit_bias")
        bias[token] = value
    try:
        pen = Penalties.of(
            req.presence_penalty, req.frequency_penalty, req.repetition_penalty, bias
        )
    except ValueError as e:  # Penalties' message starts with the field it rejects
        raise bad(str(e), str(e).split()[0].split("[")[0]) from None
    return pen if pen.active else None


def _logprob_budget(req: RequestBody, n: int, max_tokens: int) -> int | None:
    """`_logprobs`, refused where its entries could pass MAX_LOGPROB_ENTRIES."""
    top = _logprobs(req)
    if top is not None and n * max_tokens * (top + 1) > MAX_LOGPROB_ENTRIES:
        field = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        raise bad(
            f"n ({n}) x max_tokens ({max_tokens}) x ({field} + 1 = {top + 1}) logprob entries "
            f"exceed the {MAX_LOGPROB_ENTRIES:,} a response may carry; lower max_tokens, n or "
            f"{field}",
            field,
        )
    return top


def _logprobs(req: RequestBody) -> int | None:
    """None, or how many likeliest tokens each position lists (chat: top_logprobs, which needs
    logprobs: true; completions: logprobs itself)."""
    if isinstance(req, ChatRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
        if not req.logprobs:
            if top:
                raise bad("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return top or 0
    if req.logprobs is None:
        return None
    if not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}", "logprobs"
        )
    if req.echo:
        raise bad(
            "echo with logprobs would need the prompt's logprobs, which this server does not "
            "compute; leave out echo or logprobs",
            "echo",
        )
    return req.logprobs


def _guided(req: RequestBody) -> Structure | None:
    """vLLM's guided_* fields as a Structure (at most one of them)."""
    given = {
        k: v
        for k, v in {
            "guided_json": req.guided_json,
            "guided_regex": req.guided_regex,
            "guided_choice": req.guided_choice,
            "guided_grammar": req.guided_grammar,
        }.items()
        if v is not None
    }
    if len(given) > 1:
        raise bad(f"at most one of {', '.join(given)}", next(iter(given)))
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad("guided_json is not JSON", name) from None
        if not isinstance(value, dict):
            raise bad("guided_json must be a JSON schema object", name)
        return Structure(value)
    if name == "guided_choice":
        if not value or not all(value):
            raise bad("guided_choice must hold at least one non-empty string", name)
        return Structure(regex="|".join(re.escape(c) for c in value))
    return Structure(regex=value) if name == "guided_regex" else Structure(lark=value)


def _structure(
    req: RequestBody, fmt: ToolFormat | None
) -> tuple[Structure | None, ToolFormat | None]:
    """What the output must match, and the format tool calls are read in (None: not read)."""
    structure = _guided(req)
    if req.response_format is not None and req.response_format.get("type") != "text":
        if structure is not None:
            raise bad(
                "response_format and a guided_* field cannot both be asked", "response_format"
            )
        try:
            structure = Structure(schema_of(req.response_format))
        except ValueError as e:
            raise bad(str(e), "response_format") from None
    if not isinstance(req, ChatRequest) or not req.tools or req.tool_choice == "none":
        if isinstance(req, ChatRequest) and req.tool_choice not in (None, "none") and not req.tools:
            raise bad("tool_choice needs tools", "tool_choice")
        return structure, None
    if fmt is None:
        raise bad(
            "this model's chat template has no tool-call format the server reads (it reads "
            "the Hermes <tool_call> format: Qwen2.5 and others); leave out tools",
            "tools",
        )
    functions = [{"name": t.function.name, "parameters": t.function.parameters} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoice):
        functions = [f for f in functions if f["name"] == choice.function.name]
        if not functions:
            raise bad(
                f"tool_choice names {shown(choice.function.name)}, not in tools", "tool_choice"
            )
    if choice is None or choice == "auto":
        return structure, fmt
    if structure is not None:
        raise bad("a required tool call and response_format cannot both be asked", "tool_choice")
    # One call unless asked for more: a grammar that allows another call after each one lets a
    # model that prefers a newline to its end token repeat calls until max_tokens (seen with
    # Qwen2.5-Coder 0.5B); with tool_choice "auto" the model decides, unconstrained.
    parallel = req.parallel_tool_calls is True and not isinstance(choice, ToolChoice)
    return Structure(functions=tuple(functions), parallel=parallel), fmt


def _prediction(
    req: RequestBody, ids: list[int] | None, room: int, vocab: int
) -> PredictionIndex | None:
    """The request's prediction as the one value the layers below take (its index not built
    yet: serve.tokens builds it off the worker's lock)."""
    if req.prediction is None:
        return None
    if ids is None:
        raise TypeError("a request's prediction must be tokenized first: pass prediction_ids")
    if len(ids) > room:
        raise bad(
            f"the prediction ({len(ids)} tokens) is longer than the room left in the context "
            f"window after the prompt ({room} tokens); shorten it or leave it out",
            "prediction",
            "context_length_exceeded",
        )
    try:
        return PredictionIndex(ids, PredictionDrafter.N_MAX, vocab=vocab)
    except ValueError as e:
        raise bad(str(e), "prediction") from None


def _warp(req: RequestBody, vocab: int) -> Warp:
    t = 1.0 if req.temperature is None else req.temperature
    # top_k >= V keeps every token: the same distribution, without a top-k over too many.
    top_k = req.top_k if req.top_k is None or req.top_k < vocab else vocab
    # the request's other sampling fields are Warp's by name (core.config.WARP_FIELDS)
    rest = {
        name: getattr(req, name) for name in WARP_FIELDS if name not in ("temperature", "top_k")
    }
    try:
        warp = Warp(t, top_k, **rest)
    except ValueError as e:  # Warp's message starts with the field it rejects
        field = str(e).split()[0]
        raise bad(str(e), field if field in WARP_FIELDS else None) from None
    if t > TEMPERATURE_MAX:
        raise bad(f"temperature must be in [0, {TEMPERATURE_MAX:g}], got {t}", "temperature")
    return warp


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("stop strings must be non-empty", "stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad(f"stop strings are at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    return stops


def _check_prompt(prompt_ids: list[int], vocab: int, param: str) -> None:
    if not prompt_ids:
        raise bad("the prompt is empty", param)
    bad_id = next((i for i in prompt_ids if not 0 <= i < vocab), None)
    if bad_id is not None:
        raise bad(f"prompt token id {bad_id} is outside the vocabulary [0, {vocab})", param)


def _max_tokens(req: RequestBody, n_prompt: int, n_ctx: int, prompt_param: str) -> int:
    max_tokens = req.max_tokens
    if max_tokens is None and isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens
    room = n_ctx - n_prompt
    if room < 1:
        raise bad(
            f"the prompt ({n_prompt} tokens) fills the context window of {n_ctx} tokens",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens < 1:
        raise bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise bad(
            f"max_tokens ({max_tokens}) + the prompt ({n_prompt} tokens) exceeds the context "
            f"window of {n_ctx} tokens; at most {room}",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens
