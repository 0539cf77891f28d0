"""The wire format: OpenAI request models, their validation, and the response records.

Nothing here needs an app, an engine or a model: `validate_request(req, n_ctx, vocab)` turns a
parsed request into the `GenParams` the worker generates from, and raises `ApiError` (OpenAI's
error body, serve.errors) for anything it cannot serve. The rules for temperature, top-k and
top-p are `core.config.Warp`'s (one place for each check); what is added here is OpenAI's own
bound on the temperature, [0, 2], and the server's limits on stop strings.

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
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specdec.core.config import Warp
from specdec.core.drafters import PredictionIndex
from specdec.core.metrics import GenerationStats
from specdec.serve.errors import bad
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation

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
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}


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


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c or ())


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

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as backends.chat.encode_messages takes them; 400 when there are none."""
        if not self.messages:
            raise bad("messages must hold at least one message", "messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

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
    _refuse_unsupported(body)
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_context=False, include_input=False)[0]
        # loc can hold union member tags ("prompt", "str"): the field alone is OpenAI's param.
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(map(str, err["loc"])) or "request body"
        raise bad(f"{where}: {err['msg']}", param=param, code="invalid_type") from None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in UNSUPPORTED.items():
        v = body.get(name)
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


def validate_request(
    req: ChatRequest | CompletionRequest,
    n_ctx: int,
    vocab: int,
    prompt_ids: list[int] | None = None,
    prediction_ids: list[int] | None = None,
    defaults: SpecDefaults = SpecDefaults(),  # noqa: B008 - frozen
) -> GenParams:
    """Check `req` against a context window of `n_ctx` tokens and a vocabulary of `vocab`.

    `prompt_ids` is the tokenized prompt; it may be left out for a completion whose prompt is
    already token ids. `prediction_ids`: the request's prediction, tokenized (required when it
    has one). `defaults`: the server's speculation flags, which the request's `speculation`
    overrides. Raises ApiError 400 naming the offending field.
    """
    if prompt_ids is None:
        prompt = req.single_prompt() if isinstance(req, CompletionRequest) else None
        if not isinstance(prompt, list):
            raise TypeError("a text or chat prompt must be tokenized first: pass prompt_ids")
        prompt_ids = prompt
    prompt_param = "messages" if isinstance(req, ChatRequest) else "prompt"
    if req.n not in (None, 1):
        raise bad("only n=1 is supported", "n")
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
    return GenParams(
        list(prompt_ids),
        max_tokens,
        warp,
        seed,
        stops,
        prediction,
        speculation=speculation,
        origins=req.include_speculation,
    )


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
    try:
        warp = Warp(t, top_k, req.top_p)
    except ValueError as e:  # Warp's message starts with the field it rejects
        field = str(e).split()[0]
        raise bad(str(e), field if field in ("temperature", "top_k", "top_p") else None) from None
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


# ------------------------------------------------------------------------------ response records
def _counts(st: GenerationStats) -> dict[str, Any]:
    """GenerationStats' per-request counts, as responses carry them (core.metrics defines them)."""
    return {
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "rounds": st.rounds,
        "drafting_rounds": st.drafting_rounds,
        "tokens_per_round": st.tokens_per_round,
        "mean_acceptance_length": st.mean_acceptance_length,
        "drafted_per_position": list(st.drafted_per_pos),
        "accepted_per_position": list(st.accepted_per_pos),
    }


def spec_record(st: GenerationStats) -> dict[str, Any]:
    """The per-response `spec` object: GenerationStats' numbers (core.metrics defines them)."""
    return {**_counts(st), "ttft_s": st.ttft_s, "wall_s": st.wall_s}


def speculation_usage(st: GenerationStats, sp: Speculation) -> dict[str, Any]:
    """usage.speculation: the settings the request ran with and what its speculation did.

    Beyond `spec_record`'s counts: `by_source` {source: {drafted, accepted}} (the drafters'
    source names: "model", "lookup3", "lookup8+", "prediction", ...) and `k_histogram`
    {K: rounds that verified K drafted tokens} (K = 0: plain target steps; keys are strings, as
    JSON's are)."""
    by_source = {
        src: {"drafted": n, "accepted": st.accepted_by_source.get(src, 0)}
        for src, n in sorted(st.drafted_by_source.items())
    }
    return {
        **sp.settings(),
        **_counts(st),
        "by_source": by_source,
        "k_histogram": {str(k): n for k, n in sorted(st.k_histogram.items())},
    }


def usage(st: GenerationStats, sp: Speculation | None = None) -> dict[str, Any]:
    """OpenAI's usage object; the prediction counts are core.metrics' definitions (0 without
    a prediction, as OpenAI reports them). With `sp`, the extension `speculation` too."""
    out = {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.generated,
        "total_tokens": st.prompt_tokens + st.generated,
        # prompt tokens whose KV came from the previous request (the engine's prompt cache)
        "prompt_tokens_details": {"cached_tokens": st.cached_prompt_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": st.accepted_prediction_tokens,
            "rejected_prediction_tokens": st.rejected_prediction_tokens,
        },
    }
    if sp is not None:
        out["speculation"] = speculation_usage(st, sp)
    return out


@dataclass
class Reply:
    """The response objects of one request: the whole completion, or its SSE chunks."""

    model: str  # the id responses carry (the target spec the server was started with)
    chat: bool
    req: ChatRequest | CompletionRequest
    prompt_ids: list[int]
    speculation: Speculation | None = None  # usage.speculation's settings
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _usage(self, st: GenerationStats, streamed: bool) -> dict[str, Any]:
        # usage.speculation in a stream only when asked (include_speculation): the default
        # stream stays byte for byte what it was before the extension
        opted = not streamed or self.req.include_speculation
        return usage(st, self.speculation if opted else None)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def completion(
        self, text: str, ids: list[int], finish: str, st: GenerationStats
    ) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body.update(usage=self._usage(st, streamed=False), spec=spec_record(st))
        if self.req.return_token_ids:
            choice["token_ids"] = ids
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(
        self,
        text: str | None,
        ids: list[int] | tuple[int, ...],
        finish: str | None = None,
        origins: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk (text None: a chat chunk with an empty delta); `origins`: its
        round's token origins (serve.origins), for stream_options.include_speculation."""
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            c["delta"] = {} if text is None else {"content": text}
        else:
            c["text"] = text or ""
        if self.req.return_token_ids:
            c["token_ids"] = list(ids)
        if origins is not None:
            c["speculation"] = origins
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [c])

    def first_chunk(self) -> dict[str, Any]:
        """A chat stream's opening chunk: the assistant role (and the prompt ids, if asked)."""
        first = self.chunk("", [])
        first["choices"][0]["delta"]["role"] = "assistant"
        if self.req.return_token_ids:
            first["prompt_token_ids"] = self.prompt_ids
        return first

    def last_chunk(self, finish: str, st: GenerationStats) -> dict[str, Any]:
        last = self.chunk(None, [], finish)
        last.update(usage=self._usage(st, streamed=True), spec=spec_record(st))
        return last

    def usage_chunk(self, st: GenerationStats) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body.update(usage=self._usage(st, streamed=True), spec=spec_record(st))
        return body
