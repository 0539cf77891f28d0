"""The worker's cycle: admit what the free slots take, one round for every request decoding
(one target pass for all of them), then the cycle's prefill budget for the prompts going in;
and `finish`, the one way a request ends.

serve.scheduler decides (which slot, how many prompt tokens); serve.models builds and runs the
generations; serve.delivery turns a round's tokens into the request's events. The cycle moves
each request's Status (serve.requests) along: PREFILLING, DECODING, then a final one by
`finish`, which hands its text to its draft pool, counts it in /metrics, emits its last event
and frees its slot (taken out of the running list before the next admission).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.core.decode import Generation, rounds_together
from specdec.core.drafters import common_prefix
from specdec.core.metrics import StopReason
from specdec.core.processing import GrammarError
from specdec.serve import scheduler
from specdec.serve.delivery import Output
from specdec.serve.draft_pools import ServedPools
from specdec.serve.errors import ApiError, bad
from specdec.serve.job_queue import JobQueue
from specdec.serve.metrics import Metrics
from specdec.serve.models import ServedModels
from specdec.serve.prompt_store import Entry
from specdec.serve.requests import FINISHED_BY, Done, Failed, Request, Start, Status
from specdec.serve.scheduler import PassCosts, SlotView

if TYPE_CHECKING:
    from specdec.serve.config import ServeConfig

log = logging.getLogger(__name__)

#: The prompt cache reuses, and reports, whole blocks of this many tokens (vLLM's block): a
#: client that guesses another's prompt learns at most whether a block matched, not the matching
#: length, and only within a scope (a slot's or the RAM store's KV is reused by its scope alone).
PROMPT_CACHE_BLOCK = 16
_SERVICE_EMA = 0.8  # smoothing of the mean generation time that Retry-After is estimated from


class Cycle:
    """The requests running, one per slot, and how each cycle moves them."""

    def __init__(
        self,
        models: ServedModels,
        queue: JobQueue[Request],
        pools: ServedPools,
        metrics: Metrics,
        lock: threading.Lock,
        cfg: ServeConfig,
        clock: Callable[[], float],
    ) -> None:
        self.models = models
        self.parallel = len(models.targets)
        self.running_per_key = cfg.running_per_key()
        self.prompt_cache = cfg.prompt_cache_on(models.target.batch_invariant)
        self.prefill_share = cfg.prefill_share
        self.running: list[Request] = []  # in their slots
        self.service_s = 1.0  # EMA of generation wall time, for Retry-After
        self._queue = queue
        self._pools = pools
        self._metrics = metrics
        self._lock = lock
        self._held = False  # this worker holds `lock` (_hold)
        self._clock = clock
        self._prefill_costs = PassCosts()  # the prefill passes run, timed (scheduler)
        # Per slot, the scope (serve.draft_pools) of the request whose KV its target holds:
        # another tenant's request prefills afresh, or its cached_tokens would say what the last
        # wrote.
        self._cache_scope: list[str | None] = [None] * self.parallel
        # Slots' caches kept in RAM for later requests of their scope (serve --cache-ram)
        self._store = cfg.prompt_store() if self.prompt_cache else None

    def step(self) -> bool:
        """One cycle; False once the queue is closed and nothing runs."""
        if not self._admit_free():
            return False
        ready = [r for r in self.running if r.status is Status.DECODING]
        round_s = None  # nothing decodes: the prompts take the cycle
        if ready:
            t0 = self._clock()
            self._guarded(ready, lambda: self._round(ready))
            round_s = self._clock() - t0
        self._prefill_newcomers(round_s)
        return True  # the requests that ended leave `running` at the next admission

    def store_gauges(self) -> dict[str, float]:
        """The RAM store's size, for /metrics."""
        store = self._store
        return {
            "specdec_prompt_store_bytes": store.nbytes if store is not None else 0,
            "specdec_prompt_store_entries": len(store) if store is not None else 0,
        }

    def stop_all(self) -> None:
        """The worker is going away: every running request fails, the lock is let go."""
        for r in self.running:
            err = ApiError(500, "the engine stopped", type="server_error", code="engine_error")
            with contextlib.suppress(Exception):  # its Failed goes out whatever its end raised
                self.finish(r, Status.FAILED, err)
        self.running.clear()
        self._hold(False)

    def finish(self, r: Request, status: Status, error: ApiError | None = None) -> None:
        """End `r` with a final `status` (FAILED: with `error`): the one place a request ends,
        on the worker, or on the event loop for a request still in the queue (the queue hands a
        request to one side only). Its text goes to its draft pool, its numbers to /metrics,
        then its last event (a client that has its answer finds it in /metrics), which goes out
        even if the bookkeeping raises; its slot is free from the next admission on."""
        assert status.finished and (status is not Status.FAILED or error is not None), status
        if r.status.finished:
            return
        r.status = status
        # The record outlives its run (its HTTP handler holds it): what it ran with is let go
        # now, so an evicted draft pool or a prediction index is freed at once, not at a GC
        # (the generation's cancellation check refers back to the record).
        gen, use, r.gen, r.use = r.gen, r.use, None, None
        try:
            if use is not None:  # after the generation, never during it: drafts from earlier
                self._pools.end(use, [*r.params.prompt_ids, *r.out.ids] if gen and r.out else ())
            if gen is None:  # ended before its generation began
                self._metrics.inc("specdec_generations_total", outcome=status.outcome)
            else:
                self._settle(r, gen, status)
        finally:
            if status.finish_reason is not None and gen is not None:
                r.emit(Done(status, gen.stats))
            else:
                r.emit(Failed(error if error is not None else status.error()))

    def _settle(self, r: Request, gen: Generation, status: Status) -> None:
        """A generation's end: its K policy's learning kept, its slot reset if it failed, its
        numbers to /metrics."""
        gen.finish()
        if status is Status.FAILED:  # a pass that raised may have left it half-written
            self.models.reset_slot(r.slot)
        wall = time.perf_counter() - r.started
        self.service_s = _SERVICE_EMA * self.service_s + (1 - _SERVICE_EMA) * wall
        rounds = r.out.rounds if r.out else []
        self._metrics.record_generation(gen.stats, status.outcome, r.arrived, r.started, rounds)
        drafter = r.params.speculation.drafter_name
        self._metrics.inc("specdec_generations_by_drafter_total", drafter=drafter)

    # -------------------------------------------------------------------------- admission
    def _admit_free(self) -> bool:
        """Admit requests while slots are free (a tenant at its running cap waits); False when
        the queue is closed and nothing runs."""
        while True:
            self.running = [r for r in self.running if not r.status.finished]
            if len(self.running) >= self.parallel:
                return True
            self._hold(bool(self.running))  # not while idle, waiting below
            tenants = (r.tenant for r in self.running)
            busy = scheduler.busy_tenants(tenants, self.running_per_key)
            r = self._queue.get(block=not self.running, busy=busy)
            if r is None:
                return bool(self.running)
            try:
                self._admit(r)
            except Exception as e:  # _admit reports its own errors; this is a last resort
                log.exception("engine worker: unexpected error")
                self.finish(r, Status.FAILED, _server_error("admission", e))

    def _admit(self, r: Request) -> None:
        """Start `r` in the free slot scheduler.place picks, or end it if it was abandoned
        while waiting or its arguments are bad."""
        stop = r.abandoned()
        if stop is not None:  # abandoned while waiting, and not withdrawn in time
            self.finish(r, stop)
            return
        p = r.params
        r.out = Output.for_request(self.models.tokens, p)
        if p.prediction is not None:
            p.prediction.build()  # outside the lock, if it was not built ahead
        self._hold(True)
        scope = self._pools.scope(r.tenant)
        free = sorted(set(range(self.parallel)) - {x.slot for x in self.running})
        views = [
            SlotView(sc, t.cached_tokens)
            for sc, t in zip(self._cache_scope, self.models.targets, strict=True)
        ]
        block = PROMPT_CACHE_BLOCK if self.prompt_cache else 0
        r.slot, reuse = scheduler.place(free, views, scope, p.prompt_ids, block)
        if self._store is not None and self._through_store(r.slot, scope, p.prompt_ids, reuse):
            reuse = True
            self._cache_scope[r.slot] = scope  # what the target holds now, whatever follows
        r.started = time.perf_counter()
        r.use = self._pools.begin(r.tenant)
        self.running.append(r)  # from here on, its slot is taken until `finish`
        try:  # make_generation checks every argument before any model work
            pool = r.use.pool if r.use is not None else None
            r.gen = self.models.generation(
                p, r.slot, r.tenant, pool, block if reuse else 0,
                cancelled=lambda: r.abandoned() is not None, on_round=r.out.on_round,
            )  # fmt: skip
        except ValueError as e:
            self.finish(r, Status.FAILED, bad(str(e)))
            return
        self._cache_scope[r.slot] = scope  # what the target will hold
        r.status = Status.PREFILLING
        r.emit(Start())

    def _through_store(self, slot: int, scope: str, prompt: list[int], reuse: bool) -> bool:
        """Before a request of `scope` takes `slot`: what the slot holds goes to the RAM store
        if the request would overwrite most of it, and the scope's stored cache that shares more
        of `prompt` than the slot keeps (by a block at least) comes back into the slot. True:
        it came back (the request reuses it as its own scope's KV)."""
        assert self._store is not None
        target, draft = self.models.targets[slot], self.models.drafts[slot]
        kept = common_prefix(target.cached_tokens, prompt) if reuse else 0
        entry, shared = self._store.best(scope, prompt)
        back = entry is not None and shared // PROMPT_CACHE_BLOCK > kept // PROMPT_CACHE_BLOCK
        held = self._cache_scope[slot]
        left = kept if not back else 0  # what of the slot's cache survives the request
        mostly_lost = target.n_cached >= PROMPT_CACHE_BLOCK and 2 * left < target.n_cached
        if held is not None and mostly_lost:  # a keystroke's request keeps most: not saved
            if not self._store.holds(held, target.cached_tokens):
                saved = target.save()
                if saved is not None:  # a draft cache is kept only where reusing it is exact
                    q = draft.save() if draft is not None and draft.batch_invariant else None
                    self._store.put(Entry(held, saved, q))
        if not back:
            return False
        assert entry is not None
        target.restore(entry.target)
        if draft is not None:
            if entry.draft is not None:
                draft.restore(entry.draft)
            else:
                draft.reset()
        self._metrics.inc("specdec_prompt_store_restored_total")
        return True

    # -------------------------------------------------------------------------- the passes
    def _prefill_newcomers(self, round_s: float | None) -> None:
        """The cycle's prefill budget (scheduler.prefill_budget: what the round cost, `round_s`;
        None: nothing decodes) over the prompts going in, the oldest first."""
        for r in [r for r in self.running if r.status is Status.PREFILLING]:
            stop = r.abandoned()  # abandoned while waiting for its share of the budget
            if stop is not None:
                self.finish(r, stop)
        newcomers = [r for r in self.running if r.status is Status.PREFILLING]
        if not newcomers:
            return
        budget = scheduler.prefill_budget(round_s, self._prefill_costs, self.prefill_share)
        need = [(r, max(1, r.gen.prompt_left)) for r in newcomers if r.gen is not None]
        plan = scheduler.plan_prefill(need, budget, alone=round_s is not None)
        for r, n in plan.prefill.items():
            self._guarded([r], lambda r=r, n=n: self._prefill(r, n))

    def _prefill(self, r: Request, tokens: int) -> None:
        """Up to `tokens` of `r`'s prompt into its slot's cache, timed for the scheduler; once
        the prompt is in, its rounds begin (or it ends, cancelled while prefilling)."""
        assert r.gen is not None
        t0 = self._clock()
        done = r.gen.prefill(tokens)
        self._prefill_costs.add(r.gen.last_prefill, self._clock() - t0)
        if not done:
            return
        if r.gen.stop_reason is StopReason.CANCELLED:
            self.finish(r, r.abandoned() or Status.CANCELLED)
        else:
            r.status = Status.DECODING

    def _round(self, ready: list[Request]) -> None:
        """One round for every prefilled request, one target pass; hand each its text. A
        request whose own part of the round raised fails alone (rounds_together)."""
        for r, got in zip(ready, rounds_together([r.gen for r in ready]), strict=True):
            if isinstance(got, Exception):
                self._fail(r, got)
                continue
            try:  # one request's delivery (its text, its stop strings) fails it alone
                self._deliver(r, got)
            except Exception as e:
                self._fail(r, e)

    def _deliver(self, r: Request, ids: list[int]) -> None:
        """Hand a round's tokens to `r`; end it when it is done, stopped by a stop string, or
        abandoned."""
        assert r.gen is not None and r.out is not None
        r.emit(r.out.push(ids, r.gen))
        if not r.out.stopped and not r.gen.done:
            stop = r.abandoned()
            if stop is not None:
                self.finish(r, stop)
            return
        rest = r.out.flush()
        if rest is not None:
            r.emit(rest)
        # A stop string, else the generation's reason: a stop id or the length.
        self.finish(r, Status.FINISHED_STOP if r.out.stopped else FINISHED_BY[r.gen.stop_reason])

    def _guarded(self, group: list[Request], step: Callable[[], object]) -> None:
        """Run `step` for `group`; on an exception, fail every request of the group."""
        try:
            step()
        except Exception as e:
            for r in group:
                self._fail(r, e)

    def _fail(self, r: Request, e: Exception) -> None:
        """End `r` for `e`, raised by its generation: 400 when its grammar gave up, else 500."""
        if r.status.finished:  # raised by its own end's bookkeeping: its client was told
            log.error("ending a request failed", exc_info=e)
            return
        if isinstance(e, GrammarError):  # the request's grammar, not the server, gave up
            # its message quotes the tenant's schema and text: theirs alone, not the log's
            log.warning("a request's grammar gave up; its client is told why (400)")
            err = ApiError(400, f"{e}; simplify the schema or grammar", code="grammar_error")
        else:
            log.error("generation failed", exc_info=e)
            err = _server_error("generation", e)
        self.finish(r, Status.FAILED, err)

    def _hold(self, held: bool) -> None:
        """Hold `lock` while any generation runs, and only then (code outside the worker takes
        it to use the models)."""
        if held and not self._held:
            self._lock.acquire()
        elif self._held and not held:
            self._lock.release()
        self._held = held


def _server_error(what: str, e: Exception) -> ApiError:
    """The 500 for an unexpected exception `e` while `what`: its type, not its text (which may
    hold another request's data); the log has the rest."""
    msg = f"{what} failed: {type(e).__name__} (the server's log has the details)"
    return ApiError(500, msg, type="server_error", code="engine_error")
