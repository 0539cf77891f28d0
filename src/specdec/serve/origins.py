"""Token origins: where each committed token came from (stream_options.include_speculation).

Glossary (after vLLM's rejection sampler, whose "recovered" token is called "corrected" here):
    accepted   a drafted token the accept rule kept; its `source` names the draft source
               ("model", "lookup3", "lookup8+", "prediction", ...: the drafters' names; "grammar"
               for the tokens a grammar forced, drafted ahead of the drafter's own)
    corrected  the target's token at the first rejected draft position (resampled from the
               residual max(0, p - q); the target's argmax when greedy)
    bonus      the target's extra token after a round whose K drafts were all accepted
    target     the token of a plain target step: a round that drafted nothing (K = 0)
A round commits its accepted drafts, then one corrected, bonus or target token, cut short by the
token budget or a stop token; so its origins follow from its K, its accepted count and how many
tokens it committed, and they add up to the completion's tokens.

The engine hears each round's `Round` record through `generate.stream`'s `on_round` hook, just
before the stream yields that round's committed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdec.core.metrics import FORCED, Round
from specdec.serve.text import TextAssembler

ORIGINS = ("accepted", "corrected", "bonus", "target")


def origin(r: Round, i: int) -> str:
    """The origin of round `r`'s i-th committed token (the glossary above)."""
    if i < r.n_accepted:
        return "accepted"
    if r.k == 0:
        return "target"
    return "bonus" if r.n_accepted == r.k else "corrected"


class OriginTracker:
    """Each round's token origins and the text each token adds, as a chunk's `speculation`.

    `observe` is `generate.stream`'s on_round; `record(ids)` is called with the chunk the stream
    then yields. The text per token comes from a second TextAssembler without stop strings, fed
    one token at a time: a token that ends inside a UTF-8 character adds "" and the one
    completing it adds the character, so the pieces concatenate to the completion's text (up to
    a stop string, where the streamed text is cut and the pieces are not).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._pieces = TextAssembler(decode)
        self._round: Round | None = None
        self._index = 0

    def observe(self, r: Round) -> None:
        self._round = r

    def record(self, ids: Sequence[int]) -> dict[str, Any]:
        """The `speculation` object of the chunk carrying this round's committed `ids`:
        {round, k, source, forced, accepted, tokens: [{id, text, origin, source (accepted
        ones)}]}."""
        r, self._round = self._round, None
        if r is None or r.n_emitted != len(ids):
            raise RuntimeError("a chunk without its round: stream's on_round was not heard")
        self._index += 1
        tokens = []
        for i, t in enumerate(ids):
            token = {"id": t, "text": self._pieces.push([t]), "origin": origin(r, i)}
            if i < r.n_accepted:
                token["source"] = FORCED if i < r.forced else r.source
            tokens.append(token)
        return {
            "round": self._index,
            "k": r.k,
            "source": r.source if r.k else None,
            "forced": r.forced,
            "accepted": r.n_accepted,
            "tokens": tokens,
        }
