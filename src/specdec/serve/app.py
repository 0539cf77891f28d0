"""`specdec serve`: an OpenAI-compatible HTTP server over one speculative-decoding engine.

Endpoints
    POST /v1/chat/completions   messages -> the model's chat template -> token ids
    POST /v1/completions        prompt: a string (tokenized raw), or a list of token ids (the
                                only way to serve a tokenizer-free mock model)
    GET  /v1/models             the one model; its id is the target spec string
    GET  /health                {"status": "ok", ...}
    GET  /metrics               Prometheus text format, each metric defined in its HELP line

Request fields honoured by both POST endpoints: model, max_tokens (chat also accepts
max_completion_tokens), temperature (default 1, 0 = greedy), top_p, top_k (extension), stop (a
string or a list), seed, stream, stream_options.include_usage, n (must be 1) and
return_token_ids (extension, after vLLM: each choice also carries its generated token ids, so a
client can check exactness token for token). Unknown fields are ignored. Responses carry `usage`
and a `spec` object, GenerationStats' numbers for that request (decode.py has the definitions):

    drafted, accepted       draft tokens sent to verification; of those, kept by the accept rule
    acceptance_rate         accepted / drafted
    tokens_per_round        committed tokens per target pass (mean acceptance length, bonus
                            token included)
    rounds, drafted_per_position, accepted_per_position, ttft_s, wall_s

`stop` strings: the text is cut at the first occurrence of any of them (the stop string is not
returned) and generation ends. Streaming holds back text that may be the start of a stop string,
or an incomplete UTF-8 character, until it is resolved, so the streamed deltas concatenate to
the non-streamed text. `usage.completion_tokens` counts every token the engine committed, which
can include a few past a stop string: one round commits up to K+1 tokens at once.

Concurrency. The engine is not thread-safe and its caches hold one sequence, so one worker
thread owns the models and generates one request at a time. Requests wait in a bounded FIFO
(`--max-queue` waiting requests, not counting the one being generated; HTTP 429 with Retry-After
beyond that). The worker hands each round's text to the request's event loop through an
asyncio.Queue (`loop.call_soon_threadsafe`). Between rounds it checks whether the client went
away or the request's deadline passed, and if so closes the SpecStream: the engine is free for
the next request within one round. Cache safety: `decode.stream` resets the target's and the
draft's caches at the start of every call, so nothing of one request's state reaches the next;
after an engine exception both models are reset again.

Errors: every error body is OpenAI's {"error": {"message", "type", "param", "code"}}, and the
server keeps serving.
    400 invalid_request_error   malformed JSON, wrong types, temperature < 0, top_p outside
                                (0, 1], max_tokens beyond the context window, n != 1, ...
    401 invalid_api_key         --api-key set and the Bearer token is missing or wrong
    404 model_not_found         (and unknown routes: not_found)
    413 request_too_large       body over --max-body-bytes
    429 queue_full              with Retry-After (seconds)
    500 server_error            the engine raised
    504 timeout                 --request-timeout passed, counted from arrival (queue included)
A streaming request that fails after its response started gets the error object as its last
SSE event (the openai client raises it as an APIError). A non-streaming request whose client
went away is counted as 499 (nginx's "client closed request") in specdec_requests_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import math
import queue
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from specdec.backends import chat as prompting
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import SpecStream, stream
from specdec.core.metrics import GenerationStats
from specdec.core.model import SpecModel

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 512  # when a request names none (capped by the room left in the context)
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 32k-token context is ~130 KB of text
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_QUEUE = 64
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts
RETRY_AFTER_RANGE_S = (1, 60)
_SERVICE_EMA = 0.8  # smoothing of the mean generation time that Retry-After is estimated from


@dataclass(frozen=True)
class ServeConfig:
    """`specdec serve` flags, one to one."""

    target: str
    draft: str | None = None
    drafter: str | None = None  # None: the engine's default ("model" when a draft is given)
    k: int | str | None = None  # None: the engine's default
    k_max: int | None = None
    p_min: float | None = None
    device: str | None = None
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S

    def spec_config(self) -> SpecConfig:
        """The speculation settings for the engine: SpecConfig's defaults where none was set."""
        opts = {"drafter": self.drafter, "k": self.k, "k_max": self.k_max, "p_min": self.p_min}
        return SpecConfig(**{key: v for key, v in opts.items() if v is not None})


# ------------------------------------------------------------------------------ errors, schemas
class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class _Strict(BaseModel):
    # strict: "0.5" is not a float and true is not an int; wrong types are 400s, not coerced.
    # extra fields are ignored, as OpenAI clients send fields this server does not use.
    model_config = ConfigDict(strict=True, extra="ignore")


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None


class _StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    return_token_ids: bool = False


class ChatRequest(_Request):
    messages: list[_Message]
    max_completion_tokens: int | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]


def _text_of(content: str | list[_TextPart] | None) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content or ())


def _parse(kind: type[_Request], body: Any) -> Any:
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # loc can hold union member tags ("prompt", "str"): the field alone is OpenAI's param.
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(map(str, err["loc"])) or "request body"
        raise _bad(f"{where}: {err['msg']}", param=param, code="invalid_type") from None


@dataclass(frozen=True)
class GenParams:
    """One request, validated: what the worker needs to generate it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int
    stop: tuple[str, ...]


# ------------------------------------------------------------------------------ text assembly
class TextAssembler:
    """Committed token chunks in, text deltas out, with `stop` strings honoured.

    The whole output is re-decoded per chunk (tokenizers merge pieces across token boundaries,
    so decoding chunk by chunk is not the same text). Text that could still become a stop string,
    or that ends in an incomplete UTF-8 character (U+FFFD), is held back until resolved.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""  # the decoded output, cut at a stop string once one is found
        self.sent = 0  # characters of `text` handed out so far
        self.stopped = False  # a stop string was found

    def push(self, ids: list[int]) -> str:
        self.tokens += ids
        text = self.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[: max(cut, self.sent)]  # what was sent cannot be taken back
            return self._take(len(self.text))
        self.text = text
        safe = len(text.rstrip("\ufffd"))
        safe -= _stop_prefix_len(text[:safe], self.stop)
        return self._take(max(safe, self.sent))

    def flush(self) -> str:
        """Everything not yet handed out: call once the generation has ended."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


# ------------------------------------------------------------------------------ metrics
class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # cumulative, Prometheus-style
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)

# name -> (type, HELP). The HELP lines are the definitions (after vLLM's spec-decode metrics).
_METRICS: dict[str, tuple[str, str]] = {
    "specdec_requests_total": (
        "counter",
        "HTTP requests to /v1 endpoints answered, by endpoint and status code "
        "(429 rejections and errors included)",
    ),
    "specdec_generations_total": (
        "counter",
        "Requests that reached the engine, by outcome: finished (stop or length), "
        "cancelled (client went away), timeout, error",
    ),
    "specdec_queue_depth": (
        "gauge",
        "Requests waiting for the engine (not counting the one being generated)",
    ),
    "specdec_queue_capacity": ("gauge", "--max-queue: waiting requests beyond it get HTTP 429"),
    "specdec_busy": ("gauge", "1 while the engine is generating, else 0"),
    "specdec_prompt_tokens_total": ("counter", "Prompt tokens of generations started"),
    "specdec_generated_tokens_total": (
        "counter",
        "Tokens committed (accepted + one recovered or bonus token per round)",
    ),
    "specdec_rounds_total": (
        "counter",
        "Target forward passes after the prefill (one per round; a plain target "
        "step is a round with no draft)",
    ),
    "specdec_drafts_total": ("counter", "Rounds that drafted at least one token"),
    "specdec_draft_tokens_total": ("counter", "Draft tokens proposed and sent to verification"),
    "specdec_accepted_tokens_total": ("counter", "Draft tokens kept by the accept rule"),
    "specdec_drafted_per_position_total": (
        "counter",
        "Rounds that drafted a token at this position (1 = first draft token)",
    ),
    "specdec_accepted_per_position_total": (
        "counter",
        "Rounds whose draft token at this position was accepted; divided by "
        "specdec_drafted_per_position_total it is the acceptance rate by position",
    ),
    "specdec_acceptance_length": (
        "histogram",
        "Tokens committed by one round: accepted drafts plus the recovered or "
        "bonus token (so >= 1; the mean includes the bonus token); a round cut short by a stop "
        "token or the max_tokens budget counts what it committed",
    ),
    "specdec_time_to_first_token_seconds": (
        "histogram",
        "Arrival of the request to its first committed token: queue wait, prefill "
        "and the first draft + verify round",
    ),
    "specdec_inter_token_latency_seconds": (
        "histogram",
        "Time between consecutive rounds' committed tokens of one request; a round "
        "that commits several tokens is observed once",
    ),
    "specdec_queue_wait_seconds": ("histogram", "Arrival of the request to the engine starting it"),
    "specdec_request_latency_seconds": (
        "histogram",
        "Arrival of the request to its last committed token (finished ones)",
    ),
}


class Metrics:
    """Counters and histograms of the server; updated from the worker and the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._hists = {
            "specdec_acceptance_length": _Histogram(_LENGTH_BUCKETS),
            "specdec_time_to_first_token_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_inter_token_latency_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_queue_wait_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_request_latency_seconds": _Histogram(_LATENCY_BUCKETS),
        }

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        with self._lock:
            series = self._counters.setdefault(name, {})
            key = tuple(sorted(labels.items()))
            series[key] = series.get(key, 0) + value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._hists[name].observe(value)

    def record_generation(
        self,
        stats: GenerationStats,
        outcome: str,
        arrived: float,
        started: float,
        round_times: list[float],
        round_lens: list[int],
    ) -> None:
        self.inc("specdec_generations_total", outcome=outcome)
        self.inc("specdec_prompt_tokens_total", stats.prompt_tokens)
        self.inc("specdec_generated_tokens_total", stats.generated)
        self.inc("specdec_rounds_total", stats.rounds)
        self.inc("specdec_drafts_total", stats.drafted_per_pos[0] if stats.drafted_per_pos else 0)
        self.inc("specdec_draft_tokens_total", stats.drafted)
        self.inc("specdec_accepted_tokens_total", stats.accepted)
        for i, (d, a) in enumerate(zip(stats.drafted_per_pos, stats.accepted_per_pos, strict=True)):
            self.inc("specdec_drafted_per_position_total", d, position=str(i + 1))
            self.inc("specdec_accepted_per_position_total", a, position=str(i + 1))
        self.observe("specdec_queue_wait_seconds", started - arrived)
        for n in round_lens:
            self.observe("specdec_acceptance_length", n)
        if round_times:
            self.observe("specdec_time_to_first_token_seconds", round_times[0] - arrived)
            if outcome == "finished":
                self.observe("specdec_request_latency_seconds", round_times[-1] - arrived)
        for a, b in itertools.pairwise(round_times):
            self.observe("specdec_inter_token_latency_seconds", b - a)

    def render(self, gauges: dict[str, float]) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_) in _METRICS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if kind == "gauge":
                    lines.append(f"{name} {_num(gauges.get(name, 0))}")
                elif kind == "counter":
                    series = self._counters.get(name) or ({(): 0} if "_per_" not in name else {})
                    for key, v in sorted(series.items()):
                        lines.append(f"{name}{_labels(key)} {_num(v)}")
                else:
                    h = self._hists[name]
                    for b, c in zip(h.buckets, h.counts, strict=True):
                        lines.append(f'{name}_bucket{{le="{b}"}} {c}')
                    lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                    lines += [f"{name}_sum {_num(h.sum)}", f"{name}_count {h.count}"]
        return "\n".join(lines) + "\n"


def _labels(key: tuple[tuple[str, str], ...]) -> str:
    if not key:
        return ""
    esc = (v.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n") for _, v in key)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(key, esc, strict=True)) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


# ------------------------------------------------------------------------------ the engine
@dataclass
class _Job:
    params: GenParams
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    deadline: float  # time.perf_counter() after which the request has timed out
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # worker -> event loop
    cancel: threading.Event = field(default_factory=threading.Event)  # event loop -> worker

    def emit(self, *event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _cancelled_error() -> ApiError:
    # 499: nginx's "client closed request"; nobody reads it, but it ends the request's handler.
    return ApiError(499, "the client went away", type="cancelled", code="client_closed")


def _timeout_error() -> ApiError:
    return ApiError(
        504, "the request timed out (--request-timeout)", type="timeout", code="timeout"
    )


class Engine:
    """One target (and draft), one worker thread that owns them, a bounded FIFO of jobs.

    Events a job receives, in order: ("start",), then ("delta", text, token_ids) per round,
    then ("done", finish_reason, stats), or ("error", ApiError) at any point.
    `lock` is held for the whole of each generation: code outside the worker (tests, a warm-up)
    takes it to use the models directly.
    """

    def __init__(
        self,
        target: SpecModel,
        draft: SpecModel | None = None,
        *,
        model_id: str | None = None,
        spec: SpecConfig = SpecConfig(),  # noqa: B008 - frozen
        max_queue: int = DEFAULT_MAX_QUEUE,
        metrics: Metrics | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.target = target
        self.draft = draft
        self.model_id = model_id or target.name
        self.spec = spec
        self.tokenizer = target.tokenizer or getattr(draft, "tokenizer", None)
        self.stop_ids = prompting.stop_ids(self.tokenizer)
        # Every model the prompt must fit, for max_tokens validation.
        self.n_ctx = min(m.n_ctx for m in (target, draft) if m is not None)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.lock = threading.Lock()
        # HF fast tokenizers are not safe to call from two threads at once ("Already borrowed"):
        # the event loop encodes prompts while the worker decodes outputs.
        self.tokenizer_lock = threading.Lock()
        self.busy = False
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._service_s = 1.0  # EMA of generation wall time, for Retry-After
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # -------------------------------------------------------------------------- lifecycle
    def warm_up(self) -> None:
        """One 2-token generation: surfaces a bad model pair or option at startup rather than
        in the first request, and pays one-time costs (k=auto calibration) there too."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        prompt = [bos if bos is not None else 0]
        with self.lock:
            s = stream(
                self.target,
                prompt,
                draft=self.draft,
                spec=self.spec,
                warp=Warp(0.0),
                max_new_tokens=2,
                seed=0,
            )
            for _ in s:
                pass

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail waiting jobs with 503, let the running one finish its round, join the worker."""
        self._stopping = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(
                    "error",
                    ApiError(
                        503,
                        "the server is shutting down",
                        type="server_error",
                        code="shutting_down",
                    ),
                )
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    # -------------------------------------------------------------------------- admission
    def submit(self, job: _Job) -> None:
        """Queue `job` (FIFO); ApiError 429 when the queue is full."""
        if self._stopping:
            raise ApiError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            )
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            lo, hi = RETRY_AFTER_RANGE_S
            retry = min(hi, max(lo, math.ceil(self._service_s)))
            raise ApiError(
                429,
                f"the request queue is full ({self.max_queue} waiting); retry after {retry} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            ) from None

    # -------------------------------------------------------------------------- text helpers
    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return prompting.decode(self.tokenizer, ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template's rendering of `messages` (backends.chat.encode_messages)."""
        with self.tokenizer_lock:
            try:
                return prompting.encode_messages(self.tokenizer, messages)
            except prompting.NoChatTemplateError as e:
                raise _bad(
                    f"{self.model_id} has no chat template (a mock or base model); use "
                    "/v1/completions",
                    param="messages",
                    code="no_chat_template",
                ) from e
            except ValueError as e:
                raise _bad(str(e), "messages") from e

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _bad(f"{self.model_id} has no tokenizer; pass the prompt as token ids", "prompt")
        with self.tokenizer_lock:
            return prompting.encode(self.tokenizer, text, chat=False)

    # -------------------------------------------------------------------------- the worker
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._serve(job)
            except Exception:  # _serve reports its own errors; this is a last resort
                log.exception("engine worker: unexpected error")

    def _serve(self, job: _Job) -> None:
        if job.cancel.is_set():  # the client left while queued
            self.metrics.inc("specdec_generations_total", outcome="cancelled")
            job.emit("error", _cancelled_error())
            return
        if time.perf_counter() > job.deadline:
            self.metrics.inc("specdec_generations_total", outcome="timeout")
            job.emit("error", _timeout_error())
            return
        p = job.params
        with self.lock:
            started = time.perf_counter()
            try:  # stream() checks every argument before any model work
                s = stream(
                    self.target,
                    p.prompt_ids,
                    draft=self.draft,
                    spec=self.spec,
                    warp=Warp(p.temperature, p.top_k, p.top_p),
                    max_new_tokens=p.max_tokens,
                    seed=p.seed,
                    stop_ids=self.stop_ids,
                )
            except ValueError as e:
                self.metrics.inc("specdec_generations_total", outcome="error")
                job.emit("error", _bad(str(e)))
                return
            job.emit("start")
            round_times: list[float] = []  # when each round's tokens were committed
            round_lens: list[int] = []  # how many tokens each round committed
            self.busy = True
            try:
                outcome = self._rounds(job, s, round_times, round_lens)
            except Exception as e:
                outcome = "error"
                log.exception("generation failed")
                err = f"generation failed: {type(e).__name__}: {e}"
                job.emit("error", ApiError(500, err, type="server_error", code="engine_error"))
                # Leave nothing half-written for the next request (stream() resets them too).
                for m in (self.target, self.draft):
                    if m is not None:
                        with contextlib.suppress(Exception):
                            m.reset()
            finally:
                s.close()  # a no-op once exhausted; else stops the loop at its yield
                self.busy = False
            wall = time.perf_counter() - started
            self._service_s = _SERVICE_EMA * self._service_s + (1 - _SERVICE_EMA) * wall
            self.metrics.record_generation(
                s.stats, outcome, job.arrived, started, round_times, round_lens
            )

    def _rounds(
        self, job: _Job, s: SpecStream, round_times: list[float], round_lens: list[int]
    ) -> str:
        """Hand each round's text to the job until the end; return the outcome for metrics."""
        text = TextAssembler(self.decode, job.params.stop)
        for ids in s:
            round_times.append(time.perf_counter())
            round_lens.append(len(ids))
            job.emit("delta", text.push(ids), ids)
            if text.stopped:
                break
            # The deadline first: the event loop also cancels a job it has timed out.
            if time.perf_counter() > job.deadline:
                job.emit("error", _timeout_error())
                return "timeout"
            if job.cancel.is_set():
                job.emit("error", _cancelled_error())
                return "cancelled"
        rest = text.flush()
        if rest:
            job.emit("delta", rest, [])
        # A stop string, else decode.stream's reason: "stop" (a stop id) or "length".
        finish = "stop" if text.stopped or s.result is None else s.result.stop_reason
        job.emit("done", finish, s.stats)
        return "finished"


# ------------------------------------------------------------------------------ the app
def _spec_record(st: GenerationStats) -> dict[str, Any]:
    return {
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "tokens_per_round": st.tokens_per_round,
        "rounds": st.rounds,
        "drafted_per_position": list(st.drafted_per_pos),
        "accepted_per_position": list(st.accepted_per_pos),
        "ttft_s": st.ttft_s,
        "wall_s": st.wall_s,
    }


def _usage(st: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.generated,
        "total_tokens": st.prompt_tokens + st.generated,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body of {declared} bytes exceeds the limit of {limit} bytes",
            code="request_too_large",
        )
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(
                413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def _watch_disconnect(request: Request, job: _Job) -> None:
    """Set job.cancel when the client goes away. After the body is read, the next ASGI message
    on this connection is `http.disconnect`, so this waits on an event, it does not poll."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app over a started-or-not `engine` (the lifespan starts and stops it)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        yield
        engine.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None)
    model_ids = {cfg.target, engine.target.name, engine.target.name.split(":", 1)[-1]}
    metrics = engine.metrics

    def error_response(e: ApiError, path: str) -> JSONResponse:
        if path.startswith("/v1/"):
            metrics.inc("specdec_requests_total", endpoint=path, code=str(e.status))
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return error_response(ApiError(e.status_code, str(e.detail), code=code), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
        return error_response(err, request.url.path)

    def check_auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), cfg.api_key):
            raise ApiError(
                401,
                "missing or incorrect API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(model: str) -> None:
        if model not in model_ids:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {cfg.target!r}",
                param="model",
                code="model_not_found",
            )

    def params_of(
        req: _Request, prompt_ids: list[int], prompt_param: str, max_tokens: int | None
    ) -> GenParams:
        if req.n not in (None, 1):
            raise _bad("only n=1 is supported", "n")
        t = 1.0 if req.temperature is None else req.temperature
        if not math.isfinite(t) or t < 0:
            raise _bad(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t}", "temperature"
            )
        top_p = req.top_p
        if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if req.top_k is not None and req.top_k < 1:
            raise _bad(f"top_k must be >= 1 (or absent), got {req.top_k}", "top_k")
        if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
            raise _bad(f"seed must be in [-2**63, 2**64), got {req.seed}", "seed")
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if any(not s for s in stops):
            raise _bad("stop strings must be non-empty", "stop")
        if not prompt_ids:
            raise _bad("the prompt is empty", prompt_param)
        bad = next((i for i in prompt_ids if not 0 <= i < engine.target.vocab_size), None)
        if bad is not None:
            raise _bad(
                f"prompt token id {bad} is outside the vocabulary [0, {engine.target.vocab_size})",
                prompt_param,
            )
        room = engine.n_ctx - len(prompt_ids)
        if room < 1:
            raise _bad(
                f"the prompt ({len(prompt_ids)} tokens) fills the context window of "
                f"{engine.n_ctx} tokens",
                prompt_param,
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if max_tokens < 1:
            raise _bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if max_tokens > room:
            raise _bad(
                f"max_tokens ({max_tokens}) + the prompt ({len(prompt_ids)} tokens) "
                f"exceeds the context window of {engine.n_ctx} tokens; at most {room}",
                "max_tokens",
                "context_length_exceeded",
            )
        # No seed: a fresh one per request (OpenAI's behaviour), never a fixed default.
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        # top_k >= V keeps every token: the same distribution, without a top-k over too many.
        top_k = None if req.top_k is None else min(req.top_k, engine.target.vocab_size)
        return GenParams(prompt_ids, max_tokens, t, top_p, top_k, seed, stops)

    async def next_event(job: _Job) -> tuple:
        remaining = job.deadline - time.perf_counter()
        try:
            return await asyncio.wait_for(job.events.get(), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            job.cancel.set()  # the worker stops at its next round boundary
            raise _timeout_error() from None

    async def run(
        request: Request,
        req: _Request,
        prompt_ids: list[int],
        prompt_param: str,
        max_tokens: int | None,
        chat: bool,
        arrived: float,
    ) -> Any:
        params = params_of(req, prompt_ids, prompt_param, max_tokens)
        loop = asyncio.get_running_loop()
        job = _Job(params, loop, arrived, arrived + cfg.request_timeout)
        engine.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        streaming = False
        endpoint = request.url.path
        try:
            first = await next_event(job)
            if first[0] == "error":
                raise first[1]
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            if req.stream:
                streaming = True
                metrics.inc("specdec_requests_total", endpoint=endpoint, code="200")
                events = _sse_events(job, watcher, req, rid, created, chat, prompt_ids)
                return StreamingResponse(
                    events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            text, ids = [], []
            while True:
                ev = await next_event(job)
                if ev[0] == "delta":
                    text.append(ev[1])
                    ids += ev[2]
                elif ev[0] == "error":
                    raise ev[1]
                else:
                    break
            _, finish, st = ev
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            body: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": cfg.target,
                "choices": [choice],
                "usage": _usage(st),
                "spec": _spec_record(st),
            }
            if req.return_token_ids:
                choice["token_ids"] = ids
                body["prompt_token_ids"] = prompt_ids
            metrics.inc("specdec_requests_total", endpoint=endpoint, code="200")
            return JSONResponse(body)
        finally:
            if not streaming:  # the SSE generator owns the job from here on
                job.cancel.set()  # a no-op for a finished job; stops one we gave up on
                watcher.cancel()

    async def _sse_events(
        job: _Job,
        watcher: asyncio.Task,
        req: _Request,
        rid: str,
        created: int,
        chat: bool,
        prompt_ids: list[int],
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, ids: list[int], finish: str | None = None) -> dict:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                c["delta"] = {} if text is None else {"content": text}
            else:
                c["text"] = text or ""
            if req.return_token_ids:
                c["token_ids"] = ids
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": cfg.target,
                "choices": [c],
            }

        try:
            if chat:
                first = chunk("", [])
                first["choices"][0]["delta"]["role"] = "assistant"
                if req.return_token_ids:
                    first["prompt_token_ids"] = prompt_ids
                yield _sse(first)
            while True:
                try:
                    ev = await next_event(job)
                except ApiError as e:
                    yield _sse(e.body())
                    return
                if ev[0] == "delta":
                    if ev[1] or (req.return_token_ids and ev[2]):
                        yield _sse(chunk(ev[1], ev[2]))
                elif ev[0] == "error":
                    yield _sse(ev[1].body())
                    return
                else:
                    _, finish, st = ev
                    last = chunk(None, [], finish)
                    last.update(usage=_usage(st), spec=_spec_record(st))
                    yield _sse(last)
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield _sse(
                            {
                                "id": rid,
                                "object": obj,
                                "created": created,
                                "model": cfg.target,
                                "choices": [],
                                "usage": _usage(st),
                                "spec": _spec_record(st),
                            }
                        )
                    yield "data: [DONE]\n\n"
                    return
        finally:  # normal end, or the client went away (this generator is then cancelled)
            job.cancel.set()
            watcher.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        arrived = time.perf_counter()
        check_auth(request)
        req: ChatRequest = _parse(ChatRequest, await _read_json(request, cfg.max_body_bytes))
        if not req.messages:
            raise _bad("messages must hold at least one message", "messages")
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in req.messages]
        check_model(req.model)
        prompt_ids = engine.encode_chat(messages)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        return await run(request, req, prompt_ids, "messages", max_tokens, True, arrived)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        arrived = time.perf_counter()
        check_auth(request)
        req: CompletionRequest = _parse(
            CompletionRequest, await _read_json(request, cfg.max_body_bytes)
        )
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _bad(
                    "batched prompts are not supported; send one prompt per request", "prompt"
                )
            prompt = prompt[0]
        check_model(req.model)
        prompt_ids = engine.encode_text(prompt) if isinstance(prompt, str) else list(prompt)
        return await run(request, req, prompt_ids, "prompt", req.max_tokens, False, arrived)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        check_auth(request)
        metrics.inc("specdec_requests_total", endpoint="/v1/models", code="200")
        card = {
            "id": cfg.target,
            "object": "model",
            "created": 0,
            "owned_by": "specdec",
            "draft": cfg.draft,
            "n_ctx": engine.n_ctx,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Any:
        status = "ok" if engine.alive else "engine_stopped"
        body = {
            "status": status,
            "model": cfg.target,
            "busy": engine.busy,
            "queue_depth": engine.queue_depth,
        }
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Any:
        gauges = {
            "specdec_queue_depth": engine.queue_depth,
            "specdec_busy": int(engine.busy),
            "specdec_queue_capacity": engine.max_queue,
        }
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4")

    return app


# ------------------------------------------------------------------------------ entry points
def build_engine(cfg: ServeConfig) -> Engine:
    """Load the models named by `cfg`, check them with a warm-up generation, return the engine."""
    from specdec.backends import load_model

    load_kw: dict[str, Any] = {"n_threads": cfg.threads} if cfg.threads else {}
    target = load_model(cfg.target, device=cfg.device, **load_kw)
    draft = load_model(cfg.draft, device=cfg.device, **load_kw) if cfg.draft else None
    engine = Engine(
        target,
        draft,
        model_id=cfg.target,
        spec=cfg.spec_config(),
        max_queue=cfg.max_queue,
    )
    engine.warm_up()
    return engine


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (no name lookup: nothing leaves the machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    if not is_loopback(cfg.host) and cfg.api_key is None:
        print(
            f"warning: serving on {cfg.host} without --api-key: anyone who can reach this "
            "port can use the model",
            file=sys.stderr,
        )
    engine = build_engine(cfg)
    print(
        f"specdec: serving {cfg.target}"
        + (f" (draft {cfg.draft})" if cfg.draft else "")
        + f" at http://{cfg.host}:{cfg.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(create_app(engine, cfg), host=cfg.host, port=cfg.port, log_level="info")
