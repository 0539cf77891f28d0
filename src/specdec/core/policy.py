"""How many tokens to draft each round: fixed K, transformers' +2/-1 schedule, or K from cost.

Every policy gets `prepare(target, context) -> seconds` once per generation, after the prompt
prefill (k="auto" reads its persisted cost curve there), answers `choose(source, remaining) -> K`
before each round, hears `observe(round)` after it, and `finish(target)` when the generation
ends (k="auto" persists what it learned).
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

import bisect
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specdec.core.cost import cost_in_target_steps, expected_tokens_per_round
from specdec.core.cost import p_at_least_from_conditional as p_at_least
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

    def finish(self, target: SpecModel) -> None: ...


class _NoPreparation:
    def prepare(self, target: SpecModel, context: list[int]) -> float:
        """Seconds spent getting ready for a generation: none for policies without costs."""
        return 0.0

    def finish(self, target: SpecModel) -> None:
        """Called when a generation ends: nothing to keep for policies without costs."""


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


#: Until a pass over b tokens has been timed, it is assumed to cost one step plus PRIOR_SLOPE of
#: a step per extra token: between this CPU's measured 0.46-0.66 (llama.cpp, Qwen 1.5B) and a
#: GPU's ~0.02, so a new source is tried at K = 1 (break-even at 50% acceptance) and the real
#: cost replaces the guess after one round. Measured points are interpolated linearly.
PRIOR_SLOPE = 0.5
#: Sources whose drafts are strong evidence from the start: (prior acceptance, depth cap before
#: any evidence). A prediction aligned with the output is the file being re-emitted; its drafts
#: run to the next edit (measured on the rewrite tasks: most rounds accept every drafted token).
STRONG_SOURCES = {"prediction": (0.9, 8)}
#: How deep a source without evidence is explored: the deepest K whose failed round costs at
#: most EXPLORE times a failed K = 1 (v(K + 1) - v(1) + K t_d <= EXPLORE (v(2) - v(1) + t_d)).
#: Why: where the verify curve is front-loaded (AMX: v(2) = 1.83 steps, v(4) = 2.11) a K = 1
#: probe is the dearest per token, and at the 60% prior it never pays, so lookup was never
#: tried (`specdec replay` of 28 recorded rewrite outputs on the 1,024-token curve, decode
#: phase: lookup alone 1.90x -> 2.25x with this rule, 2.50x with fade_down_only too; on a
#: linear curve it stays at K = 1).
EXPLORE = 1.5
#: The weight of a persisted v(b) read from the cost store, in measurements (see `_measured`):
#: one, so it fades toward the prior (IDLE_DECAY per round) only where this run does not
#: confirm it. At 0.5 every b the run had not yet used was half the prior's 0.5 steps per
#: token, which on this CPU (0.31 measured at b = 16) kept rewrites at K = 3 (replayed on four
#: rewrite outputs: 1.79x -> 1.98x decode-phase speedup).
LOADED_WEIGHT = 1.0


@dataclass
class CostModelK:
    """K maximizing expected tokens per second under measured costs (module docstring).

    No calibration runs in the request path: v(b) is learned from the verify passes the
    generation makes anyway (PRIOR_SLOPE until then), and kept in `target.cost_store` (a JSON
    file the backend names per model file, build and settings) between processes.
    """

    k_max: int
    verify_s: dict[int, float] = field(default_factory=dict)  # b -> seconds (EMA)
    # b -> decayed count of measurements; a b given in verify_s without one is trusted as is
    verify_n: dict[int, float] = field(default_factory=dict)
    sources: dict[str, _SourceStats] = field(default_factory=dict)
    explore: float = EXPLORE  # 0: explore at K = 1 (before issue 22)
    # a stale v(b) fades toward the prior only where the prior is cheaper (False: both ways)
    fade_down_only: bool = True
    _known: list[int] = field(default_factory=list, repr=False)  # sorted keys of verify_s
    _dirty: bool = field(default=False, repr=False)  # verify_s changed since the last save

    # ------------------------------------------------------------------ estimates
    def _prior(self, b: int) -> float:
        step = self.verify_s.get(1)
        return (1.0 if step is None else step) * (1 + PRIOR_SLOPE * (b - 1))

    def _measured(self, b: int) -> float:
        """The measurement of v(b), drawn back to the prior as it goes stale: its weight is its
        decayed count, capped at 1. Why: a curve measured on a busy machine (or read from the
        store) can make every K > 0 look dear, and then K = 0 forever never re-measures it;
        fading it lets a source's retry (IDLE_DECAY) find the real cost again. Only toward a
        cheaper prior: a measurement below the prior (a flat curve: 0.2 steps per token at
        b = 32 on AMX, against the prior's 0.5) is not what fading is for, and fading it made
        the long drafts a copy needs look twice as dear within a few requests (replayed on 28
        rewrite outputs in one process, 1,024-token curve, decode phase: the prediction drafter
        2.57x -> 2.85x, lookup alone 1.90x -> 2.41x)."""
        n = min(1.0, self.verify_n.get(b, 1.0))
        prior = self._prior(b)
        if self.fade_down_only:
            prior = min(prior, self.verify_s[b])
        return n * self.verify_s[b] + (1 - n) * prior

    def v(self, b: int) -> float:
        """Seconds for a target pass over b tokens: measured, else interpolated linearly
        between measurements, else the prior's slope from the nearest measurement."""
        if b in self.verify_s:
            return self._measured(b)
        known = self._known
        if len(known) != len(self.verify_s):
            known = self._known = sorted(self.verify_s)
        if not known:
            return 1.0 + PRIOR_SLOPE * (b - 1)  # in steps; any unit gives the same argmax
        i = bisect.bisect_left(known, b)
        if 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
            w = (b - lo) / (hi - lo)
            return (1 - w) * self._measured(lo) + w * self._measured(hi)
        ref = known[0] if i == 0 else known[-1]
        step = self.verify_s.get(1, self.verify_s[ref] / (1 + PRIOR_SLOPE * (ref - 1)))
        return max(step, self._measured(ref) + PRIOR_SLOPE * step * (b - ref))

    def alphas(self, source: str) -> list[float]:
        """Conditional acceptance per position; position i's prior is position i-1's estimate.

        Why chained: with a fixed prior, a position never drafted keeps PRIOR_ALPHA forever, so a
        source whose first positions are accepted 95% of the time still looks like 60% beyond
        the K it happened to start with, and K never grows (measured in simulation on
        copy-heavy outputs: stuck at K = 3). Positions deeper in a run of accepted drafts are
        rarely less likely to be accepted, so the previous position is the better guess.
        """
        prior = STRONG_SOURCES.get(source, (PRIOR_ALPHA, 1))[0]
        st = self.sources.get(source)
        if st is None:
            return [prior] * self.k_max
        out = []
        for a, n in zip(st.accepted, st.tried, strict=True):
            prior = (a + prior * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def _rates(self, source: str, k_top: int) -> list[float]:
        """Expected tokens per second for k = 0..k_top (core.cost's E(k) / cost(k))."""
        alphas = self.alphas(source)
        st = self.sources.get(source)
        t_d = st.draft_s_per_token if st and st.draft_s_per_token is not None else 0.0
        p = p_at_least(alphas[:k_top])
        vs = [self.v(b) for b in range(1, k_top + 2)]  # [k_top + 1]: v(1) .. v(k_top + 1)
        rates = []
        for k in range(k_top + 1):
            rates.append(expected_tokens_per_round(p, k) / cost_in_target_steps(vs, t_d, k))
        return rates

    def expected_rate(self, source: str, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens from `source`."""
        return self._rates(source, k)[k]

    # ------------------------------------------------------------------ policy
    def prepare(self, target: SpecModel, context: list[int]) -> float:
        """Read the persisted cost curve the first time this policy meets a target; return the
        seconds it took (no pass of the target is run)."""
        path = target.cost_store
        if self.verify_s or path is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            saved = json.loads(Path(path).read_text())["verify_s"]
            for b, s in saved.items():
                if float(s) > 0:  # half a measurement's weight: confirmed or replaced soon
                    self.verify_s[int(b)], self.verify_n[int(b)] = float(s), LOADED_WEIGHT
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # none yet, or unreadable: learn it again
        return time.perf_counter() - t0

    def finish(self, target: SpecModel) -> None:
        """Keep what this generation learned of v(b) for the next process."""
        if self._dirty and target.cost_store is not None:
            self._dirty = not save_curve(target.cost_store, self.verify_s)

    def depth_cap(self, source: str) -> int:
        """Draft at most about twice as deep as the positions with evidence: 2 * (leading
        positions judged at least once, decayed count >= 0.5) + 1. Why: position i's
        acceptance is guessed from position i-1's until it is judged, so an untried source is
        explored shallow: at K = 1, or as deep as a failure costs at most EXPLORE failed K = 1
        rounds (`_explore_depth`); and doubling reaches the long drafts a copy needs (K = 31+,
        where a verify pass costs ~0.46 steps per token on this CPU) in five fully accepted
        rounds, where one position per round took thirty."""
        floor = max(STRONG_SOURCES.get(source, (PRIOR_ALPHA, 1))[1], self._explore_depth(source))
        st = self.sources.get(source)
        depth = 0
        while st is not None and depth < self.k_max and st.tried[depth] >= 0.5:
            depth += 1
        return min(self.k_max, max(floor, 2 * depth + 1))

    def _explore_depth(self, source: str) -> int:
        """The deepest k whose failed round (every draft rejected) costs at most `explore`
        times a failed K = 1 round, drafting included (EXPLORE's rule)."""
        if self.explore <= 0:
            return 1
        st = self.sources.get(source)
        t_d = st.draft_s_per_token if st and st.draft_s_per_token is not None else 0.0
        v1 = self.v(1)
        budget = self.explore * (self.v(2) - v1 + t_d)
        k = 1
        while k < self.k_max and self.v(k + 2) - v1 + (k + 1) * t_d <= budget:
            k += 1
        return k

    def choose(self, source: str, remaining: int) -> int:
        k_top = min(self.k_max, remaining, self.depth_cap(source))
        rates = self._rates(source, k_top)
        return max(range(k_top + 1), key=lambda k: (rates[k], -k))

    def observe(self, r: Round) -> None:
        source, k, n_accepted = r.source, r.k, r.n_accepted
        b = k + 1
        old = self.verify_s.get(b)
        self.verify_s[b] = r.verify_s if old is None else DECAY * old + (1 - DECAY) * r.verify_s
        for x in self.verify_n:  # measurements go stale like acceptance estimates do
            self.verify_n[x] *= IDLE_DECAY
        self.verify_n[b] = self.verify_n.get(b, 0.0) + 1.0
        self._dirty = True
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


def save_curve(path: str | os.PathLike[str], verify_s: dict[int, float]) -> bool:
    """Write a verify-cost curve {b: seconds} where CostModelK.prepare reads it (atomically);
    False if it could not be written (a read-only cache only costs the next process some
    learning)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"verify_s": {str(b): s for b, s in sorted(verify_s.items())}}))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


#: Named K policies beside make_policy's, for replays and comparisons (study.replay, `specdec
#: replay --policy NAME`): name -> (k_max) -> a fresh policy. "auto-issue21": k=auto as it was
#: before issue 22 (untried sources explored at K = 1, stale costs fading both ways).
POLICIES: dict[str, Callable[[int], KPolicy]] = {
    "auto-issue21": lambda k_max: CostModelK(k_max, explore=0.0, fade_down_only=False),
}


def make_policy(k: int | str, k_max: int) -> KPolicy:
    """k: an int (fixed K), "auto" (CostModelK) or "schedule" (transformers' +2/-1)."""
    if k == "auto":
        return CostModelK(k_max)
    if k == "schedule":
        return ScheduleK(k_max, k=min(4, k_max))
    return FixedK(int(k))
