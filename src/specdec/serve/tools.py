"""Tool calls: how a chat template's family writes them, the grammar that forces one, and the
parser that reads them out of the generated text (streamed or whole).

The format is chosen from the model's chat template, not from its name: a template that
renders `tools` and writes calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>` is the Hermes family (Qwen2.5, Hermes, and many fine-tunes). A template without
a known format gets a 400 that says so, rather than calls nobody parses.

    tool_format(tokenizer)          the template's ToolFormat, or None
    ToolFormat.grammar(...)         Lark text (llguidance's dialect) for tool_choice "required" or
                                    a named function: one call (or several with
                                    parallel_tool_calls), each constrained by its function's
                                    JSON schema
    ToolParser                      text in, content and finished calls out, holding back what
                                    may be the start of a call
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

#: A function without `parameters` takes any JSON object (OpenAI's reading).
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


def tool_call_for_template(call: Any) -> dict[str, Any]:
    """An assistant's earlier call (serve.wire.ToolCall) as chat templates take it: arguments as
    an object (transformers' convention; Qwen's template writes them with `tojson`), kept as
    the string when it is not JSON."""
    try:
        args: Any = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }


@dataclass(frozen=True)
class ToolFormat:
    """A template family's tool-call syntax: `open` + JSON {"name", "arguments"} + `close`."""

    name: str
    open: str
    close: str
    open_token: int | None = None  # the markers' ids where each is one added token
    close_token: int | None = None

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """Lark text for one call (or one or more, `parallel`) of any of `functions` (each
        {"name", "parameters"}), its arguments constrained by the function's JSON schema."""
        bodies = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or ANY_ARGUMENTS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join(
            [
                start,
                f'call: {self._literal(self.open, self.open_token)} "\\n" body "\\n" '
                f"{self._literal(self.close, self.close_token)}",
                f"body: %json {json.dumps(schema)}",
            ]
        )

    @staticmethod
    def _literal(text: str, token: int | None) -> str:
        # an added token is matched by its id: llguidance keeps added tokens apart from text
        return f"<[{token}]>" if token is not None else json.dumps(text)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format the model's chat template writes, or None when it has none known."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    if HERMES.open in template:
        return ToolFormat(
            HERMES.name,
            HERMES.open,
            HERMES.close,
            _added_token(tokenizer, HERMES.open),
            _added_token(tokenizer, HERMES.close),
        )
    return None


def _added_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class Call:
    """A finished call: OpenAI's tool_calls entry."""

    index: int
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def record(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}

    def deltas(self) -> list[dict[str, Any]]:
        """The streamed form, as OpenAI sends it: the call's id, type and name with empty
        arguments, then its arguments (sent once the call is whole; the SDKs join the
        arguments of one index)."""
        head = {"name": self.name, "arguments": ""}
        return [
            {"index": self.index, "id": self.id, "type": "function", "function": head},
            {"index": self.index, "function": {"arguments": self.arguments}},
        ]


class ToolParser:
    """Reads calls out of generated text as it arrives. `push(text)` returns the content that
    is certainly not part of a call and the calls finished in it; text that may be the start
    of `open` is held back until it is known. A call whose body is not a JSON object with a
    string `name` stays content (the model wrote something else)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[Call] = []
        self._buf = ""
        self._in_call = False

    def push(self, text: str) -> tuple[str, list[Call]]:
        self._buf += text
        content, done = [], []
        while True:
            if not self._in_call:
                at = self._buf.find(self.fmt.open)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.fmt.open)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._in_call = True
            end = self._buf.find(self.fmt.close)
            if end < 0:
                break
            block = self._buf[: end + len(self.fmt.close)]
            self._buf = self._buf[end + len(self.fmt.close) :]
            self._in_call = False
            call = self._read(block, len(self.calls) + len(done))
            if call is None:
                content.append(block)
            else:
                done.append(call)
        text_out = "".join(content)
        if self.calls or done:  # between and after calls only whitespace separates them
            text_out = text_out if text_out.strip() else ""
        self.calls += done
        return text_out, done

    def flush(self) -> str:
        """The text held back at the end (an unfinished call stays content)."""
        rest, self._buf, self._in_call = self._buf, "", False
        return rest

    def _read(self, block: str, index: int) -> Call | None:
        body = block[len(self.fmt.open) : -len(self.fmt.close)].strip()
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return Call(index, obj["name"], text)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
