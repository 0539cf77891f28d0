"""Drafters: whatever proposes the K tokens that the target verifies.

Protocol (after HF's CandidateGenerator and llama.cpp's common/speculative.h):

    propose(context, k) -> (x [k'] int64, q [k', V] float32 | None)   requires k >= 1; k' <= k
    observe(n_accepted)                                                after the accept walk

`context` is the whole committed sequence (prompt + generated). `q` must be exactly the
distributions the tokens were sampled from, or None when the drafter is deterministic given the
context (then q is one-hot on each token, and `rejection_sample` stays exact at any
temperature). `observe` lets a stateful drafter roll its cache back to the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .device import synchronize
from .models.base import SpecModel
from .sampling import probs_from_logits, sample


@dataclass(frozen=True)
class Warp:
    """How logits become a distribution; applied identically to the draft and the target."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)


class Drafter(Protocol):
    def propose(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def observe(self, n_accepted: int) -> None: ...


class ModelDrafter:
    """A draft model: x_i ~ q(. | context + x[:i]), keeping every q_i (paper, Algorithm 1 line 1).

    Cache choreography: before proposing, the draft cache is cut back to the longest prefix it
    shares with `context` and extended with the uncached suffix; x_k is never fed back (no one
    needs q_{k+1}). `observe(a)` truncates the cache to context + x[:a], so after every round the
    draft cache holds a prefix of the committed sequence.
    """

    def __init__(
        self, model: SpecModel, warp: Warp, generator: torch.Generator, width: int
    ) -> None:
        self.model = model
        self.warp = warp
        self.generator = generator
        self.width = width  # shared sampling width V (see tokenizer.check_pair)
        self._base = 0  # len(context) at the last propose

    def propose(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.model
        n = _common_prefix(m.cached_tokens, context)
        if n == len(context):  # the model must see at least the last context token
            n -= 1
        m.truncate(n)
        logits = m.extend(context[n:])[-1]  # [V_model] next-token logits after the context
        self._base = len(context)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            row = logits[: self.width]  # [V]
            if self.warp.greedy:
                xs.append(int(row.argmax()))
            else:
                q_i = self.warp.probs(row)  # [V] exactly the distribution x_i is drawn from
                xs.append(sample(q_i, self.generator))
                qs.append(q_i)
            if i + 1 < k:
                logits = m.extend([xs[-1]])[-1]
        synchronize(m.device)
        x = torch.tensor(xs, dtype=torch.long)  # [k]
        # Greedy drafting is deterministic given the context: q is one-hot, signalled by None.
        q = torch.stack(qs) if qs else None  # [k, V]
        return x, q

    def observe(self, n_accepted: int) -> None:
        self.model.truncate(self._base + n_accepted)


def _common_prefix(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and a == b[: len(a)]:  # the usual case after observe(): one C compare
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
