"""Penalties, logit bias, min-p, a grammar and logprobs under speculation (core.processing):
exact, because every verify row is adjusted from its own prefix.

Greedy: speculation (lookup, a draft model, a prediction, company in a joint pass) gives the
target-only tokens and logprobs, token for token. Sampling (level 2, `stats`): 1,000 seeded
generations x 25 tokens with presence/frequency/repetition penalties, a logit bias and a
grammar, speculative (a draft model, K = 4) against target-only with the same settings;
the chi-square statistic over token and bigram frequencies, its paired permutation p-value
(1,000 permutations), pass at p > 0.01; the same test
rejects (p < 0.01) a processor that adjusts every row of a pass from the committed prefix
alone, the mistake the rule exists to prevent.
"""

from __future__ import annotations

import pytest
import torch

from specdec.backends.mock import MockModel
from specdec.core.decode import FORCED_PER_ROUND, rounds_together
from specdec.core.generate import generate, stream
from specdec.core.processing import FORCED, MAX_BIAS, Penalties, Processor
from specdec.core.sampling import probs_from_logits, token_logprobs
from specdec.study.run.significance import paired_permutation_p

V = 48
PROMPT = [1, 2, 3]
N_GEN = 1000
N_TOK = 25


class Alternating:
    """A toy grammar over the mock vocabulary: token parities alternate, and a token that is a
    multiple of 4 forces the two after it (t + 3, t + 4). A stack of states gives rollback."""

    def __init__(self, width: int = V, last: int = 3) -> None:
        self.width = width
        self._states: list[tuple[int, tuple[int, ...]]] = [(last % 2, ())]

    def _ok(self, t: int) -> bool:
        parity, pending = self._states[-1]
        return t == pending[0] if pending else t % 2 != parity

    def allowed(self) -> torch.Tensor:
        return torch.tensor([self._ok(t) for t in range(self.width)])

    def consume(self, tokens) -> int:
        for n, t in enumerate(tokens):
            if not self._ok(t):
                return n
            _, pending = self._states[-1]
            forces = t % 4 == 0 and t + 4 < self.width
            nxt = pending[1:] if pending else ((t + 3, t + 4) if forces else ())
            self._states.append((t % 2, nxt))
        return len(tokens)

    def rollback(self, n: int) -> None:
        del self._states[len(self._states) - n :]

    def forced(self) -> list[int]:
        return list(self._states[-1][1])


def valid(tokens: list[int]) -> bool:
    g = Alternating()
    return g.consume(tokens) == len(tokens)


PEN = Penalties.of(presence=0.8, frequency=0.6, repetition=1.3, bias={5: 2.0, 6: -100.0})


@pytest.fixture(scope="module")
def pair() -> tuple[MockModel, MockModel]:
    target = MockModel(V, seed=0)
    return target, MockModel.near(target, noise=0.7, seed=1)


# ---------------------------------------------------------------------------- definitions
def test_penalties_are_openais_and_transformers_definitions() -> None:
    """presence and frequency on generated tokens (OpenAI), repetition on prompt and generated
    (transformers: a positive logit divided, a negative one multiplied), bias added."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]])
    seen = torch.tensor([[False, True, True, True, False]])  # token 3 in the prompt only
    pen = Penalties.of(presence=0.5, frequency=0.25, repetition=2.0, bias={4: 1.5})
    want = [2.0, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0 / 2, -2.0 + 1.5]
    assert pen.apply(logits, counts, seen)[0].tolist() == pytest.approx(want)
    for bad in [{"presence": 2.1}, {"frequency": float("nan")}, {"repetition": 0}]:
        with pytest.raises(ValueError):
            Penalties.of(**bad)
    with pytest.raises(ValueError, match="logit_bias"):
        Penalties.of(bias={1: 150})


def test_min_p_keeps_tokens_within_a_ratio_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, 1.0, min_p=0.25)  # keeps p >= 0.125
    assert p.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert probs_from_logits(logits, 1.0, min_p=1.0).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_each_verify_row_is_adjusted_from_its_own_prefix() -> None:
    """rows(logits, x)[i] is what a processor that had committed x[:i] makes of row i; a
    draft token the grammar forbids leaves the rows after it unmasked (never reached)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    x = [4, 7, 8, 11]  # 4 forces 7, 8; then 8 is not a trigger (it was forced): 11 is odd
    got = Processor(PEN, Alternating(), PROMPT, V).rows(logits, x)
    for i in range(len(x) + 1):
        one = Processor(PEN, Alternating(), PROMPT, V)
        one.commit(x[:i])
        assert torch.equal(got[i], one.row(logits[i], [])), i
        assert torch.equal(got[i], Processor(PEN, Alternating(), PROMPT, V).row(logits[i], x[:i]))
    # greedy: a row whose argmax the grammar allows is left unmasked, the others masked; the
    # argmax of every row is the fully masked row's
    for seed in range(20):
        lg = torch.randn(5, V, generator=torch.Generator().manual_seed(seed))
        full = Processor(PEN, Alternating(), PROMPT, V).rows(lg, x)
        lazy = Processor(PEN, Alternating(), PROMPT, V).rows(lg, x, greedy=True)
        assert torch.equal(full.argmax(-1), lazy.argmax(-1))
        bad = Processor(None, Alternating(), PROMPT, V).rows(logits, [4, 6, 7])  # 6: same parity
    assert torch.isinf(bad[1, 6]) and bool(torch.isfinite(bad[2]).all())


def test_a_draft_steps_row_is_the_last_verify_row_of_its_prefix() -> None:
    """`row` (a draft step's adjustment, built alone) equals the last row `rows` builds for
    the same drafted prefix, repeats and tokens already generated included."""
    g = torch.Generator().manual_seed(1)
    proc = Processor(PEN, None, PROMPT, V)
    proc.commit([5, 9, 9])
    for drafted in ([], [9], [5, 7, 7, 30], [6] * 5):
        lg = torch.randn(len(drafted) + 1, V, generator=g)
        assert torch.equal(proc.row(lg[-1], drafted), proc.rows(lg, drafted)[-1]), drafted


def test_logit_bias_entries_are_capped() -> None:
    Penalties.of(bias={i: 1.0 for i in range(MAX_BIAS)})
    with pytest.raises(ValueError, match=f"at most {MAX_BIAS} are taken.*grammar"):
        Penalties.of(bias={i: 1.0 for i in range(MAX_BIAS + 1)})


def test_logprobs_are_the_models_own_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    got = token_logprobs(logits, [0, 2], 2)
    lp = torch.log_softmax(logits, -1)
    assert [e.logprob for e in got] == pytest.approx([float(lp[0, 0]), float(lp[1, 2])])
    assert [t for t, _ in got[0].top] == [1, 0] and got[1].top[0][0] == 2


# ---------------------------------------------------------------------------- greedy: exact
SPECS = {
    "lookup-k4": dict(drafter="lookup", k=4),
    "model-k3": dict(k=3, draft=True),
    "model-auto": dict(k="auto", draft=True),
    "prediction-auto": dict(drafter="prediction", k="auto", prediction=[8, 11, 12, 3, 4] * 6),
}
ADJUST = {
    "penalties": dict(penalties=PEN),
    "grammar": dict(constraint=True),
    "both": dict(penalties=PEN, constraint=True),
    "min_p": dict(penalties=PEN, min_p=0.2),
}


def _run(target, draft, spec: dict, adjust: dict, temperature: float = 0.0, seed: int = 0):
    kw = {k: v for k, v in {**spec, **adjust}.items() if k not in ("draft", "constraint")}
    return generate(
        target,
        PROMPT,
        draft=draft if spec.get("draft") else None,
        constraint=Alternating() if adjust.get("constraint") else None,
        temperature=temperature,
        max_new_tokens=40,
        seed=seed,
        logprobs=3,
        debug=True,
        **kw,
    )


@pytest.mark.parametrize("adjust", ADJUST, ids=list(ADJUST))
@pytest.mark.parametrize("spec", SPECS, ids=list(SPECS))
def test_greedy_speculation_equals_target_only(pair, spec: str, adjust: str) -> None:
    target, draft = pair
    alone = _run(target, None, {}, ADJUST[adjust])
    spec_run = _run(target, draft, SPECS[spec], ADJUST[adjust])
    assert spec_run.tokens == alone.tokens
    assert spec_run.logprobs == alone.logprobs  # bit for bit: the same rows
    assert len(alone.logprobs) == len(alone.tokens)
    assert spec_run.stats.drafted > 0
    if ADJUST[adjust].get("constraint"):
        assert valid(alone.tokens)
        assert spec_run.stats.drafted_by_source.get(FORCED, 0) > 0  # forced tokens drafted
    if "penalties" in ADJUST[adjust]:  # the adjustments did change the answer
        assert alone.tokens != _run(target, None, {}, {}).tokens


def _together(gens) -> None:
    """Prefill the generations, then run them in joint rounds (rounds_together) to the end."""
    for g in gens:
        while not g.prefill():
            pass
    while any(not g.done for g in gens):
        live = [g for g in gens if not g.done]
        for got in rounds_together(live):
            assert not isinstance(got, Exception), got


def test_greedy_in_company_equals_alone(pair) -> None:
    """Four generations with their own adjustments in joint passes (rounds_together), each
    equal to its target-only answer."""
    target, _ = pair
    kinds = [ADJUST["both"], ADJUST["penalties"], ADJUST["grammar"], {}]
    alone = [_run(target, None, {}, a).tokens for a in kinds]
    slots = target.slots(4)
    gens = []
    for slot, a in zip(slots, kinds, strict=True):
        s = stream(
            slot,
            PROMPT,
            drafter="lookup",
            k=4,
            temperature=0.0,
            max_new_tokens=40,
            penalties=a.get("penalties"),
            constraint=Alternating() if a.get("constraint") else None,
        )
        gens.append(s.generation)
    _together(gens)
    assert [g.tokens for g in gens] == alone


class Spelled:
    """A grammar that allows one sequence and then anything: every token of it forced (a long
    `guided_choice`'s single choice)."""

    def __init__(self, seq: list[int], width: int = V) -> None:
        self.seq, self.width, self.pos = seq, width, [0]

    def allowed(self) -> torch.Tensor | None:
        if self.pos[-1] >= len(self.seq):
            return None
        mask = torch.zeros(self.width, dtype=torch.bool)
        mask[self.seq[self.pos[-1]]] = True
        return mask

    def consume(self, tokens) -> int:
        for n, t in enumerate(tokens):
            p = self.pos[-1]
            if p < len(self.seq) and t != self.seq[p]:
                return n
            self.pos.append(p + 1)
        return len(tokens)

    def rollback(self, n: int) -> None:
        del self.pos[len(self.pos) - n :]

    def forced(self) -> list[int]:
        return self.seq[self.pos[-1] :]


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_a_grammar_forcing_hundreds_of_tokens_takes_them_a_bounded_number_a_round(
    pair, drafter: str
) -> None:
    """200 forced tokens go in rounds of at most FORCED_PER_ROUND (a round's pass is shared with
    other streams: a grammar must not make one pass of thousands of rows), all of them emitted,
    then decoding goes on; with a draft model its q gets a one-hot row per forced token."""
    target, draft = pair
    seq = [(7 * i + 5) % V for i in range(200)]
    s = stream(
        target,
        PROMPT,
        drafter=drafter,
        draft=draft if drafter == "model" else None,
        k=4,
        temperature=0.0 if drafter == "lookup" else 1.0,
        seed=3,
        max_new_tokens=230,
        constraint=Spelled(seq),
    )
    rounds = []
    s.generation.on_round = rounds.append
    tokens = [t for chunk in s for t in chunk]
    assert tokens[:200] == seq and len(tokens) == 230
    assert max(r.forced for r in rounds) == FORCED_PER_ROUND
    assert max(r.k for r in rounds) <= FORCED_PER_ROUND + 4


def test_a_fixed_k_is_bounded_in_company_and_not_alone(pair) -> None:
    """A request's fixed K (up to 128 through the server) in a shared pass is at most its
    `k_company`; the answers stay target-only's. Alone, it drafts its own K."""
    target, _ = pair
    alone = _run(target, None, {}, {}).tokens
    greedy40 = dict(temperature=0.0, max_new_tokens=40)
    gens, rounds = [], []
    for slot in target.slots(2):
        s = stream(slot, PROMPT, drafter="prediction", prediction=alone, k=30, **greedy40)
        s.generation.k_company = 5
        s.generation.on_round = rounds.append
        gens.append(s.generation)
    _together(gens)
    assert [g.tokens for g in gens] == [alone, alone]
    assert max(r.k for r in rounds) == 5
    solo = stream(target, PROMPT, drafter="prediction", prediction=alone, k=30, **greedy40)
    solo.generation.k_company = 5
    own: list = []
    solo.generation.on_round = own.append
    assert [t for chunk in solo for t in chunk] == alone and max(r.k for r in own) > 5


def test_forced_tokens_count_in_the_k_company_of_a_shared_pass(pair) -> None:
    """In company a round puts at most its k_company tokens, forced and drafted together, into
    the shared pass (a grammar forcing 200 must not make a neighbour's pass 33 rows longer);
    every forced token is still emitted, and alone the round takes FORCED_PER_ROUND."""
    target, _ = pair
    seq = [(7 * i + 5) % V for i in range(200)]
    gens, rounds = [], []
    for slot in target.slots(2):
        s = stream(slot, PROMPT, drafter="lookup", k=4, temperature=0.0, max_new_tokens=230,
                   constraint=Spelled(seq))  # fmt: skip
        s.generation.k_company = 6
        s.generation.on_round = rounds.append
        gens.append(s.generation)
    _together(gens)
    assert [g.tokens[:200] for g in gens] == [seq, seq]
    assert max(r.forced for r in rounds) == 6 and max(r.k for r in rounds) <= 6
    assert max(r.rows for r in rounds) <= 2 * (6 + 1)  # two requests, k_company + 1 rows each


def test_bad_adjustments_are_refused_before_any_model_work(pair) -> None:
    target, _ = pair
    with pytest.raises(ValueError, match="logit_bias token id 99"):
        generate(target, PROMPT, penalties=Penalties.of(bias={99: 1.0}), max_new_tokens=2)
    with pytest.raises(ValueError, match="logprobs"):
        generate(target, PROMPT, logprobs=V + 1, max_new_tokens=2)


# ---------------------------------------------------------------------------- sampling: level 2
def _sample(target, draft, seeds, **adjust) -> list[list[int]]:
    return [
        generate(
            target,
            PROMPT,
            draft=draft,
            k=4 if draft is not None else None,
            temperature=1.0,
            max_new_tokens=N_TOK,
            seed=s,
            penalties=PEN,
            constraint=Alternating(),
            **adjust,
        ).tokens
        for s in seeds
    ]


def _bigrams(seqs: list[list[int]]) -> list[list[int]]:
    return [[a * V + b for a, b in zip([PROMPT[-1], *s[:-1]], s, strict=True)] for s in seqs]


def _p_values(spec: list[list[int]], base: list[list[int]]) -> tuple[float, float]:
    """Permutation p-values of the chi-square statistic over tokens and bigrams (tokens of one
    generation are dependent: test_decode's reason for the same choice)."""
    p_tok = paired_permutation_p(spec, base, n_perm=1000)
    p_bi = paired_permutation_p(_bigrams(spec), _bigrams(base), n_perm=1000)
    return p_tok, p_bi


@pytest.fixture(scope="module")
def adjusted_baseline(pair) -> list[list[int]]:
    target, _ = pair
    return _sample(target, None, range(10_000, 10_000 + N_GEN))


@pytest.mark.stats
def test_level2_adjusted_speculation_matches_adjusted_baseline(pair, adjusted_baseline) -> None:
    target, draft = pair
    spec = _sample(target, draft, range(N_GEN))
    assert all(valid(s) for s in spec + adjusted_baseline)
    p_tok, p_bi = _p_values(spec, adjusted_baseline)
    assert p_tok > 0.01 and p_bi > 0.01, (p_tok, p_bi)


@pytest.mark.stats
def test_level2_has_power_against_rows_adjusted_from_the_committed_prefix(
    pair, adjusted_baseline, monkeypatch
) -> None:
    """The mistake: every row of a pass penalized as if nothing had been drafted before it."""
    target, draft = pair

    def committed_only(self, logits, x, greedy=False):
        out = logits.to("cpu", torch.float32)
        counts, seen = self._counted([])
        return self.penalties.apply(out, counts.expand_as(out), seen.expand_as(out))

    monkeypatch.setattr(Processor, "rows", committed_only)
    pen = Penalties.of(presence=2.0, frequency=2.0)

    def run(d, s):
        k = 4 if d is not None else None
        kw = dict(temperature=1.0, max_new_tokens=N_TOK, seed=s, penalties=pen)
        return generate(target, PROMPT, draft=d, k=k, **kw).tokens

    spec = [run(draft, s) for s in range(N_GEN)]
    base = [run(None, s) for s in range(10_000, 10_000 + N_GEN)]  # K = 0: one row, correct
    p_tok, p_bi = _p_values(spec, base)
    assert min(p_tok, p_bi) < 0.01, (p_tok, p_bi)
