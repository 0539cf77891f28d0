"""One request, one record, one status (serve.requests): what a client sees and what /metrics
counts are read off the status, and `Cycle.finish` is the one transition that ends a request."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from serverkit import MOCK_SPEC, metric

from specdec.backends.mock import MockModel
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine
from specdec.serve.requests import STOPS, Delta, Done, Failed, Request, Start, Status
from specdec.serve.validation import validate_request
from specdec.serve.wire import CompletionRequest, parse_request

V = 64


def _events(loop: asyncio.AbstractEventLoop, r: Request) -> list:
    """The events handed to `r` so far (the worker hands them with call_soon_threadsafe)."""
    loop.run_until_complete(asyncio.sleep(0))
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


def _request(loop: asyncio.AbstractEventLoop, prompt: list[int], **fields: object) -> Request:
    req = parse_request(CompletionRequest, {"model": MOCK_SPEC, "prompt": prompt, **fields})
    return Request(validate_request(req, 512, V), loop, 0.0, math.inf)


def test_every_status_is_live_or_says_how_it_ended() -> None:
    live = {Status.WAITING, Status.PREFILLING, Status.DECODING}
    reasons = {s: s.finish_reason for s in Status if s.finish_reason is not None}
    assert reasons == {
        Status.FINISHED_STOP: "stop",
        Status.FINISHED_LENGTH: "length",
        Status.FINISHED_TOOL_CALLS: "tool_calls",
    }
    for s in Status:
        assert s.finished == (s not in live)
    # /metrics' outcome labels are the ones docs/serving.md lists, one per final status
    outcomes = {s: s.outcome for s in Status if s.finished}
    assert set(outcomes.values()) == {"finished", "cancelled", "timeout", "error", "shutdown"}
    assert outcomes[Status.FAILED] == "error"
    for s in STOPS:  # a request stopped from outside is told why, by its own error
        assert s.error().status in (499, 503, 504)
    with pytest.raises(ValueError):
        Status.FAILED.error()  # a failure carries the error that caused it
    assert Status.FINISHED_STOP.with_calls() is Status.FINISHED_TOOL_CALLS
    assert Status.FINISHED_LENGTH.with_calls() is Status.FINISHED_LENGTH  # cut: length wins


def test_finish_ends_a_request_once_emits_its_last_event_and_counts_it_once() -> None:
    engine = Engine(MockModel(V))  # never started: finish is called by hand
    loop = asyncio.new_event_loop()
    try:
        r = _request(loop, [1, 2, 3])
        engine.cycle.finish(r, Status.CANCELLED)
        engine.cycle.finish(r, Status.TIMED_OUT)  # already ended: a no-op
        (ev,) = _events(loop, r)
        assert isinstance(ev, Failed) and ev.error.code == "client_closed"
        assert r.status is Status.CANCELLED
        text = engine.metrics.render({})
        assert metric(text, "specdec_generations_total", outcome="cancelled") == 1
        assert metric(text, "specdec_generations_total", outcome="timeout") == 0
        with pytest.raises(AssertionError):
            engine.cycle.finish(r, Status.DECODING)  # not a final status
    finally:
        loop.close()


def test_a_withdrawn_request_leaves_the_queue_and_a_draining_engine_shuts_the_rest() -> None:
    engine = Engine(MockModel(V), None, ServeConfig(target=MOCK_SPEC, max_queue=4))
    engine.runs_in_caller = True  # alive, but nothing serves the queue yet
    loop = asyncio.new_event_loop()
    try:
        a, b = _request(loop, [1, 2]), _request(loop, [3, 4])
        engine.submit(a)
        engine.submit(b)
        assert engine.queue_depth == 2 and a.status is Status.WAITING
        engine.withdraw(a, Status.CANCELLED)
        assert engine.queue_depth == 1 and a.status is Status.CANCELLED
        engine.drain()
        assert engine.queue_depth == 0 and b.status is Status.SHUT_DOWN
        (ev,) = _events(loop, b)
        assert isinstance(ev, Failed) and ev.error.code == "shutting_down"
        text = engine.metrics.render({})
        assert metric(text, "specdec_generations_total", outcome="shutdown") == 1
    finally:
        loop.close()


def test_a_served_request_moves_through_its_statuses_and_ends_with_a_finish_reason() -> None:
    """Run by the worker: WAITING, then PREFILLING and DECODING, then FINISHED_LENGTH; its
    events are Start, its deltas, and Done carrying the status; its slot is free after."""
    engine = Engine(MockModel(V))
    loop = asyncio.new_event_loop()
    seen: list[Status] = []
    real = engine.cycle._deliver

    def deliver(r: Request, ids: list[int]) -> None:
        seen.append(r.status)
        real(r, ids)

    engine.cycle._deliver = deliver  # type: ignore[method-assign]
    worker = threading.Thread(target=engine.run, daemon=True)
    engine.runs_in_caller = True
    worker.start()
    try:
        r = _request(loop, [1, 2, 3], max_tokens=8, temperature=0)
        engine.submit(r)
        for _ in range(200):
            if r.status.finished:
                break
            threading.Event().wait(0.01)
        assert r.status is Status.FINISHED_LENGTH and set(seen) == {Status.DECODING}
        events = _events(loop, r)
        assert isinstance(events[0], Start) and isinstance(events[-1], Done)
        assert events[-1].status.finish_reason == "length"
        assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 8
        assert r.gen is None and r.use is None  # let go of at the end
        assert engine.running == 0
    finally:
        engine.stop()
        worker.join(5)
        loop.close()


def test_a_request_refused_at_admission_leaves_the_lock_free(monkeypatch) -> None:
    """make_generation refusing a request's arguments (a 400 at admission) ends it, and an idle
    worker then holds no lock: code outside the worker (a warm-up, a test's generate) takes it."""
    from specdec.serve.models import ServedModels

    def refuse(self, *args, **kwargs):
        raise ValueError("a bad argument found at admission")

    monkeypatch.setattr(ServedModels, "generation", refuse)
    engine = Engine(MockModel(V))
    loop = asyncio.new_event_loop()
    worker = threading.Thread(target=engine.run, daemon=True)
    engine.runs_in_caller = True
    worker.start()
    try:
        r = _request(loop, [1, 2, 3], max_tokens=4)
        engine.submit(r)
        for _ in range(200):
            if r.status.finished:
                break
            threading.Event().wait(0.01)
        assert r.status is Status.FAILED
        (ev,) = _events(loop, r)
        assert isinstance(ev, Failed) and ev.error.status == 400
        assert engine.lock.acquire(timeout=2), "the idle worker kept the engine's lock"
        engine.lock.release()
    finally:
        engine.stop()
        worker.join(5)
        loop.close()
