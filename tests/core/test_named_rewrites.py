"""core.edits.named_rewrites: the edits an instruction names ("rename `a` to `b`"), found in
linear time. Its regexes once had unbounded repeats that a crafted instruction made rescan each
line from every backtick ("`a` (" x 8000: 0.5 s, quadratic); bounded, they must still find what
the unbounded ones found in any instruction whose names and gaps are within the bounds.
"""

from __future__ import annotations

import gc
import random
import re
import time
from collections.abc import Callable

import pytest

from specdec.core.edits import named_rewrites

#: The unbounded regexes: what it must find (on short text, where they are fast).
REFERENCE = tuple(
    re.compile(p)
    for p in (
        r"(?i)\brename\b[^`\n]{0,40}`([^`\n]+)`[^`\n]{0,40}?\b(?:to|into|as)\s+`([^`\n]+)`",
        r"`([^`\n]+)`\s*(?:\([^)\n]*\)\s*)?becomes\s+`([^`\n]+)`",
        r"(?i)\breplace\b[^`\n]{0,20}`([^`\n]+)`[^`\n]{0,20}?\bwith\s+`([^`\n]+)`",
        r"(?i)\bchange\b[^`\n]{0,20}`([^`\n]+)`\s+to\s+`([^`\n]+)`",
        r"(?i)\bfrom\s+`([^`\n]+)`\s+to\s+`([^`\n]+)`",
    )
)
FENCE = re.compile(r"```.*?```", re.DOTALL)


def reference(instruction: str) -> list[tuple[str, str]]:
    text = FENCE.sub("", instruction)
    found = sorted((m.start(), m[1], m[2]) for rx in REFERENCE for m in rx.finditer(text))
    return list(dict.fromkeys((old, new) for _, old, new in found if old != new))


@pytest.mark.parametrize(
    ("instruction", "pairs"),
    [
        ("rename `a` to `b`", [("a", "b")]),
        ("Rename the column `a` into `b`.", [("a", "b")]),
        ("`x` becomes `y`", [("x", "y")]),
        ("`x` (the counter) becomes `y`", [("x", "y")]),
        ("`a` (unclosed `b` becomes `c`", [("b", "c")]),
        ("replace `p` with `q`", [("p", "q")]),
        ("Replace every `p` call with `q`", [("p", "q")]),
        ("change `m` to `n`", [("m", "n")]),
        ("from `u` to `v`", [("u", "v")]),
        ("upgrade from\n`1.4` to `1.5`", [("1.4", "1.5")]),
        ("rename `a` to `a`", []),  # no edit
        ("renamed `a` to `b`", []),  # \b: not the word
        ("rename `a` then use it, and later on think of `b`", []),  # no "to"
        ("change `m` into `n`", []),  # "change" takes "to" only
        ("`x` Becomes `y`", []),  # "becomes" is case-sensitive
        ("rename\n`a` to `b`", []),  # the name must be on the keyword's line
        ("rename `a` to `b` and `c` becomes `d`; rename `a` to `b`", [("a", "b"), ("c", "d")]),
        ("```\nrename `a` to `b`\n```\nfrom `u` to `v`", [("u", "v")]),  # not in code
    ],
)
def test_the_named_forms(instruction: str, pairs: list[tuple[str, str]]) -> None:
    assert named_rewrites(instruction) == pairs == reference(instruction)


KEYWORDS = ("rename", "Rename the", "RENAME", "replace", "change", "from", "", "renamed", "_from")
WORDS = ("to", "TO", "into", "İnto", "as", "aſ", "with", "becomes", "Becomes", "xto", "to_", "")
NAMES = ("`a`", "`b`", "`c d`", "`é`", "``", "`\n`", "`", "``a`")
GAPS = ("", " ", " ", " ", "  ", "\t", "\n", " \n ", "\r ", " (see `z`) ", " (p) ", " (\n) ", " x ")
FAR = ("y" * 19 + " ", "y" * 39 + " ", "y" * 41 + " ", "```", "\n```\n", "(", ")", "_", "-")


def _attempt(rng: random.Random) -> str:
    """Keyword, gap, name, gap, word, gap, name: a near miss, or a match."""
    gap = lambda: rng.choice(GAPS if rng.random() < 0.9 else FAR)  # noqa: E731
    parts = (rng.choice(KEYWORDS), gap(), rng.choice(NAMES), gap(), rng.choice(WORDS), gap())
    return "".join(parts) + rng.choice(NAMES) + gap()


def test_it_finds_what_the_regexes_found() -> None:
    """Random instructions from the regexes' own parts, and edge characters: a case fold (İ,
    ſ), \\b next to a non-ASCII letter or "_", newlines, lone and fenced backticks, asides."""
    rng = random.Random(0)
    named = 0
    for _ in range(20000):
        text = "".join(_attempt(rng) for _ in range(rng.randint(1, 3)))
        want = reference(text)
        assert named_rewrites(text) == want, repr(text)
        named += bool(want)
    assert named > 500  # the draw names edits often enough to check the matching


def _growth(make: Callable[[int], str]) -> float:
    """How much longer named_rewrites takes on make(4n) than on make(n), for an n where make(n)
    takes >= 10 ms (the timer's noise small beside it). This thread's CPU time, not the wall
    clock's (which other processes' load stretches); the best of 5 runs each, small and large
    in turn; without the garbage collector (its passes grow with the heap, not with the work)."""

    def once(text: str) -> float:
        t0 = time.thread_time()
        named_rewrites(text)
        return time.thread_time() - t0

    gc.disable()
    try:
        n = 1000
        while min(once(make(n)) for _ in range(2)) < 0.01 and n < 256_000:
            n *= 2
        small, large = make(n), make(4 * n)
        t_small = t_large = float("inf")
        for _ in range(5):
            t_small, t_large = min(t_small, once(small)), min(t_large, once(large))
    finally:
        gc.enable()
    return t_large / t_small


#: Instructions crafted against each form: a regex tried at each backtick (or keyword) that
#: reads on to the line's end, or to a far stop, does n x n work on these.
CRAFTED: dict[str, Callable[[int], str]] = {
    "rename, names": lambda n: "rename " + "`a` " * n,
    "rename, unclosed": lambda n: "rename `" * n,
    "rename, long gap": lambda n: "rename `a`" + " to" * n + " `b`",
    "rename, matches": lambda n: "rename `a` to `b` " * n,
    "becomes, asides": lambda n: "`a` (" * n,
    "becomes, one stop": lambda n: "`a` (" * n + ")" + " " * n + "becomes",
    "becomes, chain": lambda n: "`a` becomes " * n,
    "replace": lambda n: "replace `a` " * n,
    "change, spaces": lambda n: "change `a`" + " " * n + "to",
    "from, keywords": lambda n: "from " * n + "`a`",
    "from, lines": lambda n: ("from" + " \n" * n + "`a`") * 2,
    "backticks": lambda n: "`" * n,
    "fence": lambda n: "```" + "a`" * n,
}


@pytest.mark.parametrize("shape", list(CRAFTED))
def test_crafted_instructions_take_linear_time(shape: str) -> None:
    """4x the text takes about 4x the time: < 6x (16x if quadratic). Noise (a cache another
    process emptied) stretches one run of a pair, a quadratic scan every measure: the lowest
    of up to 3 measures counts."""
    growth = [_growth(CRAFTED[shape])]
    while growth[-1] >= 6 and len(growth) < 3:
        growth.append(_growth(CRAFTED[shape]))
    assert min(growth) < 6, (shape, growth)
