"""How many tokens to draft each round: fixed K, transformers' +2/-1 schedule, or K from cost.

Every policy gets `prepare(target, context) -> seconds` once per generation, after the prompt
prefill (k="auto" measures the verify curve there the first time it meets a target), answers
`choose(source, remaining) -> K` before each round and hears `observe(round)` after it.
Policies see only costs and past acceptance — never the target's distribution for the current
round — so any of them leaves the output distribution exactly the target's.

`CostModelK` ("k=auto") keeps online estimates of
    v(b)      seconds for one target pass over b tokens (b = K + 1 in a round)
    t_d       seconds per drafted token, per draft source
    alpha_i   P(draft i accepted | drafts 1..i-1 accepted), per draft source
and picks the K in {0 .. K_max} that maximizes expected tokens per second,

    E[tokens | K] / (v(K + 1) + K * t_d),   E[tokens | K] = 1 + sum_{i<=K} prod_{j<=i} alpha_j

(core.cost's formulas, the microbench's too, here in seconds). K = 0 is a plain target step:
where speculation cannot pay, it turns itself off.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from specdec.core.cost import cost_in_target_steps, expected_tokens_per_round
from specdec.core.cost import p_at_least_from_conditional as p_at_least
from specdec.core.device import synchronize
from specdec.core.metrics import Round
from specdec.core.model import SpecModel

#: Exponential forgetting per observation, so estimates follow a prompt whose character changes.
DECAY = 0.95
#: Forgetting per round of every source, drafted or not: a source switched off drifts back to
#: the prior and is tried again (~140 rounds after one rejection switched it off; in simulation
#: on 37 greedy outputs of the 1.5B, 0.99 and 0.98 re-explored often enough to cost 1-2%).
IDLE_DECAY = 0.995
#: Prior acceptance (pseudo-counts) for a source never seen: optimistic enough to try drafting.
PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 2.0


class KPolicy(Protocol):
    k_max: int

    def prepare(self, target: SpecModel, context: list[int]) -> float: ...

    def choose(self, source: str, remaining: int) -> int: ...

    def observe(self, r: Round) -> None: ...


class _NoPreparation:
    def prepare(self, target: SpecModel, context: list[int]) -> float:
        """Seconds spent getting ready for a generation: none for policies without costs."""
        return 0.0


@dataclass
class FixedK(_NoPreparation):
    k_max: int

    def choose(self, source: str, remaining: int) -> int:
        return min(self.k_max, remaining)

    def observe(self, r: Round) -> None:
        pass


@dataclass
class ScheduleK(_NoPreparation):
    """transformers' "heuristic" schedule: K += 2 after a fully accepted round, else K -= 1."""

    k_max: int
    k: int = 4

    def choose(self, source: str, remaining: int) -> int:
        return min(self.k, self.k_max, remaining)

    def observe(self, r: Round) -> None:
        if r.k == 0:
            return
        self.k = min(self.k_max, self.k + 2) if r.n_accepted == r.k else max(1, self.k - 1)


@dataclass
class _SourceStats:
    accepted: list[float]  # decayed count of acceptances at position i (given i-1 accepted)
    tried: list[float]  # decayed count of positions i that were verified
    draft_s_per_token: float | None = None


@dataclass
class CostModelK:
    """K maximizing expected tokens per second under measured costs (module docstring)."""

    k_max: int
    verify_s: dict[int, float] = field(default_factory=dict)  # b -> seconds (EMA)
    sources: dict[str, _SourceStats] = field(default_factory=dict)

    # ------------------------------------------------------------------ estimates
    def v(self, b: int) -> float:
        """Seconds for a target pass over b tokens: measured, else interpolated linearly."""
        if b in self.verify_s:
            return self.verify_s[b]
        known = sorted(self.verify_s)
        if not known:
            return float(b)  # no data: serial cost, so nothing looks free
        lo = max((x for x in known if x < b), default=None)
        hi = min((x for x in known if x > b), default=None)
        if lo is not None and hi is not None:
            w = (b - lo) / (hi - lo)
            return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]
        ref = lo if lo is not None else hi
        return self.verify_s[ref] * b / ref  # beyond the data: assume serial, pessimistic

    def alphas(self, source: str) -> list[float]:
        """Conditional acceptance per position; position i's prior is position i-1's estimate.

        Why chained: with a fixed prior, a position never drafted keeps PRIOR_ALPHA forever, so a
        source whose first positions are accepted 95% of the time still looks like 60% beyond
        the K it happened to start with, and K never grows (measured in simulation on
        copy-heavy outputs: stuck at K = 3). Positions deeper in a run of accepted drafts are
        rarely less likely to be accepted, so the previous position is the better guess.
        """
        st = self.sources.get(source)
        if st is None:
            return [PRIOR_ALPHA] * self.k_max
        out, prior = [], PRIOR_ALPHA
        for a, n in zip(st.accepted, st.tried, strict=True):
            prior = (a + prior * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def expected_rate(self, source: str, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens from `source`."""
        e = expected_tokens_per_round(p_at_least(self.alphas(source)[:k]), k)
        st = self.sources.get(source)
        t_d = st.draft_s_per_token if st and st.draft_s_per_token is not None else 0.0
        return e / cost_in_target_steps([self.v(b) for b in range(1, k + 2)], t_d, k)

    # ------------------------------------------------------------------ policy
    def prepare(self, target: SpecModel, context: list[int]) -> float:
        """Measure v(b) once, the first time this policy meets a target (then refined online);
        return the seconds it took (0 once known)."""
        if self.verify_s:
            return 0.0
        t0 = time.perf_counter()
        self.verify_s.update(calibrate_verify(target, self.k_max, context))
        return time.perf_counter() - t0

    def depth_cap(self, source: str) -> int:
        """Draft at most one position beyond those with evidence: 1 + the leading positions
        judged at least once (decayed count >= 0.5). Why: position i's acceptance is guessed
        from position i-1's until it is judged, and an untried source would otherwise be
        explored at the K the prior favours (K = 3 on this CPU's curve) — each failed
        exploration then costs v(4) - v(1) instead of v(2) - v(1)."""
        st = self.sources.get(source)
        if st is None:
            return 1
        depth = 0
        while depth < self.k_max and st.tried[depth] >= 0.5:
            depth += 1
        return min(self.k_max, depth + 1)

    def choose(self, source: str, remaining: int) -> int:
        best_k, best = 0, self.expected_rate(source, 0)
        for k in range(1, min(self.k_max, remaining, self.depth_cap(source)) + 1):
            r = self.expected_rate(source, k)
            if r > best:
                best_k, best = k, r
        return best_k

    def observe(self, r: Round) -> None:
        source, k, n_accepted = r.source, r.k, r.n_accepted
        b = k + 1
        old = self.verify_s.get(b)
        self.verify_s[b] = r.verify_s if old is None else DECAY * old + (1 - DECAY) * r.verify_s
        # Every round forgets a little of every source, drafted or not: a source whose estimate
        # fell below break-even drifts back to the prior and is tried again. Forgetting only on
        # use froze it: one early rejection per source switched prompt lookup off for the rest
        # of the process (measured: 0 tokens drafted on 11 prompts after the warm-up).
        for other in self.sources.values():
            for i in range(self.k_max):
                other.accepted[i] *= IDLE_DECAY
                other.tried[i] *= IDLE_DECAY
        if k == 0:
            return
        st = self.sources.setdefault(source, _SourceStats([0.0] * self.k_max, [0.0] * self.k_max))
        for i in range(self.k_max):
            st.accepted[i] *= DECAY
            st.tried[i] *= DECAY
        # Positions 1..n_accepted were accepted; position n_accepted+1 (if drafted) was rejected;
        # later positions were never judged and say nothing about their conditional rate.
        for i in range(min(n_accepted + 1, k)):
            st.tried[i] += 1
            st.accepted[i] += i < n_accepted
        per_tok = r.draft_s / k
        st.draft_s_per_token = (
            per_tok
            if st.draft_s_per_token is None
            else DECAY * st.draft_s_per_token + (1 - DECAY) * per_tok
        )


# ---------------------------------------------------------------------- calibration
#: Verify-cost curves measured once per loaded model (and K_max) in this process.
_CALIBRATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
CALIBRATION_REPEATS = 3


def calibrate_verify(target: SpecModel, k_max: int, context: list[int]) -> dict[int, float]:
    """Median seconds of target passes over b = 1..k_max+1 tokens on top of `context`.

    Measured once per model and cached (a second call returns the cached curve); the target's
    cache must hold `context[:-1]` or less and is restored to its length on return.
    """
    cached = _CALIBRATED.get(target)
    if cached is not None and max(cached) >= k_max + 1:
        return cached
    n0 = target.n_cached
    filler = (context * (k_max + 2))[: k_max + 1]  # real token ids, content is irrelevant
    samples: dict[int, list[float]] = {b: [] for b in range(1, k_max + 2)}
    for _ in range(CALIBRATION_REPEATS):
        for b in samples:
            synchronize(target.device)
            t0 = time.perf_counter()
            target.extend(filler[:b])
            synchronize(target.device)
            samples[b].append(time.perf_counter() - t0)
            target.truncate(n0)
    curve = {b: sorted(ts)[len(ts) // 2] for b, ts in samples.items()}
    _CALIBRATED[target] = curve
    return curve


def make_policy(k: int | str, k_max: int) -> KPolicy:
    """k: an int (fixed K), "auto" (CostModelK) or "schedule" (transformers' +2/-1)."""
    if k == "auto":
        return CostModelK(k_max)
    if k == "schedule":
        return ScheduleK(k_max, k=min(4, k_max))
    return FixedK(int(k))
