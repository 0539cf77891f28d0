"""What changes p before the sampler sees it: OpenAI's penalties and logit bias, and a grammar.

The rule that keeps speculation exact: row i of a verify pass (p_i, which judges x_i) is
adjusted from its own prefix, the committed sequence plus x_1..x_{i-1}, exactly as a
target-only run would adjust it after emitting those tokens. The rejection rule then samples
the adjusted distribution, whatever the drafter proposed: a draft token the grammar forbids has
p_i(x_i) = 0 and is rejected without being sampled (core.sampling.rejection_sample).

    Penalties   presence, frequency (on generated tokens: OpenAI's and vLLM's definition),
                repetition (on prompt and generated tokens: transformers' and vLLM's), and
                logit_bias; a pure function of a row and its token counts
    Constraint  a grammar matcher's state machine (backends.grammar binds one to a tokenizer):
                which tokens it allows now, consuming tokens, rolling them back, and the tokens
                it forces (a free draft)
    Processor   one generation's adjustments: `rows` for a verify pass, `row` for a draft step,
                `commit` as tokens are committed

Order, vLLM's: grammar mask, logit bias, penalties; then the Warp (core.sampling.warped).
Logprobs are not taken from here: they are the model's own (see core.decode).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.core.metrics import FORCED

__all__ = ["FORCED", "Constraint", "Penalties", "Processor"]
#: OpenAI's bounds: penalties in [-2, 2], a logit bias in [-100, 100]. repetition_penalty is
#: transformers'/vLLM's: > 0, 1 is none.
PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)
#: logit_bias entries a request may carry: past a few hundred a bias is a restriction of the
#: vocabulary, which a grammar expresses (and ~80,000 fit in a 1 MiB body)
MAX_BIAS = 300


def _number(what: str, v: object, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < lo or v > hi or (open_lo and v == lo):
        bound = f"({lo:g}, {hi:g}]" if open_lo else f"[{lo:g}, {hi:g}]"
        raise ValueError(f"{what} must be a number in {bound}, got {v!r}")
    return float(v)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Penalties:
    """Logit adjustments that depend on which tokens came before (none by default).

    presence    logit[t] -= presence for every t generated at least once
    frequency   logit[t] -= frequency x (times t was generated)
    repetition  for every t in the prompt or generated: a positive logit is divided by it, a
                negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor)
    bias        ((token id, value), ...): logit[t] += value (OpenAI's logit_bias)
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _number("presence_penalty", self.presence, *PENALTY_RANGE)
        _number("frequency_penalty", self.frequency, *PENALTY_RANGE)
        _number("repetition_penalty", self.repetition, 0.0, 2.0, open_lo=True)
        if len(self.bias) > MAX_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.bias)} entries, at most {MAX_BIAS} are taken; "
                "restrict the vocabulary with a grammar (response_format, guided_*) instead"
            )
        for t, v in self.bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            _number(f"logit_bias[{t}]", v, *BIAS_RANGE)

    @classmethod
    def of(
        cls,
        presence: float | None = None,
        frequency: float | None = None,
        repetition: float | None = None,
        bias: Mapping[int, float] | None = None,
    ) -> Penalties:
        """From optional values (None: none), bias as a mapping."""
        return cls(
            0.0 if presence is None else presence,
            0.0 if frequency is None else frequency,
            1.0 if repetition is None else repetition,
            tuple(sorted((bias or {}).items())),
        )

    @property
    def counted(self) -> bool:
        """Whether the adjustment depends on the tokens before (not only on the bias)."""
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @property
    def active(self) -> bool:
        return self.counted or bool(self.bias)

    def check_ids(self, width: int) -> None:
        bad = next((t for t, _ in self.bias if t >= width), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {width})")

    @functools.cached_property
    def _bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bias as tensors, ids and values, built once (not per verify row or draft step)."""
        ids = torch.tensor([t for t, _ in self.bias], dtype=torch.long)
        return ids, torch.tensor([v for _, v in self.bias], dtype=torch.float32)

    def apply(self, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """logits [n, V] float32 adjusted, rows independent: counts [n, V] (times each token was
        generated before that row), seen [n, V] bool (in the prompt or generated before)."""
        x = logits
        if self.bias:
            ids, values = self._bias
            x = x.index_add(-1, ids, values.expand(x.shape[0], -1))
        if self.repetition != 1:
            r = self.repetition
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if self.frequency:
            x = x - self.frequency * counts
        if self.presence:
            x = x - self.presence * (counts > 0).to(x.dtype)
        return x


class GrammarError(ValueError):
    """A grammar could not go on (a matcher's resource limit, or an error state): the request
    fails with this message, never a silent stop that would look like a finished answer."""


class Constraint(Protocol):
    """A grammar matcher at the end of the committed sequence (its state moves with `consume`
    and `rollback`). `allowed()` is a bool [V] mask over the sampling width (None: anything);
    it raises GrammarError when the matcher cannot go on."""

    def allowed(self) -> torch.Tensor | None: ...

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance over `tokens` while the grammar allows them; how many it took."""
        ...

    def rollback(self, n: int) -> None: ...

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (keys, punctuation, closing brackets): a draft
        that costs nothing to make (jump-forward); [] when none."""
        ...


class Processor:
    """One generation's adjustments of p, each row from its own prefix (module docstring).

    `prompt` is the prompt's ids (repetition counts them), `width` the sampling width V."""

    def __init__(
        self,
        penalties: Penalties | None,
        constraint: Constraint | None,
        prompt: Iterable[int],
        width: int,
    ) -> None:
        self.penalties = penalties if penalties is not None and penalties.active else None
        if self.penalties is not None:
            self.penalties.check_ids(width)
        self.constraint = constraint
        self.width = width
        # proposed tokens ahead of the committed ones that a draft step's `row` comes after
        # (the grammar's forced tokens, drafted before the drafter's own)
        self.ahead: list[int] = []
        self._counts = torch.zeros(width)  # [V] times each token was generated
        self._seen = torch.zeros(width, dtype=torch.bool)  # [V] in the prompt or generated
        if self.penalties is not None and self.penalties.repetition != 1:
            self._seen[torch.tensor(list(prompt), dtype=torch.long)] = True

    def rows(self, logits: torch.Tensor, x: Sequence[int], greedy: bool = False) -> torch.Tensor:
        """A verify pass's rows [k+1, V] adjusted: row i as if x[:i] had been committed. Rows
        past a draft token the grammar forbids are left unmasked: the walk never reaches them
        (that token is rejected). `greedy`: only each row's argmax is used, so a row whose
        argmax the grammar allows is left unmasked (masking would not move it: llama.cpp's
        check before the full mask), which spares computing most masks."""
        out = logits.to("cpu", torch.float32)
        if self.penalties is not None:
            out = self.penalties.apply(out, *self._counted(x))
        if self.constraint is not None:
            taken = 0
            for i in range(len(x) + 1):
                if not (greedy and self._allows(int(out[i].argmax()))):
                    if out.data_ptr() == logits.data_ptr():  # the caller's rows stay as they are
                        out = out.clone()
                    _mask(out[i], self.constraint.allowed())
                if i == len(x) or self.constraint.consume([x[i]]) == 0:
                    break
                taken += 1
            self.constraint.rollback(taken)
        return out

    def _allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (its state unchanged)."""
        ok = self.constraint.consume([token]) == 1  # type: ignore[union-attr]
        if ok:
            self.constraint.rollback(1)  # type: ignore[union-attr]
        return ok

    def row(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """One draft step's row [V] adjusted as if `drafted` had been committed (a draft model
        drafting from the adjusted q drafts what the adjusted p accepts)."""
        drafted = [*self.ahead, *drafted]
        out = logits.to("cpu", torch.float32).reshape(1, -1)
        if self.penalties is not None:  # the last row of _counted's, built alone: O(V + k)
            counts = self._counts.clone()
            if drafted:
                counts.index_add_(0, torch.tensor(drafted), torch.ones(len(drafted)))
            out = self.penalties.apply(out, counts[None], (self._seen | (counts > 0))[None])
        if self.constraint is not None:
            out = out.clone() if out.data_ptr() == logits.data_ptr() else out
            taken = self.constraint.consume(drafted)
            if taken == len(drafted):
                _mask(out[0], self.constraint.allowed())
            self.constraint.rollback(taken)
        return out[0]

    def valid(self, x: Sequence[int]) -> int:
        """How many of the drafted tokens x the grammar allows in a row (all without one)."""
        if self.constraint is None:
            return len(x)
        taken = self.constraint.consume(x)
        self.constraint.rollback(taken)
        return taken

    def forced(self) -> list[int]:
        return self.constraint.forced() if self.constraint is not None else []

    def commit(self, tokens: Sequence[int]) -> None:
        """The committed tokens: counted, and consumed by the grammar."""
        self.ahead = []
        if self.penalties is not None and tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long)  # a repeated id counts each time
            self._counts.index_put_((ids,), torch.ones(len(ids)), accumulate=True)
            self._seen[ids] = True
        if self.constraint is not None:
            self.constraint.consume(tokens)

    def _counted(self, x: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """counts and seen [k+1, V] for rows 0..k, row i having x[:i] generated on top."""
        n = len(x) + 1
        counts = self._counts.expand(n, -1).clone()
        for j, t in enumerate(x):
            counts[j + 1 :, t] += 1
        return counts, self._seen.expand(n, -1) | (counts > 0)


def _mask(row: torch.Tensor, allowed: torch.Tensor | None) -> None:
    if allowed is not None:
        row.masked_fill_(~allowed[: row.shape[-1]], float("-inf"))
