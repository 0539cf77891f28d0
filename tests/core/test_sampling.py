"""Level 1 of the exactness gate: the sampling rule alone (paper, section 6.1).

Statistics and thresholds are explicit: chi-square goodness of fit against the analytic p with
bins of expected count < 5 pooled, pass at p-value > 0.001; KL(p_hat || p) <= 1e-3 (its
expectation under the null is about (V - 1) / (2N) = 2.9e-4 for V = 30, N = 50,000). Seeds are
fixed, so every run sees the same draws.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from stats_util import gof_chi2, kl

from specdec.core.sampling import (
    argmax_rows,
    greedy_verify,
    probs_from_logits,
    rejection_sample,
    sample,
)

V = 30
N_TRIALS = 50_000
P_MIN = 0.001
KL_MAX = 1e-3


def _zipf(perm_seed: int, s: float = 1.5) -> torch.Tensor:
    w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** s
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(perm_seed))
    return (w[perm] / w.sum()).float()


def _dirichlet(alpha: float, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([alpha] * V), dtype=torch.float32)


def _families() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    p_near = _dirichlet(1.0, 3)
    noise = torch.randn(V, generator=torch.Generator().manual_seed(4))
    q_near = p_near * torch.exp(0.05 * noise)
    return {
        "uniform-dirichlet": (_dirichlet(1.0, 1), _dirichlet(1.0, 2)),
        "heavy-tailed": (_zipf(5), _zipf(6)),
        "near-identical": (p_near, q_near / q_near.sum()),
        "mismatched-concentration": (_dirichlet(0.3, 7), _dirichlet(5.0, 8)),
    }


def _emit_first(p: torch.Tensor, q: torch.Tensor | None, xs: torch.Tensor, seed: int) -> np.ndarray:
    """Counts of the first emitted token over one K=1 round per drafted token in `xs`."""
    g = torch.Generator().manual_seed(seed)
    p2 = torch.stack([p, p])  # [2, V]: p_1 and the (here irrelevant) bonus row
    q1 = None if q is None else q[None]  # [1, V]
    counts = np.zeros(V, dtype=np.int64)
    for x in xs.split(1):
        tokens, _ = rejection_sample(x, q1, p2, g)
        counts[int(tokens[0])] += 1
    return counts


@pytest.mark.stats
@pytest.mark.parametrize("family", list(_families()))
def test_emitted_token_is_distributed_as_p(family: str) -> None:
    p, q = _families()[family]
    g = torch.Generator().manual_seed(100)
    xs = torch.multinomial(q, N_TRIALS, replacement=True, generator=g)  # draw-from-q
    counts = _emit_first(p, q, xs, seed=101)
    chi2, dof, pval = gof_chi2(counts, p.numpy())
    div = kl(counts / counts.sum(), p.numpy())
    assert pval > P_MIN, f"{family}: chi2={chi2:.1f} dof={dof} p={pval:.2e}"
    assert div <= KL_MAX, f"{family}: KL(p_hat||p)={div:.2e}"


@pytest.mark.stats
def test_gate_has_power_against_the_draft_distribution() -> None:
    """The same statistic rejects a broken rule that always accepts (its output is q, not p)."""
    p, q = _families()["uniform-dirichlet"]
    g = torch.Generator().manual_seed(100)
    xs = torch.multinomial(q, N_TRIALS, replacement=True, generator=g)
    counts = np.bincount(xs.numpy(), minlength=V)
    _, _, pval = gof_chi2(counts, p.numpy())
    assert pval < 1e-6


@pytest.mark.stats
def test_deterministic_drafter_path_q_none() -> None:
    """q=None: the drafted token is fixed given the context (one-hot q); output is still p."""
    p = _dirichlet(1.0, 11)
    x_fixed = int(torch.argmax(p))  # e.g. a greedy draft, or prompt lookup
    counts = _emit_first(p, None, torch.full((N_TRIALS,), x_fixed), seed=12)
    _, _, pval = gof_chi2(counts, p.numpy())
    assert pval > P_MIN
    # The accept probability of a one-hot draft is p(x) exactly.
    assert abs(counts[x_fixed] / N_TRIALS - float(p[x_fixed])) < 0.01


def _markov(v: int, alpha: float, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([alpha] * v, size=v), dtype=torch.float32)  # [v, v]


@pytest.mark.stats
@pytest.mark.parametrize("deterministic", [False, True])
def test_multi_position_chain_second_token(deterministic: bool) -> None:
    """K = 3 drafts on a Markov chain: the joint law of the first two emitted tokens is
    P[c0](y1) * P[y1](y2), so tokens accepted at position 2+, recovered there, or drawn as the
    bonus are all tested. With `deterministic`, drafts are argmax of Q and q=None."""
    v, K, c0, n = 12, 3, 0, 30_000
    P = _markov(v, 1.0, 21)  # [v, v] target: row = previous token
    Q = P * torch.exp(0.5 * torch.randn(v, v, generator=torch.Generator().manual_seed(22)))
    Q = Q / Q.sum(-1, keepdim=True)  # [v, v] draft, close to P
    g = torch.Generator().manual_seed(23)
    joint = np.zeros((v, v), dtype=np.int64)
    for _ in range(n):
        out: list[int] = []
        ctx = c0
        while len(out) < 2:
            xs, qs = [], []
            prev = ctx
            for _ in range(K):
                if deterministic:
                    x = int(Q[prev].argmax())
                else:
                    x = int(torch.multinomial(Q[prev], 1, generator=g))
                xs.append(x)
                qs.append(Q[prev])
                prev = x
            p_rows = torch.stack([P[c] for c in [ctx, *xs]])  # [K+1, v]
            q_rows = None if deterministic else torch.stack(qs)  # [K, v]
            tokens, _ = rejection_sample(torch.tensor(xs), q_rows, p_rows, g)
            out += tokens.tolist()
            ctx = out[-1]
        joint[out[0], out[1]] += 1
    expected = (P[c0][:, None] * P).numpy().reshape(-1)  # [v*v]
    _, dof, pval = gof_chi2(joint.reshape(-1), expected)
    assert pval > P_MIN, f"chi2 dof={dof} p={pval:.2e}"


def test_p_equals_q_always_accepts() -> None:
    g = torch.Generator().manual_seed(31)
    p = _dirichlet(1.0, 32)
    K = 4
    for _ in range(2000):
        x = torch.multinomial(p, K, replacement=True, generator=g)
        tokens, n_acc = rejection_sample(x, p.expand(K, V), p.expand(K + 1, V), g)
        assert n_acc == K and tokens.numel() == K + 1


def test_disjoint_supports_always_reject() -> None:
    g = torch.Generator().manual_seed(41)
    p = torch.zeros(V)
    p[: V // 2] = 1.0 / (V // 2)
    q = torch.zeros(V)
    q[V // 2 :] = 1.0 / (V - V // 2)
    for _ in range(2000):
        x = torch.multinomial(q, 1, generator=g)
        tokens, n_acc = rejection_sample(x, q[None], torch.stack([p, p]), g)
        assert n_acc == 0 and tokens.numel() == 1 and int(tokens[0]) < V // 2


def test_zero_probability_target_tokens_never_emitted() -> None:
    g = torch.Generator().manual_seed(51)
    p = _dirichlet(1.0, 52)
    banned = torch.tensor([0, 3, 7, 12, 29])
    p[banned] = 0.0
    p = p / p.sum()
    q = _dirichlet(0.5, 53)  # puts mass on the banned tokens
    K = 3
    seen = np.zeros(V, dtype=np.int64)
    for _ in range(5000):
        x = torch.multinomial(q, K, replacement=True, generator=g)
        tokens, n_acc = rejection_sample(x, q.expand(K, V), p.expand(K + 1, V), g)
        # p_i(x_i) = 0 is never accepted
        assert not any(int(t) in banned.tolist() for t in x[:n_acc])
        seen[tokens.numpy()] += 1
    assert seen[banned.numpy()].sum() == 0
    assert seen.sum() > 5000


def test_q_of_drafted_token_zero_is_rejected() -> None:
    """x with q(x) = 0 cannot have been sampled from q: reject, recover from max(0, p - q)."""
    g = torch.Generator().manual_seed(61)
    p = torch.full((V,), 1.0 / V)
    q = torch.zeros(V)
    q[1:] = 1.0 / (V - 1)
    for _ in range(200):
        tokens, n_acc = rejection_sample(torch.tensor([0]), q[None], torch.stack([p, p]), g)
        assert n_acc == 0
        assert int(tokens[0]) == 0  # the residual max(0, p - q) is one-hot on token 0


def test_all_zero_residual_falls_back_to_p() -> None:
    """p <= q everywhere (round-off): the residual is empty, the recovered token comes from p."""
    g = torch.Generator().manual_seed(71)
    q = _dirichlet(1.0, 72)
    p = q * 0.9995  # within the row-sum tolerance; rejection prob 5e-4 per draw
    for _ in range(20_000):  # ~2,000 draws to the first rejection
        x = torch.multinomial(q, 1, generator=g)
        tokens, n_acc = rejection_sample(x, q[None], torch.stack([p, p]), g)
        assert float(p[int(tokens[0])]) > 0
        if n_acc == 0:  # the fallback branch ran, and gave a token p can emit
            break
    else:
        raise AssertionError("no draw was rejected: the fallback branch never ran")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_a_clear_error(bad: float) -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.full((2, V), 1.0 / V)
    q = torch.full((1, V), 1.0 / V)
    p_bad = p.clone()
    p_bad[0, 3] = bad
    with pytest.raises(ValueError, match="p contains"):
        rejection_sample(torch.tensor([1]), q, p_bad, g)
    q_bad = q.clone()
    q_bad[0, 3] = bad
    with pytest.raises(ValueError, match="q contains"):
        rejection_sample(torch.tensor([1]), q_bad, p, g)
    logits = torch.zeros(2, V)
    logits[1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        probs_from_logits(logits, 1.0)
    # rows long enough that top-p's and typical-p's cut is looked for among their first tokens
    wide = torch.randn(3, 5000, generator=g)
    wide[1, 7] = bad
    for cut in ({"top_p": 0.9}, {"typical_p": 0.9}, {"top_k": 40, "top_p": 0.9}):
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            probs_from_logits(wide, 0.8, **cut)


def test_no_drafts_with_an_empty_q_is_plain_sampling_from_p0() -> None:
    """K = 0 with q of shape [0, V] (a round whose drafts the grammar all cut, q kept as its
    empty slice): the one emitted token is p[0]'s draw, as with q None."""
    p = _dirichlet(1.0, 21)[None]  # [1, V]
    empty = torch.empty(0, dtype=torch.long)
    got = [rejection_sample(empty, torch.empty(0, V), p, torch.Generator().manual_seed(s))
           for s in range(20)]  # fmt: skip
    want = [rejection_sample(empty, None, p, torch.Generator().manual_seed(s)) for s in range(20)]
    assert [(t.tolist(), n) for t, n in got] == [(t.tolist(), n) for t, n in want]
    assert all(n == 0 and len(t) == 1 for t, n in got)


def test_shape_and_value_errors() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.full((2, V), 1.0 / V)
    with pytest.raises(ValueError, match="shape"):
        rejection_sample(torch.tensor([1, 2]), None, p, g)  # K=2 needs p [3, V]
    with pytest.raises(ValueError, match="sum to 1"):
        rejection_sample(torch.tensor([1]), None, torch.rand(2, V) * 5, g)
    with pytest.raises(ValueError, match="out of range"):
        rejection_sample(torch.tensor([V]), None, p, g)
    with pytest.raises(ValueError, match="negative entries"):
        rejection_sample(torch.tensor([1]), None, -p, g)  # logits-like, not a distribution
    with pytest.raises(ValueError, match="total mass nan"):
        sample(torch.full((V,), float("nan")), g)
    with pytest.raises(ValueError, match="greedy"):
        probs_from_logits(torch.zeros(V), 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        probs_from_logits(torch.zeros(V), -0.5)
    with pytest.raises(ValueError, match="top_p"):
        probs_from_logits(torch.zeros(V), 1.0, top_p=0.0)
    for bad_typical in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="typical_p"):
            probs_from_logits(torch.zeros(V), 1.0, typical_p=bad_typical)


@pytest.mark.stats
def test_k_zero_is_plain_sampling() -> None:
    g = torch.Generator().manual_seed(81)
    p = _dirichlet(1.0, 82)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(20_000):
        tokens, n_acc = rejection_sample(torch.empty(0, dtype=torch.long), None, p[None], g)
        assert n_acc == 0 and tokens.numel() == 1
        counts[int(tokens[0])] += 1
    assert gof_chi2(counts, p.numpy())[2] > P_MIN


def test_seeded_runs_are_bit_reproducible() -> None:
    p = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(2)), -1)
    x = torch.tensor([3, 1, 4, 1])

    def run(seed: int) -> list[tuple[list[int], int]]:
        g = torch.Generator().manual_seed(seed)
        return [(t.tolist(), n) for t, n in (rejection_sample(x, q, p, g) for _ in range(200))]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ------------------------------------------------------------------------------ warping
def test_top_k_and_top_p_warping() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    pk = probs_from_logits(logits, 1.0, top_k=2)
    assert (pk[0, 2:] == 0).all() and abs(float(pk.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    # top_p = first token's mass + a bit: exactly two tokens are kept
    pp = probs_from_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)
    assert (pp[0, :2] > 0).all() and (pp[0, 2:] == 0).all()
    # top_p below the first token's mass keeps only the argmax
    assert float(probs_from_logits(logits, 1.0, top_p=0.01)[0, 0]) == 1.0
    # ... also below float32's least positive value, which rounds it to 0 (it once dropped every
    # token: NaN, and a served request with top_p = 1e-300 failed every neighbour of its pass)
    for tiny in (1e-300, 1e-46, 5e-324):
        rows = probs_from_logits(torch.stack([logits[0], logits[0].flip(0)]), 1.0, top_p=tiny)
        assert rows.tolist() == [[1.0, 0, 0, 0, 0], [0, 0, 0, 0, 1.0]]
    # temperature sharpens
    assert float(probs_from_logits(logits, 0.5)[0, 0]) > float(full[0])


#: p = [0.4, 0.3, 0.2, 0.1] has entropy H = 1.2799 nats; |-ln p - H| = [0.364, 0.076, 0.329, 1.023],
#: so locally typical sampling takes the tokens in the order 1, 2, 0, 3 (cumulative mass 0.3,
#: 0.5, 0.9, 1.0) and keeps the shortest run of them reaching typical_p: not the likeliest first.
TYPICAL = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(
    ("typical_p", "kept"),
    [
        (1e-300, [1]),  # the most typical token alone, not the argmax (token 0)
        (0.25, [1]),
        (0.45, [1, 2]),
        (0.6, [0, 1, 2]),
        (0.95, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),  # off: the identity
    ],
)
def test_typical_p_keeps_the_tokens_nearest_the_entropy(typical_p: float, kept: list[int]) -> None:
    logits = torch.tensor([TYPICAL]).log()
    got = probs_from_logits(logits, 1.0, typical_p=typical_p)[0]
    assert torch.nonzero(got).flatten().tolist() == kept
    want = torch.zeros(4)
    want[kept] = torch.tensor(TYPICAL)[kept] / sum(TYPICAL[i] for i in kept)
    assert torch.allclose(got, want, atol=1e-6)


def test_typical_p_one_is_the_identity_and_follows_top_k() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    assert torch.equal(
        probs_from_logits(logits, 0.7, typical_p=1.0), probs_from_logits(logits, 0.7)
    )
    # top-k first (llama.cpp's order): H and the distances are those of the 3 tokens top-k kept,
    # [4/9, 3/9, 2/9] (H = 1.0608; distances 0.250, 0.038, 0.443): 0.5 keeps tokens 1 and 0
    got = probs_from_logits(torch.tensor([TYPICAL]).log(), 1.0, top_k=3, typical_p=0.5)[0]
    assert torch.allclose(got, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=1e-6)


def test_typical_p_is_transformers_typical_warper() -> None:
    """The same kept set and probabilities as transformers' TypicalLogitsWarper (min 1 token)
    on random rows and masses."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(7)
    for _ in range(100):
        logits = 2 * torch.randn(3, V, generator=g)  # [3, V]
        mass = 0.01 + 0.98 * float(torch.rand(1, generator=g))
        theirs = torch.softmax(warpers.TypicalLogitsWarper(mass)(None, logits.clone()), -1)
        ours = probs_from_logits(logits, 1.0, typical_p=mass)
        assert torch.equal(theirs > 0, ours > 0) and torch.allclose(theirs, ours, atol=1e-6)


def _keep_mass_by_full_sort(probs: torch.Tensor, order: torch.Tensor, mass: float) -> torch.Tensor:
    """The cut as the whole row sorted gives it (what `_keep_mass` did before it looked among
    the first tokens first): the reference its shortcut must equal bit for bit."""
    idx = torch.sort(order, dim=-1, stable=True).indices
    sorted_p = probs.gather(-1, idx)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= mass
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _cut_rows(g: torch.Generator, v: int) -> list[torch.Tensor]:
    """Rows [3, v] of logits where a cut is hard to get right: peaked and flat, ties in the
    logits (at the cut and everywhere), rows top-k left 40 entries of, a row of one value."""
    rows = []
    for scale in (0.3, 1.0, 3.0, 8.0):
        rows.append(scale * torch.randn(3, v, generator=g))
    tied = torch.randint(0, 6, (3, v), generator=g).float()  # six values, ~v / 6 ties each
    rows += [tied, tied * 4.0, torch.zeros(3, v)]
    peaked = torch.randn(3, v, generator=g)
    peaked[:, :300] = 6.0  # 300 tokens tied at the top: the cut falls among the ties
    rows.append(peaked)
    return rows


def test_the_cut_among_the_first_tokens_is_the_full_sorts_bit_for_bit() -> None:
    """top-p's and typical-p's cut, looked for among the first CUT_CANDIDATES tokens (then 8x
    as many, then the whole row), gives the same probabilities, bit for bit, as sorting the
    whole row, on rows built to trip it (ties at the cut, flat rows, top-k's -inf entries,
    masses near 0 and 1), also in a batch whose rows are decided in different ways; and the
    shortcut decides every row top-k left 40 tokens of, at masses up to 0.99."""
    from specdec.core import sampling

    g = torch.Generator().manual_seed(11)
    v = 20_000  # > 8 x CUT_CANDIDATES: all three ways are taken
    decided, tried = collections.Counter(), collections.Counter()
    for logits in _cut_rows(g, v):
        for top_k in (None, 40):
            x = logits.clone()
            if top_k is not None:
                kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
                x = x.masked_fill(x < kth, float("-inf"))
            probs = torch.softmax(x, dim=-1)
            top_k_left = top_k or 0  # (top-k keeps every token tied with the k-th: more)
            entropy = torch.special.entr(probs).sum(-1, keepdim=True)
            for order in (-probs, (-torch.log(probs) - entropy).abs()):
                for mass in (1e-300, 0.05, 0.5, 0.9, 0.95, 0.99, 0.999999, 1.0 - 1e-9):
                    want = _keep_mass_by_full_sort(probs, order, mass)
                    assert torch.equal(sampling._keep_mass(probs, order, mass), want), mass
                    way = next(
                        (m for m in (256, 2048)
                         if sampling._cut_among_first(probs, order, mass, m)[1].all()), None,
                    )  # fmt: skip
                    tried[top_k] += 1
                    decided[top_k] += way is not None
                    if int((probs > 0).sum(-1).max()) <= top_k_left and mass <= 0.99:
                        assert way == 256, mass
    assert tried == {None: 128, 40: 128} and decided[None] > 32, (decided, tried)
    # one batch of rows each decided its own way (the first m, 8x m, the whole row)
    rows = torch.stack([r[0] for r in _cut_rows(g, v)])  # [8, v]
    probs = torch.softmax(rows, dim=-1)
    for mass in (0.5, 0.9, 0.99):
        want = _keep_mass_by_full_sort(probs, -probs, mass)
        assert torch.equal(sampling._keep_mass(probs, -probs, mass), want)


# ------------------------------------------------------------------------------ greedy
def _logits_with_argmax(argmaxes: list[int], v: int = 10) -> torch.Tensor:
    out = torch.randn(len(argmaxes), v, generator=torch.Generator().manual_seed(0))
    for i, a in enumerate(argmaxes):
        out[i, a] = out[i].max() + 1.0
    return out  # [len, v]


@pytest.mark.parametrize(
    ("draft", "argmaxes", "expected", "n_acc"),
    [
        ([], [5], [5], 0),  # K = 0: plain greedy step
        ([1, 2, 3], [1, 2, 3, 9], [1, 2, 3, 9], 3),  # all accepted, bonus = argmax p_4
        ([1, 2, 3], [4, 2, 3, 9], [4], 0),  # first rejected
        ([1, 2, 3], [1, 7, 3, 9], [1, 7], 1),  # middle rejected; later matches ignored
        ([1, 2, 3], [1, 2, 0, 9], [1, 2, 0], 2),  # last rejected
    ],
)
def test_greedy_verify_table(
    draft: list[int], argmaxes: list[int], expected: list[int], n_acc: int
) -> None:
    tokens, n = greedy_verify(torch.tensor(draft, dtype=torch.long), _logits_with_argmax(argmaxes))
    assert tokens.tolist() == expected and n == n_acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V", [151936, 1000, 100])
def test_argmax_rows_is_torchs_argmax_and_finds_every_nan(dtype: torch.dtype, V: int) -> None:
    """argmax_rows (chunk maxima, then the first chunk's argmax; the last V % 128 logits apart)
    gives torch.argmax's answer: ties in a chunk, across chunks and between the chunks and the
    tail (the first), -inf and +inf rows, the maximum in the tail, a 1-D row, fewer logits than
    a chunk. greedy_verify, which checks only the picked values, names a NaN wherever it is
    (first, last, between, several, in the tail only, beside a +inf)."""
    g = torch.Generator().manual_seed(V)
    rows = torch.randn(6, V, generator=g).to(dtype)
    rows[1, 10] = rows[1, V // 2] = rows[1, V - 1] = 99.0  # ties: the first
    rows[2, :] = float("-inf")
    rows[2, V - 1] = 0.0  # the maximum last, in the tail where V % 128
    rows[3, 5] = float("inf")
    rows[4, 3] = rows[4, 4] = 50.0  # a tie inside one chunk
    rows[5, V - 2] = 70.0
    assert torch.equal(argmax_rows(rows), rows.argmax(-1))
    assert int(argmax_rows(rows[1])) == 10 and argmax_rows(rows).dtype == torch.long
    draft = torch.tensor([1, 2, 3, 4, 5])
    spots = [[(0, 0)], [(3, V - 1)], [(1, V // 3)], [(2, 5), (2, 9)], [(3, 4), (0, V - 3)]]
    for where in spots:
        bad = rows.clone()
        for r, c in where:
            bad[r, c] = float("nan")
        assert torch.equal(argmax_rows(bad), bad.argmax(-1)), where
        with pytest.raises(ValueError, match="NaN"):
            greedy_verify(draft, bad)


def test_general_rule_on_one_hots_equals_greedy() -> None:
    """T -> 0: p and q collapse to one-hots and the general rule becomes greedy_verify."""
    g = torch.Generator().manual_seed(91)
    for trial in range(200):
        gen = torch.Generator().manual_seed(trial)
        K = 1 + trial % 5
        logits = torch.randn(K + 1, 10, generator=gen)  # [K+1, 10]
        x = torch.randint(0, 10, (K,), generator=gen)
        x[: trial % (K + 1)] = logits[: trial % (K + 1)].argmax(-1)  # force some matches
        p = torch.nn.functional.one_hot(logits.argmax(-1), 10).float()  # [K+1, 10]
        q = torch.nn.functional.one_hot(x, 10).float()  # [K, 10]
        assert [t.tolist() for t in rejection_sample(x, q, p, g)[:1]] == [
            greedy_verify(x, logits)[0].tolist()
        ]


@pytest.mark.stats
def test_inverse_cdf_sampler_matches_p_and_skips_zero_mass() -> None:
    """`sample` (inverse CDF, not torch.multinomial) on a row with holes and an unnormalized
    scale: zero-mass tokens never drawn, frequencies match p (chi-square, 50,000 draws)."""
    p = _zipf(11).double()
    p[::3] = 0.0  # every third token impossible, including the first
    p[-1] = 0.0  # and the last: the round-up fallback must not land on it
    p = p / p.sum()
    g = torch.Generator().manual_seed(12)
    counts = np.zeros(V, dtype=np.int64)
    row = (p * 7.5).float()  # sample() must not assume a normalized row
    for _ in range(N_TRIALS):
        counts[sample(row, g)] += 1
    assert counts[p.numpy() == 0].sum() == 0
    keep = p.numpy() > 0
    chi2, dof, pval = gof_chi2(counts[keep], p.numpy()[keep])
    assert pval > P_MIN, f"chi2={chi2:.1f} dof={dof} p={pval:.2e}"
    with pytest.raises(ValueError, match="total mass"):
        sample(torch.zeros(V), g)
