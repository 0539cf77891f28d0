"""A running request's output on its way out: a round's tokens become its `Delta` (the text safe
to send, stop strings honoured; its tokens' origins and logprobs when asked), and what it
produced is kept for its draft pool and /metrics.

The worker (serve.cycle) calls `Output.push` once a round and `flush` at the end; the text is
decoded incrementally (serve.text.TextAssembler) with the worker's copy of the tokenizer
(serve.tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.core.decode import Generation
from specdec.core.metrics import Round
from specdec.serve.gen_params import GenParams
from specdec.serve.metrics import RoundMark
from specdec.serve.origins import OriginTracker
from specdec.serve.text import TextAssembler
from specdec.serve.tokens import TokenEntry, Tokens


@dataclass(frozen=True)
class Delta:
    """One round's event for its request (serve.requests.Event)."""

    text: str  # may be empty: text held back (a possible stop string, a partial character)
    token_ids: tuple[int, ...]  # the round's committed tokens (empty for the final flush)
    origins: dict | None = None  # the round's token origins (serve.origins), when asked
    logprobs: tuple[TokenEntry, ...] = ()  # one per token (serve.tokens), when asked


@dataclass(eq=False)
class Output:
    """What one request produced so far, and its text assembler."""

    tokens: Tokens
    text: TextAssembler
    origins: OriginTracker | None  # stream_options.include_speculation only
    logprobs: bool  # each token's logprobs go out with it
    ids: list[int] = field(default_factory=list)  # the tokens committed, for the draft pool
    rounds: list[RoundMark] = field(default_factory=list)  # for /metrics
    drafted: int = 0  # draft tokens sent to verification so far

    @classmethod
    def for_request(cls, tokens: Tokens, p: GenParams) -> Output:
        origins = OriginTracker(tokens.decode) if p.origins else None
        return cls(tokens, TextAssembler(tokens.decode, p.stop), origins, p.logprobs is not None)

    @property
    def on_round(self) -> Callable[[Round], None] | None:
        """What the generation tells of each round (decode's `on_round`): the origins tracker's
        observer where the request asked for its tokens' origins."""
        return self.origins.observe if self.origins is not None else None

    @property
    def stopped(self) -> bool:
        """A stop string was found: nothing after it goes out."""
        return self.text.stopped

    def push(self, ids: list[int], gen: Generation) -> Delta:
        """The delta of a round that committed `ids` (`gen`'s newest tokens)."""
        self.ids += ids
        drafted = gen.stats.drafted - self.drafted  # this round's
        self.rounds.append(RoundMark(time.perf_counter(), len(ids), drafted))
        self.drafted = gen.stats.drafted
        record = self.origins.record(ids) if self.origins is not None else None
        entries = self.tokens.entries(gen.logprobs[-len(ids) :]) if self.logprobs and ids else ()
        return Delta(self.text.push(ids), tuple(ids), record, entries)

    def flush(self) -> Delta | None:
        """The text held back (a possible stop string that was not one, a partial character),
        once the generation is done; None when nothing was held."""
        rest = self.text.flush()
        return Delta(rest, ()) if rest else None
