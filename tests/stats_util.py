"""Test statistics shared by the exactness gates (explicit, so thresholds mean something)."""

from __future__ import annotations

import numpy as np
from scipy import stats

#: Bins with an expected count below this are pooled into one bin (the usual validity rule).
MIN_EXPECTED = 5.0


def gof_chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int, float]:
    """Goodness of fit of observed `counts` [V] to the analytic distribution `p` [V].

    Returns (chi2, dof, p_value). Bins whose expected count is below MIN_EXPECTED are pooled.
    Observations in bins where p == 0 make the statistic infinite (and p_value 0).
    """
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    expected = n * np.asarray(p, dtype=np.float64)
    if counts[expected == 0].sum() > 0:
        return float("inf"), 0, 0.0
    small = expected < MIN_EXPECTED
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return chi2, dof, float(stats.chi2.sf(chi2, dof))


def two_sample_chi2(a: np.ndarray, b: np.ndarray) -> tuple[float, int, float]:
    """Two-sample chi-square (2 x B contingency) between count vectors `a` and `b` [B].

    Bins whose expected count (under the pooled null) is below MIN_EXPECTED in either row are
    pooled into one bin, so every expected count used is >= MIN_EXPECTED.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    tot = a + b
    frac_a = a.sum() / tot.sum()
    exp_min = np.minimum(tot * frac_a, tot * (1 - frac_a))
    small = exp_min < MIN_EXPECTED
    table = np.stack([a[~small], b[~small]])
    if small.any():
        table = np.concatenate([table, [[a[small].sum()], [b[small].sum()]]], axis=1)
    table = table[:, table.sum(0) > 0]
    chi2, p_value, dof, _ = stats.chi2_contingency(table, correction=False)
    return float(chi2), int(dof), float(p_value)


def kl(p_hat: np.ndarray, p: np.ndarray) -> float:
    """KL(p_hat || p) in nats; terms with p_hat == 0 contribute 0."""
    p_hat = np.asarray(p_hat, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    m = p_hat > 0
    return float((p_hat[m] * np.log(p_hat[m] / p[m])).sum())
