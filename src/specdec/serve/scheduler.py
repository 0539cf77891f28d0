"""The serving engine's decisions, as pure functions of what the engine shows them.

Each cycle the worker (serve.engine) admits what the free slots take, runs one round of every
request whose prompt is in (one joint target pass: decode.rounds_together, each request its own
K), then spends the cycle's prefill budget on the prompts still going in. This module decides:

    busy_tenants    whose next request must wait: API keys running their --max-running-per-key
    place           which free slot a request takes, and whether it keeps the slot's cached KV
    plan_prefill    how many prompt tokens each newcomer prefills this cycle

The prefill budget is one for the cycle, whatever the number of newcomers, and it is priced in
time: a cycle's prefill may cost what its round cost (PREFILL_SHARE), on the prefill passes the
engine measured (`PassCosts`), so a running stream waits about two rounds a cycle however many
prompts arrive; and at least the tokens that keep a prompt token within PREFILL_WASTE of its
cheapest cost, so a prompt always moves (beside a round cheaper than those tokens, the wait is
that round and those tokens). First come first served:
the oldest newcomer starts first, and while streams run it goes alone (one pass). Nothing
decoding, nobody waits: a full PREFILL_CHUNK. Why not a token budget (vLLM's
max_num_batched_tokens): on a CPU a verify row and a prompt token cost about the same, and a
pass over B tokens costs B of them; a budget that bounds the stall of a one-row stream would
starve prompts beside a long draft, and one that suits a long draft would stall a one-row
stream tenfold.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from specdec.core.cost import VerifyCurve
from specdec.core.decode import PREFILL_CHUNK
from specdec.core.drafters import common_prefix

#: A cycle's prefill may cost this share of its round's wall time (serve --prefill-share): a
#: running stream's gap stays within (1 + share) rounds while prompts arrive, and the prompts
#: get share / (1 + share) of the machine.
PREFILL_SHARE = 1.0
#: A cycle prefills at least the fewest prompt tokens whose pass costs at most PREFILL_WASTE
#: times their cost in the cheapest pass measured (per token), and at most PREFILL_MIN: beside a
#: one-row round, a token or two a cycle would mostly pay for reading the weights, and a long
#: prompt would take hundreds of cycles. PREFILL_MIN until a pass is measured.
PREFILL_WASTE = 2.0
PREFILL_MIN = 16

_K = TypeVar("_K", bound=Hashable)


@dataclass(frozen=True)
class SlotView:
    """What a slot holds: the tokens its target's cache keeps, and the scope (serve.draft_pools)
    of the request that left them (None: nothing, or reset)."""

    scope: str | None
    cached: Sequence[int] = ()


class Placement(NamedTuple):
    slot: int
    reuse: bool  # keep the prefix its cache shares with the prompt (the same scope's KV)


def busy_tenants(running: Iterable[str], cap: int) -> frozenset[str]:
    """The tenants already running `cap` requests: their next one waits (serve.job_queue)."""
    counts = collections.Counter(running)
    return frozenset(t for t, n in counts.items() if n >= cap)


def place(
    free: Sequence[int], slots: Sequence[SlotView], scope: str, prompt: Sequence[int], block: int
) -> Placement:
    """The free slot for a request of `scope` with `prompt`, in this order:
    1. of its scope, holding the longest prefix of the prompt, at least `block` tokens (0: the
       prompt cache is off): that prefix is not prefilled again;
    2. an empty slot: nobody's cache is overwritten;
    3. one of its scope: it overwrites only its own scope's KV;
    4. another scope's, the lowest: that scope's next request prefills afresh.
    Why 2 before 3 and 4: taking the lowest free slot wiped another tenant's cached prompt while
    other slots sat empty (and that tenant's cached_tokens then told it someone had run)."""
    if not free:
        raise ValueError("place: no free slot")
    if block > 0:
        kept = {i: common_prefix(slots[i].cached, prompt) for i in free if slots[i].scope == scope}
        best = max(kept, key=lambda i: (kept[i], -i), default=None)
        if best is not None and kept[best] >= block:
            return Placement(best, True)
    empty = [i for i in free if slots[i].scope is None or not slots[i].cached]
    own = [i for i in free if slots[i].scope == scope]
    slot = (empty or own or list(free))[0]
    return Placement(slot, block > 0 and slots[slot].scope == scope)


@dataclass
class PassCosts:
    """Seconds of the prefill passes the engine ran, by tokens: a VerifyCurve's robust summary
    (core.cost: lower median of the newest samples), interpolated linearly between points and
    proportionally past the last (a prompt token costs about the same in any long pass)."""

    curve: VerifyCurve = field(default_factory=VerifyCurve)
    _points: list[tuple[int, float]] = field(default_factory=list, repr=False)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.curve.add(tokens, seconds)
            self._points = sorted(self.curve.summary().items())

    def fewest(self, waste: float, most: int) -> int:
        """The fewest tokens (at most `most`) whose pass costs at most `waste` times their cost
        in the cheapest pass measured, per token; `most` until a pass is measured."""
        if not self._points:
            return most
        best = min(s / b for b, s in self._points)
        lo, hi = 1, most  # cost(t) / t falls as t grows (a pass's fixed part spread thinner)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._estimate(mid) / mid <= waste * best:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def __call__(self, tokens: int) -> float | None:
        """Estimated seconds to prefill `tokens`; None until a pass was measured."""
        return self._estimate(tokens) if self._points else None

    def _estimate(self, tokens: int) -> float:
        """`self(tokens)`, once a pass was measured."""
        pts = self._points
        i = bisect.bisect_left(pts, (tokens, float("-inf")))
        if i < len(pts) and pts[i][0] == tokens:
            return pts[i][1]
        if i == 0:
            return pts[0][1]  # fewer tokens than any measured pass: no cheaper than it
        if i == len(pts):
            b, s = pts[-1]
            return s * tokens / b
        (b0, s0), (b1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (tokens - b0) / (b1 - b0)


@dataclass(frozen=True)
class Plan:
    """A cycle's prefill: prompt tokens for each newcomer (those given none are left out), out
    of `budget`."""

    budget: int
    prefill: dict = field(default_factory=dict)


def prefill_budget(
    round_s: float | None,
    costs: PassCosts,
    share: float = PREFILL_SHARE,
    chunk: int = PREFILL_CHUNK,
) -> int:
    """Prompt tokens a cycle may prefill (module docstring): `chunk` when nothing decodes
    (`round_s` None), else the most whose pass costs `share` of the round (serve
    --prefill-share), and at least the floor PassCosts.fewest gives (PREFILL_WASTE,
    PREFILL_MIN)."""
    if round_s is None:
        return chunk
    allowed = share * round_s
    lo, hi = costs.fewest(PREFILL_WASTE, PREFILL_MIN), chunk  # the answer: in [lo, hi]
    if costs(lo) is None:
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cost = costs(mid)
        if cost is not None and cost <= allowed:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_prefill(newcomers: Sequence[tuple[_K, int]], budget: int, alone: bool = False) -> Plan:
    """Split `budget` prompt tokens over `newcomers`, (key, tokens left to prefill) in the order
    they were admitted: first come first served, so the oldest prompt starts first. `alone`
    (streams are decoding): the oldest newcomer only, as each prefill pass pays a read of the
    weights of its own, and the budget is the streams' wait."""
    out: dict[_K, int] = {}
    left = budget
    for key, need in newcomers[:1] if alone else newcomers:
        if left <= 0:
            break
        take = min(need, left)
        if take > 0:
            out[key] = take
            left -= take
    return Plan(budget, out)
