"""serve.scheduler: the engine's decisions as pure functions (no models, threads or sleep), and
the engine cycle that follows them, on mocks whose passes cost modelled time."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serverkit import MOCK_SPEC, Server, V, wait_for

from specdec.backends.mock import MockModel
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine
from specdec.serve.scheduler import (
    PREFILL_MIN,
    PREFILL_WASTE,
    PassCosts,
    Placement,
    SlotView,
    busy_tenants,
    place,
    plan_prefill,
    prefill_budget,
)

PROMPT = list(range(600))


# ------------------------------------------------------------------------------ slots
def test_a_request_keeps_its_scopes_longest_cached_prefix() -> None:
    slots = [SlotView("a", PROMPT[:300]), SlotView("a", PROMPT[:520]), SlotView(None)]
    assert place([0, 1, 2], slots, "a", PROMPT, 256) == Placement(1, True)
    # under a block: no reuse, and an empty slot is taken first
    short = [SlotView("a", PROMPT[:100]), SlotView(None)]
    assert place([0, 1], short, "a", PROMPT, 256) == Placement(1, False)


def test_an_empty_slot_is_taken_before_another_scopes_cache() -> None:
    """The review: the lowest free slot was taken, wiping key B's cached prompt while slot 2
    sat empty (and B's next cached_tokens told it someone had run)."""
    slots = [SlotView("b", PROMPT[:512]), SlotView("a", [1, 2]), SlotView(None)]
    assert place([0, 2], slots, "a", PROMPT, 256).slot == 2
    # no empty slot: its own scope's, then another's, the lowest
    assert place([0, 1], slots, "a", PROMPT, 256) == Placement(1, True)
    assert place([0], slots, "a", PROMPT, 256) == Placement(0, False)
    # prompt cache off: never reuse, still prefer an empty slot
    assert place([0, 1, 2], slots, "a", PROMPT, 0) == Placement(2, False)
    with pytest.raises(ValueError, match="no free slot"):
        place([], slots, "a", PROMPT, 256)


def test_tenants_at_their_cap_wait() -> None:
    assert busy_tenants(["a", "b", "a"], 2) == {"a"}
    assert busy_tenants([], 1) == frozenset()


# ------------------------------------------------------------------------------ prefill budget
def _linear(per_token: float, fixed: float = 0.0) -> PassCosts:
    costs = PassCosts()
    for b in (16, 64, 256):
        for _ in range(3):
            costs.add(b, fixed + per_token * b)
    return costs


def test_the_prefill_budget_costs_one_round() -> None:
    costs = _linear(0.001)  # 1 ms a token
    assert prefill_budget(None, costs) == 512  # nothing decodes: a full chunk
    assert prefill_budget(0.1, costs) == 100  # a 100 ms round: 100 tokens
    # a tiny round: the floor, the fewest tokens prefilled at half their best rate (below the
    # least pass measured, 16 tokens, a pass costs no less than it: 8 tokens, 2 ms each)
    assert prefill_budget(0.0005, costs) == costs.fewest(PREFILL_WASTE, PREFILL_MIN) == 8
    assert prefill_budget(10.0, costs) == 512  # never past a chunk
    assert prefill_budget(0.1, PassCosts()) == PREFILL_MIN  # nothing measured yet
    assert prefill_budget(0.1, costs, share=0.5) == 50  # serve --prefill-share 0.5


def test_the_floor_keeps_a_prompt_token_within_twice_its_best_cost() -> None:
    """A pass's fixed part (reading the weights) spread over its tokens: 10 ms + 1 ms a token
    costs 1.04 ms a token at 256, and 13 tokens are the fewest within twice that (a pass of
    fewer costs no less than the least measured, 16 tokens: 26 ms)."""
    costs = _linear(0.001, fixed=0.01)
    assert costs.fewest(2.0, 64) == 13
    assert costs.fewest(2.0, 8) == 8  # at most PREFILL_MIN
    assert PassCosts().fewest(2.0, PREFILL_MIN) == PREFILL_MIN  # nothing measured


def test_pass_costs_interpolate_and_extrapolate() -> None:
    costs = _linear(0.001, fixed=0.01)
    assert costs(64) == pytest.approx(0.074)
    assert costs(40) == pytest.approx(0.05)  # between 16 and 64
    assert costs(512) == pytest.approx(0.266 * 2)  # proportional past the last
    assert costs(1) == pytest.approx(0.026)  # no cheaper than the least measured
    assert PassCosts()(5) is None


def test_one_budget_for_every_newcomer_first_come_first_served() -> None:
    """Three 1,000-token prompts arriving: the cycle prefills one budget in all (once, each
    got a chunk of its own every cycle)."""
    plan = plan_prefill([("x", 1000), ("y", 1000), ("z", 1000)], 100)
    assert plan.prefill == {"x": 100}
    plan = plan_prefill([("x", 30), ("y", 1000), ("z", 5)], 100)
    assert plan.prefill == {"x": 30, "y": 70}
    assert sum(plan.prefill.values()) <= plan.budget
    # beside running streams: the oldest alone (a second pass would read the weights again)
    assert plan_prefill([("x", 30), ("y", 1000)], 100, alone=True).prefill == {"x": 30}


# ------------------------------------------------------------------------------ the engine
class _Clock:
    t = 0.0


class Modelled(MockModel):
    """A mock whose passes cost modelled seconds, FIXED + PER_TOKEN a token, on a clock its
    slots share with the engine (Engine(clock=)): the scheduler's decisions and the gaps below
    are exact, whatever the machine's load."""

    FIXED, PER_TOKEN = 0.004, 0.0005
    clock = _Clock()
    log: list  # (slot name, 'round' or 'prefill', clock after the pass)

    def _extend(self, ids: list[int], kind: str = "round") -> Any:
        self.clock.t += self.FIXED + self.PER_TOKEN * len(ids)
        self.log.append((self.name, kind, self.clock.t))
        return super()._extend(ids)

    def _prefill(self, ids: list[int]) -> None:
        self._extend(ids, "prefill")

    def _extend_slots(self, calls: list) -> list:  # one pass for its slots, as llama.cpp's
        self.clock.t += self.FIXED + self.PER_TOKEN * sum(len(ids) for _, ids in calls)
        self.log.extend((m.name, "round", self.clock.t) for m, _ in calls)
        return [MockModel._extend(m, ids) for m, ids in calls]


def _passes_beside_arriving_prompts(k: int | None) -> tuple[list, float]:
    """A stream (prompt lookup at a fixed K, or none) running while three 1,000-token prompts
    arrive; every pass the engine made, and what one of the stream's rounds costs."""
    target = Modelled(V, seed=0, name=MOCK_SPEC)
    target.clock, target.log = _Clock(), []
    cfg = ServeConfig(target=MOCK_SPEC, parallel=4, drafter="lookup" if k else None, k=k or 1,
                      draft_pool="off")  # fmt: skip
    engine = Engine(target, None, cfg, clock=lambda: target.clock.t)
    srv = Server(engine, cfg)
    try:
        stream_body = {"model": MOCK_SPEC, "prompt": [1, 2, 3] * 4, "max_tokens": 300,
                       "temperature": 0}  # fmt: skip
        long = {"model": MOCK_SPEC, "max_tokens": 2, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            running = pool.submit(srv.request, "POST", "/v1/completions", stream_body)
            wait_for(lambda: engine.running == 1 and len(target.log) > 3)
            prompts = [[(7 * i + j) % V for j in range(1000)] for i in range(3)]
            futs = [pool.submit(srv.request, "POST", "/v1/completions", {**long, "prompt": p})
                    for p in prompts]  # fmt: skip
            assert all(f.result()[0] == 200 for f in futs)
            assert running.result()[0] == 200
    finally:
        srv.close()
    rows = (k or 0) + 1
    return target.log, Modelled.FIXED + Modelled.PER_TOKEN * rows


@pytest.mark.parametrize("k", [15, None])
def test_a_running_stream_waits_one_prefill_budget_a_cycle(k: int | None) -> None:
    """The review: three 1,000-token prompts arriving stalled a running stream 3.7 s against a
    57 ms round (each newcomer prefilled a chunk of its own every cycle). Now the cycle's one
    prefill budget costs at most a round, or its floor (<= PREFILL_MIN): between two rounds of the
    stream, at most one budget is prefilled, the oldest prompt first."""
    log, round_s = _passes_beside_arriving_prompts(k)
    stream = MOCK_SPEC
    floor = Modelled.FIXED + Modelled.PER_TOKEN * PREFILL_MIN
    cost = [t - (log[i - 1][2] if i else 0.0) for i, (_, _, t) in enumerate(log)]
    at = [i for i, (name, kind, _) in enumerate(log) if name == stream and kind == "round"]
    gaps, prefilled = [], 0
    for a, b in itertools.pairwise(at):
        between = [cost[i] for i in range(a + 1, b) if log[i][1] == "prefill"]
        prefilled += len(between)
        # the budget: the cost of the cycle's round (the stream's pass), or the floor's
        assert sum(between) <= max(cost[a], floor) + 1e-9, (log[a : b + 1], cost[a])
        gaps.append(log[b][2] - log[a][2])
    assert prefilled > 20, "the prompts went in after the stream ended: nothing was measured"
    # in rounds of the stream alone: about two while the prompts go in (once ~50 for 128 x 3)
    assert max(gaps) <= 2 * max(round_s, floor) + 2 * Modelled.PER_TOKEN, (max(gaps), round_s)
    # first come first served: a newcomer's prompt finishes before the next one's starts
    order = [name for name, kind, _ in log if name != stream and kind == "prefill"]
    assert order == sorted(order, key=order.index) and len(dict.fromkeys(order)) == 3
