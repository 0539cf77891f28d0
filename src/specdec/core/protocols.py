"""The two roles the decode loop is written against, apart from the classes that fill them, so
that settings (core.config) can name them without importing the drafters or the policies:

    Drafter   proposes the K tokens the target verifies (core.drafters says the protocol's rules)
    KPolicy   chooses K for each round from what the rounds so far cost and kept (core.policy)

and `Proposal`, what a drafter hands the loop. Imports nothing of the core at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from specdec.core.metrics import Round
    from specdec.core.model import SpecModel


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


class KPolicy(Protocol):
    k_max: int

    def choose(self, source: str, remaining: int) -> int: ...

    def observe(self, r: Round) -> None: ...
