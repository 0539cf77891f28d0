"""Sampling math: logit warping, the speculative rejection rule, and the greedy rule.

Glossary (paper, Table 1; never inverted):
    p        target distributions. p[i] = p(. | s + x[:i]); p[K] is the bonus row.
    q        draft distributions the drafted tokens were sampled from (None: deterministic drafter)
    K        number of drafted tokens
    x        drafted tokens x[0..K-1]
    accepted a drafted token kept by the rule
    recovered the token drawn from norm(max(0, p - q)) at the first rejection
    bonus    the token drawn from p[K] when all K drafts are accepted

Everything here is a pure function of its inputs and an explicit `torch.Generator`, computed on
the CPU in float32: bit-reproducible across devices and free of fp16 underflow in p / q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from specdec.core.config import Warp

#: A residual max(0, p - q) whose mass is below this is treated as empty (see `rejection_sample`).
RESIDUAL_EPS = 1e-12
#: Rows of p (and q) must sum to 1 within this tolerance: float32 softmax over 262k entries sums
#: to within ~1e-5; anything further off is not a distribution.
ROW_SUM_TOL = 1e-3


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        bad = "NaN" if torch.isnan(t).any() else "inf"
        raise ValueError(f"{name} contains {bad}; the model produced invalid numbers")


def probs_from_logits(logits: torch.Tensor, temperature: float, **warp: Any) -> torch.Tensor:
    """`warped` with the Warp's fields as keywords: probs_from_logits(logits, 0.7, top_p=0.9)."""
    return warped(logits, Warp(temperature, **warp))


def warped(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Warp logits [..., V] into probabilities [..., V] float32 CPU: temperature, then top-k,
    typical-p, top-p, min-p (the truncations in llama.cpp's order, its default chain's; min-p
    keeps tokens with p >= min_p x the most likely one's).

    Apply the same warping to the target and the draft: the output of speculative decoding is
    then exactly the warped target distribution. temperature == 0 is greedy decoding, which is
    not a distribution: use `greedy_verify` / argmax for it.
    """
    if warp.greedy:
        raise ValueError(
            f"temperature {warp.temperature} is greedy decoding: take the argmax, not a "
            "distribution"
        )
    x = logits.detach().to("cpu", torch.float32) / warp.temperature  # [..., V]
    top_k, top_p, min_p, typical_p = warp.top_k, warp.top_p, warp.min_p, warp.typical_p
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    probs = torch.softmax(x, dim=-1)  # [..., V]
    if typical_p is not None and typical_p < 1.0:
        # Locally typical sampling (Meister et al.; llama.cpp's typ_p, transformers'
        # TypicalLogitsWarper): the tokens by |-log p - H| ascending, H the row's entropy, then
        # the shortest run of them holding typical_p of the mass. entr(0) = 0: a token top-k
        # dropped adds nothing to H, and its distance is inf, last in the order.
        entropy = torch.special.entr(probs).sum(-1, keepdim=True)  # [..., 1]
        probs = _keep_mass(probs, (-torch.log(probs) - entropy).abs(), typical_p)
    if top_p is not None and top_p < 1.0:
        probs = _keep_mass(probs, -probs, top_p)  # the likeliest first
    if min_p:  # the most likely token always stays: p_max >= min_p x p_max for min_p <= 1
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    # One check on the output instead of three on the input (this runs once per round on
    # [K+1, 151936] rows): NaN or +inf logits, and rows with every logit -inf, all give NaN here.
    if torch.isnan(probs.sum()):
        if torch.isnan(x).any() or torch.isposinf(x).any():
            raise ValueError("logits contain NaN or +inf; the model produced invalid numbers")
        raise ValueError("every logit is -inf in some row; there is nothing to sample")
    return probs


def _keep_mass(probs: torch.Tensor, order: torch.Tensor, mass: float) -> torch.Tensor:
    """`probs` [..., V] cut to the shortest run of tokens, taken by `order` [..., V] ascending,
    whose mass reaches `mass`, and renormalized (top-p's and typical-p's cut)."""
    # Each row's cut is looked for among its first CUT_CANDIDATES tokens by `order` first (then
    # 8x as many): the same bits as sorting the whole row, which costs about a target step
    # for each row of p and q (docs/requests.md), while the cut mostly lies in the first hundreds
    v = probs.shape[-1]
    if v <= CUT_CANDIDATES:  # a short row: sorted whole at once
        kept = _cut(probs, torch.sort(order, dim=-1, stable=True).indices, mass)
        return kept / kept.sum(-1, keepdim=True)
    p, o = probs.reshape(-1, v), order.reshape(-1, v)
    kept = torch.zeros_like(p)
    left = torch.arange(p.shape[0])  # the rows not decided yet
    m = CUT_CANDIDATES
    while len(left) and m < v:
        whole = len(left) == p.shape[0]  # no copy of the rows the first time
        got, decided = _cut_among_first(p if whole else p[left], o if whole else o[left], mass, m)
        kept[left[decided]] = got[decided]
        left, m = left[~decided], m * 8
    if len(left):
        rest = o[left]
        kept[left] = _cut(p[left], torch.sort(rest, dim=-1, stable=True).indices, mass)
    return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)


#: Tokens `_keep_mass` first looks for a row's cut among (the likeliest, for top-p).
CUT_CANDIDATES = 256
#: How far past `mass` the run kept must reach before every later token is known to be dropped:
#: a later token's exclusive cumulative mass may round a couple of float32 ulps below the
#: current one's (a cumsum rounded per entry, then a subtraction), never more.
_CUT_MARGIN = 1e-6


def _cut(probs: torch.Tensor, idx: torch.Tensor, mass: float) -> torch.Tensor:
    """Rows [..., V] of `probs` cut to the tokens kept, given `idx` [..., m]: the first m
    tokens by `order` ascending, ties in vocabulary order so that a row's cut never depends on
    the sort kernel (m = V: all of them); every token past the m is cut."""
    sorted_p = probs.gather(-1, idx)  # [..., m]
    # Drop a token when the mass strictly before it already reaches `mass`: the kept set is the
    # smallest run with mass >= `mass`, and its first token is always kept ...
    drop = (sorted_p.cumsum(-1) - sorted_p) >= mass
    # ... even where `mass` is below float32's least positive value: the comparison rounds it
    # to 0, and 0 >= 0 would drop the first token too (every row empty: NaN).
    drop[..., 0] = False
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))


def _cut_among_first(
    probs: torch.Tensor, order: torch.Tensor, mass: float, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n, V] cut among their m first tokens by `order`, and which rows [n] that decides:
    those cut as the whole row sorted cuts them (another's cut may lie past its first m: a
    larger m, or the full sort, decides)."""
    vals, idx = torch.topk(order, m, dim=-1, largest=False, sorted=False)  # [n, m]
    # the full sort's order among them: by vocabulary id, then stably by `order`
    idx, by_id = idx.sort(dim=-1)
    vals, by_order = vals.gather(-1, by_id).sort(dim=-1, stable=True)
    idx = idx.gather(-1, by_order)
    # Those strictly before the m-th value are the full sort's first tokens, in its order (a
    # token tied with the m-th may lie outside), so their cumulative mass is the full sort's too
    trusted = vals < vals[..., -1:]
    sorted_p = probs.gather(-1, idx)
    before = sorted_p.cumsum(-1) - sorted_p
    # Decided where a trusted token's mass before it passes `mass` by the margin (every later
    # one's, among these or past them, does too: cut), or where every token of nonzero
    # probability is trusted (whether a token of none is cut changes no bit: top-k's leftovers)
    passed = ((before >= mass + _CUT_MARGIN) & trusted).any(-1)
    holds_all = ((sorted_p > 0) & trusted).sum(-1) == (probs > 0).sum(-1)
    return _cut(probs, idx, mass), passed | holds_all


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability, and the `top` likeliest tokens' ((id, logprob), ...,
    most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of `tokens` under the rows [n, V] that emitted them (row i emitted
    tokens[i]), with each row's `top` likeliest. Of the model's own distribution: before
    temperature, penalties and a grammar (vLLM's default, "raw_logprobs"), so they are the same
    whatever the sampling settings, and, rows being bit-identical, with speculation on or off."""
    lp = torch.log_softmax(logits[: len(tokens)].to("cpu", torch.float32), -1)  # [n, V]
    got = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top > 0:
        values, ids = torch.topk(lp, top, dim=-1)  # [n, top]
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, g, tp) for t, g, tp in zip(tokens, got, tops, strict=True)]


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] probability vector (need not be normalized), by inverse CDF.

    Why not `torch.multinomial`: on a vocabulary-wide row it is several times slower than one
    cumulative sum and a binary search, and the baseline samples once per token. The CDF is
    accumulated in float64, so its rounding (~1e-16 per step) is far below anything a test
    could see; a token with zero probability has an empty interval [cdf[i-1], cdf[i]) and is
    never drawn.
    """
    cdf = probs.reshape(-1).to(torch.float64).cumsum(0)  # [V]
    total = cdf[-1].item()  # a Python float (a double): one read where two checks need it
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"cannot sample from a row with total mass {total}")
    u = torch.rand(1, generator=generator, dtype=torch.float64) * total  # [1] in [0, total)
    i = int(torch.searchsorted(cdf, u, right=True))  # first i with cdf[i] > u
    if i >= cdf.numel():  # u rounded up to total: the last token with mass
        i = int(torch.nonzero(probs.reshape(-1) > 0)[-1])
    return i


def _check_dist(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != width:
        raise ValueError(f"{name} must have shape [{rows}, {width}], got {tuple(t.shape)}")
    if rows == 0:  # q of a round whose drafts were all cut: no row to check (no reduction)
        return
    # Two reductions cover it all: NaN or inf anywhere makes a row sum non-finite, and a NaN
    # makes min() NaN, which fails `>= 0`. Why not three elementwise checks: this runs every
    # round on [K+1, V] rows, and each full pass over them costs as much as the accept walk. The
    # extremes come back in one read: on the small rows of a test, each read costs more than
    # the arithmetic.
    sums = t.sum(-1)  # [rows]
    lo, hi, least = torch.stack([*torch.aminmax(sums), t.min()]).tolist()  # NaN propagates
    if not (math.isfinite(lo) and math.isfinite(hi)):
        _check_finite(name, t)
    if not least >= 0:
        raise ValueError(f"{name} has negative entries; pass probabilities, not logits")
    if not max(abs(lo - 1), abs(hi - 1)) <= ROW_SUM_TOL:
        raise ValueError(f"{name} rows must sum to 1 (got {sums.tolist()}); pass probabilities")


def rejection_sample(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """The speculative sampling rule (paper, Algorithm 1, lines 3-5). Names match the paper.

    draft_tokens  [K] int64      x_1..x_K (K may be 0: then this is plain sampling from p[0])
    q             [K, V] float32 the distributions x_i were sampled from; None for a
                                 deterministic drafter (q_i is then one-hot on x_i)
    p             [K+1, V] float32 target distributions; p[K] is the bonus row
    returns       (tokens [n] int64 with 1 <= n <= K+1, n_accepted)

    Accept x_i iff r_i < min(1, p_i(x_i) / q_i(x_i)), r_i ~ U[0, 1). At the first rejection emit
    one token from norm(max(0, p_i - q_i)); if all K are accepted, emit a bonus from p[K].
    Edge cases, each with a reason:
      * q_i(x_i) = 0: x_i cannot have been sampled from q_i, so q is not the sampling
        distribution. We reject (as vLLM does); never a division by zero.
      * p_i(x_i) = 0: never accepted (r * q < 0 is false), so zero-probability target tokens are
        never emitted.
      * all-zero residual: max(0, p - q) is empty only when p <= q everywhere, i.e. p == q, where
        rejection has probability 0; reaching it means float round-off, and the conditional
        limit of the rule is a draw from p_i itself.
    """
    x = draft_tokens.to("cpu", torch.long).reshape(-1)  # [K]
    K = x.numel()
    p = p.to("cpu", torch.float32)
    V = p.shape[-1]
    _check_dist("p", p, K + 1, V)
    xs = x.tolist()  # K is small: the walk's bookkeeping is Python's, its arithmetic torch's
    if K and (min(xs) < 0 or max(xs) >= V):
        raise ValueError(f"draft token out of range [0, {V}): {xs}")
    rows = torch.arange(K)
    p_x = p[rows, x]  # [K] p_i(x_i)
    if q is None:
        q_x = torch.ones(K)  # [K] a deterministic drafter puts all its mass on x_i
    else:
        q = q.to("cpu", torch.float32)
        _check_dist("q", q, K, V)
        q_x = q[rows, x]  # [K] q_i(x_i)

    # r_i < min(1, p/q)  <=>  r_i * q < p  for q > 0 and r_i < 1: division-free.
    r = torch.rand(K, generator=generator)  # [K]
    accepted = ((q_x > 0) & (r * q_x < p_x)).tolist()  # [K] bool
    n_accepted = next((i for i, a in enumerate(accepted) if not a), K)

    if n_accepted < K:  # recovered token at the first rejected position
        i = n_accepted
        if q is None:
            residual = p[i].clone()
            residual[xs[i]] = 0.0  # max(0, p - onehot(x_i))
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)  # [V]
        mass = float(residual.sum())
        y = sample(residual / mass if mass > RESIDUAL_EPS else p[i], generator)
    else:  # bonus token from p[K], free from the verify pass
        y = sample(p[K], generator)
    tokens = torch.tensor([*xs[:n_accepted], y], dtype=torch.long)  # [n_accepted + 1]
    return tokens, n_accepted


def argmax_rows(logits: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Each row's argmax, [..., V] -> [...] int64 on the CPU, as torch.argmax gives it (the first
    of ties; in a row holding a NaN, the first NaN's index, as torch's max propagates NaN, so a
    check of the picked values finds every NaN), in a fifth of its time on a CPU, where torch's
    argmax runs scalar: the maximum of each `chunk` logits (amax, vectorized), the first chunk
    holding the row's maximum, the first maximum in it; the last V % chunk logits apart."""
    rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
    R, V = rows.shape
    n = V - V % chunk
    if n == 0:
        return logits.argmax(-1).to("cpu", torch.long)
    chunks = rows[:, :n].reshape(R, n // chunk, chunk)
    c = chunks.amax(-1).argmax(-1)  # [R]
    best = c * chunk + chunks[torch.arange(R, device=rows.device), c].argmax(-1)
    if n < V:  # the tail wins where greater, or NaN where the rest is not
        t = rows[:, n:].argmax(-1) + n
        m, tm = rows.gather(-1, best[:, None])[:, 0], rows.gather(-1, t[:, None])[:, 0]
        best = torch.where((tm > m) | (tm.isnan() & ~m.isnan()), t, best)
    return best.reshape(logits.shape[:-1]).to("cpu", torch.long)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Temperature 0: accept x_i iff argmax p_i == x_i; else emit argmax p_i. No randomness.

    draft_tokens   [K] int64
    target_logits  [K+1, V] (any float dtype; only the argmax is used)
    returns        (tokens [n] int64 with 1 <= n <= K+1, n_accepted)
    """
    x = draft_tokens.to("cpu", torch.long).reshape(-1)  # [K]
    K = x.numel()
    if target_logits.dim() != 2 or target_logits.shape[0] != K + 1:
        raise ValueError(
            f"target_logits must have shape [K+1, V] = [{K + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    best = argmax_rows(target_logits)  # [K+1]
    # on the CPU the picked values hold every row's NaN (argmax_rows); elsewhere all are checked
    cpu = target_logits.device.type == "cpu"
    if torch.isnan(target_logits.gather(-1, best[:, None]) if cpu else target_logits).any():
        raise ValueError("target_logits contain NaN; the model produced invalid numbers")
    mismatch = best[:K] != x  # [K]
    n_accepted = int(mismatch.to(torch.int8).argmax()) if bool(mismatch.any()) else K
    tokens = torch.cat([x[:n_accepted], best[n_accepted : n_accepted + 1]])
    return tokens, n_accepted
