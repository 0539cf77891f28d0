"""Deterministic mock models: fixed stochastic matrices, for the exactness tests.

The next-token logits after token t_i are  A[t_i] + B[t_{i-1}]  (B is dropped at position 0): a
second-order Markov chain whose tables come from a seeded generator. Depending on the previous
token as well as the last one makes the output sensitive to what the cache holds, so a decoder
that feeds the wrong tokens, or leaves stale ones in the cache, produces visibly different
distributions. `MockModel.near(other, noise)` builds a draft that resembles a target.
"""

from __future__ import annotations

import copy

import torch

from specdec.core.model import SpecModel


class MockModel(SpecModel):
    batch_invariant = True  # each row's logits are a function of its last two tokens alone

    def __init__(
        self,
        vocab_size: int = 48,
        seed: int = 0,
        scale: float = 2.0,
        n_ctx: int = 4096,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"mock vocab_size must be >= 2, got {vocab_size}")
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.n_ctx = n_ctx
        self.name = name or f"mock:vocab={vocab_size},seed={seed}"
        self.A = torch.randn(vocab_size, vocab_size, generator=g) * scale  # [V, V] last token
        self.B = torch.randn(vocab_size, vocab_size, generator=g) * (scale / 2)  # [V, V] previous
        # Mock models share a "tokenizer" iff they share the vocabulary size.
        self.vocab_fingerprint = f"mock-{vocab_size}"

    @classmethod
    def near(cls, other: MockModel, noise: float = 0.7, seed: int = 1) -> MockModel:
        """A model whose tables are `other`'s plus Gaussian noise: a plausible draft."""
        m = cls(other.vocab_size, seed=seed, n_ctx=other.n_ctx)
        g = torch.Generator().manual_seed(10_000 + seed)
        m.A = other.A + noise * torch.randn(other.A.shape, generator=g)
        m.B = other.B + noise * torch.randn(other.B.shape, generator=g)
        m.name = f"mock:near({other.name},noise={noise},seed={seed})"
        return m

    def _logits(self, ids: list[int], prev: int | None) -> torch.Tensor:
        if len(ids) == 1 and prev is not None:  # a decode step: the same sum, fewer small ops
            return (self.A[ids[0]] + self.B[prev])[None]  # [1, V]
        t = torch.tensor(ids, dtype=torch.long)  # [n]
        out = self.A[t]  # [n, V], a copy (indexing by a tensor)
        if prev is not None:
            out[0] += self.B[prev]
        out[1:] += self.B[t[:-1]]  # each later row's previous token is the row before's
        return out

    def _extend(self, ids: list[int]) -> torch.Tensor:
        prev = self.cached_tokens[-1] if self.cached_tokens else None
        return self._logits(ids, prev)

    def _make_slots(self, n: int) -> list[SpecModel]:
        out: list[SpecModel] = [self]
        for i in range(1, n):  # the same tables, a cache of its own
            slot = copy.copy(self)
            slot.cached_tokens, slot.name = [], f"{self.name}#{i}"
            out.append(slot)
        return out

    def _truncate(self, n: int) -> None:
        pass  # the base class drops cached_tokens[n:]; there is no other state

    def _save_state(self) -> tuple[None, int]:
        return None, 8 * self.n_cached  # the tokens are the state: sized as a list of int64s

    def _restore_state(self, state: None) -> None:
        pass  # the base class restores cached_tokens

    def _forward(self, ids: list[int]) -> torch.Tensor:
        return self._logits(ids, None)
