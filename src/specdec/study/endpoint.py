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
against that prompt and goes on. A request is retried (`retries` times, after 0.5 s, 1 s, ...)
only when nothing of the answer has arrived: a refused connection or a 5xx/429 before the stream
started. A stream cut mid-way is never retried: it would double the prompt's time.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: The environment variable an endpoint's API key is read from (`--endpoint-key-env` changes it).
API_KEY_ENV = "SPECDEC_ENDPOINT_API_KEY"
APIS = ("chat", "completions")
_RETRY_STATUS = (429, 500, 502, 503, 504)
_ERROR_CHARS = 300  # of a response body quoted in an error


class EndpointError(RuntimeError):
    """One request failed; `kind` is connect, timeout, http, bad_body, stream_error or cut
    (or "tool": a llama.cpp tool the bench runs per prompt, study.anchors.LlamaLookup)."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


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
    temperature: float
    seed: int
    top_p: float | None = None
    top_k: int | None = None
    prediction: str | None = None  # OpenAI's Predicted Outputs; sent only when given


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
        headers = {"Accept": "text/event-stream"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        timeout = httpx.Timeout(endpoint.timeout_s, connect=endpoint.connect_timeout_s)
        self._http = httpx.Client(base_url=endpoint.url, headers=headers, timeout=timeout)
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
                self._model = str(body["data"][0]["id"])
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
            "temperature": req.temperature,
            "seed": req.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if e.api == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if req.top_p is not None:
            body["top_p"] = req.top_p
        if req.top_k is not None:
            body["top_k"] = req.top_k
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
        import httpx2 as httpx

        url = f"{self.endpoint.url}{path}"
        t0 = time.perf_counter()
        text: list[str] = []
        stamps: list[float] = []
        finish = usage = timings = spec = None
        done = False
        try:
            with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    raw = resp.read().decode("utf-8", "replace")
                    raise EndpointError(
                        "http",
                        f"{url} answered {resp.status_code}: {_error_text(raw)}",
                        resp.status_code,
                    )
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue  # SSE comments, event names, keep-alives
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = _chunk(data, url)
                    piece, reason = _delta(chunk)
                    if piece:
                        text.append(piece)
                        stamps.append(time.perf_counter())
                    finish = reason or finish
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    spec = chunk.get("spec") or spec
        except httpx.TimeoutException as e:
            raise EndpointError(
                "timeout", f"{url}: no answer within the timeout ({type(e).__name__})"
            ) from None
        except httpx.ConnectError as e:
            raise EndpointError("connect", f"cannot connect to {url}: {e}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise EndpointError("cut", f"{url}: the stream broke off: {e}") from None
        except httpx.HTTPError as e:
            raise EndpointError("connect", f"{url}: {type(e).__name__}: {e}") from None
        wall = time.perf_counter() - t0
        if not done:
            raise EndpointError(
                "cut", f"{url}: the stream ended after {len(text)} chunks without [DONE]"
            )
        return Reply(
            text="".join(text),
            finish_reason=finish,
            ttft_s=stamps[0] - t0 if stamps else None,
            wall_s=wall,
            itl_s=[b - a for a, b in itertools.pairwise(stamps)],
            usage=usage if isinstance(usage, dict) else None,
            timings=timings if isinstance(timings, dict) else None,
            attempts=attempt,
            model=str(body["model"]),
            spec=spec if isinstance(spec, dict) else None,
        )

    # ------------------------------------------------------------------------ plumbing
    def _send(self, method: str, path: str) -> Any:
        import httpx2 as httpx

        url = f"{self.endpoint.url}{path}"
        try:
            resp = self._http.request(method, path)
        except httpx.TimeoutException:
            raise EndpointError("timeout", f"{url}: no answer within the timeout") from None
        except httpx.HTTPError as e:
            raise EndpointError("connect", f"cannot connect to {url}: {e}") from None
        if resp.status_code != 200:
            raise EndpointError(
                "http",
                f"{url} answered {resp.status_code}: {_error_text(resp.text)}",
                resp.status_code,
            )
        return resp

    def _json(self, resp: Any, what: str) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise EndpointError(
                "bad_body", f"{self.endpoint.url}: {what} is not JSON: {resp.text[:80]!r}"
            ) from None


def _chunk(data: str, url: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise EndpointError(
            "bad_body", f"{url}: a stream event is not JSON: {data[:80]!r}"
        ) from None
    if not isinstance(chunk, dict):
        raise EndpointError("bad_body", f"{url}: a stream event is not an object: {data[:80]!r}")
    if "error" in chunk:
        raise EndpointError("stream_error", f"{url}: error in the stream: {_error_text(data)}")
    return chunk


def _delta(chunk: Mapping[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of one chat or completions chunk."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", None  # the usage chunk
    c = choices[0]
    piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
    return (piece or ""), c.get("finish_reason")


def _error_text(raw: str) -> str:
    """The server's error message, when the body is an OpenAI error object; else its start."""
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:_ERROR_CHARS]
    except (ValueError, AttributeError):
        pass
    return raw.strip()[:_ERROR_CHARS] or "(empty body)"


# ------------------------------------------------------------------------------ RUN records
def run_record(reply: Reply, endpoint: Endpoint, tokenizer: Any) -> dict[str, Any]:
    """The bench's RUN record for one reply (the keys `bench.aggregate_runs` reads, plus the
    endpoint's own). Drafted/accepted come from llama-server's `timings` or specdec serve's
    `spec` when the server sends them."""
    ids = tokenize(tokenizer, reply.text)
    usage_n = (reply.usage or {}).get("completion_tokens")
    n = int(usage_n) if isinstance(usage_n, int) else len(ids)
    ttft = reply.ttft_s if reply.ttft_s is not None else reply.wall_s
    rec: dict[str, Any] = {
        "endpoint": endpoint.name,
        "generated": n,
        "usage_source": "usage" if isinstance(usage_n, int) else "retokenized",
        "wall_s": reply.wall_s,
        "ttft_s": ttft,
        # The client cannot see the prefill; the time to the first token stands for it (it also
        # holds the first decode step and the HTTP round trip).
        "prefill_s": ttft,
        "tokens_per_s": n / reply.wall_s if reply.wall_s > 0 else 0.0,
        "itl_ms_median": 1000 * _median(reply.itl_s) if reply.itl_s else None,
        "chunks": len(reply.itl_s) + (1 if reply.ttft_s is not None else 0),
        "prompt_tokens": (reply.usage or {}).get("prompt_tokens"),
        "stop_reason": reply.finish_reason,
        "attempts": reply.attempts,
        "text": reply.text,
        "tokens": ids,
    }
    t = reply.timings or {}
    if isinstance(t.get("draft_n"), int) and isinstance(t.get("draft_n_accepted"), int):
        rec["drafted"], rec["accepted"] = t["draft_n"], t["draft_n_accepted"]
    sp = reply.spec or {}
    if isinstance(sp.get("drafted"), int) and isinstance(sp.get("accepted"), int):
        rec["drafted"], rec["accepted"] = sp["drafted"], sp["accepted"]  # specdec serve
    if t:
        rec["server_timings"] = {k: v for k, v in t.items() if isinstance(v, (int, float))}
    return rec


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """Ids of an answer's text as the target would have produced them: no special tokens
    ([] without a tokenizer)."""
    if tokenizer is None:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
