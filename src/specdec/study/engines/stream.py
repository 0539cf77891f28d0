"""One reader of streamed OpenAI-style responses: the SSE `data:` lines of chat and completions
chunks, folded into what the stream said (its text, finish reason, `usage`, specdec serve's
`spec` object, llama-server's `timings`, the token ids asked for with `return_token_ids`) and
when (the first chunk with text, the gaps between text chunks).

Every client that reads a server's stream reads it here: the harness's endpoint client
(endpoint.Client, over httpx), the load-test scripts (scripts/loadtest_common.py and
scripts/loadtest_parallel.py, over http.client) and the server tests (tests/serverkit.py). The
reader takes the stream as any iterable of bytes, so the transport, its timeouts and how a
client goes away stay the caller's. It bounds what it holds (MAX_EVENT_BYTES a line,
MAX_STREAM_BYTES a whole stream) and raises EndpointError "bad_body" for a malformed event
(not JSON, nested too deeply, fields of the wrong type) and "stream_error" for an error event.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

MAX_EVENT_BYTES = 1 << 20  # one SSE line: a chunk carries a few tokens' text
MAX_STREAM_BYTES = 64 << 20  # a whole streamed answer
_ERROR_CHARS = 300  # of a response body quoted in an error


class EndpointError(RuntimeError):
    """One request failed; `kind` is connect, timeout, http, bad_body, stream_error or cut
    (or "tool": a llama.cpp tool the bench runs per prompt, study.engines.anchors.LlamaLookup)."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class StreamReader:
    """What one stream said so far, fed a line at a time (`line`), or a whole stream (`read`).

    `t0` is when the request was sent: `ttft_s` and the gaps count from it (now, by default).
    """

    def __init__(self, url: str, t0: float | None = None, *, keep: bool = False) -> None:
        self.url = url  # named in errors
        self.t0 = time.perf_counter() if t0 is None else t0
        # every data event, parsed, in order, where the caller asked (`keep`): a test reads the
        # per-event extensions (a chunk's `speculation`); a load run would only hold memory
        self.chunks: list[dict[str, Any]] | None = [] if keep else None
        self.pieces: list[str] = []  # the text chunks' text, in order
        self.stamps: list[float] = []  # when each arrived
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama-server's own counters
        self.spec: dict[str, Any] | None = None  # specdec serve's own counters
        self.prompt_token_ids: list[int] | None = None  # with return_token_ids
        self.token_ids: list[int] = []
        self.events = 0  # data events read, [DONE] not counted
        self.done = False  # [DONE] was read

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft_s(self) -> float | None:
        """Request sent -> the first chunk with text; None when no text came."""
        return self.stamps[0] - self.t0 if self.stamps else None

    @property
    def itl_s(self) -> list[float]:
        """The gaps between text chunks (a server may send several tokens per chunk)."""
        return [b - a for a, b in itertools.pairwise(self.stamps)]

    def read(
        self, parts: Iterable[bytes], until: Callable[[StreamReader], bool] | None = None
    ) -> StreamReader:
        """Read `parts` up to [DONE], their end, or the first line after which `until(self)`
        holds (nothing past that line is pulled from `parts`)."""
        for line in sse_lines(parts, self.url):
            self.line(line)
            if self.done or (until is not None and until(self)):
                break
        return self

    def line(self, line: str) -> None:
        """One line of the stream: a data event is folded in; SSE comments, event names and
        keep-alives are passed over."""
        if not line.startswith("data:"):
            return
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = parse_event(data, self.url)
        self.events += 1
        if self.chunks is not None:
            self.chunks.append(chunk)
        piece, reason = delta(chunk, self.url)
        if piece:
            self.pieces.append(piece)
            self.stamps.append(time.perf_counter())
        self.finish_reason = reason or self.finish_reason
        self.usage = _dict_or(chunk.get("usage"), self.usage)
        self.timings = _dict_or(chunk.get("timings"), self.timings)
        self.spec = _dict_or(chunk.get("spec"), self.spec)
        prompt_ids = chunk.get("prompt_token_ids")
        if isinstance(prompt_ids, list):
            self.prompt_token_ids = prompt_ids
        choices = chunk.get("choices")
        ids = choices[0].get("token_ids") if choices else None
        if isinstance(ids, list):
            self.token_ids += ids


def read_stream(
    parts: Iterable[bytes],
    url: str,
    *,
    t0: float | None = None,
    until: Callable[[StreamReader], bool] | None = None,
    keep: bool = False,
) -> StreamReader:
    """A stream read (StreamReader.read); `t0` when its request was sent (default: now);
    `keep`: every event kept in `chunks`."""
    return StreamReader(url, t0, keep=keep).read(parts, until)


def sse_lines(parts: Iterable[bytes], url: str) -> Iterator[str]:
    """The stream's lines (CR, LF or CRLF ends), each at most MAX_EVENT_BYTES, at most
    MAX_STREAM_BYTES in all; EndpointError bad_body past either."""
    buf = bytearray()
    total = 0
    for part in parts:
        total += len(part)
        if total > MAX_STREAM_BYTES:
            raise EndpointError("bad_body", f"{url}: the stream exceeds {MAX_STREAM_BYTES} bytes")
        buf += part
        while True:
            cut = min((i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            line = bytes(buf[:cut])
            end = cut + 2 if buf[cut : cut + 2] == b"\r\n" else cut + 1
            del buf[:end]
            yield line.decode("utf-8", "replace")
        if len(buf) > MAX_EVENT_BYTES:
            raise EndpointError("bad_body", f"{url}: a stream line exceeds {MAX_EVENT_BYTES} bytes")
    if buf:
        yield bytes(buf).decode("utf-8", "replace")


def parse_event(data: str, url: str) -> dict[str, Any]:
    """One data event's JSON object; bad_body if it is not one, stream_error for an error."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):
        raise EndpointError(
            "bad_body", f"{url}: a stream event is not JSON: {data[:80]!r}"
        ) from None
    if not isinstance(chunk, dict):
        raise EndpointError("bad_body", f"{url}: a stream event is not an object: {data[:80]!r}")
    if "error" in chunk:
        raise EndpointError("stream_error", f"{url}: error in the stream: {error_text(data)}")
    return chunk


def delta(chunk: Mapping[str, Any], url: str) -> tuple[str, str | None]:
    """(text, finish_reason) of one chat or completions chunk; bad_body for wrong types."""
    choices = chunk.get("choices")
    if choices is None or choices == []:
        return "", None  # the usage chunk
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise EndpointError("bad_body", f"{url}: a stream event's choices is not a list of objects")
    c = choices[0]
    if "delta" in c:
        d = c["delta"]
        if d is not None and not isinstance(d, dict):
            raise EndpointError("bad_body", f"{url}: a stream event's delta is not an object")
        piece = (d or {}).get("content")
    else:
        piece = c.get("text")
    reason = c.get("finish_reason")
    if piece is not None and not isinstance(piece, str):
        raise EndpointError("bad_body", f"{url}: a stream event's text is not a string")
    if reason is not None and not isinstance(reason, str):
        raise EndpointError("bad_body", f"{url}: a stream event's finish_reason is not a string")
    return (piece or ""), reason


def _dict_or(value: Any, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """`value` when it is a non-empty object, else what was there (servers omit or null it)."""
    return value if isinstance(value, dict) and value else previous


def error_text(raw: str) -> str:
    """The server's error message, when the body is an OpenAI error object; else its start."""
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(msg, (str, int, float)) and msg:
            return str(msg)[:_ERROR_CHARS]
    except (ValueError, AttributeError, RecursionError):
        pass
    return raw.strip()[:_ERROR_CHARS] or "(empty body)"
