"""The engine's queue: requests wait here, one FIFO per tenant, and the tenants take turns.

A tenant is an API key's id (serve.keys; every request of a server without keys is one tenant,
"anonymous"). The worker takes the oldest job of the tenant it served least recently, so a key
that floods the queue delays another key's request by the generation running at most, not by
its backlog; with one tenant this is a plain FIFO. Places are bounded twice: `maxsize` waiting
in all, and `per_tenant` waiting for one tenant, so that one key cannot take every place either
(QueueFull says which bound refused; the engine answers 429).

A place is held (`reserve`: a Reservation) before the request is tokenized, so that a flood of
large prompts is refused before any tokenizing; the job takes its reservation's place when it
is queued. ("Slot" is a KV sequence only: serve.engine, SpecModel.slots.)
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Generic, Protocol, TypeVar

from specdec.serve.errors import ApiError

#: Requests waiting, at most, unless --max-queue says (beyond: 429).
DEFAULT_MAX_QUEUE = 64


#: Seconds an idle worker waits for a job before it looks again (signals; see `get`).
WAIT_SLICE_S = 0.5


class _Tenanted(Protocol):
    tenant: str


J = TypeVar("J", bound=_Tenanted)


class QueueFull(Exception):
    """No place: `scope` is "queue" (maxsize waiting in all) or "tenant" (per_tenant waiting
    for the request's tenant)."""

    def __init__(self, scope: str) -> None:
        super().__init__(scope)
        self.scope = scope


def queue_full_error(scope: str, maxsize: int, per_tenant: int, retry_s: int) -> ApiError:
    """The 429 for QueueFull(`scope`), with when to retry (the engine's and the cluster's
    edge's)."""
    what = (
        f"the request queue is full ({maxsize} waiting)"
        if scope == "queue"
        else f"this API key has {per_tenant} requests waiting, its most"
    )
    return ApiError(
        429,
        f"{what}; retry after {retry_s} s",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_s)},
    )


class JobQueue(Generic[J]):
    """Bounded per-tenant FIFOs served in turn, from which a waiting job can be withdrawn."""

    def __init__(self, maxsize: int, per_tenant: int | None = None) -> None:
        self.maxsize = maxsize
        self.per_tenant = maxsize if per_tenant is None else min(per_tenant, maxsize)
        self._waiting: dict[str, collections.deque[J]] = {}  # only tenants with jobs waiting
        self._held: collections.Counter[str] = collections.Counter()  # places reserved
        # The turn in which each tenant was last served: a tenant never seen counts as served
        # before any other. One entry per tenant that ever sent a job: tenants are API keys,
        # a set fixed at start-up.
        self._served: dict[str, int] = {}
        self._turns = itertools.count()
        self._size = 0  # jobs waiting, all tenants
        self._cond = threading.Condition()
        self._closed = False

    def _check_room(self, tenant: str) -> None:
        """QueueFull unless a place is free for `tenant` (call with the lock held)."""
        if self._size + self._held.total() >= self.maxsize:
            raise QueueFull("queue")
        mine = len(self._waiting.get(tenant, ())) + self._held[tenant]
        if mine >= self.per_tenant:
            raise QueueFull("tenant")

    def reserve(self, tenant: str) -> Reservation:
        """Hold a place for a request of `tenant`; QueueFull when none is free."""
        with self._cond:
            self._check_room(tenant)
            self._held[tenant] += 1
        return Reservation(self, tenant)

    def release(self, tenant: str) -> None:
        with self._cond:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]

    def put(self, job: J, reservation: Reservation | None = None) -> None:
        """Queue `job`, in its held place if `reservation` is one; QueueFull when none is free."""
        with self._cond:
            if reservation is not None and reservation.take():
                self._held[reservation.tenant] -= 1
                if self._held[reservation.tenant] <= 0:
                    del self._held[reservation.tenant]
            else:
                self._check_room(job.tenant)
            self._waiting.setdefault(job.tenant, collections.deque()).append(job)
            self._size += 1
            self._cond.notify()

    def get(self, block: bool = True, busy: frozenset[str] = frozenset()) -> J | None:
        """The next job: the oldest of the tenant served least recently (of two never served,
        the one that queued first), passing over the `busy` tenants (those running all the
        requests they may at once); None once closed and empty, or at once when not `block` and
        no tenant but the busy ones has a job waiting."""
        with self._cond:
            while block and not self._size and not self._closed:
                # in slices: `specdec serve` waits here in the main thread, and a signal the
                # kernel hands another thread runs its Python handler only once the main thread
                # is back in the interpreter (a SIGINT to an idle server was lost otherwise)
                self._cond.wait(WAIT_SLICE_S)
            ready = [t for t in self._waiting if t not in busy]
            if not ready:
                return None
            tenant = min(ready, key=lambda t: self._served.get(t, -1))
            self._served[tenant] = next(self._turns)
            return self._pop(tenant)

    def _pop(self, tenant: str) -> J:
        jobs = self._waiting[tenant]
        job = jobs.popleft()
        if not jobs:
            del self._waiting[tenant]  # a tenant queues behind the others when it comes back
        self._size -= 1
        return job

    def remove(self, job: J) -> bool:
        with self._cond:
            jobs = self._waiting.get(job.tenant, collections.deque())
            at = next((i for i, j in enumerate(jobs) if j is job), None)  # identity, not ==
            if at is None:
                return False
            del jobs[at]
            if not jobs:
                del self._waiting[job.tenant]
            self._size -= 1
            return True

    def take_all(self) -> list[J]:
        with self._cond:
            jobs = [job for waiting in self._waiting.values() for job in waiting]
            self._waiting.clear()
            self._size = 0
            return jobs

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return self._size


class Reservation:
    """A place held in the queue (JobQueue.reserve) until its job is queued or it is released;
    a context manager that releases it, a no-op once the job has been queued."""

    def __init__(self, queue: JobQueue, tenant: str) -> None:
        self._queue = queue
        self.tenant = tenant
        self._held = True
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Give up the place to a job (True once)."""
        with self._lock:
            held, self._held = self._held, False
            return held

    def release(self) -> None:
        if self.take():
            self._queue.release(self.tenant)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
