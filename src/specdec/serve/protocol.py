"""The wire format: OpenAI request models, their validation, and the response records.

Nothing here needs an app, an engine or a model: `validate_request(req, n_ctx, vocab)` turns a
parsed request into the `GenParams` the worker generates from, and raises `ApiError` (OpenAI's
error body, serve.errors) for anything it cannot serve. The sampling fields (temperature, top_k,
top_p, min_p, typical_p) are `core.config.Warp`'s, by name, with its checks (one place for each);
what is added here is OpenAI's own bound on the temperature, [0, 2], and the server's limits on
stop strings.

Extensions (docs/api-extensions.md has the user's view, with the same definitions):
    speculation           {"drafter", "k", "k_max"} per request, the server's start-up flags as
                          defaults (serve.speculation)
    usage.speculation     what the request's speculation did (`speculation_usage`, core.metrics'
                          definitions)
    stream_options.include_speculation   each streamed chunk carries its round's token origins
                          (serve.origins)
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specdec.backends.grammar import Grammar, schema_of
from specdec.core.checks import shown
from specdec.core.config import WARP_FIELDS, Warp
from specdec.core.prediction import PredictionIndex
from specdec.core.processing import Penalties
from specdec.serve.errors import bad
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation
from specdec.serve.tools import ToolFormat, tool_call_for_template

DEFAULT_MAX_TOKENS = 512  # when a request names none (capped by the room left in the context)
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts
#: OpenAI's documented range for temperature. Above ~2 sampling is noise; bounding it also keeps
#: 1/T finite for every float a client can send.
TEMPERATURE_MAX = 2.0
#: Stop strings: OpenAI allows 4. The assembler searches only the new tail of the text, but the
#: hold-back check costs O(count x length) per round, so both are capped (issue 11, item 2).
MAX_STOPS = 16
MAX_STOP_CHARS = 256

#: OpenAI fields that would change the output or its shape and that this server does not
#: implement, with the values that ask for nothing (clients often send those explicitly). Any
#: other value is refused rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),  # chat's; completions take it (fill-in-the-middle: backends.fim)
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
}
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


# ------------------------------------------------------------------------------ the JSON body
#: Bounds checked on the raw JSON, before the request models see it: validating a 1 MiB list of
#: wrong-typed items costs seconds in pydantic (every union member fails on every item) and an
#: error list as long as the input. A prompt of token ids is at most the context window; 2**17
#: leaves room for any model served here.
MAX_LIST_ITEMS = 1 << 17
MAX_MESSAGES = 4096  # messages, and text parts of one content (OpenAI's own cap is 2048)
MAX_JSON_INT = 1 << 64  # |int| below this: seeds reach 2**64, nothing else comes close


def parse_json(body: bytes) -> Any:
    """The request body as JSON, or a 400: malformed, not UTF-8, nested too deeply for the
    parser (RecursionError), an integer literal too long for Python (ValueError) or out of
    range, NaN or an infinite number, a list longer than MAX_LIST_ITEMS, or holding a lone
    surrogate ("\\ud800" is valid JSON, but no tokenizer or UTF-8 response can carry it)."""
    try:
        obj = json.loads(body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # int literals over sys.get_int_max_str_digits(); NaN, Infinity
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_values(obj)
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _check_values(obj: Any) -> None:
    stack = [obj]  # iterative: json.loads has already bounded the depth, but keep it flat
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack += x.keys()
            stack += x.values()
        elif isinstance(x, list):
            if len(x) > MAX_LIST_ITEMS:
                raise bad(f"a list of {len(x)} items; at most {MAX_LIST_ITEMS}", code="too_long")
            stack += x
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(
                    "the request holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text",
                    code="invalid_text",
                ) from None
        elif (
            isinstance(x, int) and not isinstance(x, bool) and not -MAX_JSON_INT < x < MAX_JSON_INT
        ):
            raise bad(
                "an integer in the request is out of range (|n| >= 2**64)", code="invalid_number"
            )
        elif isinstance(x, float) and not math.isfinite(x):
            raise bad("a number in the request is too large for a double", code="invalid_number")


def check_shape(kind: str, body: Any) -> None:
    """The request's long lists have the right item types and lengths, checked in one pass
    before the models: a wrong-typed item among many is named at once (param, index), and no
    list reaches pydantic in a shape that costs it per item per union member."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_type")
    if kind == "chat":
        msgs = body.get("messages")
        if isinstance(msgs, list):
            _check_items(msgs, dict, "messages", MAX_MESSAGES, "an object")
            for m in msgs:
                if isinstance(m.get("content"), list):
                    _check_items(m["content"], dict, "messages.content", MAX_MESSAGES, "an object")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            want: type = list if isinstance(first, list) else str if isinstance(first, str) else int
            _check_items(prompt, want, "prompt", MAX_LIST_ITEMS, _TYPE_NAMES[want])
            if want is list:
                for p in prompt:
                    _check_items(p, int, "prompt", MAX_LIST_ITEMS, "a token id")
    pred = body.get("prediction")
    if isinstance(pred, dict) and isinstance(pred.get("content"), list):
        _check_items(pred["content"], dict, "prediction.content", MAX_MESSAGES, "an object")


_TYPE_NAMES = {int: "a token id", str: "a string", list: "a list of token ids"}


def _check_items(items: list, want: type, param: str, limit: int, what: str) -> None:
    if len(items) > limit:
        raise bad(f"{param}: {len(items)} items; at most {limit}", param.split(".")[0], "too_long")
    for i, x in enumerate(items):
        # bool is an int in Python, and strict validation refuses it: so does this
        if type(x) is not want:
            raise bad(
                f"{param}[{i}]: expected {what}, got {type(x).__name__}",
                param.split(".")[0],
                "invalid_type",
            )


# ------------------------------------------------------------------------------ request models
class _Strict(BaseModel):
    # strict: "0.5" is not a float and true is not an int; wrong types are 400s, not coerced.
    # extra fields are ignored, as OpenAI clients send fields (user, metadata, store, ...) that
    # change nothing here; the ones that would change the output are refused (UNSUPPORTED).
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c or ())

    def rendered(self) -> dict[str, Any]:
        """As a chat template takes it (transformers' convention: a call's arguments as an
        object; serve.tools)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [tool_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class ToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class PredictionContent(_Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat (e.g. the file
    an edit re-emits). It is drafted from (core.drafters.PredictionDrafter), so it changes the
    speed and never the output; tokenized with the target's tokenizer, never run through a
    model."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class StreamOptions(_Strict):
    include_usage: bool = False
    # extension: each chunk carries its round's token origins (serve.origins)
    include_speculation: bool = False


class _Request(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None  # null is false, as in OpenAI's own server
    stream_options: StreamOptions | None = None
    n: int | None = None
    return_token_ids: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's and transformers'
    min_p: float | None = None  # vLLM's and llama.cpp's
    typical_p: float | None = None  # llama.cpp's and transformers'
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured-output fields: a JSON schema, a regex, one of some strings, a grammar
    # (Lark, llguidance's dialect)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: PredictionContent | None = None
    # extension: {"drafter", "k", "k_max"}; checked by resolve_speculation, which names the
    # allowed values (pydantic's own messages for a free-form object would not)
    speculation: Any = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_speculation(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_speculation


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as backends.chat.encode_messages takes them; 400 when there are none."""
        if not self.messages:
            raise bad("messages must hold at least one message", "messages")
        return [m.rendered() for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    # the text after the gap: the prompt is then the text before it (fill-in-the-middle,
    # OpenAI's legacy field and Ollama's; serve.models builds the model's FIM prompt)
    suffix: str | None = None
    tools: Any = None  # a chat field: refused here rather than ignored (`validate_request`)

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text, or token ids. A list of one prompt is that prompt; batches are
        refused (one sequence per request is all the engine does)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad(
                    "batched prompts are not supported; send one prompt per request", "prompt"
                )
            return prompt[0]
        return prompt


Request = ChatRequest | CompletionRequest


def parse_request(kind: type[ChatRequest] | type[CompletionRequest], body: Any) -> Any:
    """`body` (parsed JSON) as a `kind`; 400 for wrong types and for unsupported fields."""
    check_shape("chat" if kind is ChatRequest else "completions", body)
    _refuse_unsupported(body, allowed=() if kind is ChatRequest else ("suffix",))
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_context=False, include_input=False)[0]
        # loc can hold union member tags ("prompt", "str"): the field alone is OpenAI's param.
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(map(str, err["loc"])) or "request body"
        raise bad(f"{where}: {err['msg']}", param=param, code="invalid_type") from None


def _refuse_unsupported(body: dict[str, Any], allowed: tuple[str, ...] = ()) -> None:
    for name, neutral in UNSUPPORTED.items():
        v = body.get(name) if name not in allowed else None
        # type-exact: False == 0 in Python, yet "logprobs": 0 is a request for logprobs
        if v is None or any(type(v) is type(n) and v == n for n in neutral):
            continue
        raise bad(
            f"{name} is not supported by this server; leave it out (or null)",
            param=name,
            code="unsupported_parameter",
        )


# ------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class GenParams:
    """One request, validated: what the worker needs to generate it."""

    prompt_ids: list[int]
    max_tokens: int
    warp: Warp
    seed: int
    stop: tuple[str, ...]
    prediction: list[int] | None = None  # token ids of the request's prediction
    # its n-gram index, built ahead off the engine's lock where the engine's budget allows
    # (serve.tokens.Tokens.prepare_prediction), else by the worker when the request starts
    prediction_index: PredictionIndex | None = None
    # the rewrites the instruction names ((old ids, new ids) pairs: backends.chat.
    # prediction_hints), for an index the worker builds
    prediction_hints: tuple[tuple[tuple[int, ...], ...], ...] = ()
    speculation: Speculation = Speculation()  # noqa: RUF009 - frozen; the server's defaults applied
    origins: bool = False  # stream_options.include_speculation: token origins per chunk
    penalties: Penalties | None = None  # presence/frequency/repetition penalties, logit_bias
    logprobs: int | None = None  # None: none; n: each token's and the n likeliest
    n: int = 1  # samples of the prompt, sample i seeded with seed + i
    echo: bool = False  # completions: the prompt's text before the answer's
    structure: Structure | None = None  # what the output must match (response_format, tools)
    tools: ToolFormat | None = None  # read tool calls out of the text in this format
    grammar: Grammar | None = None  # the structure's grammar, compiled by the app (off the worker)
    # tokens that end this request besides the model's own (a FIM prompt's: backends.fim)
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Structure:
    """What the output must match: JSON by a schema (None: any object); or, with `functions`
    ({"name", "parameters"} each), one tool call of them (or several, `parallel`); or a
    `regex`; or a `lark` grammar."""

    schema: dict[str, Any] | None = None
    functions: tuple[dict[str, Any], ...] = ()
    parallel: bool = True
    regex: str | None = None
    lark: str | None = None


def validate_request(
    req: ChatRequest | CompletionRequest,
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
        prediction,
        speculation=speculation,
        origins=req.include_speculation,
        penalties=_penalties(req, vocab),
        logprobs=_logprob_budget(req, n, max_tokens),
        n=n,
        echo=bool(getattr(req, "echo", False)),
        structure=structure,
        tools=tools,
    )


def _penalties(req: ChatRequest | CompletionRequest, vocab: int) -> Penalties | None:
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


def _logprob_budget(req: ChatRequest | CompletionRequest, n: int, max_tokens: int) -> int | None:
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


def _logprobs(req: ChatRequest | CompletionRequest) -> int | None:
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


def _guided(req: ChatRequest | CompletionRequest) -> Structure | None:
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
    req: ChatRequest | CompletionRequest, fmt: ToolFormat | None
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
    req: ChatRequest | CompletionRequest, ids: list[int] | None, room: int, vocab: int
) -> list[int] | None:
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
    if any(not 0 <= i < vocab for i in ids):
        raise bad("the prediction holds token ids outside the vocabulary", "prediction")
    return ids


def _warp(req: ChatRequest | CompletionRequest, vocab: int) -> Warp:
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


def _max_tokens(
    req: ChatRequest | CompletionRequest, n_prompt: int, n_ctx: int, prompt_param: str
) -> int:
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
