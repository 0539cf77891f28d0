"""One target (and draft), one worker that owns them, a bounded FIFO of jobs.

The models are not thread-safe, so one worker runs them. It generates up to `parallel`
requests at once (`specdec serve --parallel N`), each in a slot of its own (SpecModel.slots: a
KV cache per request on the shared weights): every round it prefills a chunk of each newly
admitted prompt (PREFILL_CHUNK_SHARED tokens while others decode, so a long prompt never
stalls the running streams for long), then runs one round of every prefilled request with one
target pass for all of them (decode.rounds_together: each drafts with its own drafter, K is
chosen for the pass as a whole, each accepts with its own rule and generator). Rows of a
batch-invariant model have the same bits in company as alone, so a greedy answer does not
depend on its neighbours. `specdec serve` runs the worker in the main thread (`run`) and the HTTP
server beside it: llama.cpp's OpenMP build synchronizes its threads with OpenMP barriers, and
libgomp lets barriers spin only while the threads it manages fit the CPUs; a decode started from
any other thread brings one more, so every barrier sleeps and wakes through the kernel instead
(measured: a 62 ms step took 88 ms from a second Python thread, pure llama-cpp-python alike).
`start` runs it in a thread of its own instead (tests, embedding).

Requests wait in a bounded queue, one FIFO per tenant served in turn (serve.job_queue:
`max_queue` waiting in all, not counting those being generated, and `max_queue_per_key` for one
API key; 429 with Retry-After beyond either); a free slot takes the next request of a tenant
running fewer than `max_running_per_key`, so one key cannot hold every slot either. The worker
hands each job typed events through the job's asyncio.Queue (`loop.call_soon_threadsafe`), in
order:

    Start                   generation began (the request left the queue)
    Delta(text, token_ids, origins)  one round's committed tokens and the text now safe to
                            send; `origins` (stream_options.include_speculation only) says where
                            each token came from (serve.origins)
    Done(finish_reason, stats)
    Failed(error)           at any point instead of the rest; an ApiError for the client

A job is abandoned (`Engine.withdraw`) when its client goes away, its deadline passes or the
server shuts down. A waiting job leaves the queue at once, freeing its place; a running one
stops within one round, or within one prefill chunk while its prompt is being prefilled, so an
abandoned request never holds its slot for long.

Cache safety: a generation resets its slot's draft cache when it starts, and its slot's target
cache unless the prompt cache keeps the KV of a prefix the request shares with the previous
request of its scope in that slot (`prompt_cache`, in whole blocks); after an engine exception
the slots of the requests it failed are reset again. What does reach the next request on
purpose: that prefix; its scope's draft pool (serve.draft_pools: prompt lookup drafts from the
earlier requests of the same API key, or of every key with --draft-pool shared, and each
request's prompt and output are added once it ends; with --parallel, a neighbour's that ends
while a request runs is there for its next rounds); and the k="auto" policies (`policies`:
acceptance and costs learned, never tokens), kept per tenant (serve.tenant_policies) but for
the verify-cost curve, which measures the machine and is kept for the next process too
(backends.costs).

A request's prediction is drafted from through its n-gram index (core.drafters.PredictionIndex,
~1.5 KiB a token). It is built while the request waits, off the engine, as long as the indexes
alive stay within PREBUILT_INDEX_TOKENS; past that, the worker builds it when the request
starts, so that waiting requests hold only their token ids.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.backends import chat as prompting
from specdec.backends.costs import CurveFiles
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import PREFILL_CHUNK, Generation, rounds_together, stream
from specdec.core.drafters import PredictionDrafter, PredictionIndex, common_prefix
from specdec.core.metrics import GenerationStats
from specdec.core.model import SpecModel
from specdec.core.pool import DraftPool
from specdec.serve.draft_pools import PoolConfig, PoolUse, ServedPools
from specdec.serve.errors import (
    ApiError,
    bad,
    cancelled_error,
    timeout_error,
    unavailable_error,
)
from specdec.serve.job_queue import JobQueue, QueueFull, Slot
from specdec.serve.keys import ANONYMOUS
from specdec.serve.metrics import Metrics, RoundMark
from specdec.serve.origins import OriginTracker
from specdec.serve.protocol import GenParams
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation
from specdec.serve.tenant_policies import TenantPolicies
from specdec.serve.text import TextAssembler

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64
#: Prompt tokens a newly admitted request prefills per round while others decode: each chunk
#: stalls the running streams for as long as its prefill takes; a prompt alone prefills in
#: decode.PREFILL_CHUNK pieces.
PREFILL_CHUNK_SHARED = 128
#: The prompt cache reuses, and reports, whole blocks of this many tokens: a client that guesses
#: another's prompt learns at most whether a 256-token block matched, not the matching length
#: (and only within a scope: the previous request's KV is kept for a request of its scope alone).
PROMPT_CACHE_BLOCK = 256
RETRY_AFTER_RANGE_S = (1, 60)
_SERVICE_EMA = 0.8  # smoothing of the mean generation time that Retry-After is estimated from
#: Prediction tokens whose n-gram indexes may be alive at once having been built ahead, while
#: their requests wait: ~50 MiB, a 32k-token prediction's whole index (measured: 1.5 KiB a
#: token). 65 requests in flight once held ~420 MB of them (issue 33). Built ahead, an index
#: costs the engine no time; built by the worker, it delays its own request's start (0.4 s for
#: 32k random ids on this repository's 2-core box, 1.2 s in issue 21's measurement).
PREBUILT_INDEX_TOKENS = 1 << 15


# ------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class Start:
    """The job left the queue and its generation began."""


@dataclass(frozen=True)
class Delta:
    text: str  # may be empty: text held back (a possible stop string, a partial character)
    token_ids: tuple[int, ...]  # the round's committed tokens (empty for the final flush)
    origins: dict | None = None  # the round's token origins, when the request asked for them


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (a stop string or a stop id) or "length"
    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Start | Delta | Done | Failed


# ------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    """One request on its way through the engine."""

    params: GenParams
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    deadline: float  # time.perf_counter() after which the request has timed out
    tenant: str = ANONYMOUS  # the API key's id (serve.keys): whose draft pool it reads and feeds
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)  # worker -> event loop
    reason: str | None = None  # why it was abandoned: "cancelled", "timeout" or "shutdown"
    _abandoned: threading.Event = field(default_factory=threading.Event)  # event loop -> worker

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def abandon(self, reason: str) -> None:
        if not self._abandoned.is_set():
            self.reason = reason  # the first reason is the one counted
            self._abandoned.set()

    def stopped(self) -> str | None:
        """Why the worker should stop generating this job, or None to go on."""
        if self._abandoned.is_set():
            return self.reason
        return "timeout" if time.perf_counter() > self.deadline else None


def error_for(reason: str) -> ApiError:
    """The error an abandoned job ends with."""
    if reason == "timeout":
        return timeout_error()
    if reason == "shutdown":
        return unavailable_error("the server is shutting down", "shutting_down")
    return cancelled_error()


class _IndexBudget:
    """Tokens of prebuilt prediction indexes alive, bounded: an index's tokens come back when
    the index is freed (its request ended and let go of it), whatever path it took."""

    def __init__(self, tokens: int) -> None:
        self.free = tokens
        self._lock = threading.Lock()

    def take(self, tokens: int) -> bool:
        with self._lock:
            if tokens > self.free:
                return False
            self.free -= tokens
            return True

    def give(self, tokens: int) -> None:
        with self._lock:
            self.free += tokens


def _copy_tokenizer(tokenizer: object) -> object | None:
    """A private copy of `tokenizer` for the worker; None when it cannot be copied (the worker
    then shares the original under the lock)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # a tokenizer that does not pickle: share it, locked
        log.warning("the tokenizer cannot be copied; the worker shares it under a lock")
        return None


# ------------------------------------------------------------------------------ the engine
class Engine:
    """The models, the worker thread, the queue; see the module docstring for the events.

    `lock` is held while any generation runs: code outside the worker (tests, a warm-up) takes
    it to use the models directly.
    """

    def __init__(
        self,
        target: SpecModel,
        draft: SpecModel | None = None,
        *,
        model_id: str | None = None,
        # the default speculation (`specdec serve` passes ServeConfig.spec_config(): k=auto)
        spec: SpecConfig = SpecConfig(),  # noqa: B008 - frozen
        max_queue: int = DEFAULT_MAX_QUEUE,
        # waiting requests of one tenant, at most (None: max_queue; ServeConfig.queue_per_key)
        max_queue_per_key: int | None = None,
        metrics: Metrics | None = None,
        prompt_cache: bool | None = None,
        # None: no draft pool (`specdec serve` passes ServeConfig.pool_config(): one per API key)
        draft_pool: PoolConfig | None = None,
        # None: k="auto" policies kept per tenant for the engine's life, their curves in
        # backends.costs
        policies: TenantPolicies | None = None,
        # requests generated at once, each in a slot of its own (SpecModel.slots)
        parallel: int = 1,
        # one tenant's requests generated at once, at most (None: all `parallel` slots)
        max_running_per_key: int | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_queue_per_key is not None and max_queue_per_key < 1:
            raise ValueError(f"max_queue_per_key must be >= 1, got {max_queue_per_key}")
        self.target = target
        self.draft = draft
        self.parallel = parallel
        self.running_per_key = min(parallel, max_running_per_key or parallel)
        # Slot i's target and draft: a KV cache each on the shared weights (slot 0: the models)
        self._targets = target.slots(parallel)
        self._drafts = draft.slots(parallel) if draft is not None else [None] * parallel
        self.model_id = model_id or target.name
        self.spec = spec
        # What one request's k="auto" learned carries to the next of its tenant
        # (serve.tenant_policies)
        self.policies = policies if policies is not None else TenantPolicies(CurveFiles())
        # What a request gets when its `speculation` object does not say (the start-up flags)
        self.defaults = SpecDefaults.of(spec, draft is not None)
        # Keep the target's KV of the prefix shared with the previous request, in whole blocks
        # (an editor re-sends the file, a chat the conversation): decode.stream(reuse_prefix=).
        # On by default only where it cannot change the output: kept rows were computed in
        # another batch shape than a fresh prefill would use.
        self.prompt_cache = target.batch_invariant if prompt_cache is None else prompt_cache
        # Per slot, the scope (serve.draft_pools) of the request whose KV its target holds:
        # another tenant's request prefills afresh, or its cached_tokens would say what the last
        # wrote.
        self._cache_scope: list[str | None] = [None] * parallel
        self.tokenizer = target.tokenizer or getattr(draft, "tokenizer", None)
        # The worker detokenizes every round; request threads tokenize prompts. A copy for the
        # worker, so that a long prompt being tokenized never stalls the running stream (HF
        # fast tokenizers cannot be called from two threads at once: "Already borrowed").
        self._decode_tokenizer = _copy_tokenizer(self.tokenizer)
        self.stop_ids = prompting.stop_ids(self.tokenizer)
        # Every model the prompt must fit, for max_tokens validation.
        self.n_ctx = min(m.n_ctx for m in (target, draft) if m is not None)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        # Earlier requests' text to draft from, per scope (serve.draft_pools)
        self.pools = ServedPools(draft_pool or PoolConfig("off"), self.metrics)
        self.lock = threading.Lock()
        self._held = False  # the worker holds `lock` (_hold)
        # HF fast tokenizers are not safe to call from two threads at once ("Already borrowed"):
        # request threads encode prompts while the worker decodes outputs.
        self.tokenizer_lock = threading.Lock()
        self._jobs: JobQueue[Job] = JobQueue(max_queue, max_queue_per_key)
        self._index_budget = _IndexBudget(PREBUILT_INDEX_TOKENS)
        self._active: list[_Active] = []  # the generations running, in their slots
        self._service_s = 1.0  # EMA of generation wall time, for Retry-After
        self._stopping = False
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        #: Set by the caller that will call `run` itself (before the HTTP server starts, so that
        #: its lifespan does not start the thread as well).
        self.runs_in_caller = False

    # -------------------------------------------------------------------------- lifecycle
    def warm_up(self) -> None:
        """A 2-token generation with the default speculation, and one with the draft model if
        the default does not use it (a request may ask for it): surfaces a bad model pair or
        option at startup rather than in a request, and pays one-time costs there too."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        prompt = [bos if bos is not None else 0]
        default = self.defaults.speculation()
        runs = [default]
        if self.draft is not None and not default.uses_draft:
            runs.append(resolve_speculation({"drafter": "model"}, self.defaults, False))
        with self.lock:
            for sp in runs:
                s = stream(
                    self.target,
                    prompt,
                    **self.stream_args(sp, None),
                    warp=Warp(0.0),
                    max_new_tokens=2,
                    seed=0,
                )
                for _ in s:
                    pass

    def stream_args(
        self,
        sp: Speculation,
        prediction: object,
        pool: DraftPool | None = None,
        tenant: str = ANONYMOUS,
        slot: int = 0,
    ) -> dict[str, object]:
        """`decode.stream`'s draft, spec, prediction, pool and policies for a request's
        speculation: the draft model (`slot`'s) only for the drafters that run it, no prediction
        for "none" (it drafts nothing), the draft pool only for the drafters that run prompt
        lookup, the k="auto" policies of the request's tenant."""
        return {
            "draft": self._drafts[slot] if sp.uses_draft else None,
            "spec": sp.spec_config(),
            "prediction": None if sp.drafter == "none" else prediction,
            "pool": pool if sp.uses_lookup else None,
            "policies": self.policies.get(tenant),
        }

    def start(self) -> None:
        """Run the worker in a thread of its own."""
        self._thread.start()

    def drain(self) -> None:
        """Begin shutting down, without blocking: refuse new jobs, fail the waiting ones with
        503, and abandon the running ones (they end within a round or a prefill chunk)."""
        self._stopping = True
        for job in self._jobs.take_all():
            self._end_unstarted(job, "shutdown")
        for a in list(self._active):
            a.job.abandon("shutdown")

    def stop(self, timeout: float = 10.0) -> None:
        """`drain`, then wait up to `timeout` seconds for the worker to exit."""
        self.drain()
        self._jobs.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.runs_in_caller or self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        """A generation is running."""
        return bool(self._active)

    @property
    def running(self) -> int:
        """Generations running, one per busy slot."""
        return len(self._active)

    # -------------------------------------------------------------------------- admission
    def reserve(self, tenant: str = ANONYMOUS) -> Slot:
        """A place in the queue for a request of `tenant` about to be tokenized: admission comes
        first, so a flood of large prompts gets its 429 before any tokenizing, and the queue's
        bounds bound the work in flight. ApiError 503 / 429 as `submit`; release the slot when
        done."""
        self._check_open()
        try:
            return self._jobs.reserve(tenant)
        except QueueFull as e:
            raise self._queue_full(e.scope) from None

    def submit(self, job: Job, slot: Slot | None = None) -> None:
        """Queue `job` (its tenant's turn comes after the others', serve.job_queue), in `slot`
        if one was reserved; ApiError 503 when the engine is stopping or its worker is not
        running (at once, not at the deadline), 429 when the queue, or its tenant's share, is
        full."""
        self._check_open()
        try:
            self._jobs.put(job, slot)
        except QueueFull as e:
            raise self._queue_full(e.scope) from None

    def _check_open(self) -> None:
        if self._stopping:
            raise unavailable_error("the server is shutting down", "shutting_down")
        if not self.alive:
            raise unavailable_error("the engine's worker is not running", "engine_stopped")

    def _queue_full(self, scope: str) -> ApiError:
        lo, hi = RETRY_AFTER_RANGE_S
        retry = min(hi, max(lo, math.ceil(self._service_s)))
        what = (
            f"the request queue is full ({self.max_queue} waiting)"
            if scope == "queue"
            else f"this API key has {self._jobs.per_tenant} requests waiting, its most"
        )
        return ApiError(
            429,
            f"{what}; retry after {retry} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    def withdraw(self, job: Job, reason: str) -> None:
        """Abandon `job` ("cancelled", "timeout"): a waiting job leaves the queue now, freeing
        its slot; a running one stops at the worker's next check. A no-op for a finished job."""
        job.abandon(reason)
        if self._jobs.remove(job):  # the worker will never see it: end it here
            self._end_unstarted(job, job.reason or reason)

    # -------------------------------------------------------------------------- text helpers
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, for the worker (its own tokenizer: no lock shared with requests)."""
        if self._decode_tokenizer is not None:
            return prompting.decode(self._decode_tokenizer, ids)
        with self.tokenizer_lock:
            return prompting.decode(self.tokenizer, ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template's rendering of `messages` (backends.chat.encode_messages)."""
        with self.tokenizer_lock:
            try:
                return prompting.encode_messages(self.tokenizer, messages)
            except prompting.NoChatTemplateError as e:
                raise bad(
                    f"{self.model_id} has no chat template (a mock or base model); use "
                    "/v1/completions",
                    param="messages",
                    code="no_chat_template",
                ) from e
            except ValueError as e:
                raise bad(str(e), "messages") from e

    def encode_prediction(self, text: str) -> list[int]:
        """A request's prediction as token ids (backends.chat.encode_prediction)."""
        if self.tokenizer is None:
            raise bad(f"{self.model_id} has no tokenizer to read a prediction with", "prediction")
        with self.tokenizer_lock:
            return prompting.encode_prediction(self.tokenizer, text)

    def prediction_index(self, prediction: list[int], instruction: str) -> PredictionIndex:
        """A request's prediction with its n-gram index, and the rewrites its instruction names
        as hints (backends.chat.prediction_hints)."""
        return PredictionIndex(prediction, PredictionDrafter.N_MAX, self._hints(instruction))

    def _hints(self, instruction: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
        with self.tokenizer_lock:
            return tuple(prompting.prediction_hints(self.tokenizer, instruction))

    def prepare_prediction(self, params: GenParams, instruction: str) -> GenParams:
        """`params` with its prediction's hints, and its index where PREBUILT_INDEX_TOKENS
        allows (else the worker builds it when the request starts). Call off the event loop."""
        if not params.prediction or params.speculation.drafter == "none":
            return params  # nothing drafts from it
        hints = self._hints(instruction)
        tokens = len(params.prediction)
        if not self._index_budget.take(tokens):
            return dataclasses.replace(params, prediction_hints=hints)
        index = PredictionIndex(params.prediction, PredictionDrafter.N_MAX, hints)
        weakref.finalize(index, self._index_budget.give, tokens)
        return dataclasses.replace(params, prediction_index=index, prediction_hints=hints)

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad(f"{self.model_id} has no tokenizer; pass the prompt as token ids", "prompt")
        with self.tokenizer_lock:
            return prompting.encode(self.tokenizer, text, chat=False)

    # -------------------------------------------------------------------------- the worker
    def run(self) -> None:
        """The worker: serve the queue in the calling thread until `stop` closes it."""
        try:
            while self._cycle():
                pass
        finally:
            # Stopped (the queue closed), or killed by a BaseException inside a job: nobody
            # will serve the queue any more, and submit() now refuses with 503.
            self._stopping = True
            self.runs_in_caller = False
            for a in self._active:
                err = ApiError(500, "the engine stopped", type="server_error", code="engine_error")
                a.job.emit(Failed(err))
            self._active.clear()
            self._hold(False)
            for waiting in self._jobs.take_all():
                self._end_unstarted(waiting, "shutdown")

    def _cycle(self) -> bool:
        """Admit what the free slots take, a prefill chunk for each request not yet prefilled,
        one round for every prefilled one; False once the queue is closed and nothing runs."""
        while len(self._active) < self.parallel:
            running = collections.Counter(a.job.tenant for a in self._active)
            busy = frozenset(t for t, n in running.items() if n >= self.running_per_key)
            job = self._jobs.get(block=not self._active, busy=busy)
            if job is None:
                if not self._active:
                    return False  # closed, and nothing left to finish
                break
            try:
                self._admit(job)
            except Exception:  # _admit reports its own errors; this is a last resort
                log.exception("engine worker: unexpected error")
        decoding = [a for a in self._active if a.gen.prefilled]
        chunk = PREFILL_CHUNK_SHARED if decoding else PREFILL_CHUNK
        for a in [a for a in self._active if not a.gen.prefilled]:
            self._guarded([a], lambda a=a: a.gen.prefill(chunk) and self._prefill_ended(a))
        ready = [a for a in self._active if a.gen.prefilled and not a.ended]
        if ready:
            self._guarded(ready, lambda: self._round(ready))
        for a in [a for a in self._active if a.ended]:
            self._active.remove(a)
        self._hold(bool(self._active))
        return True

    def _hold(self, held: bool) -> None:
        """Hold `lock` while any generation runs, and only then (code outside the worker takes
        it to use the models)."""
        if held and not self._held:
            self.lock.acquire()
        elif self._held and not held:
            self.lock.release()
        self._held = held

    def _end_unstarted(self, job: Job, reason: str) -> None:
        self.metrics.inc("specdec_generations_total", outcome=reason)
        job.emit(Failed(error_for(reason)))

    def _admit(self, job: Job) -> None:
        """Start `job` in a free slot (the one whose cached prompt it shares most of, else the
        lowest), or end it if it was abandoned while waiting or its arguments are bad."""
        reason = job.stopped()
        if reason is not None:  # abandoned while waiting, and not withdrawn in time
            self._end_unstarted(job, reason)
            return
        p = job.params
        origins = OriginTracker(self.decode) if p.origins else None
        prediction = self._prediction(p)  # outside the lock, as it was built ahead
        self._hold(True)
        slot = self._free_slot(job)
        started = time.perf_counter()
        use = self.pools.begin(job.tenant)
        try:  # stream() checks every argument before any model work
            s = stream(
                self._targets[slot],
                p.prompt_ids,
                **self.stream_args(
                    p.speculation,
                    prediction,
                    use.pool if use is not None else None,
                    tenant=job.tenant,
                    slot=slot,
                ),
                warp=p.warp,
                max_new_tokens=p.max_tokens,
                seed=p.seed,
                stop_ids=self.stop_ids,
                cancelled=lambda: job.stopped() is not None,  # polled between prefill chunks
                on_round=origins.observe if origins is not None else None,
                reuse_prefix=self._reuse_prefix(job.tenant, slot),
            )
        except ValueError as e:
            self.metrics.inc("specdec_generations_total", outcome="error")
            job.emit(Failed(bad(str(e))))
            self.pools.end(use, ())  # nothing ran: nothing to add
            self._hold(bool(self._active))
            return
        self._cache_scope[slot] = self.pools.scope(job.tenant)  # what the target will hold
        job.emit(Start())
        text = TextAssembler(self.decode, p.stop)
        self._active.append(_Active(job, slot, s.generation, use, started, text, origins))

    def _free_slot(self, job: Job) -> int:
        """The free slot for `job`: the one of its scope whose cache holds the longest prefix of
        its prompt (at least a block), else the lowest."""
        free = sorted(set(range(self.parallel)) - {a.slot for a in self._active})
        if self.prompt_cache:
            scope, ids = self.pools.scope(job.tenant), job.params.prompt_ids
            kept = {
                i: common_prefix(self._targets[i].cached_tokens, ids)
                for i in free
                if self._cache_scope[i] == scope
            }
            best = max(kept, key=lambda i: (kept[i], -i), default=None)
            if best is not None and kept[best] >= PROMPT_CACHE_BLOCK:
                return best
        return free[0]

    def _guarded(self, group: list[_Active], step: Callable[[], object]) -> None:
        """Run `step` for `group`; on an exception, fail every request of the group with 500
        and reset their slots (a pass that raised may have left them half-written)."""
        try:
            step()
        except Exception as e:
            for a in group:
                self._fail(a, e)

    def _fail(self, a: _Active, e: Exception) -> None:
        """End `a` with 500 for `e`, raised by its generation, and reset its slot (a pass that
        raised may have left it half-written)."""
        if a.ended:
            return
        log.error("generation failed", exc_info=e)
        err = f"generation failed: {type(e).__name__} (the server's log has the details)"
        a.job.emit(Failed(ApiError(500, err, type="server_error", code="engine_error")))
        self._reset_slot(a.slot)
        self._end(a, "error", None)

    def _prefill_ended(self, a: _Active) -> None:
        """The prompt is in: end a request cancelled during its prefill (its stop_reason)."""
        if a.gen.stop_reason == "cancelled":
            reason = a.job.stopped() or "cancelled"
            a.job.emit(Failed(error_for(reason)))
            self._end(a, reason, None)

    def _round(self, ready: list[_Active]) -> None:
        """One round for every prefilled request, one target pass; hand each its text. A
        request whose own part of the round raised fails alone (rounds_together)."""
        gens = [a.gen for a in ready]
        for a, got in zip(ready, rounds_together(gens), strict=True):
            if isinstance(got, Exception):
                self._fail(a, got)
            else:
                self._deliver(a, got)

    def _deliver(self, a: _Active, ids: list[int]) -> None:
        """Hand a round's tokens to the job (and its origins, if asked); end it when it is done,
        stopped by a stop string, or abandoned."""
        job, g = a.job, a.gen
        a.output += ids
        a.rounds.append(RoundMark(time.perf_counter(), len(ids), g.stats.drafted - a.drafted))
        a.drafted = g.stats.drafted
        record = a.origins.record(ids) if a.origins is not None else None
        job.emit(Delta(a.text.push(ids), tuple(ids), record))
        if not a.text.stopped and not g.done:
            reason = job.stopped()
            if reason is not None:
                job.emit(Failed(error_for(reason)))
                self._end(a, reason, None)
            return
        rest = a.text.flush()
        if rest:
            job.emit(Delta(rest, ()))
        # A stop string, else the generation's reason: "stop" (a stop id) or "length".
        finish = "stop" if a.text.stopped else g.stop_reason
        self._end(a, "finished", Done(finish, g.stats))

    def _end(self, a: _Active, outcome: str, done: Done | None) -> None:
        """A request ended: its text goes to its draft pool, its numbers to /metrics, then its
        Done (a client that has its answer finds it in /metrics); its slot is free."""
        a.ended = True
        a.gen.finish()
        p = a.job.params
        # After the generation, never during it: a request drafts from earlier ones only.
        self.pools.end(a.use, [*p.prompt_ids, *a.output])
        wall = time.perf_counter() - a.started
        self._service_s = _SERVICE_EMA * self._service_s + (1 - _SERVICE_EMA) * wall
        self.metrics.record_generation(a.gen.stats, outcome, a.job.arrived, a.started, a.rounds)
        self.metrics.inc("specdec_generations_by_drafter_total", drafter=p.speculation.drafter)
        if done is not None:
            a.job.emit(done)

    @staticmethod
    def _prediction(p: GenParams) -> list[int] | PredictionIndex | None:
        """What the request drafts from first: its index, built now if it was not built ahead
        (Engine.prepare_prediction)."""
        if p.prediction_index is not None or not p.prediction or p.speculation.drafter == "none":
            return p.prediction_index or p.prediction
        return PredictionIndex(p.prediction, PredictionDrafter.N_MAX, p.prediction_hints)

    def _reuse_prefix(self, tenant: str, slot: int) -> int:
        """decode.stream's reuse_prefix for a request in `slot`: blocks of the KV its target
        holds, if the request that left it was of the same scope."""
        same = self.pools.scope(tenant) == self._cache_scope[slot]
        return PROMPT_CACHE_BLOCK if self.prompt_cache and same else 0

    def _reset_slot(self, slot: int) -> None:
        # Leave nothing half-written for the slot's next request (a generation resets it too).
        for m in (self._targets[slot], self._drafts[slot]):
            if m is not None:
                with contextlib.suppress(Exception):
                    m.reset()


@dataclass(eq=False)
class _Active:
    """A request being generated, in its slot."""

    job: Job
    slot: int
    gen: Generation
    use: PoolUse | None  # its draft pool (serve.draft_pools), None when pools are off
    started: float  # time.perf_counter() when it left the queue
    text: TextAssembler
    origins: OriginTracker | None
    rounds: list[RoundMark] = field(default_factory=list)
    output: list[int] = field(default_factory=list)  # the tokens committed, for the draft pool
    drafted: int = 0  # draft tokens sent to verification so far
    ended: bool = False
