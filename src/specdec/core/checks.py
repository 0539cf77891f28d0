"""The value checks every layer shares (the decoder's settings, the server's request fields, the
CLI's flags): one rule per kind of value, one message. Imports nothing of specdec, so any module
of the core may use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_int(
    what: str,
    value: Any,
    lo: int,
    hi: int | None = None,
    *,
    alternatives: str = "",
    error: Callable[[str], Exception] = ValueError,
) -> int:
    """`value` if it is an int in [lo, hi] (hi None: no upper bound); otherwise `error` (a
    ValueError unless the caller raises its own kind, e.g. an HTTP 400) with the message
    "WHAT must be [ALTERNATIVES or ]an integer in [LO, HI], got VALUE".

    The one integer rule of the package. A bool is refused although Python counts it an int:
    True given as a count is a mistake. `alternatives` names what else the caller accepts in the
    same place, having checked it first (e.g. "'auto', 'schedule'" for K). VALUE is cut short: a
    client's value may be as long as a request body."""
    if isinstance(value, int) and not isinstance(value, bool):
        if lo <= value and (hi is None or value <= hi):
            return value
    bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    either = f"{alternatives} or " if alternatives else ""
    raise error(f"{what} must be {either}an integer {bound}, got {shown(value)}")


def check_fraction(
    what: str, value: Any, *, low_open: bool = False, high_open: bool = False
) -> float | None:
    """`value` if it is None (off) or a number in [0, 1], an end left out where `low_open` /
    `high_open` say; otherwise ValueError "WHAT must be in [0, 1], got VALUE" with the interval
    written as checked. A bool is refused, as by check_int."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (0 < value if low_open else 0 <= value) and (value < 1 if high_open else value <= 1):
            return value
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    raise ValueError(f"{what} must be in {interval}, got {shown(value)}")


def shown(value: Any, quote: bool = True) -> str:
    """A value for an error message (its repr, or str without `quote`), at most 60 characters:
    a client's value may be anything up to the request body's cap."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
