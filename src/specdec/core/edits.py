"""Rewrites a prediction has learned: the edits an output makes to the text it re-emits.

When an output departs from its prediction and comes back to it, the prediction's span it
skipped (`old`) and what it wrote instead (`new`) are a rewrite. Edits repeat (a rename changes
every occurrence; a new parameter goes into every signature; a call style changes at every
call), so the prediction drafter drafts the prediction *with its rewrites applied* ahead of the
cursor: after the output has written `Stock` where the file says `Inventory` once, the next
`Inventory` is drafted as `Stock`.

Token ids only (no tokenizer: an identifier tokenized in two contexts is two rewrites, each
learned on its first occurrence). Several rewrites are kept at once (at most MAX_RULES), each
with a score: +1 each time the output follows it to its end, -1 each time the output writes
something else where it applied; a rewrite at score 0 is forgotten, so one that stops matching
costs one rejected draft, not one per occurrence. A replacement or a deletion applies wherever
its `old` span occurs; an insertion (empty `old`) only between the prediction tokens it was
learned between (`before` and `after`), since an empty span occurs everywhere.

None of this can change the output's distribution: rewrites shape what is drafted, which the
target then verifies (core.drafters' protocol: drafts that depend on the context only).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

#: Longest spans learned: an edit replacing more than this is a rewritten block, not a pattern
#: that repeats.
MAX_OLD, MAX_NEW = 24, 32
#: Rewrites kept at once; the lowest-scored (then the oldest) is evicted for a new one.
MAX_RULES = 64
#: Prediction tokens on each side that anchor an insertion: two before, one after.
INSERT_BEFORE, INSERT_AFTER = 2, 1


@dataclass(eq=False)
class Rewrite:
    """Where the prediction has `old` (between `before` and `after`, for an insertion), the
    output writes `new`."""

    old: tuple[int, ...]
    new: tuple[int, ...]
    before: tuple[int, ...] = ()  # insertions only: the prediction tokens just before
    after: tuple[int, ...] = ()  # and just after
    score: int = 1
    hint: bool = False  # given (e.g. named by the instruction), not learned from the output

    def matches(self, pred: Sequence[int], pos: int) -> bool:
        """Does this rewrite apply at prediction index `pos`?"""
        if self.old:
            return tuple(pred[pos : pos + len(self.old)]) == self.old
        b, a = self.before, self.after
        return (
            pos >= len(b)
            and tuple(pred[pos - len(b) : pos]) == b
            and tuple(pred[pos : pos + len(a)]) == a
        )


class Rewrites:
    """The rewrites of one prediction, indexed by the prediction token each starts at."""

    def __init__(self, hints: Sequence[tuple[Sequence[int], Sequence[int]]] = ()) -> None:
        self._rules: list[Rewrite] = []
        self._by_first: dict[int, list[Rewrite]] = {}  # old[0] (after[0] for an insertion)
        for old, new in hints:
            if old and tuple(old) != tuple(new):
                self._add(Rewrite(tuple(old), tuple(new), hint=True))

    def __len__(self) -> int:
        return len(self._rules)

    def __iter__(self) -> Iterator[Rewrite]:
        return iter(self._rules)

    def learn(
        self, pred: Sequence[int], start: int, end: int, new: Sequence[int]
    ) -> Rewrite | None:
        """The output wrote `new` where the prediction has pred[start:end]: keep that rewrite,
        its common prefix and suffix trimmed (None when nothing is left, or a span is longer
        than MAX_OLD / MAX_NEW). It replaces a rewrite of the same `old` (and anchors)."""
        old, new = list(pred[start:end]), list(new)
        while old and new and old[0] == new[0]:
            old, new, start = old[1:], new[1:], start + 1
        while old and new and old[-1] == new[-1]:
            old, new, end = old[:-1], new[:-1], end - 1
        if (not old and not new) or len(old) > MAX_OLD or len(new) > MAX_NEW:
            return None
        before = tuple(pred[max(0, start - INSERT_BEFORE) : start]) if not old else ()
        after = tuple(pred[end : end + INSERT_AFTER]) if not old else ()
        if not old and (len(before) < INSERT_BEFORE or len(after) < INSERT_AFTER):
            return None  # an insertion at the file's edge: nothing to anchor it
        rule = Rewrite(tuple(old), tuple(new), before, after)
        for r in self._rules:
            if (r.old, r.before, r.after) == (rule.old, rule.before, rule.after):
                self._remove(r)
        self._add(rule)
        return rule

    def match(self, pred: Sequence[int], pos: int, inserted: bool) -> Rewrite | None:
        """The rewrite that applies at `pos`: an insertion first (unless one was just made
        there), else the replacement with the longest `old`."""
        if pos >= len(pred):
            return None
        best = None
        for r in self._by_first.get(pred[pos], ()):
            if not r.old and not inserted and r.matches(pred, pos):
                return r
            if r.old and r.matches(pred, pos) and (best is None or len(r.old) > len(best.old)):
                best = r
        return best

    def confirm(self, rule: Rewrite) -> None:
        """The output followed `rule` to its end."""
        rule.score += 1

    def miss(self, rule: Rewrite) -> None:
        """The output wrote something else where `rule` applied: at score 0 it is forgotten."""
        rule.score -= 1
        if rule.score <= 0 and rule in self._rules:
            self._remove(rule)

    def _add(self, rule: Rewrite) -> None:
        if len(self._rules) >= MAX_RULES:  # the lowest score goes; on ties, the oldest
            self._remove(min(self._rules, key=lambda r: r.score))
        self._rules.append(rule)
        key = rule.old[0] if rule.old else rule.after[0]
        self._by_first.setdefault(key, []).append(rule)

    def _remove(self, rule: Rewrite) -> None:
        self._rules.remove(rule)
        key = rule.old[0] if rule.old else rule.after[0]
        self._by_first[key].remove(rule)


#: How instructions name an edit: "rename (the column) `X` to `Y`", "`X` becomes `Y`", "replace
#: (every) `X` (calls) with `Y`", "change `X` to `Y`", "from `X` to `Y`" (backticks required:
#: prose words are too loose to rewrite a file with). Every repeat is bounded, a name by NAME_MAX
#: characters, an aside or a run of spaces by GAP_MAX: an instruction is a client's text, and an
#: unbounded repeat let a match tried at each backtick read on to the line's end ("`a` (" x 8000
#: took 0.5 s, 16x that for 4x the text); bounded, each try reads a bounded span: linear time.
NAME_MAX, GAP_MAX = 200, 40
_N = rf"([^`\n]{{1,{NAME_MAX}}})"  # a name between backticks
_S = rf"\s{{1,{GAP_MAX}}}"
_ASIDE = rf"(?:\([^)\n]{{0,{NAME_MAX}}}\)\s{{0,{GAP_MAX}}})?"  # "`X` (the counter) becomes"
_NAMED = tuple(
    re.compile(p)
    for p in (
        rf"(?i)\brename\b[^`\n]{{0,40}}`{_N}`[^`\n]{{0,40}}?\b(?:to|into|as){_S}`{_N}`",
        rf"`{_N}`\s{{0,{GAP_MAX}}}{_ASIDE}becomes{_S}`{_N}`",
        rf"(?i)\breplace\b[^`\n]{{0,20}}`{_N}`[^`\n]{{0,20}}?\bwith{_S}`{_N}`",
        rf"(?i)\bchange\b[^`\n]{{0,20}}`{_N}`{_S}to{_S}`{_N}`",
        rf"(?i)\bfrom{_S}`{_N}`{_S}to{_S}`{_N}`",
    )
)
_FENCE = re.compile(r"```.*?```", re.DOTALL)


def named_rewrites(instruction: str) -> list[tuple[str, str]]:
    """The (old, new) text pairs an instruction names (_NAMED), outside its fenced code, in
    order of appearance, without repeats."""
    text = _FENCE.sub("", instruction)
    found = sorted((m.start(), m.group(1), m.group(2)) for rx in _NAMED for m in rx.finditer(text))
    return list(dict.fromkeys((old, new) for _, old, new in found if old != new))


def hint_ids(
    pairs: Sequence[tuple[str, str]], encode: Callable[[str], list[int]]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Token-id rewrites for named text pairs, as the prediction tokenizes them: each pair
    alone and after a space (a BPE tokenizer spells `X` and ` X` differently). `encode`: the
    target's tokenizer, text -> ids without special tokens."""
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for old, new in pairs:
        for lead in ("", " "):
            o, n = tuple(encode(lead + old)), tuple(encode(lead + new))
            if o and o != n:
                out[(o, n)] = None
    return list(out)
