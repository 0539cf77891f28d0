"""The prediction drafter (predicted outputs / speculative edits): its aligner, and exactness.

Aligner unit tests drive `PredictionDrafter` with a hand-written output: what it drafts next
after an exact copy, an insertion, a deletion, a repeated line, a prediction shorter or longer
than the output, an empty prediction. Exactness: level 2 at T = 1 on mock chains with a partly
right prediction (permutation p-value, as tests/test_decode.py), greedy equality everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from stats_util import two_sample_chi2

from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import generate
from specdec.core.drafters import PredictionDrafter
from specdec.core.metrics import Round
from specdec.core.policy import CostModelK
from specdec.study.significance import paired_permutation_p

V = 16
PROMPT = [1, 2, 3]
P_MIN = 0.01


def _next(d: PredictionDrafter, out: list[int], k: int = 4) -> tuple[str | None, list[int]]:
    """What the drafter would draft after `out` (the prompt is PROMPT)."""
    ctx = PROMPT + out
    src = d.source(ctx)
    return src, d.propose(ctx, k).x.tolist() if src is not None else []


def _accept(d: PredictionDrafter, out: list[int], k: int, n: int) -> None:
    """One round: propose k after `out`, the verifier accepts n of them."""
    d.propose(PROMPT + out, k)
    d.observe(n)


PRED = [10, 11, 12, 13, 14, 15, 10, 11, 12, 13, 4, 5, 6, 7, 8, 9]


def test_aligned_output_drafts_the_continuation() -> None:
    d = PredictionDrafter(PRED, len(PROMPT))
    assert _next(d, []) == ("prediction-start", PRED[:4])
    _accept(d, [], 4, 4)
    assert _next(d, PRED[:5]) == ("prediction", PRED[5:9])  # 4 accepted + a bonus that matches


def test_preamble_before_the_copy_then_alignment() -> None:
    """The answer opens with a fence (tokens 0, 1) the prediction does not have."""
    d = PredictionDrafter(PRED, len(PROMPT))
    _accept(d, [], 2, 0)  # the start guessed, rejected: the output began with 0
    assert _next(d, [0]) == ("prediction-start", PRED[:4])
    _accept(d, [0, 1], 4, 4)
    assert _next(d, [0, 1, *PRED[:5]]) == ("prediction", PRED[5:9])


def test_insertion_realigns_after_the_inserted_tokens() -> None:
    d = PredictionDrafter(PRED, len(PROMPT))
    out = PRED[:3]
    _accept(d, [], 3, 3)
    out = [*out, 0, 1, 2, 3]  # inserted text, then the copy goes on
    assert _next(d, out)[0] is None  # nothing in the prediction ends with ...0 1 2 3
    out = [*out, *PRED[3:6]]  # 13 14 15: a 3-gram found right after the last aligned position
    assert _next(d, out) == ("prediction-realigned", PRED[6:10])


def test_deletion_skips_ahead() -> None:
    d = PredictionDrafter(PRED, len(PROMPT))
    _accept(d, [], 2, 2)
    out = [*PRED[:2], *PRED[10:13]]  # 10 11 | 4 5 6: the middle was deleted
    assert _next(d, out) == ("prediction-realigned", PRED[13:16])


def test_repeated_line_prefers_the_occurrence_after_the_aligned_position() -> None:
    """10 11 12 13 occurs twice; having copied the first, the second is the one that follows."""
    d = PredictionDrafter(PRED, len(PROMPT))
    _accept(d, [], 6, 6)
    out = [*PRED[:6], 99, 10, 11, 12]  # an edit (99), then the repeated run
    assert _next(d, out, 3) == ("prediction-realigned", [13, 4, 5])


def test_a_fresh_realignment_is_its_own_source_until_the_copy_is_under_way() -> None:
    """After an edit the next tokens are often still the edit: the K policy learns that regime
    ("prediction-realigned") apart from a copy under way ("prediction", after COPY_RUN tokens
    that followed the prediction since the re-alignment)."""
    pred = list(range(20, 60))
    d = PredictionDrafter(pred, len(PROMPT))
    _accept(d, [], 8, 8)
    out = [*pred[:8], 99, *pred[10:13]]  # an edit replaced 28 29 with 99; realigned on 3 tokens
    assert _next(d, out)[0] == "prediction-realigned"
    n = PredictionDrafter.COPY_RUN
    _accept(d, out, n - 1, n - 1)  # n - 1 followed: not yet
    out = [*out, *pred[13 : 13 + n - 1]]
    assert d.source(PROMPT + out) == "prediction-realigned"
    out = [*out, pred[13 + n - 1]]  # the n-th
    assert _next(d, out) == ("prediction", pred[14 + n - 1 : 18 + n - 1])
    out = [*out, 98]  # another edit: a rejection
    assert d.source(PROMPT + out) is None or d.source(PROMPT + out) == "prediction-realigned"


def test_prediction_shorter_and_longer_than_the_output() -> None:
    short = PredictionDrafter(PRED[:4], len(PROMPT))
    _accept(short, [], 4, 4)
    assert _next(short, [*PRED[:4], 7]) == (None, [])  # past its end: nothing to draft
    long = PredictionDrafter(PRED * 3, len(PROMPT))
    _accept(long, [], 8, 8)
    assert _next(long, PRED[:9], 4) == ("prediction", PRED[9:13])


def test_empty_prediction_drafts_nothing() -> None:
    d = PredictionDrafter([], len(PROMPT))
    assert _next(d, []) == (None, [])
    assert _next(d, [4, 5, 6]) == (None, [])


# ------------------------------------------------------------------ exactness, mock chains
@pytest.fixture(scope="module")
def target() -> MockModel:
    return MockModel(V, seed=0, scale=3.0)


@pytest.fixture(scope="module")
def prediction(target) -> list[int]:
    """The target's own greedy output with every 7th token changed: partly right."""
    out = generate(target, PROMPT, max_new_tokens=40, warp=Warp(0.0)).tokens
    return [(t + 1) % V if i % 7 == 6 else t for i, t in enumerate(out)]


class _CheapVerifyAuto(CostModelK):
    """k="auto" with a fixed cost curve where long drafts pay (GPU-like): K follows acceptance
    alone, deterministic for a seed (mock models' wall clock would make drafting look dear)."""

    def __init__(self) -> None:
        super().__init__(k_max=16, verify_s={b: 1.0 + 0.05 * b for b in range(1, 18)})

    def observe(self, r: Round) -> None:
        super().observe(replace(r, draft_s=0.0, verify_s=self.v(r.k + 1)))


@pytest.mark.parametrize("k", [4, 12, "auto"])
def test_prediction_is_greedy_exact_and_drafts(target, prediction, k) -> None:
    k = _CheapVerifyAuto() if k == "auto" else k
    base = generate(target, PROMPT, max_new_tokens=40, warp=Warp(0.0))
    spec = generate(
        target,
        PROMPT,
        max_new_tokens=40,
        warp=Warp(0.0),
        spec=SpecConfig(k=k),
        prediction=prediction,
        debug=True,
    )
    assert spec.tokens == base.tokens
    st = spec.stats
    assert st.accepted_prediction_tokens > 10 and st.rejected_prediction_tokens > 0
    assert st.accepted_prediction_tokens + st.rejected_prediction_tokens <= st.drafted


def test_prediction_is_lossless_at_t1(target, prediction) -> None:
    n = 600
    base = [
        generate(target, PROMPT, max_new_tokens=30, warp=Warp(1.0), seed=50_000 + s).tokens
        for s in range(n)
    ]
    seqs, accepted = [], 0
    for s in range(n):
        r = generate(
            target,
            PROMPT,
            max_new_tokens=30,
            warp=Warp(1.0),
            seed=s,
            spec=SpecConfig(k=4),
            prediction=prediction,
            debug=True,
        )
        seqs.append(r.tokens)
        accepted += r.stats.accepted_prediction_tokens
    assert accepted > n  # the prediction really was drafted from, and accepted
    count = lambda ss: np.bincount([t for s in ss for t in s], minlength=V)  # noqa: E731
    chi2, dof, p_table = two_sample_chi2(count(seqs), count(base))
    p = paired_permutation_p(seqs, base, n_perm=1000)
    assert p > P_MIN, f"chi2={chi2:.1f} dof={dof} p_perm={p:.4f} p_table={p_table:.4f}"


def test_bad_predictions_are_refused_before_any_work(target) -> None:
    target.reset()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(target, PROMPT, prediction=[1, V + 5])
    with pytest.raises(ValueError, match="needs a prediction"):
        generate(target, PROMPT, spec=SpecConfig("prediction"))
    with pytest.raises(ValueError, match="no draft model"):
        generate(
            target,
            PROMPT,
            draft=MockModel(V, seed=1),
            spec=SpecConfig("prediction"),
            prediction=[1],
        )
    assert target.n_cached == 0
