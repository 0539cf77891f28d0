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
from typing import NamedTuple, Protocol

import torch

from specdec.core.config import Warp
from specdec.core.device import synchronize
from specdec.core.model import SpecModel
from specdec.core.sampling import sample


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


class ModelDrafter:
    """A draft model: x_i ~ q(. | context + x[:i]), keeping every q_i (paper, Algorithm 1 line 1).

    Cache choreography: before proposing, the draft cache is cut back to the longest prefix it
    shares with `context` and extended with the uncached suffix; x_k is never fed back (no one
    needs q_{k+1}). `observe(a)` truncates the cache to context + x[:a], so after every round the
    draft cache holds a prefix of the committed sequence.

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
    ) -> None:
        self.model = model
        self.warp = warp
        self.generator = generator
        self.width = width  # shared sampling width V (see tokenizer.check_pair)
        self.p_min = p_min
        self._base = 0  # len(context) at the last propose

    def source(self, context: list[int]) -> str | None:
        return "model"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self.model
        n = common_prefix(m.cached_tokens, context)
        if n == len(context):  # the model must see at least the last context token
            n -= 1
        m.truncate(n)
        t0 = time.perf_counter()
        if len(context) - n > 1:  # e.g. the prompt: only the last position's logits are needed
            m.prefill(context[n:-1])
            synchronize(m.device)
        # Catching up on the prompt (or on tokens committed without this drafter) is not a
        # per-drafted-token cost; the K controller learns the per-token cost without it.
        catchup_s = time.perf_counter() - t0
        logits = m.extend(context[-1:])[-1]  # [V_model] next-token logits after the context
        self._base = len(context)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            row = logits[: self.width]  # [V]
            if self.warp.greedy:
                if self.p_min is not None and float(torch.softmax(row, -1).max()) < self.p_min:
                    break
                xs.append(int(row.argmax()))
            else:
                q_i = self.warp.probs(row)  # [V] exactly the distribution x_i is drawn from
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
#: trigram in prose. Pooled with the short matches, copy runs were never drafted: prose
#: rejections had switched "lookup3" off before the copy began (simulated on 37 greedy outputs
#: of the 1.5B: the fix-the-bug prompt p009 went from 0.996x to 1.21x).
LOOKUP_BUCKETS = (8, 4)


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

    def _match(self, context: list[int]) -> tuple[int, int] | None:
        """(n, continuation start) of the longest suffix n-gram seen before, or None."""
        self._sync(context)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) > n:
                start = self._index.get(tuple(context[-n:]))
                if start is not None:
                    return n, start
        return None

    def source(self, context: list[int]) -> str | None:
        m = self._match(context)
        if m is None:
            return None
        n = m[0]
        lo = next((b for b in LOOKUP_BUCKETS if n >= b), None)
        return f"lookup{n}" if lo is None else f"lookup{lo}+"

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self._match(context)
        tokens = [] if m is None else context[m[1] : m[1] + k]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        pass


class PredictionIndex:
    """A prediction's token ids and its n-gram index (n-gram -> sorted end positions, the index
    after the n-gram), for PredictionDrafter. Building it costs O(len x n_max) time and memory,
    so a server builds it for a request before the request takes the engine."""

    def __init__(self, prediction: list[int], n_max: int = 8) -> None:
        self.tokens = list(prediction)
        self.n_max = n_max
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.tokens) + 1):
            for n in range(1, min(n_max, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)


class PredictionDrafter:
    """Drafts from a prediction of the output (OpenAI's Predicted Outputs; Cursor's speculative
    edits): typically the file an edit will re-emit. No model: q = None, exact at any temperature.

    The drafter keeps the output aligned with the prediction: `_pos` is the index in the
    prediction of the token expected next. While the output follows the prediction, the
    alignment advances with it and the drafts are the prediction's continuation. After a
    divergence (the edit), it re-aligns on the output's latest n-gram (n = N_MAX down to 1) found
    in the prediction, preferring the nearest occurrence at or after the last aligned position (an
    edit rarely moves backwards); n < MIN_BACKWARD matches are accepted only forward and nearby,
    since a short n-gram recurs all over a file. Before any alignment (the answer's preamble,
    e.g. an opening code fence), the prediction's start is proposed, as source
    "prediction-start", so the K policy judges those guesses apart from aligned drafts.

    prediction  token ids, tokenized alone with the target's tokenizer (or their
                PredictionIndex, built beforehand)
    start       where the output begins in the context (the prompt's length)
    """

    N_MAX = 8
    MIN_BACKWARD = 3  # shortest n-gram trusted to re-align backwards or far ahead
    NEAR = 64  # "nearby" for short n-grams, in tokens
    START_WINDOW = 32  # output tokens during which the prediction's start is proposed
    COPY_RUN = 4  # tokens followed since the last re-alignment that make a copy "under way"

    model = None

    def __init__(self, prediction: list[int] | PredictionIndex, start: int) -> None:
        index = prediction if isinstance(prediction, PredictionIndex) else None
        if index is None or index.n_max < self.N_MAX:
            index = PredictionIndex(list(prediction.tokens if index else prediction), self.N_MAX)
        self.prediction = index.tokens
        self.start = start
        self._index = index.ends  # n-gram -> sorted end positions in the prediction
        self._seen = 0  # output tokens accounted for by the alignment
        self._pos: int | None = None  # next expected prediction index; None: not aligned
        self._last = 0  # the last aligned position, for "prefer forward"
        self._aligned_once = False
        self._run = 0  # output tokens that followed the prediction since the last re-alignment
        self._proposed: tuple[int, int] | None = None  # (prediction index, output length)

    def _align(self, out: list[int]) -> None:
        """Advance or re-establish the alignment for the output tokens seen since last call."""
        if len(out) < self._seen:  # a different, shorter sequence: start over
            self._seen, self._pos, self._last, self._aligned_once = 0, None, 0, False
            self._run = 0
        new = out[self._seen :]
        pred = self.prediction
        if self._pos is not None and pred[self._pos : self._pos + len(new)] == new:
            self._pos += len(new)
            self._run += len(new)
        elif new:
            self._pos = self._realign(out)
            self._run = 0
        self._seen = len(out)
        if self._pos is not None:
            self._last, self._aligned_once = self._pos, True

    def _realign(self, out: list[int]) -> int | None:
        # Before the first alignment a short n-gram (a newline after the opening fence) would
        # align mid-file; the prediction's start is the better guess there.
        shortest = 1 if self._aligned_once else self.MIN_BACKWARD
        for n in range(min(self.N_MAX, len(out)), shortest - 1, -1):
            ends = self._index.get(tuple(out[-n:]))
            if not ends:
                continue
            i = bisect.bisect_left(ends, self._last)
            if i < len(ends) and (n >= self.MIN_BACKWARD or ends[i] - self._last <= self.NEAR):
                return ends[i]  # nearest at or after the last aligned position
            if n >= self.MIN_BACKWARD:
                return ends[i - 1]  # only behind it: the edit re-emits an earlier part
        return None

    def _draft_from(self, context: list[int]) -> tuple[str, int] | None:
        out = context[self.start :]
        self._align(out)
        if self._pos is not None:
            if self._pos >= len(self.prediction):
                return None
            # Two regimes, judged apart by the K policy: a copy under way (the output has
            # followed the prediction for COPY_RUN tokens: drafts run to the next edit) and a
            # fresh re-alignment after an edit, where the next tokens are often still the edit.
            return ("prediction" if self._run >= self.COPY_RUN else "prediction-realigned"), (
                self._pos
            )
        if not self._aligned_once and len(out) < self.START_WINDOW and self.prediction:
            return "prediction-start", 0
        return None

    def source(self, context: list[int]) -> str | None:
        m = self._draft_from(context)
        return None if m is None else m[0]

    def propose(self, context: list[int], k: int) -> Proposal:
        m = self._draft_from(context)
        tokens = [] if m is None else self.prediction[m[1] : m[1] + k]
        self._proposed = None if m is None else (m[1], len(context) - self.start)
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        """The accepted drafts were the prediction's tokens from the proposed index: the output
        is aligned just past them (the recovered or bonus token is checked at the next call)."""
        if self._proposed is not None and n_accepted > 0:
            at, n_out = self._proposed
            self._pos, self._seen = at + n_accepted, n_out + n_accepted
            self._last, self._aligned_once = self._pos, True
            self._run += n_accepted
        self._proposed = None


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
