"""Token origins: where each committed token came from (stream_options.include_speculation).

Glossary (after vLLM's rejection sampler, whose "recovered" token is called "corrected" here):
    accepted   a drafted token the accept rule kept; its round's `source` names the draft source
               ("model", "lookup3", "lookup8+", "prediction", ...: the drafters' names)
    corrected  the target's token at the first rejected draft position (resampled from the
               residual max(0, p - q); the target's argmax when greedy)
    bonus      the target's extra token after a round whose K drafts were all accepted
    target     the token of a plain target step: a round that drafted nothing (K = 0)
A round commits its accepted drafts, then one corrected, bonus or target token, cut short by the
token budget or a stop token; so its origins follow from its K, its accepted count and how many
tokens it committed, and they add up to the completion's tokens.

Rounds are read off `SpecStream.stats` between rounds: each round adds one to k_histogram[K],
`n_accepted` to accepted and, when it drafted, K to drafted_by_source[source] (core.metrics.
GenerationStats.record), so the difference of two snapshots is exactly the Round the loop
recorded, with no hook in the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.core.metrics import GenerationStats
from specdec.serve.text import TextAssembler

ORIGINS = ("accepted", "corrected", "bonus", "target")


@dataclass(frozen=True)
class RoundView:
    """One round as the stats recorded it."""

    k: int  # tokens drafted and verified (0: a plain target step)
    source: str | None  # the draft source (None when nothing was drafted)
    n_accepted: int  # drafted tokens kept, 0 <= n_accepted <= k

    def origin(self, i: int) -> str:
        """The origin of the round's i-th committed token (the glossary above)."""
        if i < self.n_accepted:
            return "accepted"
        if self.k == 0:
            return "target"
        return "bonus" if self.n_accepted == self.k else "corrected"


class RoundReader:
    """The round just recorded in `stats`, read after each chunk a SpecStream yields."""

    def __init__(self, stats: GenerationStats) -> None:
        self.stats = stats
        self._snap = self._take()

    def _take(self) -> tuple[dict[int, int], dict[str, int], int, int]:
        st = self.stats
        return dict(st.k_histogram), dict(st.drafted_by_source), st.accepted, st.rounds

    def next(self) -> RoundView:
        """The round recorded since the last call (exactly one: a stream yields once a round)."""
        hist, by_source, accepted, rounds = self._snap
        st = self.stats
        if st.rounds != rounds + 1:
            raise RuntimeError(f"expected one round since the last chunk, got {st.rounds - rounds}")
        k = next(k for k, n in st.k_histogram.items() if n != hist.get(k, 0))
        grown = (s for s, n in st.drafted_by_source.items() if n != by_source.get(s, 0))
        source = next(grown, None)
        self._snap = self._take()
        return RoundView(k, source if k else None, st.accepted - accepted)


class OriginTracker:
    """Each round's token origins and the text each token adds, as a chunk's `speculation`.

    The text per token comes from a second TextAssembler without stop strings, fed one token at
    a time: a token that ends inside a UTF-8 character adds "" and the one completing it adds the
    character, so the pieces concatenate to the completion's text (up to a stop string, where
    the streamed text is cut and the pieces are not).
    """

    def __init__(self, stats: GenerationStats, decode: Callable[[list[int]], str]) -> None:
        self._rounds = RoundReader(stats)
        self._pieces = TextAssembler(decode)
        self._index = 0

    def record(self, ids: Sequence[int]) -> dict[str, Any]:
        """The `speculation` object of the chunk carrying this round's committed `ids`:
        {round, k, source, accepted, tokens: [{id, text, origin}]}."""
        view = self._rounds.next()
        self._index += 1
        tokens = [
            {"id": t, "text": self._pieces.push([t]), "origin": view.origin(i)}
            for i, t in enumerate(ids)
        ]
        return {
            "round": self._index,
            "k": view.k,
            "source": view.source,
            "accepted": view.n_accepted,
            "tokens": tokens,
        }
