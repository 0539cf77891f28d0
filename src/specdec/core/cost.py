"""The cost model of speculative decoding, written once (paper, sections 6.4-6.5).

Used by `k="auto"` (core.policy.CostModelK, with online estimates in seconds) and by the
microbench (study.run.microbench, with measured curves in target steps):

    v(b)            cost of one target pass over b tokens; a round at K verifies b = K + 1
    c               cost of one draft step, in the same unit
    p_at_least[i-1] P(at least i of the K drafts are accepted); acceptance is a prefix, so this
                    does not depend on later drafts
    E(K)            expected tokens per round = 1 + sum_{i<=K} P(>= i accepted) (the 1 is the
                    recovered or bonus token every round emits)
    cost(K)         v(K+1) + K c
    speedup(K)      E(K) / cost(K): tokens per unit of cost; against target-only decoding when
                    the unit is one target step

and `VerifyCurve`, v(b) as measured: what k="auto", the cost store and `specdec doctor` read;
`curve_at`, v(b) between and beyond measured points, the one rule k="auto" and a replay
(study.run.replay.Curve) price a pass with.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Until a pass over b tokens has been timed, it is assumed to cost one step plus PRIOR_SLOPE of
#: a step per extra token: between a CPU's slope and a GPU's (near zero), so a new source is
#: tried at K = 1 (break-even at 50% acceptance) and the real cost replaces the guess after one
#: round. Measured points are interpolated linearly.
PRIOR_SLOPE = 0.5
#: The least a token may add to a pass, in steps, where v(b) is extrapolated from measurements:
#: a verify row at a CPU's int8 peak is a small fraction of a memory-bound step (docs/kernels.md).
MIN_SLOPE = 0.05


def curve_at(
    known: Sequence[int], value: Callable[[int], float], b: int, step: float | None = None
) -> float:
    """v(b) from the points measured at `known` (sorted b, value(b) each; `step`: v(1), else
    read off the curve): the point itself; linear between points; past the last, the slope of
    the last two (a CPU's curve is close to linear past a few rows; a joint pass over several
    requests' rows asks for b beyond what one request verifies), kept within [MIN_SLOPE,
    PRIOR_SLOPE] steps a token; before the first, or with one, the prior's slope. With no point,
    the prior in steps (any unit gives k="auto" the same argmax)."""
    if not known:
        return 1.0 + PRIOR_SLOPE * (b - 1)
    i = bisect.bisect_left(known, b)
    if i < len(known) and known[i] == b:
        return value(b)
    if 0 < i < len(known):
        lo, hi = known[i - 1], known[i]
        w = (b - lo) / (hi - lo)
        return (1 - w) * value(lo) + w * value(hi)
    ref = known[0] if i == 0 else known[-1]
    if step is None:
        step = value(ref) / (1 + PRIOR_SLOPE * (ref - 1))
    slope = PRIOR_SLOPE * step
    if i > 0 and len(known) > 1:
        lo = known[-2]
        last = (value(ref) - value(lo)) / (ref - lo)
        slope = min(max(last, MIN_SLOPE * step), slope)
    return max(step, value(ref) + slope * (b - ref))


def p_at_least_from_conditional(alphas: Sequence[float]) -> list[float]:
    """[P(>= i accepted)] from conditional rates alpha_i = P(i accepted | i-1 accepted)."""
    out, survive = [], 1.0
    for a in alphas:
        survive *= a
        out.append(survive)
    return out


def expected_tokens_per_round(p_at_least: Sequence[float], k: int) -> float:
    """E[tokens per round] at speculation length k: 1 + sum_{i<=k} P(>= i accepted).

    p_at_least  [K_max] float  p_at_least[i-1] = P(at least i drafts accepted); needs k <= K_max
    """
    if not 0 <= k <= len(p_at_least):
        raise ValueError(f"k must be in [0, {len(p_at_least)}] for this profile, got {k}")
    return 1.0 + float(sum(p_at_least[:k]))


def round_cost(v: Sequence[float], c: float, k: int) -> float:
    """Cost of one round at speculation length k, in v's unit: v(k+1) + k c.

    v  [B_max] float  v[b-1] = v(b), the verify cost of b tokens: in target steps (v[0] = 1,
                      the microbench) or in seconds (k="auto")
    c  one draft step, in the same unit
    """
    if not 0 <= k < len(v):
        raise ValueError(f"k must be in [0, {len(v) - 1}] for a curve of {len(v)} points, got {k}")
    return float(v[k]) + k * c


def predicted_speedup(v: Sequence[float], c: float, p_at_least: Sequence[float], k: int) -> float:
    """Predicted speedup over target-only decoding at speculation length k: E(k) / cost(k).

    k = 0 is a plain target step (E = 1, cost = v(1) = 1): speedup 1. The arithmetic is
    unit-agnostic: with v in seconds and c a draft step in seconds this is tokens per second,
    whose argmax over k is the same.
    """
    return expected_tokens_per_round(p_at_least, k) / round_cost(v, c, k)


def best_k(v: Sequence[float], c: float, p_at_least: Sequence[float], k_max: int) -> int:
    """The k in 0..k_max with the highest predicted speedup (0: speculation cannot pay)."""
    return max(range(k_max + 1), key=lambda k: (predicted_speedup(v, c, p_at_least, k), -k))


# ---------------------------------------------------------------------------- measured v(b)
#: Samples kept per b: the newest WINDOW. A point is their lower median, so one sample far above
#: the others (a pass that met a busy sibling, a swap, a backup job) is held back until it
#: repeats; one below them is taken at once, as the drafts it invites measure it again.
WINDOW = 9
#: A pass over b rows costs at most b single steps (the rows one by one), and at least about one
#: (v(2) is ~0.9 of a step on a memory-bound CPU): ROW_SLACK times b passes of the cheapest point
#: is the most a point may cost, the slack for timer noise and a pass's fixed overhead. Above it a
#: point measured the machine's load, not the kernel.
ROW_SLACK = 2.0


@dataclass(frozen=True)
class Sample:
    seconds: float  # one timed target pass
    at: float  # when, in Unix seconds: the newer of two disagreeing points wins


@dataclass(frozen=True)
class CurvePoint:
    """v(b) as the curve holds it: its summary, what it is made of, and whether it is used."""

    b: int
    seconds: float  # the lower median of its newest WINDOW samples
    n: int  # samples behind it
    newest: float  # Unix time of its newest sample
    used: bool  # within the physical bounds against fresher points (VerifyCurve.points)


class VerifyCurve:
    """v(b), the seconds of one target pass over b tokens, from timed passes: the newest WINDOW
    samples per b, with their time. What k="auto" prices rounds with (core.policy.CostModelK),
    what the cost store keeps between processes (backends.costs) and what `specdec doctor` shows.

    A point is a robust summary, never one sample, and the points in use are physically
    consistent: each costs at most ROW_SLACK * b times the cheapest point in use. Where two points
    disagree the newer one stands (`points`), so a curve from another day or another load level
    gives way to what this process measures, and a hiccup stored once cannot price every draft
    out for good.
    """

    def __init__(self, samples: Mapping[int, Iterable[Sample]] | None = None) -> None:
        self._samples: dict[int, list[Sample]] = {}
        self._median: dict[int, float] = {}  # b -> the lower median of its samples
        self._summary: dict[int, float] | None = None  # summary(), until the next sample
        for b, ss in (samples or {}).items():
            for s in ss:
                self.add(b, s.seconds, s.at)

    @classmethod
    def of(cls, seconds: Mapping[int, float], at: float | None = None) -> VerifyCurve:
        """One sample per point of {b: seconds} (a microbench's or the doctor's medians)."""
        curve, at = cls(), time.time() if at is None else at
        for b, s in seconds.items():
            curve.add(int(b), s, at)
        return curve

    def add(self, b: int, seconds: float, at: float | None = None) -> None:
        """One timed pass over b tokens; a time that is not a positive number is ignored."""
        if b < 1 or not (math.isfinite(seconds) and seconds > 0):
            return
        kept = self._samples.setdefault(b, [])
        kept.append(Sample(float(seconds), time.time() if at is None else float(at)))
        if len(kept) > WINDOW or (len(kept) > 1 and kept[-1].at < kept[-2].at):
            kept.sort(key=lambda s: s.at)
            del kept[:-WINDOW]
        self._median[b] = statistics.median_low([s.seconds for s in kept])
        self._summary = None

    def merged(self, other: VerifyCurve) -> VerifyCurve:
        """Both curves' samples, each once (a process saves what it loaded too), the newest
        WINDOW per b."""
        out = VerifyCurve()
        for curve in (self, other):
            for b, ss in curve._samples.items():
                have = set(out._samples.get(b, ()))
                for s in ss:
                    if s not in have:
                        out.add(b, s.seconds, s.at)
        return out

    def samples(self) -> dict[int, list[Sample]]:
        """{b: its samples, oldest first}."""
        return {b: list(ss) for b, ss in sorted(self._samples.items())}

    def summary(self) -> dict[int, float]:
        """{b: seconds} of the points in use, in b order: points are taken newest first (ties:
        the cheapest per token first), each only if it and those taken before stay within the
        bounds (ROW_SLACK), so of two that disagree the older is dropped."""
        if self._summary is not None:
            return self._summary
        med, ss = self._median, self._samples
        used: set[int] = set()
        ref, per_row = math.inf, 0.0  # of the points in use: the cheapest; the dearest per row
        for b in sorted(med, key=lambda b: (-ss[b][-1].at, med[b] / b)):
            # every point a in use, b included: med[a] <= ROW_SLACK * a * the cheapest
            if max(per_row, med[b] / b) <= ROW_SLACK * min(ref, med[b]):
                used.add(b)
                ref, per_row = min(ref, med[b]), max(per_row, med[b] / b)
        self._summary = {b: med[b] for b in sorted(used)}
        return self._summary

    def points(self) -> list[CurvePoint]:
        """Every point, in b order, with whether it is in use (`summary`)."""
        used = self.summary()
        return [
            CurvePoint(b, self._median[b], len(ss), ss[-1].at, b in used)
            for b, ss in sorted(self._samples.items())
        ]

    def __len__(self) -> int:
        return len(self._samples)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyCurve) and self._samples == other._samples

    def __repr__(self) -> str:
        return f"VerifyCurve({self.summary()})"
