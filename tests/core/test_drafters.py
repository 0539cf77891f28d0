"""Drafters (prompt lookup, composite, p-min cutoff) and K policies (fixed, schedule, auto).

Each must leave the output distribution exactly the target's: level-2 two-sample chi-square on
mock models at T > 0, decided by its permutation p-value (same statistic, rule and threshold as
tests/core/test_decode.py and the level-3 gate), and greedy output
identical to target-only decoding. Controller unit tests use synthetic cost curves.
"""

from __future__ import annotations

import gc
import itertools
import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from stats_util import two_sample_chi2
from support import PairSpec

from specdec.backends.costs import CurveFiles
from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.cost import MIN_SLOPE, PRIOR_SLOPE
from specdec.core.drafters import CATCHUP_IN_PASS, LookupDrafter, ModelDrafter
from specdec.core.generate import generate
from specdec.core.metrics import Round
from specdec.core.policy import (
    PROBE_AFTER,
    PROBE_SHARE,
    AutoPolicies,
    CostModelK,
    FixedK,
    ScheduleK,
    make_policy,
)
from specdec.study.run.significance import paired_permutation_p

V = 16  # small vocabulary: the sampled output repeats n-grams, so lookup finds matches
N_GEN = 600
N_TOK = 30
P_MIN = 0.01
# A prompt with repeats, so prompt lookup has material from the first round on.
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1, 2, 3]


@pytest.fixture(scope="module")
def pair_spec() -> PairSpec:
    """Peaked distributions, so generated text repeats itself like real text does."""
    return PairSpec(v=V, scale=3.0)


@pytest.fixture(scope="module")
def baseline(pair) -> list[list[int]]:
    target, _ = pair
    return [
        generate(target, PROMPT, max_new_tokens=N_TOK, warp=Warp(temperature=1.0), seed=s).tokens
        for s in range(50_000, 50_000 + N_GEN)
    ]


class _AcceptanceOnlyAuto(CostModelK):
    """k="auto" with a fixed cost curve (verification cheap, drafting pays): K follows the
    acceptance history alone, so the run is deterministic for a seed and always drafts."""

    def __init__(self) -> None:
        super().__init__(k_max=6, verify_s={b: 1.0 + 0.05 * b for b in range(1, 8)})

    def observe(self, r: Round) -> None:
        super().observe(replace(r, draft_s=0.0, verify_s=self.v(r.k + 1)))


CASES = {
    "lookup": {"drafter": "lookup", "k": 4},
    "lookup-auto": {"drafter": "lookup", "k": "auto"},
    "composite": {"drafter": "composite", "k": 4, "draft": True},
    "model-pmin": {"drafter": "model", "k": 4, "p_min": 0.3, "draft": True},
    "model-auto": {"drafter": "model", "k": "auto", "draft": True},
    "model-auto-acceptance": {"drafter": "model", "k": _AcceptanceOnlyAuto, "draft": True},
    "model-schedule": {"drafter": "model", "k": "schedule", "draft": True},
}


def _round(source: str, k: int, n_accepted: int, draft_s: float = 0.0, verify_s: float = 0.0):
    """A round as the loop records it (n_emitted: the accepted drafts plus one token)."""
    return Round(source, k, n_accepted, n_accepted + 1, draft_s, verify_s)


def _kwargs(pair, case: str) -> dict:
    _, draft = pair
    kw = dict(CASES[case])
    kw["draft"] = draft if kw.pop("draft", False) else None
    if isinstance(kw["k"], type):
        kw["k"] = kw["k"]()  # a fresh policy object per generation
    return {"draft": kw.pop("draft"), "spec": SpecConfig(**kw)}


@pytest.mark.stats
@pytest.mark.parametrize("case", list(CASES))
def test_drafter_is_lossless_at_t1(pair, baseline, case) -> None:
    target, _ = pair
    drafted = 0
    seqs: list[list[int]] = []
    for s in range(N_GEN):
        kw = _kwargs(pair, case)
        r = generate(target, PROMPT, max_new_tokens=N_TOK, warp=Warp(1.0), seed=s, debug=True, **kw)
        seqs.append(r.tokens)
        drafted += r.stats.drafted
    if CASES[case]["k"] != "auto":  # timing-driven auto may rightly decline to draft on mocks
        assert drafted > N_GEN  # the drafter really drafted
    count = lambda ss: np.bincount([t for s in ss for t in s], minlength=V)  # noqa: E731
    chi2, dof, p_table = two_sample_chi2(count(seqs), count(baseline))
    # Tokens of one generation are dependent, so the chi2(dof) table is not the null
    # distribution; swapping whole generations between the methods is (stats.py).
    p = paired_permutation_p(seqs, baseline, n_perm=1000)
    assert p > P_MIN, f"{case}: chi2={chi2:.1f} dof={dof} p_perm={p:.4f} p_table={p_table:.4f}"


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_greedy_equals_target_only(pair, case) -> None:
    target, _ = pair
    kw = _kwargs(pair, case)
    for prompt in (PROMPT, [9, 9, 9, 9], [3, 14, 15, 9, 2, 6, 5, 3, 5]):
        base = generate(
            target,
            prompt,
            max_new_tokens=40,
            warp=Warp(temperature=0),
        ).tokens
        spec = generate(target, prompt, max_new_tokens=40, warp=Warp(0), debug=True, **kw)
        assert spec.tokens == base, case


class _Passes(MockModel):
    """A mock that records each forward pass: ("extend" | "prefill", rows)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.passes: list[tuple[str, int]] = []

    def _extend(self, ids: list[int]) -> torch.Tensor:
        self.passes.append(("extend", len(ids)))
        return super()._extend(ids)

    def _prefill(self, ids: list[int]) -> None:
        self.passes.append(("prefill", len(ids)))
        MockModel._extend(self, ids)  # the mock's one pass, not recorded again as an extend


def test_a_draft_model_catches_up_in_its_drafting_pass() -> None:
    """After a fully accepted round the draft model has x_k and the bonus token to feed: one
    pass over both rows (a step, not two) whose last row drafts; its q rows are those of a
    drafter that saw the whole context fresh. A prompt (more than CATCHUP_IN_PASS tokens) is
    prefilled first and counted as catch-up."""
    draft = _Passes(V, seed=3)
    ref_model = MockModel(V, seed=3)
    drafter = ModelDrafter(draft, Warp(1.0), torch.Generator().manual_seed(0), V)
    prompt = list(range(CATCHUP_IN_PASS + 3))
    first = drafter.propose(prompt, 3)
    assert draft.passes == [("prefill", len(prompt) - 1), *[("extend", 1)] * 3]
    assert first.catchup_s > 0
    drafter.observe(3)  # every draft accepted; the target adds a bonus token
    context = [*prompt, *first.x.tolist(), 5]
    draft.passes.clear()
    second = drafter.propose(context, 2)
    assert draft.passes == [("extend", 2), ("extend", 1)] and second.catchup_s == 0.0
    fresh = ModelDrafter(ref_model, Warp(1.0), torch.Generator().manual_seed(0), V)
    ref_q = fresh.propose(context, 1).q
    assert torch.equal(second.q[0], ref_q[0])  # the catch-up rows left the cache right


# ------------------------------------------------------------------ prompt lookup
def _brute_force(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(context) <= n:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # latest earlier occurrence
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_lookup_matches_brute_force_incrementally() -> None:
    rng = random.Random(0)
    for trial in range(30):
        d = LookupDrafter(n_max=3, n_min=1)
        ctx = [rng.randrange(6) for _ in range(5)]
        for _ in range(40):
            x, q, _ = d.propose(ctx, 5)
            assert q is None
            assert x.tolist() == _brute_force(ctx, 5, 3, 1), (trial, ctx)
            ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_lookup_prefers_longest_ngram_and_reports_source() -> None:
    d = LookupDrafter(n_max=3, n_min=1)
    ctx = [7, 1, 2, 3, 8, 9, 2, 3, 5, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 1..3 followed by 8, 9; (2, 3) alone would give 5, 5
    assert d.source(ctx) == "lookup3"
    assert d.propose(ctx, 2)[0].tolist() == [8, 9]
    assert LookupDrafter().source([1, 2, 3]) is None  # nothing repeats
    assert LookupDrafter().propose([1, 2, 3], 4)[0].numel() == 0


def test_lookup_resets_on_a_new_sequence() -> None:
    d = LookupDrafter(n_max=2, n_min=1)
    assert d.propose([1, 2, 1], 2)[0].tolist() == [2, 1]
    assert d.propose([5, 6, 5], 2)[0].tolist() == [6, 5]  # nothing from the old sequence


def test_p_min_cuts_drafts_without_changing_greedy_output(pair) -> None:
    target, draft = pair
    full = generate(
        target,
        PROMPT,
        draft=draft,
        spec=SpecConfig(k=6),
        warp=Warp(temperature=0.7),
        max_new_tokens=60,
        seed=1,
    )
    cut = generate(
        target,
        PROMPT,
        draft=draft,
        spec=SpecConfig(k=6, p_min=0.9),
        warp=Warp(temperature=0.7),
        max_new_tokens=60,
        seed=1,
    )
    assert cut.stats.drafted < full.stats.drafted
    assert cut.stats.acceptance_rate >= full.stats.acceptance_rate - 0.05


# ------------------------------------------------------------------ K policies
def _feed(policy: CostModelK, source: str, alpha: float, k: int, rounds: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        policy.observe(_round(source, k, n, draft_s=0.0, verify_s=policy.v(k + 1)))


def test_auto_turns_speculation_off_when_verification_is_dear() -> None:
    """Serial verification (v(b) = b steps, as on a batch-serial backend) and poor acceptance."""
    p = CostModelK(k_max=8, verify_s={b: 0.074 * b for b in range(1, 10)})
    _feed(p, "model", alpha=0.3, k=4, rounds=50)
    assert p.choose("model", remaining=100) == 0


def test_auto_drafts_more_when_verification_is_cheap() -> None:
    """Nearly flat verification (GPU-like) and high acceptance: draft deep."""
    p = CostModelK(k_max=8, verify_s={b: 0.030 * (1 + 0.02 * (b - 1)) for b in range(1, 10)})
    _feed(p, "model", alpha=0.9, k=8, rounds=50)
    assert p.choose("model", remaining=100) >= 6
    assert p.choose("model", remaining=2) == 2  # never beyond the remaining budget


def test_auto_accounts_for_draft_cost() -> None:
    """This machine's measured curve: v(2..5) = 1.65, 2.27, 3.13, 3.61 steps; a draft step
    costing 0.43 of a target step can't pay even at 93% acceptance, a free one can."""
    curve = {1: 1.0, 2: 1.65, 3: 2.27, 4: 3.13, 5: 3.61, 6: 4.3, 7: 5.0, 8: 5.7, 9: 6.4}
    dear = CostModelK(k_max=8, verify_s={b: 0.074 * v for b, v in curve.items()})
    for _ in range(50):
        dear.observe(_round("model", 4, 4, draft_s=4 * 0.032, verify_s=0.074 * 3.61))
    assert dear.choose("model", 100) == 0
    free = CostModelK(k_max=8, verify_s={b: 0.074 * v for b, v in curve.items()})
    for _ in range(50):
        free.observe(_round("lookup3", 4, 4, draft_s=4e-5, verify_s=0.074 * 3.61))
    assert free.choose("lookup3", 100) >= 1


def test_auto_learns_costs_online_and_interpolates() -> None:
    p = CostModelK(k_max=4)
    assert p.v(3) == 1 + 2 * PRIOR_SLOPE  # no data: the prior's slope, in steps
    p.observe(_round("none", 0, 0, 0.0, verify_s=0.1))
    p.observe(_round("model", 3, 1, draft_s=0.03, verify_s=0.2))
    assert p.v(1) == pytest.approx(0.1) and p.v(4) == pytest.approx(0.2)
    assert p.v(2) == pytest.approx(0.1 + (0.2 - 0.1) / 3)
    # beyond the data: the last two measurements' slope, within [MIN_SLOPE, PRIOR_SLOPE] steps
    assert p.v(5) == pytest.approx(0.2 + (0.2 - 0.1) / 3)
    p.observe(_round("model", 7, 1, draft_s=0.03, verify_s=0.2))  # flat: the floor's slope
    assert p.v(10) == pytest.approx(0.2 + MIN_SLOPE * 0.1 * 2)
    a = p.alphas("model")
    assert a[0] > a[1]  # position 1 accepted, position 2 rejected
    assert a[2] == pytest.approx(a[1])  # position 3 never judged: position 2's estimate


def test_auto_grows_k_past_the_positions_it_has_tried() -> None:
    """Every draft at K = 3 accepted: positions 4.. were never judged, and must not stay at the
    60% prior (that kept K at 3 on copy-heavy outputs); with a verify curve where depth is
    cheap the policy drafts deeper, and position 4's estimate is position 3's."""
    curve = {b: 0.074 * (1 + 0.25 * (b - 1)) for b in range(1, 10)}
    p = CostModelK(k_max=8, verify_s=dict(curve))
    for _ in range(30):
        p.observe(_round("lookup3", 3, 3, draft_s=0.0, verify_s=curve[4]))
    a = p.alphas("lookup3")
    assert a[3] == pytest.approx(a[2]) and a[2] > 0.9
    assert p.choose("lookup3", 100) > 3


def test_schedule_policy_plus_two_minus_one() -> None:
    s = ScheduleK(k_max=8, k=4)
    s.observe(_round("model", 4, 4, 0, 0))
    assert s.k == 6
    s.observe(_round("model", 6, 2, 0, 0))
    assert s.k == 5
    for _ in range(10):
        s.observe(_round("model", s.k, 0, 0, 0))
    assert s.k == 1
    for _ in range(10):
        s.observe(_round("model", s.k, s.k, 0, 0))
    assert s.k == 8 and s.choose("model", 3) == 3


def test_make_policy_and_bad_values(pair) -> None:
    assert isinstance(make_policy(3, 3), FixedK)
    assert isinstance(make_policy("auto", 8), CostModelK)
    target, draft = pair
    with pytest.raises(ValueError, match="drafter"):
        generate(
            target,
            PROMPT,
            spec=SpecConfig(drafter="ngram"),
        )
    with pytest.raises(ValueError, match="needs a draft"):
        generate(
            target,
            PROMPT,
            spec=SpecConfig(drafter="composite"),
        )
    with pytest.raises(ValueError, match="no draft model"):
        generate(
            target,
            PROMPT,
            draft=draft,
            spec=SpecConfig(drafter="lookup"),
        )
    with pytest.raises(ValueError, match="p_min"):
        generate(
            target,
            PROMPT,
            draft=draft,
            spec=SpecConfig(p_min=1.5),
        )
    with pytest.raises(ValueError, match="'auto'"):
        generate(
            target,
            PROMPT,
            draft=draft,
            spec=SpecConfig(k="fast"),
        )
    with pytest.raises(ValueError, match="k_max"):
        generate(
            target,
            PROMPT,
            draft=draft,
            spec=SpecConfig(k="auto", k_max=0),
        )


def test_auto_runs_no_calibration_and_keeps_its_curve_between_processes(tmp_path) -> None:
    """k="auto" learns v(b) from the verify passes a generation makes anyway: the target sees
    exactly one pass per round (no calibration passes), and what was learned goes to the
    caller's curve store and comes back to a fresh policy (a new process) before its first
    round. Unlike fixed K, its sampled output is not bit-reproducible for a seed (the
    distribution is still exact, tested above)."""

    class Counting(MockModel):
        passes = 0

        def _extend(self, ids):
            Counting.passes += 1
            return super()._extend(ids)

    target = Counting(V, seed=0, scale=3.0)
    draft = MockModel.near(target, noise=0.7, seed=1)
    store = CurveFiles(tmp_path / "costs", key=lambda m: "mock")
    kw = dict(draft=draft, k="auto", max_new_tokens=30, seed=4, debug=True)
    a = generate(target, PROMPT, policies=AutoPolicies(store), **kw)
    assert a.stats.generated == 30 and Counting.passes == 1 + a.stats.rounds  # + the prefill
    saved = json.loads((tmp_path / "costs" / "mock.json").read_text())["verify_s"]
    assert saved and all(float(s) > 0 for s in saved.values())
    fresh = AutoPolicies(store).get(target, ("model", draft), 8)  # another process
    assert fresh.curve == {int(b): float(s) for b, s in saved.items()}
    # a model the store cannot name (mock models, by default) starts from the prior
    assert AutoPolicies(CurveFiles(tmp_path / "costs")).get(target, "model", 8).curve == {}


def test_auto_policies_carry_what_a_generation_learned_to_the_next() -> None:
    """The caller's AutoPolicies hands one k="auto" policy to every generation of a target
    with one drafter, already holding what the earlier generations learned (so a pair where
    drafting cannot pay stops exploring it after the first request), and another one per
    drafter kind, draft model or k_max. A policy goes with its target (held weakly: no id()
    that a new model could reuse)."""
    target = MockModel(V, seed=0, scale=3.0)
    draft = MockModel.near(target, noise=0.7, seed=1)
    handed: list[tuple[CostModelK, dict[int, float], set[str]]] = []

    class Watched(AutoPolicies):
        def get(self, *args):
            policy = super().get(*args)
            handed.append((policy, policy.curve, set(policy.sources)))
            return policy

    policies = Watched()
    kw = dict(k="auto", max_new_tokens=12, warp=Warp(0.0), policies=policies)
    generate(target, PROMPT, draft=draft, **kw)
    generate(target, PROMPT, draft=draft, **kw)
    generate(target, PROMPT, drafter="lookup", **kw)
    generate(target, PROMPT, drafter="lookup", **{**kw, "k_max": 8})
    (first, curve0, sources0), (second, curve1, sources1) = handed[:2]
    assert curve0 == {} and sources0 == set()  # the first generation starts from the prior
    assert second is first and curve1 and "model" in sources1  # the second goes on from it
    assert len({id(p) for p, _, _ in handed}) == 3  # model; lookup; lookup with k_max 8
    other = MockModel(V, seed=3)
    policies.get(other, "lookup", 64)
    assert len(policies._kept) == 2
    del other
    gc.collect()
    assert len(policies._kept) == 1


def test_auto_retries_a_source_switched_off_by_early_rejections() -> None:
    """One rejection must not switch a drafter off for good (it did, with forgetting only on
    use: prompt lookup drafted nothing after the warm-up). Idle rounds pull the estimate back to
    the prior, and the retry is a cheap K = 1 (depth cap), then K grows with evidence. Probes
    (off here; the next test) retry sooner."""
    curve = {1: 1.0, 2: 1.48, 3: 1.89, 4: 1.89, 5: 2.4, 6: 2.81, 7: 3.13, 8: 3.75, 9: 3.99}
    p = CostModelK(k_max=8, verify_s={b: 0.066 * v for b, v in curve.items()}, probe=0.0)
    assert p.choose("lookup3", 100) == 1  # never seen: explored, but only one deep
    p.observe(_round("lookup3", 1, 0, draft_s=0.0, verify_s=0.066 * 1.48))
    p.observe(_round("lookup3", 1, 0, draft_s=0.0, verify_s=0.066 * 1.48))
    assert p.choose("lookup3", 100) == 0  # two rejections: off
    idle = 0
    while p.choose("lookup3", 100) == 0:
        p.observe(_round("none", 0, 0, draft_s=0.0, verify_s=0.066))  # plain target steps
        idle += 1
        assert idle < 1000, "never retried"
    assert 20 < idle < 400 and p.choose("lookup3", 100) == 1
    for _ in range(3):  # the retry is accepted: K may grow one position at a time
        k = p.choose("lookup3", 100)
        p.observe(_round("lookup3", k, k, draft_s=0.0, verify_s=0.066 * curve[k + 1]))
    assert p.choose("lookup3", 100) > 1


def test_auto_probes_after_idle_rounds_within_its_share_of_the_time() -> None:
    """After PROBE_AFTER rounds at K = 0 a round drafts what the prior's costs would (K = 1 for
    a source judged twice), and probes that keep failing take at most PROBE_SHARE of the time
    (their cost beyond a plain step, against every round's)."""
    step, curve = 0.066, {1: 1.0, 2: 1.48, 3: 1.89, 4: 1.89, 5: 2.4}
    p = CostModelK(k_max=8, verify_s={b: step * v for b, v in curve.items()})
    for _ in range(2):
        p.observe(_round("lookup3", 1, 0, draft_s=0.0, verify_s=step * 1.48))
    probes, spent, extra = [], 0.0, 0.0
    for i in range(3000):
        k = p.choose("lookup3", 100)
        v = step * curve[k + 1]
        probes += [i] * (k > 0)
        spent, extra = spent + v, extra + v - step
        p.observe(_round("lookup3" if k else "none", k, 0, draft_s=0.0, verify_s=v))
    assert probes[0] == PROBE_AFTER and len(probes) > 20  # retried early, and again and again
    assert extra / spent <= PROBE_SHARE + 0.005  # every probe rejected: within its share
    assert min(b - a for a, b in itertools.pairwise(probes)) >= PROBE_AFTER


def test_lookup_sources_bucket_the_match_length() -> None:
    """Long matches (the output copying its input) get their own acceptance estimate."""
    d = LookupDrafter()
    run = list(range(20, 32))  # 12 distinct tokens, then copied
    assert d.source([*run, 99, *run[:2]]) == "lookup2"
    assert d.source([*run, 99, *run[:5]]) == "lookup4+"
    assert d.source([*run, 99, *run[:9]]) == "lookup8+"
    assert d.propose([*run, 99, *run[:9]], 3)[0].tolist() == run[9:12]


@pytest.mark.parametrize("probe", [PROBE_SHARE, 0.0])
def test_auto_recovers_from_a_cost_curve_measured_on_a_busy_machine(probe: float) -> None:
    """A v(2) measured while another process held a core (2.4 steps: drafting looks dear) must
    not switch speculation off for good: a probe retries it after PROBE_AFTER idle rounds, and
    without probes unconfirmed measurements fade back to the prior, and a source with good
    acceptance is retried at K = 1 (its real cost is measured again)."""
    p = CostModelK(k_max=8, probe=probe)
    p.observe(_round("none", 0, 0, verify_s=0.05))
    for i in range(10):  # v(2) = 2.4 v(1): contended; half the drafts accepted
        p.observe(_round("lookup3", 1, i % 2, verify_s=0.12))
    assert p.choose("lookup3", 100) == 0  # drafting does not pay at that cost
    rounds = 0
    while p.choose("lookup3", 100) == 0:
        p.observe(_round("none", 0, 0, verify_s=0.05))
        rounds += 1
        assert rounds < 2000, "never retried"
    assert rounds == PROBE_AFTER if probe else 50 < rounds < 1000


AMX_1024 = {1: 1.0, 2: 1.83, 3: 2.0, 4: 2.11, 5: 2.3, 6: 2.51, 7: 2.81, 8: 2.95, 16: 3.77, 32: 5.82}


def test_auto_explores_deeper_where_a_one_token_probe_is_the_dearest() -> None:
    """A source never seen is explored as deep as a failure costs at most EXPLORE failed K = 1
    rounds: on a front-loaded curve (AMX, v(2) = 1.83 and v(4) = 2.11 steps) that is K = 3,
    where the 60% prior pays (a K = 1 probe never did); on a linear curve, K = 1; with a dear
    draft step, shallower."""
    p = CostModelK(k_max=64, verify_s={b: 0.065 * v for b, v in AMX_1024.items()})
    assert p.choose("lookup4+", 100) == 3
    assert CostModelK(k_max=64, verify_s=p.curve, explore=0.0).choose("x", 100) == 0
    linear = CostModelK(k_max=64, verify_s={b: 0.05 * (1 + 0.5 * (b - 1)) for b in range(1, 40)})
    assert linear.depth_cap("lookup4+") == 1
    p.observe(_round("model", 1, 1, draft_s=0.065 * 0.5, verify_s=0.065 * 1.83))
    assert p._explore_depth("model") < p._explore_depth("lookup4+")


def test_a_stale_cost_fades_only_toward_a_cheaper_prior() -> None:
    """Unconfirmed measurements fade toward the prior (a curve measured on a busy machine must
    not switch drafting off for good), but one below the prior stays: fading a flat curve's
    b = 32 (5.8 steps against the prior's 16.5) made long drafts look dear after a few requests."""
    p = CostModelK(k_max=64, verify_s={b: 0.065 * v for b, v in AMX_1024.items()})
    p.verify_n = {b: 1.0 for b in p.curve}
    for _ in range(600):
        p.observe(_round("none", 0, 0, verify_s=0.065))  # only b = 1 measured again
    assert p.v(32) == pytest.approx(0.065 * 5.82)  # cheaper than the prior: kept
    both = CostModelK(k_max=64, verify_s=p.curve, fade_down_only=False)
    both.verify_n = {b: 1.0 for b in p.curve}
    for _ in range(600):
        both.observe(_round("none", 0, 0, verify_s=0.065))
    assert both.v(32) > 2 * 0.065 * 5.82  # the old rule: drawn toward 0.5 steps per token
    dear = CostModelK(k_max=8, verify_s={1: 0.05, 2: 0.12})  # busy: 2.4 steps
    dear.verify_n = {1: 1.0, 2: 1.0}
    for _ in range(600):
        dear.observe(_round("none", 0, 0, verify_s=0.05))
    assert dear.v(2) < 0.05 * 1.6  # fades toward the prior's 1.5 steps
