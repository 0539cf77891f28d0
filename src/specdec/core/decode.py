"""The draft-verify loop (paper, Algorithm 1) and its baseline.

Cache choreography, an invariant checked after every round when `debug=True`:
    seq        the committed sequence (prompt + generated)
    target     holds seq[:-1]; each round extends it once with [seq[-1], x_1..x_K], and the last
               K+1 logit rows are p_1..p_{K+1} (row i predicts x_{i+1}; row K is the bonus row)
    draft      holds a prefix of seq (its drafter extends the uncached suffix before drafting)
After the accept walk both caches are truncated to the accepted length: target to len(seq) - 1.

The baseline (no draft, no drafter) is the same loop with K = 0: extend the target by the last
token and sample from p_1 through the same sampler. Greedy (temperature 0) consumes no
randomness.

A generation's arguments are checked and its drafter and K policy built in core.generate
(`generate`, `stream`, `make_generation`); this module steps it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from specdec.core.config import Warp
from specdec.core.device import synchronize
from specdec.core.drafters import Drafter, common_prefix
from specdec.core.metrics import GenerationResult, GenerationStats, Round, StopReason
from specdec.core.model import SpecModel, extend_together
from specdec.core.policy import AutoPolicies, CostModelK, KPolicy, choose_together
from specdec.core.processing import FORCED, Processor
from specdec.core.sampling import (
    TokenLogprob,
    greedy_verify,
    rejection_sample,
    token_logprobs,
    warped,
)

#: Prompt prefill runs in chunks of this many tokens, with the cancellation check between them,
#: so a request abandoned during a long prefill frees the engine within one chunk. 512 is
#: llama.cpp's default physical batch (the backend splits there anyway).
PREFILL_CHUNK = 512
#: The grammar's forced tokens one round takes at most (the rest, the next rounds'): a round's
#: pass is shared with other streams, and a grammar may force thousands (a long
#: `guided_choice`), which in one pass would stall them all and copy [rows, V] floats
#: several times over.
FORCED_PER_ROUND = 32
_T = TypeVar("_T")


class Clock:
    """Times the loop's phases into `stats` (a GenerationStats; the loop sets it): wall seconds,
    read after the devices synchronize. `stream(clock=...)` (core.generate) takes a subclass
    whose seconds are modelled instead (backends.replay.ModelledClock), so a replay runs this
    same loop, and the K policy observes the modelled times."""

    def __init__(self, devices: Sequence[torch.device] = ()) -> None:
        # the CPU computes synchronously: only an accelerator's queue needs a wait before a read
        self.devices = [d for d in devices if torch.device(d).type != "cpu"]
        self.stats = GenerationStats()
        self.last: dict[str, float] = {}  # seconds of the latest interval of each phase

    def now(self) -> float:
        for d in self.devices:
            synchronize(d)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.now()
        yield
        self.add(name, self.now() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` as the latest interval of phase `name` (a field of the stats)."""
        self.last[name] = seconds
        setattr(self.stats, name, getattr(self.stats, name) + seconds)


@dataclass(frozen=True)
class Draft:
    """One round's proposal (`Generation.propose`), what `accept` takes back: the drafts x
    ([k]: the grammar's `forced` ones first) with their q ([k, V]; None: deterministic), the
    target pass's tokens `ids` ([last committed, *x]), the drafter's `source` and the seconds
    its draft model spent catching up on context (`catchup_s`, not a per-token cost)."""

    source: str | None
    ids: list[int]
    x: torch.Tensor
    q: torch.Tensor | None
    forced: int
    catchup_s: float = 0.0


@dataclass(kw_only=True)
class Generation:
    """One generation: everything it needs, resolved and validated before any model work
    (core.generate.make_generation builds it), and its state between rounds. Its steps, in
    Algorithm 1's order: `prefill` (a chunk at a time), then rounds of `want` (what the K
    policy is asked), `propose` (draft K), one target pass over the proposed tokens (its own,
    `_round`; or shared with other generations' on slots of one model, `rounds_together`) and
    `accept` (the accept walk, commit, roll both caches back)."""

    target: SpecModel
    drafter: Drafter | None
    policy: KPolicy | None
    prompt: list[int]
    max_new_tokens: int
    warp: Warp
    width: int  # shared sampling width V (core.pair.check_pair)
    generator: torch.Generator
    stop_ids: frozenset[int]
    stats: GenerationStats
    debug: bool = False
    cancelled: Callable[[], bool] | None = None
    reuse_prefix: int = 0  # block size; 0: off
    on_round: Callable[[Round], None] | None = None  # told every round's record, after the policy
    clock: Clock | None = None  # None: wall time (Clock)
    policies: AutoPolicies | None = None  # told when the generation ends, if `policy` is theirs
    processor: Processor | None = None  # penalties and a grammar (core.processing); None: none
    top_logprobs: int | None = None  # None: no logprobs; n: each token's, and the n likeliest
    tokens: list[int] = field(default_factory=list)  # generated ids
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    stop_reason: StopReason = StopReason.LENGTH
    seq: list[int] = field(default_factory=list)  # the committed sequence: prompt + tokens
    last_prefill: int = 0  # prompt tokens the latest `prefill` call put in the cache
    _prefilled: int = -1  # prompt tokens in the target's cache; -1: the prefill has not begun
    _t_start: float = 0.0  # clock.now() when the prefill began
    _forced: list[int] = field(default_factory=list)  # the grammar's forced tokens (`want`)
    # K at most this in a pass shared with others (rounds_together; None: its own K): a fixed
    # K of 128 would set every neighbour's round, its draft steps and its rows; alone it pays
    # for itself
    k_company: int | None = None

    def __post_init__(self) -> None:
        model = self.drafter.model if _has_model(self.drafter) else None  # type: ignore[union-attr]
        devices = [self.target.device] + ([model.device] if model is not None else [])
        self.clock = self.clock if self.clock is not None else Clock(devices)
        self.clock.stats = self.stats
        self.seq = list(self.prompt)

    @property
    def prefilled(self) -> bool:
        """The prompt is in the target's cache: the rounds may begin."""
        return self._prefilled == len(self.prompt) - 1

    @property
    def drafts_with_model(self) -> bool:
        """Its drafter runs a draft model: each drafted token costs a draft step."""
        return _has_model(self.drafter)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (before the first `prefill`: all, as if nothing of
        it were cached)."""
        return len(self.prompt) - 1 - max(self._prefilled, 0)

    @property
    def done(self) -> bool:
        return self.stop_reason != StopReason.LENGTH or len(self.tokens) >= self.max_new_tokens

    def prefill(self, chunk: int = PREFILL_CHUNK) -> bool:
        """Put one chunk (at most `chunk` tokens) of the prompt in the target's cache, which
        holds seq[:-1] between rounds; True once all of it is there, or once `cancelled` said
        so before a chunk (then stop_reason is CANCELLED). The first call keeps the prefix
        the cache shares with the prompt (reuse_prefix), or empties it."""
        ids = self.prompt[:-1]
        self.last_prefill = 0
        with self.clock.phase("prefill_s"):
            if self._prefilled < 0:
                self._t_start = self.clock.now()
                self._prefilled = _keep_prefix(self.target, ids, self.reuse_prefix)
                self.stats.cached_prompt_tokens = self._prefilled
            if self._prefilled < len(ids):
                if self.cancelled is not None and self.cancelled():
                    self.stop_reason = StopReason.CANCELLED
                    return True
                end = min(len(ids), self._prefilled + chunk)
                self.target.prefill(ids[self._prefilled : end])
                self.last_prefill = end - self._prefilled
                self._prefilled = end
        if self.prefilled and _has_model(self.drafter):
            # Fresh caches per call, so a seeded run never depends on what ran before it
            # (reusing a shared prefix would change draft numerics slightly, and with them the
            # sampled drafts), unless the draft is batch-invariant and the caller lets the
            # target keep its prefix: the drafter keeps what its cache shares with the prompt.
            model = self.drafter.model  # type: ignore[union-attr]
            if not (self.reuse_prefix and model.batch_invariant):
                model.reset()
        return self.prefilled

    def want(self, cap: int | None = None) -> tuple[KPolicy | None, str | None, int]:
        """What the next round's K is chosen from: the K policy, the draft source it judges
        (None: nothing to draft) and the room left (a round emits at most K + 1 tokens).
        With a drafter, the tokens a grammar forces go first, on top of K: they cost nothing
        to make and are near certain; the policy judges what follows them. At most
        FORCED_PER_ROUND of them a round; `cap` (its k_company, in a pass shared with others)
        bounds forced and drafted tokens together."""
        # the budget, and the cache: the pass's rows must fit the target's (a slot's) context
        room = self.max_new_tokens - len(self.tokens) - 1
        room = min(room, self.target.n_ctx - self.target.n_cached - 1)
        if cap is not None:
            room = min(room, cap)
        drafter, forced = self.drafter, []
        if drafter is not None and room > 0 and self.processor is not None:
            forced = self.processor.forced()[: min(room, FORCED_PER_ROUND)]
        self._forced = forced
        room -= len(forced)
        source = drafter.source(self.seq + forced) if drafter is not None and room > 0 else None
        return self.policy, source, room

    def propose(self, k: int, source: str | None) -> Draft:
        """Draft up to k tokens x_1..x_k after the grammar's forced ones (1. draft); its `ids`
        are the round's target pass: [last committed, forced..., x_1..x_k] (the drafter may
        propose fewer than k)."""
        forced = self._forced
        x, q, catchup_s = torch.empty(0, dtype=torch.long), None, 0.0  # [k], [k, V] | None
        self.clock.last["draft_s"] = 0.0
        if k > 0 and self.drafter is not None:
            with self.clock.phase("draft_s"):
                if self.processor is not None:
                    self.processor.ahead = forced  # a draft model's q adjusted after them
                x, q, catchup_s = self.drafter.propose(self.seq + forced, k)
        if forced:  # deterministic drafts: one-hot rows where q is kept
            x = torch.cat([torch.tensor(forced, dtype=torch.long), x])
            if q is not None:  # [forced, V], each row built alone (never a [V, V] identity)
                one_hot = torch.zeros(len(forced), q.shape[-1], dtype=q.dtype)
                one_hot[torch.arange(len(forced)), x[: len(forced)]] = 1.0
                q = torch.cat([one_hot, q])
        if self.processor is not None and x.numel():  # a forbidden draft would be rejected
            keep = self.processor.valid(x.tolist())
            x, q = x[:keep], q[:keep] if q is not None else None
        f = min(len(forced), x.numel())
        return Draft(source, [self.seq[-1], *x.tolist()], x, q, f, catchup_s)

    def accept(self, draft: Draft, logits: torch.Tensor, rows: int = 0) -> list[int]:
        """3. The accept walk over the target's rows p_1..p_{k+1} for `draft`'s tokens
        (`logits`, [k + 1, V]; clock.last["verify_s"] is the pass's time and `rows` its rows,
        0: k + 1); 4. commit, then roll both caches back to the accepted length. Returns the
        committed tokens."""
        # the first f of the k drafts were forced by the grammar
        source, x, q, f, catchup_s = draft.source, draft.x, draft.q, draft.forced, draft.catchup_s
        k = x.numel()
        clock, stats, warp = self.clock, self.stats, self.warp
        raw = logits[:, : self.width]  # [k+1, V] the model's own rows
        with clock.phase("sampling_s"):
            # each row adjusted from its own prefix: the rule then samples the adjusted p
            adjust = self.processor
            logits = raw if adjust is None else adjust.rows(raw, x.tolist(), warp.greedy)
            if warp.greedy:
                emitted, n_acc = greedy_verify(x, logits)
            else:
                emitted, n_acc = rejection_sample(x, q, warped(logits, warp), self.generator)
        new = self._commit(emitted.tolist())
        if self.top_logprobs is not None:
            self.logprobs += token_logprobs(raw[: len(new)], new, self.top_logprobs)
        if self.processor is not None:
            self.processor.commit(new)
        self.seq += new
        self.target.truncate(len(self.seq) - 1)
        if k > f:  # the drafter's own drafts followed the forced ones
            self.drafter.observe(max(0, n_acc - f))  # type: ignore[union-attr]
            if n_acc < f and _has_model(self.drafter):  # it drafted after a rejected token
                m = self.drafter.model  # type: ignore[union-attr]
                m.truncate(common_prefix(m.cached_tokens, self.seq))
        draft_s = max(0.0, clock.last["draft_s"] - catchup_s)  # per-token cost, no catch-up
        name = source or (FORCED if f else "none")
        verify_s = clock.last["verify_s"]
        r = Round(name, k, n_acc, len(new), draft_s, verify_s, rows, forced=f)
        stats.catchup_s += catchup_s
        stats.record(r)
        if self.policy is not None and source is not None and n_acc >= f:
            # the policy judged the drafts after the forced ones: its own round, the pass's rows
            own = Round(source, k - f, n_acc - f, len(new) - f, draft_s, verify_s, rows or k + 1)
            self.policy.observe(own)
        if self.on_round is not None:
            self.on_round(r)
        if self.debug:
            _check_caches(self.target, self.drafter, self.seq)
        now = clock.now()
        if stats.rounds == 1:
            stats.ttft_s = now - self._t_start
        stats.wall_s = now - self._t_start
        return new

    def finish(self) -> None:
        """The generation ended (or its consumer let go of it): what k="auto" learned of the
        verify costs goes to the kept policies' store."""
        if self.policies is not None and isinstance(self.policy, CostModelK):
            self.policies.finished(self.target, self.policy)

    def _commit(self, emitted: list[int]) -> list[int]:
        """The emitted tokens that are committed: cut at the budget and after a stop id."""
        new = emitted[: self.max_new_tokens - len(self.tokens)]
        stop_at = next((i for i, t in enumerate(new) if t in self.stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
            self.stop_reason = StopReason.STOP
        self.tokens += new
        return new


class SpecStream:
    """Iterator of committed token chunks; `.result` is set once it is exhausted."""

    def __init__(self, gen: Generation) -> None:
        self.generation = gen
        self._chunks = _loop(gen)
        self.stats: GenerationStats = gen.stats
        self.result: GenerationResult | None = None

    def __iter__(self) -> SpecStream:
        return self

    def __next__(self) -> list[int]:
        try:
            return next(self._chunks)
        except StopIteration:
            g = self.generation
            self.result = GenerationResult(g.tokens, g.stop_reason, g.stats, g.logprobs)
            raise

    def close(self) -> None:
        """Stop generating (e.g. the client went away); caches stay consistent."""
        self._chunks.close()


def _loop(gen: Generation) -> Iterator[list[int]]:
    while not gen.prefill():
        pass
    if gen.stop_reason is StopReason.CANCELLED:
        return
    try:
        while not gen.done:
            yield _round(gen)
    finally:  # also when the consumer closes the stream early
        gen.finish()


def _round(gen: Generation) -> list[int]:
    """One round of Algorithm 1 with a target pass of its own."""
    policy, source, room = gen.want()
    k = policy.choose(source, room) if policy is not None and source is not None else 0
    draft = gen.propose(k, source)  # 1. draft
    with gen.clock.phase("verify_s"):  # 2. verify: [last committed, x_1..x_k] -> p_1..p_{k+1}
        logits = gen.target.extend(draft.ids)
    return gen.accept(draft, logits)  # 3. accept walk, 4. commit and roll back


def rounds_together(gens: Sequence[Generation]) -> list[list[int] | Exception]:
    """One round of each generation (prefilled, not done), their targets being slots of one
    model (SpecModel.slots), in one target pass: each drafts its own K (core.policy.
    choose_together: its own policy's, k="auto" priced by its rows' share of the pass; at most
    its `k_company` when it has company) and
    the pass verifies the sum of their rows, nobody padded to a neighbour's K; each keeps its
    own rows and accepts with its own rule and generator. On a batch-invariant backend a row
    has the same bits as in a pass of its own: a greedy answer is the same alone or in company.
    Returns each one's committed tokens, or the exception its own part of the round raised (its
    drafter, its accept walk): that one is left out of the rest of the round, the others' rounds
    stand. Only the shared pass raising raises."""
    if len(gens) == 1:
        return [_own(partial(_round, gens[0]))]
    done: dict[int, list[int] | Exception] = {}  # what each one ends the round with
    wants = {}
    for i, g in enumerate(gens):
        # its room bounded by its own slot's cache, and forced + drafted by its k_company
        w = _own(partial(g.want, g.k_company))
        if isinstance(w, Exception):
            done[i] = w
        else:
            wants[i] = w
    ks = dict(zip(wants, choose_together(list(wants.values())), strict=True))
    drafts: dict[int, Draft] = {}
    for i, (_, src, _) in wants.items():  # as `_round`: nothing drafted without a source
        d = _own(partial(gens[i].propose, ks[i] if src is not None else 0, src))
        if isinstance(d, Exception):
            done[i] = d
        else:
            drafts[i] = d
    if drafts:
        rows = sum(len(d.ids) for d in drafts.values())
        t0 = gens[0].clock.now()
        logits = extend_together([(gens[i].target, d.ids) for i, d in drafts.items()])
        seconds = gens[0].clock.now() - t0
        for (i, d), lg in zip(drafts.items(), logits, strict=True):
            gens[i].clock.add("verify_s", seconds)
            done[i] = _own(partial(gens[i].accept, d, lg, rows=rows))
    return [done[i] for i in range(len(gens))]


def _own(part: Callable[[], _T]) -> _T | Exception:
    """One generation's part of a joint round: its result, or what it raised (which is its
    own: rounds_together leaves it out and goes on with the others)."""
    try:
        return part()
    except Exception as e:
        return e


def _keep_prefix(target: SpecModel, ids: list[int], block: int) -> int:
    """Keep the target's cached prefix shared with `ids` in whole blocks of `block` tokens (0:
    none; empty the cache); returns its length."""
    keep = common_prefix(target.cached_tokens, ids) // block * block if block > 0 else 0
    if keep:
        target.truncate(keep)
    else:
        target.reset()
    return keep


def _has_model(drafter: Drafter | None) -> bool:
    return drafter is not None and drafter.model is not None


def _check_caches(target: SpecModel, drafter: Drafter | None, seq: list[int]) -> None:
    """Both caches must hold a prefix of the committed sequence; the target exactly seq[:-1]."""
    if target.cached_tokens != seq[:-1]:
        raise AssertionError(
            f"target cache holds {target.n_cached} tokens that are not seq[:-1] "
            f"(len {len(seq) - 1}): the last-K+1-rows alignment or the truncation is wrong"
        )
    model = drafter.model if drafter is not None else None
    if model is not None and model.cached_tokens != seq[: model.n_cached]:
        raise AssertionError("draft cache is not a prefix of the committed sequence")
