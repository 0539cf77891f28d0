"""Two-sample statistics for the exactness gates (paper, section 6.1).

The calibrated instrument is a two-sample chi-square over token-frequency bins. Its validity rule:
every expected count under the pooled null is >= MIN_EXPECTED, so rare tokens are pooled into one
"other" bin. `frequency_bins` builds those bins explicitly (the gate stores them as tested, so a
figure can draw exactly what was compared); `two_sample_chi2` runs the test on them.

Tokens within one generation are not independent draws (a sequence that enters a code block
repeats its tokens), so the chi-square statistic is overdispersed relative to its chi2(dof)
reference and the asymptotic p-value is too small. Measured on smollm2-135m, two baseline samples
with different seeds (the null holds exactly), 12 prompts x 60 tokens: chi2 = 38.4 on 19 dof,
asymptotic p = 0.005, while the permutation null below had mean 33.1 (not 19) and gave p = 0.26.
`paired_permutation_p` calibrates the same statistic by swapping the two methods' generations
within each prompt, which needs no independence between tokens.

The smoothed symmetric KL is reported for reference only: with ~10^4 tokens spread thinly over a
vocabulary of ~10^5, add-0.5 smoothing over the union support dominates it (paper, section 6.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

#: Bins with an expected count below this are pooled into one bin (the usual validity rule).
MIN_EXPECTED = 5.0
#: Monte Carlo permutations for `paired_permutation_p` (p resolution ~1/2000).
PERMUTATIONS = 2000
#: Pseudo-count added to every token of the union support by `smoothed_symmetric_kl`.
KL_SMOOTHING = 0.5


@dataclass(frozen=True)
class Bins:
    """Counts of two samples over the bins a chi-square test uses.

    index   [B_kept] int64   original bin ids kept as their own bins, by combined count, descending
    a, b    [B] float64      counts per tested bin; B = B_kept + 1 when `pooled` (last = the rest)
    pooled  bool             whether the last bin pools every bin not in `index`
    """

    index: np.ndarray
    a: np.ndarray
    b: np.ndarray
    pooled: bool

    @property
    def table(self) -> np.ndarray:
        return np.stack([self.a, self.b])  # [2, B]


def frequency_bins(a: np.ndarray, b: np.ndarray) -> Bins:
    """Bin count vectors `a`, `b` [V] so that every expected count is >= MIN_EXPECTED.

    A bin keeps its own column when its smaller expected count under the pooled null (its combined
    count times the smaller sample's share) is >= MIN_EXPECTED; that is the same as keeping the
    top bins by combined count. The rest are pooled into one bin. If the pool itself is still
    below MIN_EXPECTED, the least frequent kept bins join it until it is not. Empty bins are
    dropped (they carry no information and have expected count 0).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"count vectors must be 1-D and equal in shape, got {a.shape}, {b.shape}")
    tot = a + b
    n = tot.sum()
    if a.sum() == 0 or b.sum() == 0:
        raise ValueError("both samples need at least one observation")
    share = min(a.sum(), b.sum()) / n  # the smaller row's share: its expected counts are lower
    order = np.argsort(-tot, kind="stable")  # [V] most frequent first; ties by id
    big = tot[order] * share >= MIN_EXPECTED
    n_kept = int(big.sum())  # order is descending, so the kept bins are a prefix
    while n_kept > 0 and 0 < tot[order[n_kept:]].sum() * share < MIN_EXPECTED:
        n_kept -= 1  # fold the least frequent kept bin into an under-filled pool
    index = order[:n_kept]
    rest = order[n_kept:]
    pooled = bool(tot[rest].sum() > 0)
    a_bins, b_bins = a[index], b[index]
    if pooled:
        a_bins = np.append(a_bins, a[rest].sum())
        b_bins = np.append(b_bins, b[rest].sum())
    return Bins(index.astype(np.int64), a_bins, b_bins, pooled)


def chi2_of_bins(bins: Bins) -> tuple[float, int, float]:
    """Pearson chi-square of the 2 x B contingency table; returns (chi2, dof, p_value).

    With a single bin there is nothing to compare: (0.0, 0, 1.0), and callers should treat dof 0
    as "no test", not as a pass.
    """
    if bins.a.size < 2:
        return 0.0, 0, 1.0
    chi2, p_value, dof, _ = stats.chi2_contingency(bins.table, correction=False)
    return float(chi2), int(dof), float(p_value)


def two_sample_chi2(a: np.ndarray, b: np.ndarray) -> tuple[float, int, float]:
    """Two-sample chi-square (2 x B contingency) between count vectors `a` and `b` [V].

    Bins are built by `frequency_bins`, so every expected count used is >= MIN_EXPECTED.
    Returns (chi2, dof, p_value).
    """
    return chi2_of_bins(frequency_bins(a, b))


def paired_permutation_p(
    a_seqs: Sequence[Sequence[int]],
    b_seqs: Sequence[Sequence[int]],
    n_perm: int = PERMUTATIONS,
    seed: int = 0,
) -> float:
    """Permutation p-value of `two_sample_chi2` between two samples of paired generations.

    a_seqs[i], b_seqs[i]  the token ids two methods generated for prompt i (independent seeds)

    Under the null (both methods sample the same distribution) a_seqs[i] and b_seqs[i] are
    exchangeable, so swapping them for a random subset of prompts leaves the joint distribution
    unchanged. The p-value is (1 + #{permuted statistic >= observed}) / (1 + n_perm): exact in
    level for any dependence between the tokens of one generation. Swapping every pair gives the
    observed statistic again, so with n prompts the smallest attainable p is about 2 / 2^n: at
    least 8 prompts are needed to reject at 0.01.
    """
    if len(a_seqs) != len(b_seqs):
        raise ValueError(f"paired samples differ in length: {len(a_seqs)} vs {len(b_seqs)}")
    n = len(a_seqs)
    # Work on the union support only: absent tokens are dropped by the binning anyway.
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in (*a_seqs, *b_seqs)] or [[]])
    support, compact = np.unique(flat, return_inverse=True)
    S = len(support)
    rows = np.zeros((2 * n, S), dtype=np.float64)  # [2n, S] per-generation counts
    lengths = [len(s) for s in (*a_seqs, *b_seqs)]
    owner = np.repeat(np.arange(2 * n), lengths)  # [len(flat)] which generation each token is in
    np.add.at(rows, (owner, compact), 1.0)
    a, b = rows[:n], rows[n:]  # [n, S] each
    observed = two_sample_chi2(a.sum(0), b.sum(0))[0]
    diff = b - a  # [n, S] what swapping pair i moves from a to b
    a_tot = a.sum(0)  # [S]
    total = a_tot + b.sum(0)  # [S] invariant under swaps
    rng = np.random.default_rng(seed)
    at_least = 0
    chunk = max(1, min(n_perm, 2**22 // max(S, 1)))  # bounds the [chunk, S] block to ~32 MB
    for lo in range(0, n_perm, chunk):
        swaps = rng.random((min(chunk, n_perm - lo), n)) < 0.5  # [m, n] bool
        perm_a = a_tot + swaps.astype(np.float64) @ diff  # [m, S]
        for row in perm_a:
            at_least += two_sample_chi2(row, total - row)[0] >= observed - 1e-9
    return (1 + at_least) / (1 + n_perm)


def smoothed_symmetric_kl(a: np.ndarray, b: np.ndarray, alpha: float = KL_SMOOTHING) -> float:
    """KL(P_a || P_b) + KL(P_b || P_a) in nats between add-`alpha` smoothed frequencies.

    The smoothing runs over the union support (bins observed in either sample), so a token seen
    in one sample only gets a finite probability in the other. For reference only: the value is
    dominated by the smoothing when the support is sparse (many tokens seen once).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    support = (a + b) > 0
    pa = a[support] + alpha
    pb = b[support] + alpha
    pa /= pa.sum()
    pb /= pb.sum()
    return float(np.sum(pa * np.log(pa / pb)) + np.sum(pb * np.log(pb / pa)))
