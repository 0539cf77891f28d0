"""A request on its way through the engine (`Job`), and the events the worker hands it.

The worker (serve.engine) runs the models in a thread of its own, or in the main thread, never
on the event loop; each job carries the loop its request waits on, and the worker hands it
typed events through the job's asyncio.Queue (`loop.call_soon_threadsafe`), in order:

    Start                   generation began (the request left the queue)
    Delta(text, token_ids, origins, logprobs)  one round's committed tokens and the text now
                            safe to send; `origins` (stream_options.include_speculation only)
                            says where each token came from (serve.origins); `logprobs` each
                            token's (serve.tokens.TokenEntry), when asked
    Done(finish_reason, stats)
    Failed(error)           at any point instead of the rest; an ApiError for the client

The other way, the event loop abandons a job (`Job.abandon`: its client went away, or the
server is shutting down), and the worker asks `Job.stopped` between rounds and prefill chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from specdec.core.metrics import GenerationStats
from specdec.serve.errors import ApiError, cancelled_error, timeout_error, unavailable_error
from specdec.serve.keys import ANONYMOUS
from specdec.serve.protocol import GenParams
from specdec.serve.tokens import TokenEntry


# ------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class Start:
    """The job left the queue and its generation began."""


@dataclass(frozen=True)
class Delta:
    text: str  # may be empty: text held back (a possible stop string, a partial character)
    token_ids: tuple[int, ...]  # the round's committed tokens (empty for the final flush)
    origins: dict | None = None  # the round's token origins, when the request asked for them
    logprobs: tuple[TokenEntry, ...] = ()  # one per token, when the request asked for them


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (a stop string or a stop id) or "length"
    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Start | Delta | Done | Failed


# ------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    """One request on its way through the engine."""

    params: GenParams
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    deadline: float  # time.perf_counter() after which the request has timed out
    tenant: str = ANONYMOUS  # the API key's id (serve.keys): whose draft pool it reads and feeds
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)  # worker -> event loop
    reason: str | None = None  # why it was abandoned: "cancelled", "timeout" or "shutdown"
    _abandoned: threading.Event = field(default_factory=threading.Event)  # event loop -> worker

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def abandon(self, reason: str) -> None:
        if not self._abandoned.is_set():
            self.reason = reason  # the first reason is the one counted
            self._abandoned.set()

    def stopped(self) -> str | None:
        """Why the worker should stop generating this job, or None to go on."""
        if self._abandoned.is_set():
            return self.reason
        return "timeout" if time.perf_counter() > self.deadline else None


def error_for(reason: str) -> ApiError:
    """The error an abandoned job ends with."""
    if reason == "timeout":
        return timeout_error()
    if reason == "shutdown":
        return unavailable_error("the server is shutting down", "shutting_down")
    return cancelled_error()
