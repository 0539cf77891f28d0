"""Drafters: whatever proposes the K tokens that the target verifies. Here the draft model,
prompt lookup and the composite of several; the prediction drafter is core.prediction's, prompt
lookup over earlier requests core.pool's.

Protocol (after HF's CandidateGenerator and llama.cpp's common/speculative.h):

    model: SpecModel | None            the draft model whose cache the drafter keeps (None for
                                       model-free drafters); the loop checks its cache invariant
    source(context) -> str | None      which kind of proposal `propose` would make now (the K
                                       controller keeps acceptance and cost per source);
                                       None: nothing to propose, so the round is a plain step
    propose(context, k) -> Proposal    requires k >= 1; x holds k' <= k tokens
    observe(n_accepted)                after the accept walk

`context` is the whole committed sequence (prompt + generated). `q` must be exactly the
distributions the tokens were sampled from, or None when the drafter is deterministic given the
context (then q is one-hot on each token, and `rejection_sample` stays exact at any
temperature). Any rule for how many tokens to draft is allowed as long as it looks only at the
draft side (context, drafted tokens, q): the accept rule is then exact for every prefix length.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec.core.config import Warp
from specdec.core.device import synchronize
from specdec.core.model import SpecModel
from specdec.core.protocols import Drafter, Proposal
from specdec.core.sampling import argmax_rows, sample, warped

#: Uncached context tokens a draft model feeds in its first drafting pass, with the last one,
#: rather than in a prefill of their own: past a few rows a pass costs little more than one
#: (a memory-bound step), so after a fully accepted round (x_k and the bonus token uncached) the
#: catch-up is nearly free instead of a second step; longer suffixes, whose logits rows would
#: only be thrown away, are prefilled.
CATCHUP_IN_PASS = 8


def _synced_now(model: SpecModel) -> float:
    synchronize(model.device)
    return time.perf_counter()


class ModelDrafter:
    """A draft model: x_i ~ q(. | context + x[:i]), keeping every q_i (paper, Algorithm 1 line 1).

    Cache choreography: before proposing, the draft cache is cut back to the longest prefix it
    shares with `context` and extended with the uncached suffix; x_k is never fed back (no one
    needs q_{k+1}). `observe(a)` truncates the cache to context + x[:a], so after every round the
    draft cache holds a prefix of the committed sequence. A short suffix (after a fully accepted
    round: x_k and the bonus token) goes into the first drafting pass itself, one pass over its
    rows instead of one per token (CATCHUP_IN_PASS); a long one (the prompt) is prefilled first.

    `p_min` (llama.cpp's draft p-min): stop drafting as soon as the draft's most likely token has
    probability below p_min — a draft-side rule, so the output distribution is unchanged.
    """

    def __init__(
        self,
        model: SpecModel,
        warp: Warp,
        generator: torch.Generator,
        width: int,
        p_min: float | None = None,
        adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.warp = warp
        self.generator = generator
        self.width = width  # shared sampling width V (core.pair.check_pair)
        self.p_min = p_min
        # the target's adjustments (core.processing.Processor.row): q adjusted as p will be
        self.adjust = adjust
        self._base = 0  # len(context) at the last propose
        # what times the catch-up: the generation's Clock.now (set by decode.Generation, so a
        # replay's modelled clock times it too); alone, wall time after the device syncs
        self.now: Callable[[], float] = lambda: _synced_now(model)

    def source(self, context: list[int]) -> str | None:
        return "model"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.model
        n = common_prefix(m.cached_tokens, context)
        if n == len(context):  # the model must see at least the last context token
            n -= 1
        m.truncate(n)
        uncached, catchup_s = context[n:], 0.0
        # Catching up on the prompt (or on many tokens committed without this drafter) is not a
        # per-drafted-token cost; the K controller learns the per-token cost without it. A few
        # tokens fed in the drafting pass are: a fully accepted round leaves two every time.
        if len(uncached) > CATCHUP_IN_PASS:  # e.g. the prompt: only the last logits are needed
            t0 = self.now()
            m.prefill(uncached[:-1])
            catchup_s, uncached = self.now() - t0, uncached[-1:]
        logits = m.extend(uncached)[-1]  # [V_model] next-token logits after the context
        self._base = len(context)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            row = logits[: self.width]  # [V]
            if self.adjust is not None:
                row = self.adjust(row, xs)
            if self.warp.greedy:
                if self.p_min is not None and float(torch.softmax(row, -1).max()) < self.p_min:
                    break
                xs.append(int(argmax_rows(row)))
            else:
                q_i = warped(row, self.warp)  # [V]: x_i ~ q_i
                if self.p_min is not None and float(q_i.max()) < self.p_min:
                    break
                xs.append(sample(q_i, self.generator))
                qs.append(q_i)
            if i + 1 < k:
                logits = m.extend([xs[-1]])[-1]
        synchronize(m.device)
        x = torch.tensor(xs, dtype=torch.long)  # [k']
        # Greedy drafting is deterministic given the context: q is one-hot, signalled by None.
        q = torch.stack(qs) if qs else None  # [k', V]
        return Proposal(x, q, catchup_s)

    def observe(self, n_accepted: int) -> None:
        self.model.truncate(self._base + n_accepted)


#: Match lengths that share one acceptance estimate in the K controller (`LookupDrafter.source`):
#: n = 1, 2, 3 each alone, then 4-7 and 8+. A long match means the output is copying its input
#: (code editing, summarization), where drafts are accepted far more often than after a common
#: trigram in prose. Why apart: pooled with the short matches, copy runs would not be drafted,
#: since prose rejections switch the pooled source off before the copy begins.
LOOKUP_BUCKETS = (8, 4)


def lookup_source(n: int) -> str:
    """The draft source of a prompt-lookup match of n tokens (bucketed: LOOKUP_BUCKETS)."""
    lo = next((b for b in LOOKUP_BUCKETS if n >= b), None)
    return f"lookup{n}" if lo is None else f"lookup{lo}+"


class LookupDrafter:
    """Prompt lookup: no model. Find the most recent earlier occurrence of the context's last n
    tokens (n = n_max down to n_min) and propose the tokens that followed it.

    Deterministic given the context, so q = None (one-hot) and the output stays exactly the
    target's at every temperature. An index from n-gram to its latest continuation is updated
    incrementally: a call indexes O(new tokens * n_max) n-grams, plus one C-level comparison of
    the context with the one seen last (how a new sequence is detected: O(context), ~µs).
    `source` names the match length (bucketed, see LOOKUP_BUCKETS) so the K controller learns
    acceptance per length.
    """

    model = None

    def __init__(self, n_max: int = 12, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max = n_max
        self.n_min = n_min
        self._ctx: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed it
        self._indexed = 0  # n-grams ending before this position are indexed

    def _sync(self, context: list[int]) -> None:
        n = len(self._ctx)
        if len(context) < n or context[:n] != self._ctx:
            self._index.clear()  # a different sequence (new request): rebuild
            self._indexed = 0
            self._ctx = []
        self._ctx += context[len(self._ctx) :]  # copy only the new tokens
        # Index every n-gram whose continuation exists, i.e. ending at positions < len - 1.
        for end in range(self._indexed, len(context) - 1):
            for n in range(self.n_min, self.n_max + 1):
                if end - n + 1 >= 0:
                    self._index[tuple(context[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(context) - 1)

    def match(self, context: list[int]) -> tuple[int, int] | None:
        """(n, continuation start) of the longest suffix n-gram seen before, or None."""
        self._sync(context)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) > n:
                start = self._index.get(tuple(context[-n:]))
                if start is not None:
                    return n, start
        return None

    def source(self, context: list[int]) -> str | None:
        m = self.match(context)
        return None if m is None else lookup_source(m[0])

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.match(context)
        tokens = [] if m is None else context[m[1] : m[1] + k]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        pass


class CompositeDrafter:
    """The first of several drafters that has something to propose: e.g. the prediction, else
    prompt lookup, else the draft model. At most one of them may keep a draft model."""

    def __init__(self, *parts: Drafter) -> None:
        models = [d.model for d in parts if d.model is not None]
        if len(models) > 1:
            raise ValueError("a composite drafter may hold one draft model at most")
        self.parts = parts
        self.model = models[0] if models else None  # the cache the loop checks
        self._last: Drafter | None = None

    def _pick(self, context: list[int]) -> tuple[Drafter, str] | None:
        for d in self.parts:
            src = d.source(context)
            if src is not None:
                return d, src
        return None

    def source(self, context: list[int]) -> str | None:
        pick = self._pick(context)
        return None if pick is None else pick[1]

    def propose(self, context: list[int], k: int) -> Proposal:
        pick = self._pick(context)
        self._last = None if pick is None else pick[0]
        if self._last is None:
            return Proposal(torch.empty(0, dtype=torch.long), None)
        return self._last.propose(context, k)

    def observe(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(n_accepted)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    if len(a) <= len(b) and a == b[: len(a)]:  # the usual case after observe(): one C compare
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
