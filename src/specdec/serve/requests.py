"""One request through the engine: its record (`Request`), where it stands (`Status`), and the
events the worker hands it.

A request is WAITING in the queue, PREFILLING its prompt into a slot, DECODING a round each
cycle, then one of the final statuses. Only `finish` (serve.cycle.Cycle.finish: called by the
worker, or by the engine on the event loop for a request still in the queue) moves a request to
a final status, and that transition is the one place that emits its last event, counts it in
/metrics and frees its slot; what the client sees (`finish_reason`, the
error) and the metric's label are read off the status (vLLM v1's RequestStatus and its map to
finish reasons are the model).

The worker runs in a thread of its own, or in the main thread, never on the event loop; each
request carries the loop it waits on, and the worker hands it typed events through its
asyncio.Queue (`loop.call_soon_threadsafe`), in order:

    Start                   generation began (the request left the queue)
    Delta(text, token_ids, origins, logprobs)  one round's committed tokens and the text now
                            safe to send, and their origins and logprobs when asked
                            (serve.delivery makes it)
    Done(status, stats)     a FINISHED_* status
    Failed(error)           at any point instead of the rest; an ApiError for the client

The other way, the event loop asks the worker to stop a request (`Request.abandon`: its client
went away, or the server is shutting down), and the worker asks `Request.stopped` between
rounds and prefill chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.core.metrics import GenerationStats, StopReason
from specdec.serve.delivery import Delta, Output
from specdec.serve.errors import ApiError, cancelled_error, timeout_error, unavailable_error
from specdec.serve.gen_params import GenParams
from specdec.serve.keys import ANONYMOUS

if TYPE_CHECKING:
    from specdec.core.decode import Generation
    from specdec.serve.draft_pools import PoolUse


class Status(enum.Enum):
    """Where a request stands. The values are /metrics' outcome labels of the final ones."""

    WAITING = "waiting"  # in the queue (serve.job_queue)
    PREFILLING = "prefilling"  # its prompt goes into its slot's cache, a budget a cycle
    DECODING = "decoding"  # a round each cycle, in the cycle's joint pass
    FINISHED_STOP = "finished_stop"  # a stop id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens, or the context
    FINISHED_TOOL_CALLS = "finished_tool_calls"  # stopped, with tool calls (serve.answers)
    CANCELLED = "cancelled"  # its client went away
    TIMED_OUT = "timed_out"  # past its deadline (serve --request-timeout)
    FAILED = "failed"  # bad arguments found at start, its generation raised, the engine stopped
    SHUT_DOWN = "shut_down"  # the server stopped first

    @property
    def finished(self) -> bool:
        return self not in _LIVE

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason of a request that ended with an answer; None otherwise."""
        return _FINISH_REASON.get(self)

    @property
    def outcome(self) -> str:
        """The label of specdec_generations_total (serve.metrics)."""
        return "finished" if self in _FINISH_REASON else _OUTCOME[self]

    def error(self) -> ApiError:
        """What the client of a request that ended this way without an answer is told (FAILED
        carries its own error)."""
        if self is Status.TIMED_OUT:
            return timeout_error()
        if self is Status.SHUT_DOWN:
            return unavailable_error("the server is shutting down", "shutting_down")
        if self is Status.CANCELLED:
            return cancelled_error()
        raise ValueError(f"{self} carries no error of its own")

    def with_calls(self) -> Status:
        """The status of an answer whose text held tool calls (serve.tools)."""
        return Status.FINISHED_TOOL_CALLS if self is Status.FINISHED_STOP else self


_LIVE = frozenset({Status.WAITING, Status.PREFILLING, Status.DECODING})
_FINISH_REASON = {
    Status.FINISHED_STOP: "stop",
    Status.FINISHED_LENGTH: "length",
    Status.FINISHED_TOOL_CALLS: "tool_calls",
}
_OUTCOME = {
    Status.CANCELLED: "cancelled",
    Status.TIMED_OUT: "timeout",
    Status.FAILED: "error",
    Status.SHUT_DOWN: "shutdown",
}
#: What a generation's own stop reason (core.decode.Generation.stop_reason) ends a request as.
FINISHED_BY = {StopReason.STOP: Status.FINISHED_STOP, StopReason.LENGTH: Status.FINISHED_LENGTH}
#: The statuses a request can be stopped with from outside the worker (`Request.abandon`).
STOPS = frozenset({Status.CANCELLED, Status.TIMED_OUT, Status.SHUT_DOWN})


# ------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class Start:
    """The request left the queue and its generation began."""


@dataclass(frozen=True)
class Done:
    status: Status  # a FINISHED_* status: its finish_reason is the answer's
    stats: GenerationStats


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Start | Delta | Done | Failed  # Delta: serve.delivery's


# ------------------------------------------------------------------------------ the record
@dataclass(eq=False)
class Request:
    """One request (one sample of it: OpenAI's `n` makes n of them) from the queue to its end.

    The event loop writes the first block and `abandon`s; the rest is the worker's once the
    queue has handed the request over (before, `Engine.withdraw` and `drain` end it)."""

    params: GenParams
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    deadline: float  # time.perf_counter() after which the request has timed out
    tenant: str = ANONYMOUS  # the API key's id (serve.keys): whose draft pool it reads and feeds
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)  # worker -> event loop

    status: Status = Status.WAITING
    slot: int = -1  # its slot (SpecModel.slots) once admitted
    gen: Generation | None = None  # its generation, once it left the queue and started
    out: Output | None = None  # what it produced and how its text goes out (serve.delivery)
    use: PoolUse | None = None  # its draft pool (serve.draft_pools), None when pools are off
    started: float = 0.0  # time.perf_counter() when it left the queue
    _stop: Status | None = None  # the first stop asked from outside (`abandon`)
    _asked: threading.Event = field(default_factory=threading.Event)  # event loop -> worker

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def abandon(self, status: Status) -> None:
        """Ask the worker to stop this request (a STOPS status); the first one asked counts."""
        assert status in STOPS, status
        if not self._asked.is_set():
            self._stop = status
            self._asked.set()

    def abandoned(self) -> Status | None:
        """The status it was abandoned with (`abandon`, or TIMED_OUT past its deadline), to
        stop it with now; None: it goes on."""
        if self._asked.is_set():
            return self._stop
        return Status.TIMED_OUT if time.perf_counter() > self.deadline else None
