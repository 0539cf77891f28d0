"""The prediction drafter (predicted outputs / speculative edits): its aligner, and exactness.

Aligner unit tests drive `PredictionDrafter` with a hand-written output: what it drafts next
after an exact copy, an insertion, a deletion, a repeated line, a prediction shorter or longer
than the output, an empty prediction. Exactness: level 2 at T = 1 on mock chains with a partly
right prediction (permutation p-value, as tests/core/test_decode.py), greedy equality everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from stats_util import two_sample_chi2

from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp, runs_as
from specdec.core.drafters import CompositeDrafter, LookupDrafter
from specdec.core.edits import MAX_NEW, MAX_RULES, Rewrites, hint_ids, named_rewrites
from specdec.core.generate import generate
from specdec.core.metrics import Round
from specdec.core.policy import CostModelK
from specdec.core.prediction import PredictionDrafter, PredictionIndex
from specdec.study.run.significance import paired_permutation_p

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
    """The answer opens with a fence (tokens 0, 1) the prediction does not have, and the prompt
    does not quote the prediction: the start is guessed until a guess is rejected outright,
    then the copy is found by re-alignment (a wrong prediction's start, guessed every round,
    kept prompt lookup from drafting)."""
    d = PredictionDrafter(PRED, len(PROMPT))
    assert _next(d, []) == ("prediction-start", PRED[:4])
    _accept(d, [], 2, 0)  # the start guessed, rejected: the output began with 0
    assert _next(d, [0]) == (None, [])
    assert _next(d, [0, 1]) == (None, [])
    assert _next(d, [0, 1, *PRED[:3]]) == ("prediction-realigned", PRED[3:7])
    _accept(d, [0, 1, *PRED[:3]], 4, 4)
    assert _next(d, [0, 1, *PRED[:8]]) == ("prediction", PRED[8:12])


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
    ("prediction-realigned") apart from a copy under way ("prediction": the output matches
    the prediction over its last COPY_RUN tokens, the re-alignment's n-gram included)."""
    pred = list(range(20, 60))
    d = PredictionDrafter(pred, len(PROMPT))
    _accept(d, [], 8, 8)
    out = [*pred[:8], 99, pred[10]]  # an edit replaced 28 29 with 99; realigned on 1 token
    assert _next(d, out)[0] == "prediction-realigned"
    n = PredictionDrafter.COPY_RUN
    _accept(d, out, n - 2, n - 2)  # 1 + (n - 2) matched: not yet
    out = [*out, *pred[11 : 11 + n - 2]]
    assert d.source(PROMPT + out) == "prediction-realigned"
    out = [*out, pred[11 + n - 2]]  # the n-th matched token
    assert _next(d, out) == ("prediction", pred[12 + n - 2 : 16 + n - 2])
    out = [*out, 98]  # another edit: a rejection
    assert d.source(PROMPT + out) is None or d.source(PROMPT + out) == "prediction-realigned"
    d2 = PredictionDrafter(pred, len(PROMPT))  # on 3 tokens, one more followed is a copy
    _accept(d2, [], 8, 8)
    out = [*pred[:8], 99, *pred[10:13]]
    assert _next(d2, out, 1) == ("prediction-realigned", [pred[13]])
    d2.observe(1)
    assert d2.source([*PROMPT, *out, pred[13], pred[14]]) == "prediction"


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


@pytest.mark.stats
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


def test_a_prediction_is_checked_once_and_indexed_on_demand(target) -> None:
    """PredictionIndex is the one value a prediction travels as: its ids are checked against a
    vocabulary once (a narrower one checks them again), and its n-gram index is built when
    first read, not on construction (a server builds it off the worker's lock)."""
    index = PredictionIndex([1, 2, 3, 1, 2], vocab=V)
    assert index.vocab == V and not index.built
    assert index.ends[(1, 2)] == [2, 5] and index.built
    assert index.with_hints([([1], [4])]).built  # the same prediction: its index comes along
    with pytest.raises(ValueError, match="token id 3 is outside the vocabulary"):
        index.check(3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PredictionIndex([0, V], vocab=V)
    wide = PredictionIndex([V + 1])  # checked by no one yet: the core checks it
    target.reset()
    with pytest.raises(ValueError, match=f"token id {V + 1} is outside"):
        generate(target, PROMPT, prediction=wide)


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


@pytest.mark.parametrize(
    ("drafter", "has_prediction", "runs"),
    [
        ("prediction", False, "lookup"),  # the prediction, else prompt lookup
        ("prediction", True, "prediction"),
        ("lookup", True, "lookup"),
        ("model", False, "model"),
        ("composite", True, "composite"),
        (None, True, None),  # no drafter: nothing drafted, not even a prediction
    ],
)
def test_a_drafter_runs_as_runs_as_says(drafter, has_prediction, runs) -> None:
    assert runs_as(drafter, has_prediction) == runs


def test_prediction_with_a_prediction_is_lookup_with_it(target) -> None:
    """Why the server and the bench may name "lookup" for "prediction" (runs_as without a
    prediction) and pass a request's prediction beside it: decode builds the same drafter."""
    pred = [8, 11, 12, 3, 4] * 6
    runs = [
        generate(target, PROMPT, spec=SpecConfig(name, 4), prediction=pred, seed=3)
        for name in ("prediction", "lookup")
    ]
    a, b = (r.stats for r in runs)
    assert runs[0].tokens == runs[1].tokens and a.drafted > 0
    assert (a.drafted_by_source, a.accepted_by_source) == (
        b.drafted_by_source,
        b.accepted_by_source,
    )


# ------------------------------------------------------------------ learned rewrites (core.edits)
def _follow_output(d: PredictionDrafter, out: list[int], k: int = 8) -> list[tuple[int, int]]:
    """Greedy rounds over a known output, as the decode loop runs them: propose k, accept
    while the draft equals the output, commit the accepted tokens and the next one. Returns
    (drafted, accepted) per drafting round."""
    made, rounds = 0, []
    while made < len(out):
        ctx = PROMPT + out[:made]
        x = d.propose(ctx, k).x.tolist() if d.source(ctx) is not None else []
        n = 0
        while n < len(x) and made + n < len(out) and x[n] == out[made + n]:
            n += 1
        if x:
            d.observe(n)
            rounds.append((len(x), n))
        made += n + 1
    return rounds


FILE = [
    *[10, 11, 50, 12, 13, 14, 15],
    *[16, 17, 50, 18, 19, 20, 21],
    *[22, 23, 50, 24, 25, 26, 27],
    *[28, 29, 50, 30, 31, 32, 33],
    *[34, 35, 50, 36, 37, 38, 39],
]  # identifier 50 at five places, everything else distinct


def _renamed(tokens: list[int], old: int, new: list[int], keep: set[int] = frozenset()) -> list:
    """`tokens` with `old` replaced by `new` except at the occurrences numbered in `keep`."""
    out, seen = [], 0
    for t in tokens:
        if t == old:
            out += [old] if seen in keep else new
            seen += 1
        else:
            out.append(t)
    return out


def test_a_rename_is_learned_and_drafted_at_the_next_occurrences() -> None:
    out = _renamed(FILE, 50, [60, 61])
    d = PredictionDrafter(FILE, len(PROMPT))
    _follow_output(d, out)
    assert [(r.old, r.new) for r in d.rewrites] == [((50,), (60, 61))]
    # the 4 later occurrences' 8 tokens: each drafted and accepted, or the round's bonus token
    assert d.rewrite_drafted == d.rewrite_accepted >= 6
    static = PredictionDrafter(FILE, len(PROMPT), learn=False)
    rounds = _follow_output(static, out)
    assert sum(n for _, n in rounds) < sum(
        n for _, n in _follow_output(PredictionDrafter(FILE, len(PROMPT)), out)
    )  # learning accepts more


def test_after_the_first_occurrence_every_drafted_token_is_accepted() -> None:
    """The issue's rename target, on a clean rename: once the first occurrence is rewritten,
    no drafted prediction token is rejected (the copy drafts run through the renamed ones)."""
    out = _renamed(FILE, 50, [60, 61])
    d = PredictionDrafter(FILE, len(PROMPT))
    made, rejected_after = 0, 0
    while made < len(out):
        ctx = PROMPT + out[:made]
        learned = len(d.rewrites) > 0
        x = d.propose(ctx, 8).x.tolist() if d.source(ctx) is not None else []
        n = 0
        while n < len(x) and made + n < len(out) and x[n] == out[made + n]:
            n += 1
        if x:
            d.observe(n)
            if learned and made + len(x) <= len(out):
                rejected_after += len(x) - n
        made += n + 1
    assert len(d.rewrites) == 1 and rejected_after == 0


def test_several_rewrites_at_once() -> None:
    out = _renamed(_renamed(FILE, 50, [60, 61]), 36, [70])  # 36 occurs once...
    out = [t if t != 30 else 71 for t in out]  # ...and a second edit elsewhere
    doubled = [*FILE, 90, 91, 92, *FILE]
    out2 = [*out, 90, 91, 92, *out]
    d = PredictionDrafter(doubled, len(PROMPT))
    _follow_output(d, out2)
    learned = {(r.old, r.new) for r in d.rewrites}
    assert {((50,), (60, 61)), ((36,), (70,)), ((30,), (71,))} <= learned
    # the second copy's occurrences of all three (12 tokens), drafted or as bonus tokens
    assert d.rewrite_drafted == d.rewrite_accepted >= 12


def test_a_rewrite_that_stops_matching_is_forgotten() -> None:
    """The output renames the first two occurrences and keeps the other three: the rewrite,
    confirmed once, is missed at occurrences 3 and 4 and forgotten, and the last occurrence
    is drafted from the plain prediction and accepted."""
    out = _renamed(FILE, 50, [60, 61], keep={2, 3, 4})
    d = PredictionDrafter(FILE, len(PROMPT))
    _follow_output(d, out[:28])  # up to occurrence 4 (output index 28 is its 50)
    assert len(d.rewrites) == 0
    assert d.rewrite_drafted - d.rewrite_accepted <= 2 * 2  # at most two rejected rewrites
    ctx = PROMPT + out[:26]
    assert d.source(ctx) is not None and 50 in d.propose(ctx, 8).x.tolist()


def test_a_repeated_new_argument_is_learned_as_an_insertion() -> None:
    """f(a, b) -> f(a, b, c) at three call sites: an insertion between ", b" and ")"."""
    call, new_call = [20, 21, 22, 23, 24, 25], [20, 21, 22, 23, 24, 23, 26, 25]
    pred, out = [], []
    for i, filler in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 11, 12, 13])):
        pred += [*call, *filler, 40 + i]
        out += [*new_call, *filler, 40 + i]
    d = PredictionDrafter(pred, len(PROMPT))
    _follow_output(d, out)
    assert [(r.old, r.new, r.before, r.after) for r in d.rewrites] == [
        ((), (23, 26), (23, 24), (25,))
    ]
    assert d.rewrite_accepted == 2 * 2  # the two later call sites


def test_a_hint_is_drafted_before_any_occurrence() -> None:
    """A rewrite known beforehand (the instruction's "rename X to Y") drafts the first
    occurrence already."""
    out = _renamed(FILE, 50, [60, 61])
    d = PredictionDrafter(PredictionIndex(FILE, hints=[([50], [60, 61])]), len(PROMPT))
    _follow_output(d, out)
    assert d.rewrite_drafted == d.rewrite_accepted >= 8  # all 10, less bonus tokens
    wrong = PredictionDrafter(PredictionIndex(FILE, hints=[([25], [99])]), len(PROMPT))
    _follow_output(wrong, out)
    assert [r.old for r in wrong.rewrites] == [(50,)]  # the wrong hint missed, forgotten


def test_rewrites_trim_what_the_spans_share_and_bound_their_size() -> None:
    rw = Rewrites()
    pred = [1, 2, 3, 4, 5, 6, 7, 8]
    r = rw.learn(pred, 1, 5, [2, 9, 9, 5])  # 2 3 4 5 -> 2 9 9 5: only 3 4 -> 9 9 changed
    assert (r.old, r.new) == ((3, 4), (9, 9))
    assert rw.learn(pred, 2, 4, [3, 4]) is None  # nothing changed
    assert rw.learn(pred, 0, 0, [9]) is None  # an insertion with nothing before it to anchor
    assert rw.learn(pred, 0, 8, list(range(100, 100 + MAX_NEW + 1))) is None
    assert rw.match(pred, 2, inserted=False) is r and rw.match(pred, 3, False) is None
    rw.miss(r)
    assert len(rw) == 0 and rw.match(pred, 2, False) is None
    for i in range(MAX_RULES + 5):  # the oldest lowest-scored go first
        rw.learn([i + 1000, 0], 0, 1, [7])
    assert len(rw) == MAX_RULES


# ------------------------------------------------------------------ exactness with rewrites
@pytest.fixture(scope="module")
def renamed_prediction(target) -> tuple[list[int], list[int]]:
    """The target's greedy output, and a prediction of it in which one frequent token is
    written as another: the drafter learns to rewrite it back (greedy: every rewrite right)."""
    out = generate(target, PROMPT, max_new_tokens=60, warp=Warp(0.0)).tokens
    common = max(set(out), key=out.count)
    other = (common + 1) % V
    return out, [other if t == common else t for t in out]


def test_rewrites_keep_greedy_output_identical(target, renamed_prediction) -> None:
    out, pred = renamed_prediction
    for k in (4, 12, _CheapVerifyAuto()):
        d = CompositeDrafter(PredictionDrafter(pred, len(PROMPT)), LookupDrafter())
        spec = generate(
            target,
            PROMPT,
            max_new_tokens=60,
            warp=Warp(0.0),
            spec=SpecConfig(drafter=d, k=k),
            debug=True,
        )
        assert spec.tokens == out
        assert d.parts[0].rewrite_accepted > 0  # the learned rewrite was drafted and kept


@pytest.mark.stats
def test_rewrites_are_lossless_at_t1_even_when_learned_wrongly(target, prediction) -> None:
    """Level 2 at T = 1 with the drafter drafting rewrites that are wrong on purpose (a hint
    rewriting a frequent token into another) besides whatever it learns from sampled outputs:
    the output distribution is still the target's."""
    n = 600
    common = max(set(prediction), key=prediction.count)
    hint = ([common], [(common + 3) % V, (common + 5) % V])
    base = [
        generate(target, PROMPT, max_new_tokens=30, warp=Warp(1.0), seed=50_000 + s).tokens
        for s in range(n)
    ]
    seqs, drafted, learned = [], 0, 0
    for s in range(n):
        first = PredictionDrafter(PredictionIndex(prediction, hints=[hint]), len(PROMPT))
        d = CompositeDrafter(first, LookupDrafter())
        r = generate(
            target,
            PROMPT,
            max_new_tokens=30,
            warp=Warp(1.0),
            seed=s,
            spec=SpecConfig(drafter=d, k=4),
            debug=True,
        )
        seqs.append(r.tokens)
        drafted += first.rewrite_drafted
        learned += sum(not rw.hint for rw in first.rewrites)
    assert drafted > n // 2 and learned > n // 10  # wrong and learned rewrites were drafted
    count = lambda ss: np.bincount([t for s in ss for t in s], minlength=V)  # noqa: E731
    chi2, dof, p_table = two_sample_chi2(count(seqs), count(base))
    p = paired_permutation_p(seqs, base, n_perm=1000)
    assert p > P_MIN, f"chi2={chi2:.1f} dof={dof} p_perm={p:.4f} p_table={p_table:.4f}"


def test_instructions_name_their_rewrites() -> None:
    named = named_rewrites(
        "Rename the class `RateLimiter` to `TokenBucket` everywhere. `NewCounter` becomes "
        "`NewRegistry`. Replace every `var` with `const`, change `Load` to `Read` and move "
        "from `1.4` to `1.5`. Rename the field `balance` of `Account` to `cents`.\n\n"
        "```python\nrename `a` to `b`\n```"
    )
    assert named == [
        ("RateLimiter", "TokenBucket"),
        ("NewCounter", "NewRegistry"),
        ("var", "const"),
        ("Load", "Read"),
        ("1.4", "1.5"),
    ]  # not the ambiguous "balance of Account to cents", nor anything inside the code
    encode = lambda s: [ord(c) for c in s.replace(" ", "_")]  # noqa: E731 - a toy tokenizer
    assert hint_ids([("ab", "c"), ("x", "x")], encode) == [
        ((97, 98), (99,)),
        ((95, 97, 98), (95, 99)),
    ]
