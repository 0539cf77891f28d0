"""A streaming client for OpenAI-compatible endpoints: how the harness measures other engines.

`specdec bench --endpoint` and `specdec gate --endpoint` send the vendored prompts to a server
(vLLM, SGLang, llama-server, specdec's own) and read the answer as a stream, so that one client
measures every engine the same way:

    ttft_s    request sent -> first chunk with generated text (prefill + first token + HTTP)
    wall_s    request sent -> the stream's end ([DONE])
    itl_s     the gaps between text chunks (a server may send several tokens per chunk)
    tokens    `usage.completion_tokens` when the server reports it (stream_options.include_usage),
              else the returned text re-tokenized with the target's tokenizer; `usage_source`
              says which

Failures are values, not crashes: `stream` raises EndpointError with a `kind` (connect, timeout,
http, bad_body, stream_error, cut) and a message naming the endpoint, and the bench records it
against that prompt and goes on. Whatever the server sends: `timeout_s` bounds a request from
its start to the end of its stream (httpx's timeouts bound each read, so a server trickling
keep-alives would never time out; a watchdog shuts the socket at the deadline) and
MAX_ERROR_BYTES an error body; the stream itself is read by stream.py, the one reader of
streamed responses (its caps on a line and a whole answer, and every malformed event a
bad_body). A request is retried (`retries` times, after 0.5 s, 1 s, ...)
only when nothing of the answer has arrived: a refused connection or a 5xx/429 before the stream
started. A stream cut mid-way is never retried: it would double the prompt's time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from specdec.core.config import WARP_FIELDS, Warp
from specdec.study.engines.stream import MAX_EVENT_BYTES, EndpointError, error_text, read_stream

#: The environment variable an endpoint's API key is read from (`--endpoint-key-env` changes it).
API_KEY_ENV = "SPECDEC_ENDPOINT_API_KEY"
APIS = ("chat", "completions")
_RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_ERROR_BYTES = 64 << 10  # an error body: only its message is quoted
MAX_COUNT = 1 << 40  # token counts the server reports: larger is not a count


def base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000'; ValueError naming the fix for a malformed URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"endpoint {url!r} is not an http(s) URL; give the server's base URL, e.g. "
            "http://127.0.0.1:8080 or http://127.0.0.1:8080/v1"
        )
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server, as the harness addresses it."""

    url: str  # base URL (normalized by base_url on construction)
    model: str | None = None  # the request's "model"; None: the first id of GET /v1/models
    api: str = "chat"  # chat: /v1/chat/completions with messages; completions: /v1/completions
    api_key: str | None = None
    label: str | None = None  # the method name in artifacts (default: the URL)
    timeout_s: float = 600.0  # one request, start to end of stream
    connect_timeout_s: float = 10.0
    retries: int = 2  # before any of the answer arrived (see the module docstring)
    extra: Mapping[str, Any] = field(default_factory=dict)  # more request fields, sent as given

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", base_url(self.url))
        if self.api not in APIS:
            raise ValueError(f"endpoint api {self.api!r}: choose from {', '.join(APIS)}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0 or self.retries < 0:
            raise ValueError("endpoint timeouts must be > 0 and retries >= 0")

    @property
    def name(self) -> str:
        return self.label or self.url

    def describe(self) -> dict[str, Any]:
        """What an artifact records of it (never the key)."""
        return {
            "url": self.url,
            "model": self.model,
            "api": self.api,
            "label": self.name,
            "extra": dict(self.extra),
        }


def api_key_from_env(env: str = API_KEY_ENV) -> str | None:
    return os.environ.get(env) or None


@dataclass(frozen=True)
class Request:
    """One generation request; `prompt` is the user turn (chat) or the whole text (completions)."""

    prompt: str
    max_tokens: int
    warp: Warp  # its fields are the request's sampling fields, by name (None: not sent)
    seed: int
    prediction: str | None = None  # OpenAI's Predicted Outputs; sent only when given
    # chat only: the conversation before this user turn ({"role", "content"} messages)
    history: tuple[Mapping[str, str], ...] = ()


@dataclass
class Reply:
    """What one streamed request returned, and when."""

    text: str
    finish_reason: str | None
    ttft_s: float | None  # None when no text came at all
    wall_s: float
    itl_s: list[float]  # gaps between text chunks
    usage: dict[str, Any] | None
    timings: dict[str, Any] | None  # llama-server's own counters (`timings`), when sent
    attempts: int
    model: str
    spec: dict[str, Any] | None = None  # specdec serve's own counters (`spec`), when sent


class Client:
    """Requests to one endpoint over one HTTP connection pool."""

    def __init__(self, endpoint: Endpoint) -> None:
        import httpx2 as httpx

        self.endpoint = endpoint
        # identity: byte caps count what the server sent, not what a gzip bomb inflates to
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        timeout = httpx.Timeout(endpoint.timeout_s, connect=endpoint.connect_timeout_s)
        # One connection per request, so that each request's watchdog knows its socket (the
        # connect is on loopback or a LAN: well under a millisecond of the time to first token).
        limits = httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.Client(
            base_url=endpoint.url, headers=headers, timeout=timeout, limits=limits
        )
        self._model = endpoint.model

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ the model id
    def model(self) -> str:
        """The model to ask for: the configured one, else the server's first (asked once)."""
        if self._model is None:
            body = self._json(self._send("GET", "/v1/models"), "GET /v1/models")
            try:
                model = body["data"][0]["id"]
                if not isinstance(model, str) or len(model) > 1000:
                    raise TypeError
                self._model = model
            except (KeyError, IndexError, TypeError):
                raise EndpointError(
                    "bad_body",
                    f"{self.endpoint.url}/v1/models lists no model; pass --endpoint-model NAME",
                ) from None
        return self._model

    # ------------------------------------------------------------------------ one request
    def body(self, req: Request) -> dict[str, Any]:
        e = self.endpoint
        body: dict[str, Any] = {
            "model": self.model(),
            "max_tokens": req.max_tokens,
            **{name: v for name in WARP_FIELDS if (v := getattr(req.warp, name)) is not None},
            "seed": req.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if e.api == "chat":
            body["messages"] = [*map(dict, req.history), {"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if req.prediction is not None:
            body["prediction"] = {"type": "content", "content": req.prediction}
        return {**body, **e.extra}

    def stream(self, req: Request) -> Reply:
        """Send `req` and read its stream to the end; EndpointError on any failure."""
        path = "/v1/chat/completions" if self.endpoint.api == "chat" else "/v1/completions"
        body = self.body(req)
        for attempt in range(1, self.endpoint.retries + 2):
            try:
                return self._stream_once(path, body, attempt)
            except EndpointError as err:
                retriable = err.kind == "connect" or err.status in _RETRY_STATUS
                if not retriable or attempt > self.endpoint.retries:
                    raise
                time.sleep(0.5 * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _stream_once(self, path: str, body: dict[str, Any], attempt: int) -> Reply:
        url = f"{self.endpoint.url}{path}"
        t0 = time.perf_counter()
        with (
            self._transport(url) as watchdog,
            self._http.stream(
                "POST", path, json=body, extensions={"trace": watchdog.trace}
            ) as resp,
        ):
            if resp.status_code != 200:
                raise _http_error(url, resp.status_code, _read_capped(resp, MAX_ERROR_BYTES))
            got = read_stream(resp.iter_raw(), url, t0=t0, until=lambda _: watchdog.expired)
        if watchdog.expired:
            raise _deadline_error(url, self.endpoint.timeout_s)
        wall = time.perf_counter() - t0
        if not got.done:
            raise EndpointError(
                "cut", f"{url}: the stream ended after {len(got.pieces)} chunks without [DONE]"
            )
        return Reply(
            text=got.text,
            finish_reason=got.finish_reason,
            ttft_s=got.ttft_s,
            wall_s=wall,
            itl_s=got.itl_s,
            usage=got.usage,
            timings=got.timings,
            attempts=attempt,
            model=str(body["model"]),
            spec=got.spec,
        )

    # ------------------------------------------------------------------------ plumbing
    def _send(self, method: str, path: str) -> Any:
        url = f"{self.endpoint.url}{path}"
        with (
            self._transport(url) as watchdog,
            self._http.stream(method, path, extensions={"trace": watchdog.trace}) as resp,
        ):
            cap = MAX_ERROR_BYTES if resp.status_code != 200 else MAX_EVENT_BYTES
            raw = _read_capped(resp, cap)
        if resp.status_code != 200:
            raise _http_error(url, resp.status_code, raw)
        return raw

    @contextlib.contextmanager
    def _transport(self, url: str) -> Iterator[_Watchdog]:
        """One request to `url` under its deadline (`_Watchdog`, cancelled on exit), with
        httpx's errors raised as EndpointErrors: timeout; connect (nothing arrived: retried);
        cut (the answer broke off: never retried); the deadline's timeout where the watchdog
        shut the socket."""
        import httpx2 as httpx

        watchdog = _Watchdog(self.endpoint.timeout_s)
        try:
            yield watchdog
        except httpx.TimeoutException as e:
            raise EndpointError(
                "timeout", f"{url}: no answer within the timeout ({type(e).__name__})"
            ) from None
        except httpx.ConnectError as e:
            raise EndpointError("connect", f"cannot connect to {url}: {e}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            if watchdog.expired:
                raise _deadline_error(url, self.endpoint.timeout_s) from None
            raise EndpointError("cut", f"{url}: the stream broke off: {e}") from None
        except httpx.HTTPError as e:
            if watchdog.expired:
                raise _deadline_error(url, self.endpoint.timeout_s) from None
            raise EndpointError("connect", f"{url}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()

    def _json(self, raw: bytes, what: str) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise EndpointError(
                "bad_body", f"{self.endpoint.url}: {what} is not JSON: {raw[:80]!r}"
            ) from None


class _Watchdog:
    """Ends a request at its deadline, whatever the server trickles: at `seconds` after it
    started, the request's socket (learned from httpcore's trace as it connects) is shut down,
    which wakes the blocked read."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def trace(self, name: str, info: dict[str, Any]) -> None:
        if name.endswith(("connect_tcp.complete", "start_tls.complete")):
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            with self._lock:
                self._sock = sock
                if self.expired:
                    self._shut()

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _deadline_error(url: str, seconds: float) -> EndpointError:
    return EndpointError("timeout", f"{url}: the answer did not end within {seconds:g} s")


def _http_error(url: str, status: int, body: bytes) -> EndpointError:
    """A non-200 answer, quoting its body's message."""
    return EndpointError(
        "http", f"{url} answered {status}: {error_text(body.decode('utf-8', 'replace'))}", status
    )


def _read_capped(resp: Any, cap: int) -> bytes:
    """The body, or its first `cap` bytes (the rest is not read)."""
    out = bytearray()
    for part in resp.iter_raw():
        out += part
        if len(out) >= cap:
            break
    return bytes(out[:cap])


def count(value: Any) -> int | None:
    """A token count a server reported, or None when it is not one (a bool, a string, a
    negative or absurd number)."""
    if type(value) is int and 0 <= value < MAX_COUNT:
        return value
    return None


# ------------------------------------------------------------------------------ RUN records
def run_record(reply: Reply, endpoint: Endpoint, tokenizer: Any) -> dict[str, Any]:
    """The bench's RUN record for one reply (the keys `artifacts.runs.aggregate_runs` reads,
    plus the endpoint's own). Drafted/accepted come from llama-server's `timings` or specdec
    serve's `spec` when the server sends them."""
    ids = tokenize(tokenizer, reply.text)
    usage_n = count((reply.usage or {}).get("completion_tokens"))
    n = usage_n if usage_n is not None else len(ids)
    ttft = reply.ttft_s if reply.ttft_s is not None else reply.wall_s
    rec: dict[str, Any] = {
        "endpoint": endpoint.name,
        "generated": n,
        "usage_source": "usage" if usage_n is not None else "retokenized",
        "wall_s": reply.wall_s,
        "ttft_s": ttft,
        # The client cannot see the prefill; the time to the first token stands for it (it also
        # holds the first decode step and the HTTP round trip).
        "prefill_s": ttft,
        "tokens_per_s": n / reply.wall_s if reply.wall_s > 0 else 0.0,
        "itl_ms_median": 1000 * _median(reply.itl_s) if reply.itl_s else None,
        "chunks": len(reply.itl_s) + (1 if reply.ttft_s is not None else 0),
        "prompt_tokens": count((reply.usage or {}).get("prompt_tokens")),
        "stop_reason": reply.finish_reason,
        "attempts": reply.attempts,
        "text": reply.text,
        "tokens": ids,
    }
    drafts = draft_counts(reply)
    if drafts is not None:
        rec["drafted"], rec["accepted"] = drafts
    t = reply.timings or {}
    if t:
        rec["server_timings"] = {
            k: v
            for k, v in itertools.islice(t.items(), 64)
            if isinstance(k, str) and (count(v) is not None or _finite(v))
        }
    return rec


def draft_counts(reply: Reply) -> tuple[int, int] | None:
    """(drafted, accepted) as the server reported them: specdec serve's `spec`, else
    llama-server's `timings`; None where it reported neither (or not as counts)."""
    for counters, keys in ((reply.spec, ("drafted", "accepted")), (reply.timings, _LLAMA_DRAFTS)):
        drafted, accepted = (count((counters or {}).get(k)) for k in keys)
        if drafted is not None and accepted is not None:
            return drafted, accepted
    return None


_LLAMA_DRAFTS = ("draft_n", "draft_n_accepted")  # llama-server's `timings` keys


def _finite(v: Any) -> bool:
    return type(v) is float and math.isfinite(v)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """Ids of an answer's text as the target would have produced them: no special tokens
    ([] without a tokenizer)."""
    if tokenizer is None:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def percentile(xs: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of what a client measured; None for no data."""
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
