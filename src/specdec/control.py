"""How many tokens to draft each round: fixed K, transformers' +2/-1 schedule, or K from cost.

Every policy answers `choose(source, remaining) -> K` before a round and hears `observe(...)`
after it. Policies see only costs and past acceptance — never the target's distribution for the
current round — so any of them leaves the output distribution exactly the target's.

`CostModelK` ("k=auto") keeps online estimates of
    v(b)      seconds for one target pass over b tokens (b = K + 1 in a round)
    t_d       seconds per drafted token, per draft source
    alpha_i   P(draft i accepted | drafts 1..i-1 accepted), per draft source
and picks the K in {0 .. K_max} that maximizes expected tokens per second,

    E[tokens | K] / (v(K + 1) + K * t_d),   E[tokens | K] = 1 + sum_{i<=K} prod_{j<=i} alpha_j

(the microbench's cost model, in seconds). K = 0 is a plain target step: where speculation
cannot pay, it turns itself off.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from .device import synchronize
from .models.base import SpecModel

#: Exponential forgetting per observation, so estimates follow a prompt whose character changes.
DECAY = 0.95
#: Prior acceptance (pseudo-counts) for a source never seen: optimistic enough to try drafting.
PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 2.0


class KPolicy(Protocol):
    k_max: int

    def choose(self, source: str, remaining: int) -> int: ...

    def observe(
        self, source: str, k: int, n_accepted: int, draft_s: float, verify_s: float
    ) -> None: ...


@dataclass
class FixedK:
    k_max: int

    def choose(self, source: str, remaining: int) -> int:
        return min(self.k_max, remaining)

    def observe(self, source: str, k: int, n_accepted: int, draft_s: float, verify_s: float):
        pass


@dataclass
class ScheduleK:
    """transformers' "heuristic" schedule: K += 2 after a fully accepted round, else K -= 1."""

    k_max: int
    k: int = 4

    def choose(self, source: str, remaining: int) -> int:
        return min(self.k, self.k_max, remaining)

    def observe(self, source: str, k: int, n_accepted: int, draft_s: float, verify_s: float):
        if k == 0:
            return
        self.k = min(self.k_max, self.k + 2) if n_accepted == k else max(1, self.k - 1)


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
        st = self.sources.get(source)
        if st is None:
            return [PRIOR_ALPHA] * self.k_max
        return [
            (a + PRIOR_ALPHA * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
            for a, n in zip(st.accepted, st.tried, strict=True)
        ]

    def expected_rate(self, source: str, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens from `source`."""
        alphas = self.alphas(source)
        e, survive = 1.0, 1.0
        for a in alphas[:k]:
            survive *= a
            e += survive
        st = self.sources.get(source)
        t_d = st.draft_s_per_token if st and st.draft_s_per_token is not None else 0.0
        return e / (self.v(k + 1) + k * t_d)

    # ------------------------------------------------------------------ policy
    def choose(self, source: str, remaining: int) -> int:
        best_k, best = 0, self.expected_rate(source, 0)
        for k in range(1, min(self.k_max, remaining) + 1):
            r = self.expected_rate(source, k)
            if r > best:
                best_k, best = k, r
        return best_k

    def observe(self, source: str, k: int, n_accepted: int, draft_s: float, verify_s: float):
        b = k + 1
        old = self.verify_s.get(b)
        self.verify_s[b] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s
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
        per_tok = draft_s / k
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
