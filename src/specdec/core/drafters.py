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

import bisect
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from specdec.core.config import Warp
from specdec.core.device import synchronize
from specdec.core.edits import Rewrite, Rewrites
from specdec.core.model import SpecModel
from specdec.core.protocols import Drafter, Proposal
from specdec.core.sampling import sample, warped

#: Uncached context tokens a draft model feeds in its first drafting pass, with the last one,
#: rather than in a prefill of their own: past a few rows a pass costs little more than one
#: (a memory-bound step), so after a fully accepted round (x_k and the bonus token uncached) the
#: catch-up is nearly free instead of a second step; longer suffixes, whose logits rows would
#: only be thrown away, are prefilled.
CATCHUP_IN_PASS = 8


def _synced_now(model: SpecModel) -> float:
    synchronize(model.device)
    return time.perf_counter()


class ModelDrafter:
    """A draft model: x_i ~ q(. | context + x[:i]), keeping every q_i (paper, Algorithm 1 line 1).

    Cache choreography: before proposing, the draft cache is cut back to the longest prefix it
    shares with `context` and extended with the uncached suffix; x_k is never fed back (no one
    needs q_{k+1}). `observe(a)` truncates the cache to context + x[:a], so after every round the
    draft cache holds a prefix of the committed sequence. A short suffix (after a fully accepted
    round: x_k and the bonus token) goes into the first drafting pass itself, one pass over its
    rows instead of one per token (CATCHUP_IN_PASS); a long one (the prompt) is prefilled first.

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
        adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.warp = warp
        self.generator = generator
        self.width = width  # shared sampling width V (core.pair.check_pair)
        self.p_min = p_min
        # the target's adjustments (core.processing.Processor.row): q adjusted as p will be
        self.adjust = adjust
        self._base = 0  # len(context) at the last propose
        # what times the catch-up: the generation's Clock.now (set by decode.Generation, so a
        # replay's modelled clock times it too); alone, wall time after the device syncs
        self.now: Callable[[], float] = lambda: _synced_now(model)

    def source(self, context: list[int]) -> str | None:
        return "model"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.model
        n = common_prefix(m.cached_tokens, context)
        if n == len(context):  # the model must see at least the last context token
            n -= 1
        m.truncate(n)
        uncached, catchup_s = context[n:], 0.0
        # Catching up on the prompt (or on many tokens committed without this drafter) is not a
        # per-drafted-token cost; the K controller learns the per-token cost without it. A few
        # tokens fed in the drafting pass are: a fully accepted round leaves two every time.
        if len(uncached) > CATCHUP_IN_PASS:  # e.g. the prompt: only the last logits are needed
            t0 = self.now()
            m.prefill(uncached[:-1])
            catchup_s, uncached = self.now() - t0, uncached[-1:]
        logits = m.extend(uncached)[-1]  # [V_model] next-token logits after the context
        self._base = len(context)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            row = logits[: self.width]  # [V]
            if self.adjust is not None:
                row = self.adjust(row, xs)
            if self.warp.greedy:
                if self.p_min is not None and float(torch.softmax(row, -1).max()) < self.p_min:
                    break
                xs.append(int(row.argmax()))
            else:
                q_i = warped(row, self.warp)  # [V]: x_i ~ q_i
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
#: trigram in prose. Why apart: pooled with the short matches, copy runs would not be drafted,
#: since prose rejections switch the pooled source off before the copy begins.
LOOKUP_BUCKETS = (8, 4)


def lookup_source(n: int) -> str:
    """The draft source of a prompt-lookup match of n tokens (bucketed: LOOKUP_BUCKETS)."""
    lo = next((b for b in LOOKUP_BUCKETS if n >= b), None)
    return f"lookup{n}" if lo is None else f"lookup{lo}+"


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

    def match(self, context: list[int]) -> tuple[int, int] | None:
        """(n, continuation start) of the longest suffix n-gram seen before, or None."""
        self._sync(context)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) > n:
                start = self._index.get(tuple(context[-n:]))
                if start is not None:
                    return n, start
        return None

    def source(self, context: list[int]) -> str | None:
        m = self.match(context)
        return None if m is None else lookup_source(m[0])

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.match(context)
        tokens = [] if m is None else context[m[1] : m[1] + k]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        pass


class PredictionIndex:
    """A prediction's token ids and its n-gram index (n-gram -> sorted end positions, the index
    after the n-gram), for PredictionDrafter. Building it costs O(len x n_max) time and memory,
    so a server builds it for a request before the request takes the engine. `hints`: rewrites
    known before the output starts ((old ids, new ids) pairs, e.g. the instruction's "rename X
    to Y", core.edits), drafted from the start and forgotten like learned ones if they fail."""

    def __init__(
        self,
        prediction: list[int],
        n_max: int = 8,
        hints: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    ) -> None:
        self.tokens = list(prediction)
        self.n_max = n_max
        self.hints = [(tuple(o), tuple(n)) for o, n in hints]
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.tokens) + 1):
            for n in range(1, min(n_max, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)


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


class CompositeDrafter:
    """The first of several drafters that has something to propose: e.g. the prediction, else
    prompt lookup, else the draft model. At most one of them may keep a draft model."""

    def __init__(self, *parts: Drafter) -> None:
        models = [d.model for d in parts if d.model is not None]
        if len(models) > 1:
            raise ValueError("a composite drafter may hold one draft model at most")
        self.parts = parts
        self.model = models[0] if models else None  # the cache the loop checks
        self._last: Drafter | None = None

    def _pick(self, context: list[int]) -> tuple[Drafter, str] | None:
        for d in self.parts:
            src = d.source(context)
            if src is not None:
                return d, src
        return None

    def source(self, context: list[int]) -> str | None:
        pick = self._pick(context)
        return None if pick is None else pick[1]

    def propose(self, context: list[int], k: int) -> Proposal:
        pick = self._pick(context)
        self._last = None if pick is None else pick[0]
        if self._last is None:
            return Proposal(torch.empty(0, dtype=torch.long), None)
        return self._last.propose(context, k)

    def observe(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(n_accepted)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    if len(a) <= len(b) and a == b[: len(a)]:  # the usual case after observe(): one C compare
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
