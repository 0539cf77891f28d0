"""One target (and draft), one worker that owns them, a bounded FIFO of jobs.

The models are not thread-safe, so one worker runs them. It generates up to `parallel`
requests at once (`specdec serve --parallel N`), each in a slot of its own (SpecModel.slots: a
KV cache per request on the shared weights). Each cycle it admits what the free slots take,
runs one round of every request whose prompt is in with one target pass for all of them
(decode.rounds_together: each drafts its own K with its own drafter and accepts with its own
rule and generator), then spends the cycle's one prefill budget on the prompts still going in.
serve.scheduler decides which slot a request takes and how many prompt tokens each newcomer
gets; a request's state (scheduler.State) says where it is. Rows of a batch-invariant model
have the same bits in company as alone, so a greedy answer does not depend on its neighbours,
and a request whose own part of a round raises fails alone. `specdec serve` runs the worker in
the main thread (`run`) and the HTTP server beside it: llama.cpp's OpenMP build synchronizes
its threads with OpenMP barriers, and libgomp lets barriers spin only while the threads it
manages fit the CPUs; a decode started from any other thread brings one more, so every barrier
sleeps and wakes through the kernel instead
(measured: a 62 ms step took 88 ms from a second Python thread, pure llama-cpp-python alike).
`start` runs it in a thread of its own instead (tests, embedding).

Requests wait in a bounded queue, one FIFO per tenant served in turn (serve.job_queue:
`max_queue` waiting in all, not counting those being generated, and `max_queue_per_key` for one
API key; 429 with Retry-After beyond either); a free slot takes the next request of a tenant
running fewer than `max_running_per_key`, so one key cannot hold every slot either. The worker
hands each job its events (serve.jobs: Start, Delta, Done or Failed) through the job's
asyncio.Queue.

A job is abandoned (`Engine.withdraw`) when its client goes away, its deadline passes or the
server shuts down. A waiting job leaves the queue at once, freeing its place; a running one
stops within one round, or within one prefill chunk while its prompt is being prefilled, so an
abandoned request never holds its slot for long.

Cache safety: a generation resets its slot's draft cache when it starts, and its slot's target
cache unless the prompt cache keeps the KV of a prefix the request shares with the previous
request of its scope in that slot (`prompt_cache`, in whole blocks); after an engine exception
the slots of the requests it failed are reset again. A request takes an empty slot before one
that holds another scope's prompt (scheduler.place). What does reach the next request on
purpose: that prefix; its scope's draft pool (serve.draft_pools: prompt lookup drafts from the
earlier requests of the same API key, or of every key with --draft-pool shared, and each
request's prompt and output are added once it ends; with --parallel, a neighbour's that ends
while a request runs is there for its next rounds); and the k="auto" policies (`policies`:
acceptance and costs learned, never tokens), kept per tenant (serve.tenant_policies) but for
the verify-cost curve, which measures the machine and is kept for the next process too
(backends.costs).

Text and token ids: serve.tokens (prompts tokenized and prediction indexes built while the
request waits, off the worker).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.backends import chat as prompting
from specdec.backends.costs import CurveFiles
from specdec.backends.grammar import Grammar, Grammars
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import Generation, prepare, rounds_together, stream
from specdec.core.model import SpecModel
from specdec.core.pool import DraftPool
from specdec.core.processing import GrammarError
from specdec.serve import scheduler
from specdec.serve.draft_pools import PoolConfig, PoolUse, ServedPools
from specdec.serve.errors import ApiError, bad, unavailable_error
from specdec.serve.job_queue import DEFAULT_MAX_QUEUE, JobQueue, QueueFull, Reservation
from specdec.serve.jobs import Delta, Done, Failed, Job, Start, error_for
from specdec.serve.keys import ANONYMOUS
from specdec.serve.metrics import Metrics, RoundMark
from specdec.serve.origins import OriginTracker
from specdec.serve.protocol import Structure
from specdec.serve.scheduler import PassCosts, SlotView, State
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation
from specdec.serve.tenant_policies import TenantPolicies
from specdec.serve.text import TextAssembler
from specdec.serve.tokens import Tokens

if TYPE_CHECKING:
    from specdec.serve.config import ServeConfig

log = logging.getLogger(__name__)

#: The prompt cache reuses, and reports, whole blocks of this many tokens: a client that guesses
#: another's prompt learns at most whether a 256-token block matched, not the matching length
#: (and only within a scope: the previous request's KV is kept for a request of its scope alone).
PROMPT_CACHE_BLOCK = 256
RETRY_AFTER_RANGE_S = (1, 60)
_SERVICE_EMA = 0.8  # smoothing of the mean generation time that Retry-After is estimated from


# ------------------------------------------------------------------------------ the engine
class Engine:
    """The models, the worker thread, the queue; the events it hands a job are serve.jobs'.

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
        # a cycle's prompt prefill may cost this times its round (scheduler.prefill_budget)
        prefill_share: float = scheduler.PREFILL_SHARE,
        # what the scheduler times rounds and prefill passes with (a test's modelled time)
        clock: Callable[[], float] = time.perf_counter,
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
        # What one request's k="auto" learned carries to the next of its tenant
        # (serve.tenant_policies)
        self.policies = policies if policies is not None else TenantPolicies(CurveFiles())
        # What a request gets when its `speculation` object does not say (the start-up flags)
        self.defaults = SpecDefaults(spec, draft is not None)
        # Keep the target's KV of the prefix shared with the previous request, in whole blocks
        # (an editor re-sends the file, a chat the conversation): decode.stream(reuse_prefix=).
        # On by default only where it cannot change the output: kept rows were computed in
        # another batch shape than a fresh prefill would use.
        self.prompt_cache = target.batch_invariant if prompt_cache is None else prompt_cache
        # Per slot, the scope (serve.draft_pools) of the request whose KV its target holds:
        # another tenant's request prefills afresh, or its cached_tokens would say what the last
        # wrote.
        self._cache_scope: list[str | None] = [None] * parallel
        # Prompts in, text out (serve.tokens): request threads encode, the worker decodes
        self.tokens = Tokens(target.tokenizer or getattr(draft, "tokenizer", None), self.model_id)
        self.stop_ids = prompting.stop_ids(self.tokens.tokenizer)
        self._grammars: Grammars | None = None  # built on the first request with a structure
        self._grammars_lock = threading.Lock()
        # Every model the prompt must fit, for max_tokens validation.
        self.n_ctx = min(m.n_ctx for m in (target, draft) if m is not None)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        # Earlier requests' text to draft from, per scope (serve.draft_pools)
        self.pools = ServedPools(draft_pool or PoolConfig("off"), self.metrics)
        self.lock = threading.Lock()
        self._held = False  # the worker holds `lock` (_hold)
        self._jobs: JobQueue[Job] = JobQueue(max_queue, max_queue_per_key)
        self._active: list[_Active] = []  # the generations running, in their slots
        self._prefill_costs = PassCosts()  # the prefill passes run, timed (scheduler)
        self._clock = clock
        self.prefill_share = prefill_share
        self._service_s = 1.0  # EMA of generation wall time, for Retry-After
        self._stopping = False
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        #: Set by the caller that will call `run` itself (before the HTTP server starts, so that
        #: its lifespan does not start the thread as well).
        self.runs_in_caller = False

    @classmethod
    def from_config(
        cls, cfg: ServeConfig, target: SpecModel, draft: SpecModel | None = None, **overrides: Any
    ) -> Engine:
        """The engine `cfg` (serve.config.ServeConfig) describes, on these models: the one mapping
        from the server's settings to the engine's (`overrides`: an Engine argument set by
        hand, e.g. a test's own speculation or policies)."""
        kw: dict[str, Any] = {
            "model_id": cfg.target,
            "spec": cfg.spec_config(),
            "max_queue": cfg.max_queue,
            "max_queue_per_key": cfg.queue_per_key(),
            "prompt_cache": cfg.prompt_cache,
            "draft_pool": cfg.pool_config(),
            "parallel": cfg.parallel,
            "max_running_per_key": cfg.running_per_key(),
            "prefill_share": cfg.prefill_share,
        }
        return cls(target, draft, **(kw | overrides))

    @property
    def spec(self) -> SpecConfig:
        """The start-up speculation (a request's `speculation` overrides it: `defaults`)."""
        return self.defaults.spec

    @property
    def tokenizer(self) -> object | None:
        return self.tokens.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: object | None) -> None:
        self.tokens.tokenizer = tokenizer

    def grammar(self, structure: Structure) -> Grammar:
        """The grammar of a request's structure (protocol.Structure), compiled and checked
        against the model's tokenizer: ApiError 400 naming the problem. Call off the event loop
        and off the worker: the first call builds llguidance's token trie (~2 s for 150k
        tokens), and a large schema compiles for up to a second; each sample then runs on a
        copy of it."""
        try:
            grammars = self._grammars_for_model()
            if structure.functions:
                fmt = self.tokens.tool_format
                assert fmt is not None, "protocol.validate_request checked the tool format"
                return grammars.lark(fmt.grammar(list(structure.functions), structure.parallel))
            if structure.regex is not None:
                return grammars.regex(structure.regex)
            if structure.lark is not None:
                return grammars.lark(structure.lark)
            return grammars.json_schema(structure.schema)
        except ValueError as e:
            raise bad(str(e), _structure_param(structure)) from None

    def _grammars_for_model(self) -> Grammars:
        with self._grammars_lock:
            if self._grammars is None:
                tokenizer = self.tokens.tokenizer
                if tokenizer is None:
                    raise ValueError(f"{self.model_id} has no tokenizer to build a grammar with")
                with self.tokens.lock:
                    self._grammars = Grammars(tokenizer, self.target.vocab_size, self.stop_ids)
            return self._grammars

    # -------------------------------------------------------------------------- lifecycle
    def warm_up(self) -> None:
        """A 2-token generation with the default speculation, and one with the draft model if
        the default does not use it (a request may ask for it): surfaces a bad model pair or
        option at startup rather than in a request, and pays one-time costs there too."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        prompt = [bos if bos is not None else 0]
        default = resolve_speculation(None, self.defaults, False)
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
        without a drafter (it drafts nothing), the draft pool only for the drafters that run
        prompt lookup, the k="auto" policies of the request's tenant."""
        return {
            "draft": self._drafts[slot] if sp.uses_draft else None,
            "spec": sp.run_config(),
            "prediction": prediction if sp.drafts else None,
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
    def draining(self) -> bool:
        """`drain` was called: no new jobs are taken."""
        return self._stopping

    @property
    def kv_usage(self) -> float:
        """The target's KV cells holding tokens over all of its slots' cells, 0 to 1."""
        held = sum(t.n_cached for t in self._targets)
        return held / (self.target.n_ctx * len(self._targets))

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
    def reserve(self, tenant: str = ANONYMOUS) -> Reservation:
        """A place in the queue for a request of `tenant` about to be tokenized: admission comes
        first, so a flood of large prompts gets its 429 before any tokenizing, and the queue's
        bounds bound the work in flight. ApiError 503 / 429 as `submit`; release the reservation
        when done."""
        self._check_open()
        try:
            return self._jobs.reserve(tenant)
        except QueueFull as e:
            raise self._queue_full(e.scope) from None

    def submit(self, job: Job, reservation: Reservation | None = None) -> None:
        """Queue `job` (its tenant's turn comes after the others', serve.job_queue), in
        `reservation`'s place if one was reserved; ApiError 503 when the engine is stopping or its
        worker is not running (at once, not at the deadline), 429 when the queue, or its tenant's
        share, is full."""
        self._check_open()
        try:
            self._jobs.put(job, reservation)
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
        its place; a running one stops at the worker's next check. A no-op for a finished job."""
        job.abandon(reason)
        if self._jobs.remove(job):  # the worker will never see it: end it here
            self._end_unstarted(job, job.reason or reason)

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
        """Admit what the free slots take, one round for every request decoding, then the
        cycle's prefill budget for the prompts going in (serve.scheduler); False once the queue
        is closed and nothing runs."""
        if not self._admit_free():
            return False  # closed, and nothing left to finish
        ready = [a for a in self._active if a.state is State.DECODING]
        round_s = None  # nothing decodes: the prompts take the cycle
        if ready:
            t0 = self._clock()
            self._guarded(ready, lambda: self._round(ready))
            round_s = self._clock() - t0
        self._prefill_newcomers(round_s)
        self._active = [a for a in self._active if a.state is not State.ENDED]
        self._hold(bool(self._active))
        return True

    def _admit_free(self) -> bool:
        """Admit jobs while slots are free (a tenant at its running cap waits); False when the
        queue is closed and nothing runs."""
        while len(self._active) < self.parallel:
            tenants = (a.job.tenant for a in self._active)
            busy = scheduler.busy_tenants(tenants, self.running_per_key)
            job = self._jobs.get(block=not self._active, busy=busy)
            if job is None:
                return bool(self._active)
            try:
                self._admit(job)
            except Exception as e:  # _admit reports its own errors; this is a last resort
                log.exception("engine worker: unexpected error")
                # its client is told now, not at its request timeout; a job already
                # started (in _active) ends as any failed generation does
                started = next((a for a in self._active if a.job is job), None)
                if started is not None:
                    self._fail(started, e)
                else:
                    job.emit(Failed(_server_error("admission", e)))
        return True

    def _prefill_newcomers(self, round_s: float | None) -> None:
        """The cycle's prefill budget (scheduler.prefill_budget: what the round cost, `round_s`;
        None: nothing decodes) over the prompts going in, the oldest first."""
        for a in [a for a in self._active if a.state is State.PREFILLING]:
            reason = a.job.stopped()  # abandoned while waiting for its share of the budget
            if reason is not None:
                a.job.emit(Failed(error_for(reason)))
                self._end(a, reason, None)
        newcomers = [a for a in self._active if a.state is State.PREFILLING]
        if not newcomers:
            return
        budget = scheduler.prefill_budget(round_s, self._prefill_costs, self.prefill_share)
        need = [(a, max(1, a.gen.prompt_left)) for a in newcomers]
        plan = scheduler.plan_prefill(need, budget, alone=round_s is not None)
        for a, n in plan.prefill.items():
            self._guarded([a], lambda a=a, n=n: self._prefill(a, n))

    def _prefill(self, a: _Active, tokens: int) -> None:
        """Up to `tokens` of `a`'s prompt into its slot's cache, timed for the scheduler; once
        the prompt is in, its rounds begin (or it ends, cancelled while prefilling)."""
        t0 = self._clock()
        done = a.gen.prefill(tokens)
        self._prefill_costs.add(a.gen.last_prefill, self._clock() - t0)
        if not done:
            return
        if a.gen.stop_reason == "cancelled":
            reason = a.job.stopped() or "cancelled"
            a.job.emit(Failed(error_for(reason)))
            self._end(a, reason, None)
        else:
            a.state = State.DECODING

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
        """Start `job` in the free slot scheduler.place picks, or end it if it was abandoned
        while waiting or its arguments are bad."""
        reason = job.stopped()
        if reason is not None:  # abandoned while waiting, and not withdrawn in time
            self._end_unstarted(job, reason)
            return
        p = job.params
        origins = OriginTracker(self.tokens.decode) if p.origins else None
        prediction = self.tokens.prediction(p)  # outside the lock, as it was built ahead
        self._hold(True)
        scope = self.pools.scope(job.tenant)
        free = sorted(set(range(self.parallel)) - {a.slot for a in self._active})
        views = [
            SlotView(sc, t.cached_tokens)
            for sc, t in zip(self._cache_scope, self._targets, strict=True)
        ]
        block = PROMPT_CACHE_BLOCK if self.prompt_cache else 0
        slot, reuse = scheduler.place(free, views, scope, p.prompt_ids, block)
        started = time.perf_counter()
        use = self.pools.begin(job.tenant)
        try:  # prepare() checks every argument before any model work
            grammar = p.grammar
            constraint = self._grammars_for_model().constraint(grammar) if grammar else None
            gen = prepare(
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
                penalties=p.penalties,
                constraint=constraint,
                logprobs=p.logprobs,
                max_new_tokens=p.max_tokens,
                seed=p.seed,
                stop_ids=self.stop_ids,
                cancelled=lambda: job.stopped() is not None,  # polled between prefill chunks
                on_round=origins.observe if origins is not None else None,
                reuse_prefix=block if reuse else 0,
            )
        except ValueError as e:
            self.metrics.inc("specdec_generations_total", outcome="error")
            job.emit(Failed(bad(str(e))))
            self.pools.end(use, ())  # nothing ran: nothing to add
            self._hold(bool(self._active))
            return
        self._cache_scope[slot] = scope  # what the target will hold
        # in company, K at most the server's k_max for its kind of drafter (a request's own
        # fixed K, up to MAX_REQUEST_K, would set its neighbours' rounds)
        gen.k_company = self.defaults.spec.resolved_k_max(gen.drafts_with_model)
        job.emit(Start())
        text = TextAssembler(self.tokens.decode, p.stop)
        self._active.append(_Active(job, slot, gen, use, started, text, origins))

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
        if isinstance(e, GrammarError):  # the request's grammar, not the server, gave up
            log.warning("grammar failed: %s", e)
            err = ApiError(400, f"{e}; simplify the schema or grammar", code="grammar_error")
        else:
            log.error("generation failed", exc_info=e)
            err = _server_error("generation", e)
        a.job.emit(Failed(err))
        self._reset_slot(a.slot)
        self._end(a, "error", None)

    def _round(self, ready: list[_Active]) -> None:
        """One round for every prefilled request, one target pass; hand each its text. A
        request whose own part of the round raised fails alone (rounds_together)."""
        gens = [a.gen for a in ready]
        for a, got in zip(ready, rounds_together(gens), strict=True):
            if isinstance(got, Exception):
                self._fail(a, got)
                continue
            try:  # one request's delivery (its text, its stop strings) fails it alone
                self._deliver(a, got)
            except Exception as e:
                self._fail(a, e)

    def _deliver(self, a: _Active, ids: list[int]) -> None:
        """Hand a round's tokens to the job (and its origins, if asked); end it when it is done,
        stopped by a stop string, or abandoned."""
        job, g = a.job, a.gen
        a.output += ids
        a.rounds.append(RoundMark(time.perf_counter(), len(ids), g.stats.drafted - a.drafted))
        a.drafted = g.stats.drafted
        record = a.origins.record(ids) if a.origins is not None else None
        asked = job.params.logprobs is not None and ids
        entries = self.tokens.entries(g.logprobs[-len(ids) :]) if asked else ()
        job.emit(Delta(a.text.push(ids), tuple(ids), record, entries))
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
        a.state = State.ENDED
        a.gen.finish()
        p = a.job.params
        # After the generation, never during it: a request drafts from earlier ones only.
        self.pools.end(a.use, [*p.prompt_ids, *a.output])
        wall = time.perf_counter() - a.started
        self._service_s = _SERVICE_EMA * self._service_s + (1 - _SERVICE_EMA) * wall
        self.metrics.record_generation(a.gen.stats, outcome, a.job.arrived, a.started, a.rounds)
        self.metrics.inc("specdec_generations_by_drafter_total", drafter=p.speculation.drafter_name)
        if done is not None:
            a.job.emit(done)

    def _reset_slot(self, slot: int) -> None:
        # Leave nothing half-written for the slot's next request (a generation resets it too).
        for m in (self._targets[slot], self._drafts[slot]):
            if m is not None:
                with contextlib.suppress(Exception):
                    m.reset()


def _structure_param(s: Structure) -> str:
    """The request field a structure came from, for its 400."""
    if s.functions:
        return "tools"
    if s.regex is not None:
        return "guided_regex"
    return "guided_grammar" if s.lark is not None else "response_format"


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
    state: State = State.PREFILLING

    @property
    def ended(self) -> bool:
        return self.state is State.ENDED


def _server_error(what: str, e: Exception) -> ApiError:
    """The 500 for an unexpected exception `e` while `what`: its type, not its text (which may
    hold another request's data); the log has the rest."""
    msg = f"{what} failed: {type(e).__name__} (the server's log has the details)"
    return ApiError(500, msg, type="server_error", code="engine_error")
