"""A request's samples in the engine, from the route that made them to their last event: made
(`make_samples`), queued in their reserved places and released once (`submitted`, the skeleton
of every route that generates: serve.answers' `respond`, serve.infill's `answer`), and their
events merged as they come (`sample_events`).

A request asks for n samples (OpenAI's `n`; llama.cpp's `n_cmpl`): each is a request of its own
in the engine (serve.requests.Request, `Sample` here, as FastAPI's Request is the HTTP one),
sample i seeded with seed + i, so the samples are independent draws (the same answers at
temperature 0). With free slots they run side by side, each slot prefilling the prompt itself;
one after another, a later sample keeps the prompt's KV through the prompt cache (whole
blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.serve.engine import Engine
from specdec.serve.errors import ApiError, timeout_error
from specdec.serve.gen_params import GenParams
from specdec.serve.job_queue import Reservation
from specdec.serve.requests import Done, Event, Failed, Status
from specdec.serve.requests import Request as Sample
from specdec.serve.validation import SEED_RANGE


def sample_params(params: GenParams, i: int) -> GenParams:
    """Sample i's parameters: seeded with seed + i (wrapped into torch's seed range)."""
    if i == 0:
        return params
    lo, hi = SEED_RANGE
    return dataclasses.replace(params, seed=(params.seed + i - lo) % (hi - lo) + lo)


def make_samples(
    params: GenParams,
    loop: asyncio.AbstractEventLoop,
    arrived: float,
    deadline: float,
    tenant: str,
) -> list[Sample]:
    """The request's samples, one engine request each, sample i seeded with seed + i."""
    return [
        Sample(sample_params(params, i), loop, arrived, deadline, tenant=tenant)
        for i in range(params.n)
    ]


async def next_event(engine: Engine, sample: Sample) -> Event:
    """The sample's next event, by its deadline: past it, the sample is withdrawn (timed out)
    and this raises the 504."""
    remaining = sample.deadline - time.perf_counter()
    try:
        return await asyncio.wait_for(sample.events.get(), timeout=max(remaining, 0.0))
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        engine.withdraw(sample, Status.TIMED_OUT)
        raise timeout_error() from None


async def _watch_disconnect(request: Request, engine: Engine, samples: list[Sample]) -> None:
    """Withdraw the samples when the client goes away. After the body is read, the next ASGI
    message on this connection is `http.disconnect`, so this waits on an event, it does not
    poll."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for sample in samples:
                engine.withdraw(sample, Status.CANCELLED)
            return


async def _event_or_failure(engine: Engine, sample: Sample) -> Event:
    """The sample's next event; a timeout is its Failed event."""
    try:
        return await next_event(engine, sample)
    except ApiError as e:
        return Failed(e)


async def sample_events(engine: Engine, samples: list[Sample]) -> AsyncIterator[tuple[int, Event]]:
    """Every sample's events, each tagged with its sample's index, as they come; a sample's
    timeout is its Failed event. Ends once every sample has ended."""
    if len(samples) == 1:  # no task per event for the common case
        while True:
            ev = await _event_or_failure(engine, samples[0])
            yield 0, ev
            if isinstance(ev, (Done, Failed)):
                return
    merged: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, sample: Sample) -> None:
        while True:
            ev = await _event_or_failure(engine, sample)
            await merged.put((i, ev))
            if isinstance(ev, (Done, Failed)):
                return

    tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(samples)]
    try:
        left = len(samples)
        while left:
            i, ev = await merged.get()
            left -= isinstance(ev, (Done, Failed))
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Held:
    """A request's samples in the engine, and the task that withdraws them when the client goes
    away (`submitted`). Released once, by whichever owns them at the end: the route that
    answers whole, or the stream it returned (`stream`)."""

    engine: Engine
    samples: list[Sample]
    watcher: asyncio.Task
    streaming: bool = False  # a stream owns them

    def release(self) -> None:
        for sample in self.samples:
            self.engine.withdraw(sample, Status.CANCELLED)  # a no-op for a finished sample
        self.watcher.cancel()

    def stream(
        self, events: AsyncIterator[str], headers: dict[str, str] | None = None
    ) -> StreamingResponse:
        """An SSE response of `events`, which owns the samples from here on: they are
        released when it ends, normally or because the client went away (the generator is
        then cancelled)."""
        self.streaming = True
        return StreamingResponse(
            self._owned(events), media_type="text/event-stream", headers=headers
        )

    async def _owned(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            self.release()


@contextlib.contextmanager
def submitted(
    request: Request, engine: Engine, samples: list[Sample], reservations: list[Reservation]
) -> Iterator[Held]:
    """Queue the samples in their reserved places and withdraw them if the client goes away;
    on leaving, release them, unless a stream took them (`Held.stream`). The skeleton of every
    route that generates (serve.answers' `respond`, serve.infill's `answer`)."""
    for sample, reservation in zip(samples, reservations, strict=True):
        engine.submit(sample, reservation)
    watcher = asyncio.create_task(_watch_disconnect(request, engine, samples))
    held = Held(engine, samples, watcher)
    try:
        yield held
    finally:
        if not held.streaming:
            held.release()
