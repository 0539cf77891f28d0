"""The wire format: the request bodies OpenAI's clients send, and how a body is read into one.

Nothing here needs an app, an engine or a model. A body is read in three steps, each a 400
(OpenAI's error body, serve.errors) naming what is wrong: `parse_json` (the bytes as bounded
JSON), `check_shape` (the long lists' item types, before pydantic sees them) and
`parse_request` (the `ChatRequest` or `CompletionRequest`, strictly typed; fields that would
change the output and are not implemented are refused). What a parsed request asks is checked
against the models afterwards, once its prompt is tokenized (serve.validation).

Extensions (docs/api-extensions.md has the user's view, with the same definitions):
    speculation           {"drafter", "k", "k_max"} per request, the server's start-up flags as
                          defaults (serve.speculation)
    usage.speculation     what the request's speculation did (serve.answers'
                          `speculation_usage`, core.metrics' definitions)
    stream_options.include_speculation   each streamed chunk carries its round's token origins
                          (serve.origins)
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specdec.serve.errors import bad
from specdec.serve.tools import tool_call_for_template

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


class _RequestBody(_Strict):
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


class ChatRequest(_RequestBody):
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


class CompletionRequest(_RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    # the text after the gap: the prompt is then the text before it (fill-in-the-middle,
    # OpenAI's legacy field and Ollama's; serve.models builds the model's FIM prompt)
    suffix: str | None = None
    tools: Any = None  # a chat field: refused rather than ignored (serve.validation)

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


#: A request body of either route, parsed (the engine's record of a request is serve.requests')
RequestBody = ChatRequest | CompletionRequest


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
