"""How many tokens to draft each round: fixed K, transformers' +2/-1 schedule, or K from cost.

Every policy answers `choose(source, remaining) -> K` before each round and hears
`observe(round)` after it. Policies see only costs and past acceptance — never the target's
distribution for the current round — so any of them leaves the output distribution exactly the
target's.

`CostModelK` ("k=auto") keeps online estimates of
    v(b)      seconds for one target pass over b tokens (b = K + 1 in a round): the timed
              passes' robust summary, within physical bounds (core.cost.VerifyCurve)
    t_d       seconds per drafted token, per draft source
    alpha_i   P(draft i accepted | drafts 1..i-1 accepted), per draft source
and picks the K in {0 .. K_max} that maximizes expected tokens per second,

    E[tokens | K] / (v(K + 1) + K * t_d),   E[tokens | K] = 1 + sum_{i<=K} prod_{j<=i} alpha_j

(core.cost's formulas, the microbench's too, here in seconds). K = 0 is a plain target step:
where speculation cannot pay, it turns itself off, and probes now and then (PROBE_SHARE of the
time at most) whether the costs that switched it off still hold.

A policy is data: it reads and writes no file. Its verify-cost curve comes in with `load_curve`
and goes out as `costs`; `AutoPolicies`, which the owner of the models keeps (a server's
engine, a CLI run, a bench), holds k="auto" policies across generations and moves their curves
to and from a `CurveStore` (backends.costs.CurveFiles keeps them in JSON files).
"""

from __future__ import annotations

import bisect
import functools
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Protocol

from specdec.core.cost import (
    PRIOR_SLOPE,
    VerifyCurve,
    curve_at,
    expected_tokens_per_round,
    round_cost,
)
from specdec.core.cost import p_at_least_from_conditional as p_at_least
from specdec.core.metrics import Round
from specdec.core.model import SpecModel
from specdec.core.protocols import KPolicy

#: Exponential forgetting per observation, so estimates follow a prompt whose character changes.
DECAY = 0.95
#: Forgetting per round of every source, drafted or not: a source switched off drifts back to
#: the prior and is tried again, slowly enough that the retries cost little where it still
#: does not pay.
IDLE_DECAY = 0.995
#: Prior acceptance (pseudo-counts) for a source never seen: optimistic enough to try drafting.
PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 2.0


@dataclass
class FixedK:
    k_max: int

    def choose(self, source: str, remaining: int) -> int:
        return min(self.k_max, remaining)

    def observe(self, r: Round) -> None:
        pass


@dataclass
class ScheduleK:
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


#: Sources whose drafts are strong evidence from the start: (prior acceptance, depth cap before
#: any evidence). A prediction aligned with the output is the file being re-emitted: its drafts
#: usually run to the next edit, accepted whole.
STRONG_SOURCES = {"prediction": (0.9, 8)}
#: How deep a source without evidence is explored: the deepest K whose failed round costs at
#: most EXPLORE times a failed K = 1 (v(K + 1) - v(1) + K t_d <= EXPLORE (v(2) - v(1) + t_d)).
#: Why: where the verify curve is front-loaded (the first extra token costs most of a step, the
#: next ones little) a K = 1 probe is the dearest per token and at the prior never pays, so the
#: source would never be tried; on a linear curve the rule stays at K = 1.
EXPLORE = 1.5
#: The weight of a v(b) loaded from a stored curve, in measurements (see `_measured`): one, so
#: it fades toward the prior (IDLE_DECAY per round) only where this run does not confirm it.
#: Why not less: every b the run has not used yet would lean toward the prior's dearer slope,
#: and the long drafts a copy needs would not be tried.
LOADED_WEIGHT = 1.0


#: Probing: after PROBE_AFTER rounds in a row that draft less than k="auto" would on the
#: prior's costs (`_probe`), either nothing or less because a point this process has not
#: measured prices the deeper pass, one round drafts that much, while probes have cost at most
#: PROBE_SHARE of the time this policy has seen rounds take. Why: a round re-measures only the
#: pass it makes, so a verify curve that is wrong on the dear side (a hiccup that outlived the
#: bounds, a curve from a busier day) would otherwise hold K down for good; a probe re-measures
#: it, and the acceptance, at a bounded price.
PROBE_AFTER = 16
PROBE_SHARE = 0.02


@dataclass
class CostModelK:
    """K maximizing expected tokens per second under measured costs (module docstring).

    No calibration runs in the request path: v(b) is learned from the verify passes the
    generation makes anyway (PRIOR_SLOPE until then), or starts from a curve measured before
    (`load_curve`: what an earlier process learned, or the microbench's). `verify_s` seeds the
    curve with one sample per point.
    """

    k_max: int
    verify_s: InitVar[Mapping[int, float] | None] = None
    costs: VerifyCurve = field(default_factory=VerifyCurve)  # v(b): samples and their summary
    # b -> decayed count of this process's measurements; a point without one is trusted as is
    verify_n: dict[int, float] = field(default_factory=dict)
    sources: dict[str, _SourceStats] = field(default_factory=dict)
    explore: float = EXPLORE  # 0: explore an untried source at K = 1
    probe: float = PROBE_SHARE  # the most of the time probes may take (0: never probe)
    # a stale v(b) fades toward the prior only where the prior is cheaper (False: both ways)
    fade_down_only: bool = True
    _summary: dict[int, float] = field(default_factory=dict, repr=False)  # costs.summary()
    _known: list[int] = field(default_factory=list, repr=False)  # sorted keys of _summary
    _here: set[int] = field(default_factory=set, repr=False)  # b this policy's rounds measured
    _short: int = field(default=0, repr=False)  # rounds in a row below a probe (PROBE_AFTER)
    # the round's choice was below a probe (None: no choice, a round without a source)
    _below: bool | None = field(default=None, repr=False)
    _probe_base: float | None = field(default=None, repr=False)  # est. cost of the round a
    # probe replaced; None: the last choice was no probe
    _seen_s: float = field(default=0.0, repr=False)  # seconds of every round observed
    _probe_s: float = field(default=0.0, repr=False)  # what probes cost beyond those rounds

    def __post_init__(self, verify_s: Mapping[int, float] | None) -> None:
        if verify_s:
            self.costs = self.costs.merged(VerifyCurve.of(verify_s))
        self._refresh()

    def _refresh(self) -> None:
        self._summary = self.costs.summary()  # VerifyCurve's own, in b order
        self._known = list(self._summary)

    # ------------------------------------------------------------------ estimates
    def _prior(self, b: int) -> float:
        step = self._summary.get(1)
        return (1.0 if step is None else step) * (1 + PRIOR_SLOPE * (b - 1))

    def _measured(self, b: int) -> float:
        """The measurement of v(b), drawn back to the prior as it goes stale: its weight is its
        decayed count, capped at 1. Why: a curve measured on a busy machine (or loaded from a
        store) can make every K > 0 look dear, and then K = 0 forever never re-measures it;
        fading it lets a source's retry (IDLE_DECAY) find the real cost again. Only toward a
        cheaper prior (fade_down_only): a measurement below the prior (a flat curve) is not
        what fading is for, and fading it up would make the long drafts a copy needs look dear
        again within a few requests."""
        n = min(1.0, self.verify_n.get(b, 1.0))
        prior = self._prior(b)
        if self.fade_down_only:
            prior = min(prior, self._summary[b])
        return n * self._summary[b] + (1 - n) * prior

    def v(self, b: int) -> float:
        """Seconds for a target pass over b tokens: core.cost.curve_at over this policy's
        points, each drawn back to the prior as it goes stale (`_measured`)."""
        known, step = self._known, self._summary.get(1)
        if step is None and known:  # no step measured: read off the point extrapolated from
            ref = known[0] if b < known[0] else known[-1]
            step = self._summary[ref] / (1 + PRIOR_SLOPE * (ref - 1))
        return curve_at(known, self._measured, b, step)

    def alphas(self, source: str) -> list[float]:
        """Conditional acceptance per position; position i's prior is position i-1's estimate.

        Why chained: with a fixed prior, a position never drafted keeps PRIOR_ALPHA forever, so a
        source whose first positions are accepted 95% of the time still looks like 60% beyond
        the K it happened to start with, and K never grows. Positions deeper in a run of
        accepted drafts are rarely less likely to be accepted, so the previous position is the
        better guess.
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

    def expected_tokens(self, source: str, k_top: int) -> list[float]:
        """E[tokens per round] for k = 0..k_top drafted from `source` (core.cost's E(k))."""
        p = p_at_least(self.alphas(source)[:k_top])
        return [expected_tokens_per_round(p, k) for k in range(k_top + 1)]

    def draft_cost(self, source: str) -> float:
        """Seconds per drafted token from `source` (0 until measured)."""
        st = self.sources.get(source)
        return st.draft_s_per_token if st and st.draft_s_per_token is not None else 0.0

    def _rates(
        self,
        source: str,
        k_top: int,
        v: Callable[[int], float] | None = None,
        tokens: list[float] | None = None,
    ) -> list[float]:
        """Expected tokens per second for k = 0..k_top (core.cost's E(k) / cost(k)), with the
        verify costs `v` (default: this policy's) and E(k) `tokens` (default: computed)."""
        v = v or self.v
        t_d = self.draft_cost(source)
        vs = [v(b) for b in range(1, k_top + 2)]  # [k_top + 1]: v(1) .. v(k_top + 1)
        tokens = tokens or self.expected_tokens(source, k_top)
        return [tokens[k] / round_cost(vs, t_d, k) for k in range(k_top + 1)]  # per second

    def expected_rate(self, source: str, k: int) -> float:
        """Expected tokens per second of a round drafting k tokens from `source`."""
        return self._rates(source, k)[k]

    # ------------------------------------------------------------------ the curve, in and out
    def load_curve(self, curve: VerifyCurve | Mapping[int, float]) -> None:
        """Start from a verify-cost curve measured before (an earlier process's samples, or a
        microbench's {b: seconds}): each point this process has not measured counts as
        LOADED_WEIGHT measurements for fading (`_measured`); non-positive times are ignored."""
        loaded = curve if isinstance(curve, VerifyCurve) else VerifyCurve.of(curve)
        self.costs = self.costs.merged(loaded)
        for b in loaded.samples():
            self.verify_n.setdefault(b, LOADED_WEIGHT)
        self._refresh()

    @property
    def curve(self) -> dict[int, float]:
        """What this policy prices passes with, {b: seconds} (VerifyCurve.summary)."""
        return dict(self._summary)

    # ------------------------------------------------------------------ policy
    def depth_cap(self, source: str) -> int:
        """Draft at most about twice as deep as the positions with evidence: 2 * (leading
        positions judged at least once, decayed count >= 0.5) + 1. Why: position i's
        acceptance is guessed from position i-1's until it is judged, so an untried source is
        explored shallow: at K = 1, or as deep as a failure costs at most EXPLORE failed K = 1
        rounds (`_explore_depth`); and doubling reaches the long drafts a copy needs (K = 31+)
        in five fully accepted rounds, where one position per round would take thirty."""
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
        tokens = self.expected_tokens(source, k_top)
        rates = self._rates(source, k_top, tokens=tokens)
        k = max(range(k_top + 1), key=lambda k: (rates[k], -k))
        self._probe_base, self._below = None, False
        probe = 0 if self.probe <= 0 or k == k_top else self._probe(source, k_top, tokens)
        if probe <= k or (k > 0 and self._points_of(probe + 1) <= self._here):
            return k  # as deep as a probe would draft, or priced by this run's own passes
        if self._short < PROBE_AFTER or self._probe_s > self.probe * self._seen_s:
            self._below = True
            return k
        self._probe_base = self.v(k + 1) + k * self.draft_cost(source)
        return probe

    def _probe(self, source: str, k_top: int, tokens: list[float]) -> int:
        """A probe's K: what would be drafted if v(b) were the prior's (one step, and half a
        step a token), so that a curve wrong on the dear side is measured where it matters."""
        step = self.v(1)
        rates = self._rates(source, k_top, lambda b: step * (1 + PRIOR_SLOPE * (b - 1)), tokens)
        return max(range(1, k_top + 1), key=lambda k: (rates[k], -k))

    def _points_of(self, b: int) -> set[int]:
        """The measured points that price v(b) (`v`): b's own, the two around it, or the nearest
        one or two beyond the last or before the first."""
        known = self._known
        if b in self._summary or not known:
            return {b} & set(self._summary)
        i = bisect.bisect_left(known, b)
        return set(known[max(0, i - 1) : i + 1]) if 0 < i < len(known) else set(known[-2:])

    def observe(self, r: Round) -> None:
        source, k, n_accepted = r.source, r.k, r.n_accepted
        b = r.pass_rows  # the pass may have verified other sequences' rows too
        if self._probe_base is not None and k > 0:  # what the probe cost beyond the choice
            self._probe_s += max(0.0, r.verify_s + r.draft_s - self._probe_base)
        self._probe_base = None
        if self._below is not None:  # rounds without a source leave the count as it is
            self._short = self._short + 1 if self._below else 0
        self._below = None
        self._seen_s += r.verify_s + r.draft_s
        self._here.add(b)
        self.costs.add(b, r.verify_s)
        self._refresh()
        for x in self.verify_n:  # measurements go stale like acceptance estimates do
            self.verify_n[x] *= IDLE_DECAY
        self.verify_n[b] = self.verify_n.get(b, 0.0) + 1.0
        # Every round forgets a little of every source, drafted or not: a source whose estimate
        # fell below break-even drifts back to the prior and is tried again. Forgetting only on
        # use would freeze it: one early rejection would switch prompt lookup off for good.
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


#: Rounds of best responses `choose_together` runs at most: each k="auto" sequence redrafts
#: against the pass its neighbours' latest K make; it settles in two or three.
JOINT_ITERATIONS = 6


def choose_together(wants: Sequence[tuple[KPolicy | None, str | None, int]]) -> list[int]:
    """Each sequence's own K for a joint pass (decode.rounds_together), from its (policy, source,
    room): the pass verifies the sum of the rows, nobody's padded to a neighbour's. A fixed or
    schedule policy drafts what it chooses; a sequence without a source drafts nothing; the
    k="auto" ones maximize the expected tokens of the whole pass per second of it,

        sum_i E_i(k_i) / (v(sum_i (k_i + 1)) + sum_i t_i k_i),

    by Dinkelbach's rule for a ratio: at the pass's current rate r, each k_i maximizes
    E_i(k) - r (v(B_i + k + 1) - v(B_i) + t_i k), the marginal seconds of its rows on top of
    the B_i its neighbours bring; then r is updated, until no K moves (JOINT_ITERATIONS). Why:
    a row's price depends on the pass it joins (on a CPU the first rows ride on one read of
    the weights, later ones cost compute), and alone this is the K CostModelK.choose picks
    (probes aside). v is the first k="auto" policy's curve: they all measure the one machine;
    each E_i counts up to its own k_max and depth cap (a neighbour's k_max is not its own)."""
    ks = [
        p.choose(src, room) if p is not None and src and not isinstance(p, CostModelK) else 0
        for p, src, room in wants
    ]
    autos = [
        (i, p, src, min(p.k_max, room, p.depth_cap(src)))
        for i, (p, src, room) in enumerate(wants)
        if isinstance(p, CostModelK) and src and room > 0
    ]
    if not autos:
        return ks
    curve = autos[0][1]
    tokens = {i: p.expected_tokens(src, top) for i, p, src, top in autos}
    t_d = {i: p.draft_cost(src) for i, p, src, _ in autos}
    v = functools.cache(curve.v)  # each v(b) priced once, and only the b asked for

    def rate() -> float:
        got = sum(tokens[i][ks[i]] for i in tokens) + len(ks) - len(tokens)
        drafting = sum(t_d[i] * ks[i] for i in tokens)
        return got / (v(sum(k + 1 for k in ks)) + drafting)

    for _ in range(JOINT_ITERATIONS):
        r, moved = rate(), False
        for i, _, _, top in autos:
            base = sum(k + 1 for k in ks) - ks[i] - 1  # the neighbours' rows

            gains = [tokens[i][k] - r * (v(base + k + 1) - v(base) + t_d[i] * k)
                     for k in range(top + 1)]  # fmt: skip
            best = max(range(top + 1), key=lambda k: (gains[k], -k))
            moved |= best != ks[i]
            ks[i] = best
        if not moved:
            break
    return ks


class CurveStore(Protocol):
    """Where verify-cost curves live between processes, per target (e.g.
    backends.costs.CurveFiles: a JSON file per model file, build and settings). `save` adds the
    curve's samples to what is kept (another process may have saved some meanwhile), or with
    `replace` keeps only them (a deliberate measurement: `specdec doctor`, `specdec microbench`)."""

    def load(self, target: SpecModel) -> VerifyCurve: ...

    def save(self, target: SpecModel, curve: VerifyCurve, replace: bool = False) -> object: ...


@dataclass
class _Kept:
    policy: CostModelK
    stored: VerifyCurve  # what the store holds from this policy (or gave it)


class AutoPolicies:
    """k="auto" policies kept across generations by the owner of the models (a server's engine,
    a CLI run, a bench): one CostModelK per target, drafter and k_max, so what one generation
    learned (acceptance per draft source, draft cost, v(b)) carries to the next, and a pair
    where drafting cannot pay stops exploring it after the first request.

    `curves`: where a new policy's v(b) comes from and where what each generation learned goes
    (None: kept in this object only). Targets are held weakly, so a policy goes with its model;
    the drafter keys (a draft model, a Drafter object) are held while their target lives.
    """

    def __init__(self, curves: CurveStore | None = None) -> None:
        self.curves = curves
        self._kept: weakref.WeakKeyDictionary[SpecModel, dict[Hashable, _Kept]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, target: SpecModel, drafter: Hashable, k_max: int) -> CostModelK:
        """The policy for `target` with `drafter` (whatever tells drafters apart: a name, with
        the draft model it runs) and `k_max`; on first use a new one, from the store's curve."""
        per_target = self._kept.setdefault(target.owner, {})  # one for all of a model's slots
        kept = per_target.get((drafter, k_max))
        if kept is None:
            policy = CostModelK(k_max)
            if self.curves is not None:
                policy.load_curve(self.curves.load(target.owner))
            kept = per_target[(drafter, k_max)] = _Kept(policy, VerifyCurve(policy.costs.samples()))
        return kept.policy

    def finished(self, target: SpecModel, policy: CostModelK) -> None:
        """A generation with `policy` ended: what it measured of v(b) goes to the store."""
        if self.curves is None:
            return
        for kept in self._kept.get(target.owner, {}).values():
            if kept.policy is policy and policy.costs != kept.stored:
                kept.stored = VerifyCurve(policy.costs.samples())
                self.curves.save(target.owner, kept.stored)


#: Named K policies beside make_policy's, for replays and comparisons (study.run.replay, `specdec
#: replay --policy NAME`): name -> (k_max) -> a fresh policy. "auto-shallow": k=auto with
#: untried sources explored at K = 1 and stale costs fading both ways (no EXPLORE depth, no
#: fade_down_only: what those two rules are measured against).
POLICIES: dict[str, Callable[[int], KPolicy]] = {
    "auto-shallow": lambda k_max: CostModelK(k_max, explore=0.0, fade_down_only=False),
}


def make_policy(k: int | str, k_max: int) -> KPolicy:
    """k: an int (fixed K), "auto" (CostModelK) or "schedule" (transformers' +2/-1)."""
    if k == "auto":
        return CostModelK(k_max)
    if k == "schedule":
        return ScheduleK(k_max, k=min(4, k_max))
    return FixedK(int(k))
