"""Drafters: whatever proposes the K tokens that the target verifies.

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
from typing import NamedTuple, Protocol

import torch

from specdec.core.config import Warp
from specdec.core.device import synchronize
from specdec.core.model import SpecModel
from specdec.core.sampling import sample


class Proposal(NamedTuple):
    """What a drafter proposes for one round."""

    x: torch.Tensor  # [k'] int64, the drafted tokens x_1..x_k'
    q: torch.Tensor | None  # [k', V] float32, the distributions they were drawn from; None: one-hot
    catchup_s: float = 0.0  # seconds spent prefilling context the draft model had not seen


class Drafter(Protocol):
    model: SpecModel | None

    def source(self, context: list[int]) -> str | None: ...

    def propose(self, context: list[int], k: int) -> Proposal: ...

    def observe(self, n_accepted: int) -> None: ...


class ModelDrafter:
    """A draft model: x_i ~ q(. | context + x[:i]), keeping every q_i (paper, Algorithm 1 line 1).

    Cache choreography: before proposing, the draft cache is cut back to the longest prefix it
    shares with `context` and extended with the uncached suffix; x_k is never fed back (no one
    needs q_{k+1}). `observe(a)` truncates the cache to context + x[:a], so after every round the
    draft cache holds a prefix of the committed sequence.

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
    ) -> None:
        self.model = model
        self.warp = warp
        self.generator = generator
        self.width = width  # shared sampling width V (see tokenizer.check_pair)
        self.p_min = p_min
        self._base = 0  # len(context) at the last propose

    def source(self, context: list[int]) -> str | None:
        return "model"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.model
        n = _common_prefix(m.cached_tokens, context)
        if n == len(context):  # the model must see at least the last context token
            n -= 1
        m.truncate(n)
        t0 = time.perf_counter()
        if len(context) - n > 1:  # e.g. the prompt: only the last position's logits are needed
            m.prefill(context[n:-1])
            synchronize(m.device)
        # Catching up on the prompt (or on tokens committed without this drafter) is not a
        # per-drafted-token cost; the K controller learns the per-token cost without it.
        catchup_s = time.perf_counter() - t0
        logits = m.extend(context[-1:])[-1]  # [V_model] next-token logits after the context
        self._base = len(context)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            row = logits[: self.width]  # [V]
            if self.warp.greedy:
                if self.p_min is not None and float(torch.softmax(row, -1).max()) < self.p_min:
                    break
                xs.append(int(row.argmax()))
            else:
                q_i = self.warp.probs(row)  # [V] exactly the distribution x_i is drawn from
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
#: trigram in prose. Pooled with the short matches, copy runs were never drafted: prose
#: rejections had switched "lookup3" off before the copy began (simulated on 37 greedy outputs
#: of the 1.5B: the fix-the-bug prompt p009 went from 0.996x to 1.21x).
LOOKUP_BUCKETS = (8, 4)


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

    def _match(self, context: list[int]) -> tuple[int, int] | None:
        """(n, continuation start) of the longest suffix n-gram seen before, or None."""
        self._sync(context)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) > n:
                start = self._index.get(tuple(context[-n:]))
                if start is not None:
                    return n, start
        return None

    def source(self, context: list[int]) -> str | None:
        m = self._match(context)
        if m is None:
            return None
        n = m[0]
        lo = next((b for b in LOOKUP_BUCKETS if n >= b), None)
        return f"lookup{n}" if lo is None else f"lookup{lo}+"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self._match(context)
        tokens = [] if m is None else context[m[1] : m[1] + k]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        pass


class CompositeDrafter:
    """Prompt lookup when the context has a match, else the draft model."""

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter) -> None:
        self.lookup = lookup
        self.model = model.model  # the draft model's cache is the one this drafter keeps
        self._model_drafter = model
        self._last: LookupDrafter | ModelDrafter | None = None

    def _pick(self, context: list[int]) -> tuple[LookupDrafter | ModelDrafter, str]:
        src = self.lookup.source(context)
        if src is not None:
            return self.lookup, src
        return self._model_drafter, "model"

    def source(self, context: list[int]) -> str | None:
        return self._pick(context)[1]

    def propose(self, context: list[int], k: int) -> Proposal:
        self._last, _ = self._pick(context)
        return self._last.propose(context, k)

    def observe(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(n_accepted)


def _common_prefix(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and a == b[: len(a)]:  # the usual case after observe(): one C compare
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
