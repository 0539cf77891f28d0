"""Test statistics shared by the exactness gates (explicit, so thresholds mean something)."""

from __future__ import annotations

import numpy as np
from scipy import stats

# The library owns the two-sample test (the level-3 gate uses it too); re-exported here.
from specdec.study.run.significance import MIN_EXPECTED, two_sample_chi2

__all__ = ["MIN_EXPECTED", "gof_chi2", "kl", "two_sample_chi2"]


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


def kl(p_hat: np.ndarray, p: np.ndarray) -> float:
    """KL(p_hat || p) in nats; terms with p_hat == 0 contribute 0."""
    p_hat = np.asarray(p_hat, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    m = p_hat > 0
    return float((p_hat[m] * np.log(p_hat[m] / p[m])).sum())
