"""A replay backend: a target that answers from a recorded greedy output instead of computing,
and a clock whose seconds are modelled, so that `core.generate.stream` itself re-runs a recorded
generation (study.run.replay, `specdec replay`): the loop, the drafters and the K policies are
the ones a live run executes, not a copy of them.

Why replaying outputs is enough: a greedy output is what the target produces after its prompt,
whatever drafted for it (the loop is lossless, and greedy decoding is deterministic where the
backend is batch-invariant). The greedy accept walk reads a logit row only through its argmax,
and only the rows whose context is the committed sequence plus accepted drafts, so rows one-hot
on the recorded tokens make every round the one the recorded model would have made.

    ReplayTarget(prompt, output, vocab_size, clock)
        a SpecModel; row i of extend(tokens) predicts the token after cached + tokens[: i + 1]:
        one-hot on the recorded token where that context is prompt + output[:j], j < len(output).
        Elsewhere (off the record, or past its end) the record says nothing, and the row is
        one-hot on the last id, V - 1, which the record leaves unused: a model-free drafter,
        drafting from the context and the prediction, never proposes it, so a draft there is
        rejected (greedy_verify reads such a row only past the end, where the loop's commit
        has cut at the stop token). A row depends on its context alone, as the contract asks
    ModelledClock(cost)
        a decode.Clock whose seconds are charged, not read: each verify pass (ReplayTarget)
        costs cost(i, k)[1] and each proposal (Charged) cost(i, k)[0], for round i drafting k
        tokens; a phase lasts exactly what was charged in it
    Charged(drafter, clock)
        the drafter, each proposal charged to the clock for the tokens it drafted

Limits, stated: the prompt's prefill is charged nothing (a replay measures the decode phase), and
the loop's own bookkeeping costs only what `cost` says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from specdec.core.decode import Clock
from specdec.core.drafters import Drafter, Proposal
from specdec.core.model import SpecModel

#: (round index i, tokens drafted k) -> (draft_s, verify_s): what one round costs
CostFn = Callable[[int, int], tuple[float, float]]


class ModelledClock(Clock):
    """decode.Clock on modelled time: `now()` is the seconds charged so far."""

    def __init__(self, cost: CostFn) -> None:
        super().__init__()
        self.cost = cost
        self.t = 0.0  # modelled seconds since the start
        self.round = 0  # the round being charged: verify passes so far
        self._pending: float | None = None  # charged in the open phase (None: no phase open)

    def now(self) -> float:
        return self.t

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # the phase's seconds are the charges themselves, not a difference of two readings:
        # the K policy observes exactly cost(i, k), as the old replay fed it
        self._pending = 0.0
        try:
            yield
            self.add(name, self._pending)
            self.t += self._pending
        finally:
            self._pending = None

    def drafted(self, k: int) -> None:
        """A proposal of k tokens in the current round."""
        self._charge(self.cost(self.round, k)[0])

    def verified(self, b: int) -> None:
        """A target pass over b = k + 1 tokens: the round's verify, which ends its charges."""
        self._charge(self.cost(self.round, b - 1)[1])
        self.round += 1

    def _charge(self, seconds: float) -> None:
        if self._pending is None:
            self.t += seconds
        else:
            self._pending += seconds


class Charged:
    """`drafter`, each proposal charged to `clock` for the tokens it holds."""

    def __init__(self, drafter: Drafter, clock: ModelledClock) -> None:
        self.drafter = drafter
        self.clock = clock
        self.model = drafter.model

    def source(self, context: list[int]) -> str | None:
        return self.drafter.source(context)

    def propose(self, context: list[int], k: int) -> Proposal:
        p = self.drafter.propose(context, k)
        self.clock.drafted(p.x.numel())
        return p

    def observe(self, n_accepted: int) -> None:
        self.drafter.observe(n_accepted)


class ReplayTarget(SpecModel):
    """A target that replays one recorded greedy output (module docstring)."""

    batch_invariant = True  # a row depends on its context alone

    def __init__(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        vocab_size: int,
        clock: ModelledClock | None = None,
        name: str = "replay",
        n_ctx: int | None = None,
    ) -> None:
        """n_ctx: the context window (default: the record's length); a replay gives it the
        recorded run's, len(prompt) + max_new_tokens."""
        super().__init__()
        self.record = [*prompt, *output]  # the sequence the recorded model committed
        if any(not 0 <= t < vocab_size - 1 for t in self.record):
            raise ValueError(f"vocab_size {vocab_size}: a replay needs one id above the record's")
        self.vocab_size = vocab_size
        self.unknown = vocab_size - 1  # what a row predicts where the record says nothing
        self.n_ctx = len(self.record) if n_ctx is None else n_ctx
        self.clock = clock
        self.name = name
        self._agree = 0  # leading cached tokens equal to the record

    def _rows(self, ids: list[int], start: int, agree: int) -> tuple[torch.Tensor, int]:
        """Logits [len(ids), V] for `ids` at positions start.., the first `agree` of the
        context on the record; also how many of the new context agree."""
        rec, hot = self.record, []  # hot[i]: the token row i is one-hot on
        for i, t in enumerate(ids):
            agree = self._follow(agree, start + i, t)
            j = start + i + 1  # the position row i predicts
            hot.append(rec[j] if agree == j and j < len(rec) else self.unknown)
        out = torch.zeros(len(ids), self.vocab_size)  # [n, V] float32
        out[torch.arange(len(ids)), torch.tensor(hot)] = 1.0
        return out, agree

    def _follow(self, agree: int, pos: int, t: int) -> int:
        """`agree` once token t is at position pos."""
        on = agree == pos and pos < len(self.record) and self.record[pos] == t
        return agree + 1 if on else agree

    def _extend(self, ids: list[int]) -> torch.Tensor:
        logits, self._agree = self._rows(ids, self.n_cached, self._agree)
        if self.clock is not None:
            self.clock.verified(len(ids))
        return logits

    def _prefill(self, ids: list[int]) -> None:  # the prompt: no logits, nothing charged
        for i, t in enumerate(ids):
            self._agree = self._follow(self._agree, self.n_cached + i, t)

    def _truncate(self, n: int) -> None:
        self._agree = min(self._agree, n)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        return self._rows(ids, 0, 0)[0]
