"""The prediction drafter: drafts from a prediction of the output (OpenAI's Predicted Outputs;
Cursor's speculative edits), typically the file an edit will re-emit, kept aligned with the
output as it departs from the prediction and comes back (its rewrites: core.edits).

A drafter like the others (core.drafters says the protocol's rules): no model, so q = None, and
what it drafts depends on the context only, so the output distribution is the target's at every
temperature.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import torch

from specdec.core.edits import Rewrite, Rewrites
from specdec.core.protocols import Proposal


class PredictionIndex:
    """A request's prediction, the one value every layer passes: its token ids, checked against
    the vocabulary once, here (`vocab`; None: the caller checked them), its `hints` (rewrites
    known before the output starts, (old ids, new ids) pairs, e.g. the instruction's "rename X
    to Y", core.edits: drafted from the start and forgotten like learned ones if they fail), and
    its n-gram index for PredictionDrafter (n-gram -> sorted end positions, the index after the
    n-gram). The index costs O(len x n_max) time and memory, so it is built on demand (`build`,
    or the first read of `ends`): a server builds it before the request takes the engine."""

    def __init__(
        self,
        prediction: list[int],
        n_max: int = 8,
        hints: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
        vocab: int | None = None,
    ) -> None:
        self.tokens = list(prediction)
        self.vocab: int | None = None
        self.n_max = n_max
        self.hints = [(tuple(o), tuple(n)) for o, n in hints]
        self._ends: dict[tuple[int, ...], list[int]] | None = None
        if vocab is not None:
            self.check(vocab)

    def check(self, vocab: int) -> PredictionIndex:
        """Self, its ids checked to lie in [0, vocab) (ValueError naming the first that does
        not): the one check of a prediction's ids. An index checked against this vocabulary or
        a narrower one is not read again."""
        if self.vocab is None or self.vocab > vocab:
            bad = next((t for t in self.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"prediction token id {bad} is outside the vocabulary [0, {vocab})"
                )
            self.vocab = vocab
        return self

    def with_hints(self, hints: Sequence[tuple[Sequence[int], Sequence[int]]]) -> PredictionIndex:
        """The same prediction (not checked again) with these hints."""
        out = PredictionIndex(self.tokens, self.n_max, hints)
        out.vocab, out._ends = self.vocab, self._ends
        return out

    @property
    def built(self) -> bool:
        return self._ends is not None

    @property
    def ends(self) -> dict[tuple[int, ...], list[int]]:
        """The n-gram index (`build`s it on first use)."""
        return self.build()._ends  # type: ignore[return-value]

    def build(self) -> PredictionIndex:
        """Build the n-gram index unless it is built; returns self."""
        if self._ends is None:
            ends: dict[tuple[int, ...], list[int]] = {}
            for end in range(1, len(self.tokens) + 1):
                for n in range(1, min(self.n_max, end) + 1):
                    ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
            self._ends = ends
        return self


class _Cursor(NamedTuple):
    """Where the output stands in the prediction with its rewrites applied."""

    pos: int  # prediction index of the next token to copy
    pending: tuple[int, ...] = ()  # tokens of a rewrite still to come before pred[pos]
    rule: Rewrite | None = None  # the rewrite `pending` comes from
    inserted: bool = False  # an insertion at pos was made already (make it once)


class _Token(NamedTuple):
    """One token of the prediction as drafted: the cursor after it, and the rewrite that made
    it (None: copied), `done` when it is that rewrite's last token."""

    id: int
    after: _Cursor
    rule: Rewrite | None
    done: bool


class PredictionDrafter:
    """Drafts from a prediction of the output (OpenAI's Predicted Outputs; Cursor's speculative
    edits): typically the file an edit will re-emit. No model: q = None, exact at any temperature.

    The drafter keeps the output aligned with the prediction: a cursor at the prediction's next
    expected token. While the output follows the prediction, the cursor advances with it and
    the drafts are the prediction's continuation. After a divergence (the edit), it re-aligns
    on the output's latest n-gram (n = N_MAX down to 1) found in the prediction, preferring the
    nearest occurrence at or after the last aligned position (an edit rarely moves backwards);
    n < MIN_BACKWARD matches are accepted only forward and nearby, since a short n-gram recurs
    all over a file. Before any alignment (the answer's preamble, e.g. an opening code fence),
    the prediction's start is proposed, as source "prediction-start", so the K policy judges
    those guesses apart from aligned drafts; where the prompt does not quote the prediction,
    only until one guess is rejected outright (a wrong prediction's start, proposed every
    round, would keep prompt lookup from drafting).

    Edits are learned (core.edits): the span between the departure and the re-alignment, and
    what the output wrote there, becomes a rewrite once the output has followed the prediction
    again for COPY_RUN tokens; drafts and the alignment read the prediction with its rewrites
    applied (`learn=False`: the plain prediction, as before).

    prediction  token ids, tokenized alone with the target's tokenizer (or their
                PredictionIndex, built beforehand, which may carry rewrite hints)
    start       where the output begins in the context (the prompt's length)
    """

    N_MAX = 8
    MIN_BACKWARD = 3  # shortest n-gram trusted to re-align backwards or far ahead
    NEAR = 64  # "nearby" for short n-grams, in tokens
    START_WINDOW = 32  # output tokens during which the prediction's start is proposed
    COPY_RUN = 4  # tokens followed since the last re-alignment that make a copy "under way"
    LEAD = 3  # prompt tokens before the quoted prediction that announce its start
    #: The regimes the K policy judges apart: (least matched tokens, source name)
    REGIMES = ((4, "prediction"), (0, "prediction-realigned"))

    model = None

    def __init__(
        self, prediction: list[int] | PredictionIndex, start: int, learn: bool = True
    ) -> None:
        index = prediction if isinstance(prediction, PredictionIndex) else None
        if index is None or index.n_max < self.N_MAX:
            tokens = list(prediction.tokens if index else prediction)
            index = PredictionIndex(tokens, self.N_MAX, index.hints if index else ())
        self.prediction = index.tokens
        self.start = start
        self.learn = learn
        self.rewrites = Rewrites(index.hints if learn else ())
        self._index = index.ends  # n-gram -> sorted end positions in the prediction
        self._lead: list[int] | None = None  # what precedes the prediction in the prompt
        # drafted tokens that a rewrite wrote (verified), and those accepted: how much the
        # learned edits drafted (a metrics hook; the K policy sees them as the regime's tokens)
        self.rewrite_drafted = self.rewrite_accepted = 0
        self._reset()

    def _reset(self) -> None:
        self._seen = 0  # output tokens accounted for by the alignment
        self._cur: _Cursor | None = None  # None: not aligned
        self._last = 0  # the last aligned prediction index, for "prefer forward"
        self._aligned_once = False
        self._run = 0  # output tokens that followed the prediction since the last re-alignment
        self._start_missed = False  # a guess of the start was rejected at its first token
        self._realigned_n = 0  # the n-gram length of the last re-alignment
        self._departed: tuple[int, int] | None = None  # (prediction index, output index)
        self._candidate: tuple[int, int, list[int]] | None = None  # the edit, unconfirmed
        self._proposed: tuple[list[_Token], int] | None = None  # (draft, output length)

    # ------------------------------------------------------------------ the prediction, rewritten
    def _virtual(self, cur: _Cursor, n: int) -> list[_Token]:
        """Up to n tokens of the prediction from `cur`, with the rewrites applied."""
        pred, out = self.prediction, []
        pos, pending, rule, inserted = cur
        deleted: Rewrite | None = None  # a deletion is done when the token after it is
        while len(out) < n:
            if pending:
                tok, pending = pending[0], pending[1:]
                out.append(
                    _Token(
                        tok,
                        _Cursor(pos, pending, rule if pending else None, inserted),
                        rule,
                        not pending,
                    )
                )
                continue
            r = self.rewrites.match(pred, pos, inserted) if len(self.rewrites) else None
            if r is not None:
                pos, inserted = (pos, True) if not r.old else (pos + len(r.old), False)
                if r.new:
                    pending, rule = r.new, r
                else:
                    deleted = r
                continue
            if pos >= len(pred):
                break
            out.append(_Token(pred[pos], _Cursor(pos + 1), deleted, deleted is not None))
            pos, inserted, deleted = pos + 1, False, None
        return out

    def _credit(self, toks: Sequence[_Token]) -> None:
        """The output followed these tokens: rewrites it followed to their end are confirmed."""
        for t in toks:
            if t.rule is not None and t.done:
                self.rewrites.confirm(t.rule)

    def _follow(self, new: list[int]) -> int:
        """Advance the cursor over the output's new tokens while they follow the prediction;
        how many did. A rewrite the output did not follow where it applied is missed."""
        assert self._cur is not None
        v = self._virtual(self._cur, len(new))
        j = 0
        while j < len(v) and v[j].id == new[j]:
            j += 1
        self._credit(v[:j])
        if j:
            self._cur = v[j - 1].after
        if j < len(new) and j < len(v) and v[j].rule is not None:
            self.rewrites.miss(v[j].rule)
        return j

    # ------------------------------------------------------------------ alignment
    def _align(self, out: list[int]) -> None:
        """Advance or re-establish the alignment for the output tokens seen since last call."""
        if len(out) < self._seen:  # a different, shorter sequence: start over
            self._reset()
        new = out[self._seen :]
        if self._cur is not None and new:
            j = self._follow(new)
            self._run += j
            if j < len(new):
                # The edit starts here, unless this alignment was an unconfirmed guess made
                # after an earlier departure: then it started there (kept in _departed).
                fresh = self._confirmed() or self._departed is None
                if self.learn and fresh and not self._cur.pending:
                    self._departed = (self._cur.pos, self._seen + j)
                self._realign_to(out)
        elif new:
            self._realign_to(out)
        self._seen = len(out)
        self._aligned_once = self._aligned_once or self._cur is not None
        self._settle()

    def _confirmed(self) -> bool:
        """Has the output followed the alignment for COPY_RUN tokens (the n-gram it re-aligned
        on counted)? A re-alignment on one common token is often wrong (a later occurrence
        of it): until confirmed, it neither moves the anchor of "prefer forward" nor teaches
        an edit, so the right re-alignment is still found behind it."""
        return self._cur is not None and self._realigned_n + self._run >= self.COPY_RUN

    def _realign_to(self, out: list[int]) -> None:
        found = self._realign(out)
        self._run, self._candidate = 0, None
        if found is None:
            self._cur = None
            return
        end, n = found
        self._cur, self._realigned_n = _Cursor(end), n
        if self._departed is not None:
            pos, at = self._departed
            if end - n >= pos and len(out) - n >= at:  # forward: the edit replaced pred[pos:]
                self._candidate = (pos, end - n, out[at : len(out) - n])

    def _settle(self) -> None:
        """Once the alignment is confirmed: learn the edit that led to it, and anchor there."""
        if not self._confirmed():
            return
        assert self._cur is not None
        if self._candidate is not None:
            self.rewrites.learn(self.prediction, *self._candidate)
        self._candidate = self._departed = None
        self._last = self._cur.pos

    def _realign(self, out: list[int]) -> tuple[int, int] | None:
        """(end position in the prediction, n) of the output's latest n-gram found in it."""
        # Before the first alignment a short n-gram (a newline after the opening fence) would
        # align mid-file; the prediction's start is the better guess there.
        shortest = 1 if self._aligned_once else self.MIN_BACKWARD
        for n in range(min(self.N_MAX, len(out)), shortest - 1, -1):
            ends = self._index.get(tuple(out[-n:]))
            if not ends:
                continue
            i = bisect.bisect_left(ends, self._last)
            if i < len(ends) and (n >= self.MIN_BACKWARD or ends[i] - self._last <= self.NEAR):
                return ends[i], n  # nearest at or after the last aligned position
            if n >= self.MIN_BACKWARD:
                return ends[i - 1], n  # only behind it: the edit re-emits an earlier part
        return None

    # ------------------------------------------------------------------ the drafter protocol
    def _draft_from(self, context: list[int]) -> tuple[str, _Cursor] | None:
        out = context[self.start :]
        self._align(out)
        cur = self._cur
        if cur is not None:
            if cur.pos >= len(self.prediction) and not cur.pending:
                return None
            # Two regimes, judged apart by the K policy: a copy under way (the output matches
            # the prediction over its last COPY_RUN tokens, the re-alignment's n-gram counted:
            # drafts run to the next edit) and a fresh re-alignment after an edit on a shorter
            # match, where the next tokens are often still the edit, so its drafts fail far
            # more often.
            m = self._realigned_n + self._run
            return next(name for least, name in self.REGIMES if m >= least), cur
        if not self._aligned_once and len(out) < self.START_WINDOW and self._at_start(context):
            return "prediction-start", _Cursor(0)
        return None

    def _at_start(self, context: list[int]) -> bool:
        """Is the prediction's start the likely next text? When the prompt quotes the
        prediction (an edit request holding the file), the answer opens with it or the way
        the prompt does (a code fence): the start is proposed first, then right after the
        output wrote the LEAD tokens that precede it in the prompt, not at every token of
        the preamble (each of those guesses was rejected, and they taught the K policy to
        stop trying). Else, at every position of the window until a guess is rejected outright."""
        if self._lead is None:
            self._lead = _lead_in(context[: self.start], self.prediction, self.LEAD)
        out = context[self.start :]
        if not self._lead:  # not quoted: guess at every position until a guess is rejected
            return bool(self.prediction) and not self._start_missed
        if not out:
            return bool(self.prediction)
        j = min(len(self._lead), len(out))
        return out[-j:] == self._lead[-j:]

    def source(self, context: list[int]) -> str | None:
        m = self._draft_from(context)
        return None if m is None else m[0]

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self._draft_from(context)
        draft = [] if m is None else self._virtual(m[1], k)
        self._proposed = None if m is None else (draft, len(context) - self.start)
        return Proposal(torch.tensor([t.id for t in draft], dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        """The accepted drafts were the prediction's tokens from the proposed cursor: the
        output is aligned just past them (the recovered or bonus token is checked at the next
        call, where a rewrite it departs from is missed)."""
        if self._proposed is not None:
            rewritten = [t.rule is not None for t in self._proposed[0]]
            self.rewrite_drafted += sum(rewritten)
            self.rewrite_accepted += sum(rewritten[:n_accepted])
        if self._proposed is not None and n_accepted == 0 and not self._aligned_once:
            self._start_missed = True  # the start is not the next text (_at_start)
        if self._proposed is not None and n_accepted > 0:
            draft, n_out = self._proposed
            self._credit(draft[:n_accepted])
            self._cur, self._seen = draft[n_accepted - 1].after, n_out + n_accepted
            self._aligned_once = True
            self._run += n_accepted
            self._settle()
        self._proposed = None


def _lead_in(prompt: list[int], prediction: list[int], n: int, probe: int = 8) -> list[int]:
    """The n prompt tokens before the first place the prompt quotes the prediction's first
    `probe` tokens; [] when it does not quote them (or nothing precedes them)."""
    head = prediction[:probe]
    if not head:
        return []
    for i in range(len(prompt) - len(head) + 1):
        if prompt[i] == head[0] and prompt[i : i + len(head)] == head:
            return prompt[max(0, i - n) : i]
    return []
