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
"""

from __future__ import annotations

from collections.abc import Sequence


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
