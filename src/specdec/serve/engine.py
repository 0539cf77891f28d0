"""One target (and draft), one worker that owns them, a bounded FIFO of requests.

The engine is four parts, each a module: what it serves with (serve.models.ServedModels: the
models and their slots, the tokenizer's services and the grammar cache, which the app calls
once per request, `prepare`), the queue and admission (here, serve.job_queue), the worker's
cycle (serve.cycle.Cycle, with serve.scheduler's decisions), and a request's delivery
(serve.delivery). A request is one record with one status (serve.requests.Request, Status)
from the queue to its end.

The models are not thread-safe, so one worker runs them. It generates up to `parallel`
requests at once (`specdec serve --parallel N`), each in a slot of its own (SpecModel.slots: a
KV cache per request on the shared weights). Each cycle it admits what the free slots take,
runs one round of every request whose prompt is in with one target pass for all of them
(decode.rounds_together: each drafts its own K with its own drafter and accepts with its own
rule and generator), then spends the cycle's one prefill budget on the prompts still going in.
Rows of a batch-invariant model have the same bits in company as alone, so a greedy answer
does not depend on its neighbours, and a request whose own part of a round raises fails alone.
`specdec serve` runs the worker in the main thread (`run`) and the HTTP server beside it:
llama.cpp's OpenMP build synchronizes its threads with OpenMP barriers, and libgomp lets
barriers spin only while the threads it manages fit the CPUs; a decode started from any other
thread brings one more, so every barrier sleeps and wakes through the kernel instead
(measured: a 62 ms step took 88 ms from a second Python thread, pure llama-cpp-python alike).
`start` runs it in a thread of its own instead (tests, embedding).

Requests wait in a bounded queue, one FIFO per tenant served in turn (serve.job_queue:
`max_queue` waiting in all, not counting those being generated, and `max_queue_per_key` for one
API key; 429 with Retry-After beyond either); a free slot takes the next request of a tenant
running fewer than `max_running_per_key`, so one key cannot hold every slot either. The worker
hands each request its events (serve.requests: Start, Delta, Done or Failed) through the
request's asyncio.Queue.

A request is abandoned (`Engine.withdraw`) when its client goes away, its deadline passes or the
server shuts down. A waiting one leaves the queue at once, freeing its place; a running one
stops within one round, or within one prefill chunk while its prompt is being prefilled, so an
abandoned request never holds its slot for long.

Cache safety: a generation resets its slot's draft cache when it starts, and its slot's target
cache unless the prompt cache keeps the KV of a prefix the request shares with the previous
request of its scope in that slot, or with a cache of its scope kept in RAM (ServeConfig's
`prompt_cache` and `cache_ram`: serve.prompt_store; in whole blocks; the draft's too where it
is batch-invariant); after an engine exception the slots of the requests it failed are reset
again. A request takes an empty slot before one
that holds another scope's prompt (scheduler.place). What does reach the next request on
purpose: that prefix; its scope's draft pool (serve.draft_pools: prompt lookup drafts from the
earlier requests of the same API key, or of every key with --draft-pool shared, and each
request's prompt and output are added once it ends; with --parallel, a neighbour's that ends
while a request runs is there for its next rounds); and the k="auto" policies (`policies`:
acceptance and costs learned, never tokens), kept per tenant (serve.tenant_policies) but for
the verify-cost curve, which measures the machine and is kept for the next process too
(backends.costs).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from specdec.backends.costs import CurveFiles
from specdec.core.model import SpecModel
from specdec.serve.config import ServeConfig
from specdec.serve.cycle import Cycle
from specdec.serve.draft_pools import ServedPools
from specdec.serve.errors import ApiError, unavailable_error
from specdec.serve.job_queue import JobQueue, QueueFull, Reservation, queue_full_error
from specdec.serve.keys import ANONYMOUS
from specdec.serve.metrics import Metrics
from specdec.serve.models import ServedModels
from specdec.serve.requests import Request, Status
from specdec.serve.tenant_policies import TenantPolicies

RETRY_AFTER_RANGE_S = (1, 60)


class Engine:
    """The models (`models`), the queue, the worker and its cycle (`cycle`); a request's
    events are serve.requests'.

    `lock` is held while any generation runs: code outside the worker (tests, a warm-up) takes
    it to use the models directly.
    """

    def __init__(
        self,
        target: SpecModel,
        draft: SpecModel | None = None,
        cfg: ServeConfig | None = None,
        *,
        metrics: Metrics | None = None,
        # None: k="auto" policies kept per tenant for the engine's life, their curves in
        # backends.costs
        policies: TenantPolicies | None = None,
        # what the scheduler times rounds and prefill passes with (a test's modelled time)
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """The engine `cfg` describes (None: `specdec serve`'s defaults, the target's name as
        the model id), on these models."""
        cfg = cfg if cfg is not None else ServeConfig(target=target.name)
        self.metrics = metrics or Metrics()
        policies = policies if policies is not None else TenantPolicies(CurveFiles())
        self.models = ServedModels(target, draft, cfg, policies)
        # Earlier requests' text to draft from, per scope (serve.draft_pools)
        self.pools = ServedPools(cfg.pool_config(), self.metrics)
        self.lock = threading.Lock()
        self._queue: JobQueue[Request] = JobQueue(cfg.max_queue, cfg.queue_per_key())
        self.cycle = Cycle(
            self.models, self._queue, self.pools, self.metrics, self.lock, cfg, clock
        )
        self._stopping = False
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        #: Set by the caller that will call `run` itself (before the HTTP server starts, so that
        #: its lifespan does not start the thread as well).
        self.runs_in_caller = False

    def warm_up(self) -> None:
        """ServedModels.warm_up, under the lock."""
        with self.lock:
            self.models.warm_up()

    # -------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run the worker in a thread of its own."""
        self._thread.start()

    def run(self) -> None:
        """The worker: serve the queue in the calling thread until `stop` closes it."""
        try:
            while self.cycle.step():
                pass
        finally:
            # Stopped (the queue closed), or killed by a BaseException inside a request: nobody
            # will serve the queue any more, and submit() now refuses with 503.
            self._stopping = True
            self.runs_in_caller = False
            self.cycle.stop_all()
            for waiting in self._queue.take_all():
                self.cycle.finish(waiting, Status.SHUT_DOWN)

    def drain(self) -> None:
        """Begin shutting down, without blocking: refuse new requests, fail the waiting ones
        with 503, and abandon the running ones (they end within a round or a prefill chunk)."""
        self._stopping = True
        for r in self._queue.take_all():
            self.cycle.finish(r, Status.SHUT_DOWN)
        for r in list(self.cycle.running):
            r.abandon(Status.SHUT_DOWN)

    def stop(self, timeout: float = 10.0) -> None:
        """`drain`, then wait up to `timeout` seconds for the worker to exit."""
        self.drain()
        self._queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def parallel(self) -> int:
        """Slots: requests generated at once."""
        return self.cycle.parallel

    @property
    def max_queue(self) -> int:
        """Requests waiting, at most."""
        return self._queue.maxsize

    @property
    def alive(self) -> bool:
        return self.runs_in_caller or self._thread.is_alive()

    @property
    def draining(self) -> bool:
        """`drain` was called: no new requests are taken."""
        return self._stopping

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        """Generations running, one per busy slot."""
        return len(self.cycle.running)

    @property
    def busy(self) -> bool:
        """A generation is running."""
        return bool(self.cycle.running)

    # -------------------------------------------------------------------------- admission
    def reserve(self, tenant: str = ANONYMOUS) -> Reservation:
        """A place in the queue for a request of `tenant` about to be tokenized: admission comes
        first, so a flood of large prompts gets its 429 before any tokenizing, and the queue's
        bounds bound the work in flight. ApiError 503 / 429 as `submit`; release the reservation
        when done."""
        self._check_open()
        try:
            return self._queue.reserve(tenant)
        except QueueFull as e:
            raise self._queue_full(e.scope) from None

    def submit(self, r: Request, reservation: Reservation | None = None) -> None:
        """Queue `r` (its tenant's turn comes after the others', serve.job_queue), in
        `reservation`'s place if one was reserved; ApiError 503 when the engine is stopping or its
        worker is not running (at once, not at the deadline), 429 when the queue, or its tenant's
        share, is full."""
        self._check_open()
        try:
            self._queue.put(r, reservation)
        except QueueFull as e:
            raise self._queue_full(e.scope) from None

    def withdraw(self, r: Request, status: Status) -> None:
        """Abandon `r` (CANCELLED, TIMED_OUT): a waiting request leaves the queue now, freeing
        its place; a running one stops at the worker's next check. A no-op once it ended."""
        r.abandon(status)
        if self._queue.remove(r):  # the worker will never see it: end it here
            self.cycle.finish(r, r.abandoned() or status)

    def _check_open(self) -> None:
        if self._stopping:
            raise unavailable_error("the server is shutting down", "shutting_down")
        if not self.alive:
            raise unavailable_error("the engine's worker is not running", "engine_stopped")

    def _queue_full(self, scope: str) -> ApiError:
        lo, hi = RETRY_AFTER_RANGE_S
        retry = min(hi, max(lo, math.ceil(self.cycle.service_s)))
        return queue_full_error(scope, self.max_queue, self._queue.per_tenant, retry)
