"""Where the cluster's generations run (serve.edge's `FrontDoor`): the replicas known, their
slots, the requests waiting for one, each key's prompt homes. One asyncio loop owns it (the
edge's), so a count is changed only where a request is sent and where its answer ends.

    slots       each replica runs `--parallel` generations; a request of n samples takes
                min(n, parallel) of them, counted when it is sent and freed when its answer
                ends (`Sent.free`, once, whatever the answer was): nothing is counted forever,
                and nothing waits while a replica has room.
    queue       requests wait here, one FIFO per API key served in turn (serve.job_queue, the
                single server's): `--max-queue` and `--max-queue-per-key` per replica, so the
                cluster's bounds are N times one server's; a key runs at most its
                `--max-running-per-key` share of each replica's slots. A waiter that leaves
                frees its place at once.
    affinity    a (key, prompt prefix) pair goes to the replica that answered it last while
                that one has room (its prompt cache and the key's draft pool live there), else
                to the least loaded replica, where the new prompt evicts the least recently
                used one first (a replica keeps its last `--parallel` prompts). Each key's
                memory of pairs is bounded apart (a key evicts only its own).
    replicas    found and checked by `/health` probes (`watch`); one that fails PROBE_MISSES
                probes in a row, or cannot be reached, is forgotten until it answers again
                (Ray restarts a dead one under a new name).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.serve.errors import timeout_error, unavailable_error
from specdec.serve.job_queue import JobQueue, QueueFull, queue_full_error

#: The prompt's first characters that, with the API key, name where its cache is: about one
#: prompt-cache block (serve.cycle.PROMPT_CACHE_BLOCK tokens) of code.
AFFINITY_CHARS = 1024
#: (prefix -> replica) pairs remembered per API key, the least recently routed forgotten first.
AFFINITY_PER_KEY = 1024
#: Seconds the edge waits for a replica's /health probe.
PROBE_S = 3.0
#: Seconds between probes of the replicas, once all of them are known (0.5 s until then).
WATCH_S = 2.0
#: Probes a replica may fail in a row (time-outs) before it is forgotten.
PROBE_MISSES = 2
#: Requests that are not generations (/v1/models, the playground) in flight per replica.
LIGHT_PER_REPLICA = 8
#: The seconds a request has left, sent by the edge to the replica (never taken from a client).
DEADLINE_HEADER = b"x-specdec-deadline-s"


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request, read whole by the edge, for a replica's app."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]] = field(repr=False)  # the API key among them
    body: bytes = field(repr=False)
    replica: str | None = None  # where the edge sends it; None: any
    strict: bool = False  # that replica or none (a probe); else another if it is gone
    avoid: tuple[str, ...] = ()  # with no replica: any but these (how probes find the others)


class Answer(Protocol):
    """A replica's answer: (status, headers), then the body's chunks; `cancel` ends it."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def __anext__(self) -> Awaitable[Any]: ...

    def cancel(self) -> None: ...


class Replicas(Protocol):
    """How the edge reaches the engine replicas."""

    def call(self, fwd: Forwarded) -> Answer: ...


def affinity_key(authorization: str, body: bytes) -> str | None:
    """A digest of the API key and the first AFFINITY_CHARS characters of the prompt (a chat's
    messages' text in order, or a completion's prompt); None for a body that names no prompt."""
    return affinity_of(authorization, parse_json(body))


def affinity_of(authorization: str, obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    messages = obj.get("messages")
    text = _prompt_text(messages if messages is not None else obj.get("prompt"))
    if isinstance(obj.get("input_prefix"), str):  # /infill: the other files, then the prefix
        extra = obj.get("input_extra")
        chunks = (
            [c.get("text") for c in extra if isinstance(c, dict)] if isinstance(extra, list) else []
        )
        text = _prompt_text([*chunks, obj["input_prefix"]])
    if not text:
        return None
    digest = hashlib.sha256(f"{authorization}\0{text[:AFFINITY_CHARS]}".encode())
    return digest.hexdigest()[:32]


def parse_json(body: bytes) -> Any:
    try:  # the replica's app bounds the JSON and says what is wrong with it; here, no answer
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _prompt_text(x: Any) -> str:
    """The text of a prompt, messages or content parts, in order (token ids as numbers)."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return _prompt_text(x.get("content", x.get("text", "")))
    if isinstance(x, list):
        return "\n".join(_prompt_text(v) if not isinstance(v, int) else str(v) for v in x)
    return ""


def samples_of(obj: Any) -> int:
    """The samples a generation asks for (`n`; the replica checks its range, 1 where it is
    not one)."""
    from specdec.serve.validation import MAX_N

    n = obj.get("n") if isinstance(obj, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


# ------------------------------------------------------------------------------ the state
@dataclass(eq=False)
class Waiter:
    """A generation waiting for slots (serve.job_queue holds it)."""

    tenant: str
    need: int  # slots: min(n, --parallel)
    affinity: str | None
    placed: asyncio.Future[str] = field(repr=False)


class Sent:
    """A generation's hold on a replica's slots, freed once (`free`), whatever ended it."""

    def __init__(self, door: FrontDoor, waiter: Waiter, replica: str) -> None:
        self.door, self.waiter, self.replica = door, waiter, replica

    def moved(self, replica: str) -> None:
        """The answer came from `replica` (the chosen one was gone): count it there."""
        if replica != self.replica and self.door is not None:
            _add(self.door.running, self.replica, -self.waiter.need)
            _add(self.door.running, replica, self.waiter.need)
            self.replica = replica

    def free(self) -> None:
        door, self.door = self.door, None
        if door is not None:
            door.release(self)


class FrontDoor:
    """The edge's routing state: the replicas known, their slots, the waiting generations."""

    def __init__(self, replicas: Replicas, cfg: Any, want: int | None = None) -> None:
        self.replicas = replicas
        self.want = want or cfg.replicas  # replicas the cluster runs
        self.slots = cfg.parallel
        self._per_key = cfg.running_per_key()
        self.queue: JobQueue[Waiter] = JobQueue(
            cfg.max_queue * self.want, cfg.queue_per_key() * self.want
        )
        self.known: OrderedDict[str, int] = OrderedDict()  # replica -> probes missed in a row
        self.running: Counter[str] = Counter()  # slots held per replica
        self.by_tenant: Counter[str] = Counter()  # slots held per tenant
        self.homes: dict[str, OrderedDict[str, str]] = {}  # tenant -> affinity -> replica
        self.kept: dict[str, collections.deque[int]] = {}  # replica -> its last answers' turns
        self._turn = itertools.count()
        self._next: Waiter | None = None  # taken from the queue, waiting for room
        self.draining = False
        self._light = asyncio.Semaphore(LIGHT_PER_REPLICA * self.want)
        self._changed = asyncio.Event()  # a probe is wanted now (an answer failed)

    # -------------------------------------------------------------- admission
    async def admit(self, tenant: str, need: int, affinity: str | None, deadline: float) -> Sent:
        """Wait for `need` slots on one replica: ApiError 429 (the queue or the key's share of
        it is full), 503 (draining), 504 (the deadline passed while waiting)."""
        if self.draining:
            raise unavailable_error("the server is shutting down", "shutting_down")
        waiter = Waiter(tenant, min(need, self.slots), affinity, asyncio.Future())
        try:
            self.queue.put(waiter)
        except QueueFull as e:
            per = self.queue.per_tenant
            raise queue_full_error(e.scope, self.queue.maxsize, per, 1) from None
        self._dispatch()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
                replica = await asyncio.shield(waiter.placed)
        except BaseException as e:
            self._withdraw(waiter)
            if isinstance(e, TimeoutError):
                raise timeout_error() from None
            raise
        return Sent(self, waiter, replica)

    def _withdraw(self, waiter: Waiter) -> None:
        """A waiter leaves (its client went, its deadline passed): its place is free at once;
        slots already given to it are given back."""
        if waiter.placed.done() and not waiter.placed.cancelled():
            if waiter.placed.exception() is None:
                Sent(self, waiter, waiter.placed.result()).free()
            return
        waiter.placed.cancel()
        if self._next is waiter:
            self._next = None
        else:
            self.queue.remove(waiter)
        self._dispatch()

    def release(self, sent: Sent) -> None:
        _add(self.running, sent.replica, -sent.waiter.need)
        _add(self.by_tenant, sent.waiter.tenant, -sent.waiter.need)
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free slots to waiters: the next tenant's turn first (serve.job_queue), a
        waiter that fits nowhere yet keeping its turn."""
        while True:
            if self._next is None:
                cap = self._per_key * max(1, len(self.known))
                busy = frozenset(t for t, held in self.by_tenant.items() if held >= cap)
                self._next = self.queue.get(block=False, busy=busy)
                if self._next is None:
                    return
            waiter = self._next
            if waiter.placed.done():  # withdrawn meanwhile
                self._next = None
                continue
            replica = self._place(waiter)
            if replica is None:
                return
            self._next = None
            _add(self.running, replica, waiter.need)
            _add(self.by_tenant, waiter.tenant, waiter.need)
            waiter.placed.set_result(replica)

    def _place(self, waiter: Waiter) -> str | None:
        """The replica for `waiter`: its pair's home while that has room, else the least loaded
        with room, where its prompt evicts the least recently used one first; None: none has
        room."""
        room = [r for r in self.known if self.running[r] + waiter.need <= self.slots]
        if not room:
            return None
        homes = self.homes.get(waiter.tenant, {})
        home = homes.get(waiter.affinity) if waiter.affinity else None
        if home in room:
            return home
        mix = waiter.affinity or ""
        return min(room, key=lambda r: (self.running[r], self._evicts(r), _mix(mix, r)))

    def _evicts(self, replica: str) -> tuple[int, int]:
        """What a new prompt costs `replica`, which keeps the prompts of its last `slots`
        answers: (0, 0) while it keeps fewer, else (1, the turn of the oldest it keeps)."""
        kept = self.kept.get(replica, ())
        return (0, 0) if len(kept) < self.slots else (1, kept[0])

    def answered(self, tenant: str, affinity: str | None, replica: str) -> None:
        """`replica` answered a generation: its prompt is kept there, and it is its pair's home
        (bounded per tenant)."""
        self.kept.setdefault(replica, collections.deque(maxlen=self.slots)).append(next(self._turn))
        if not affinity:
            return
        homes = self.homes.setdefault(tenant, OrderedDict())
        homes[affinity] = replica
        homes.move_to_end(affinity)
        while len(homes) > AFFINITY_PER_KEY:
            homes.popitem(last=False)

    @contextlib.asynccontextmanager
    async def light(self) -> AsyncIterator[None]:
        """A place for a request that is no generation (bounded, as each replica takes only
        LIGHT_PER_REPLICA of them beyond its slots)."""
        if self.draining:
            raise unavailable_error("the server is shutting down", "shutting_down")
        async with self._light:
            yield

    def drain(self) -> None:
        """Shutting down: new requests and the waiting ones get 503; running answers finish."""
        self.draining = True
        error = unavailable_error("the server is shutting down", "shutting_down")
        waiting = [*self.queue.take_all(), *([self._next] if self._next else [])]
        self._next = None
        for waiter in waiting:
            if not waiter.placed.done():
                waiter.placed.set_exception(error)

    # -------------------------------------------------------------- the replicas
    async def ask(self, fwd: Forwarded, timeout: float) -> tuple[int, list, bytes]:
        """A whole answer to `fwd` within `timeout` seconds (cancelled past them)."""
        answer = self.replicas.call(fwd)
        try:
            async with asyncio.timeout(timeout):
                status, head = await answer.__anext__()
                return status, head, b"".join([c async for c in answer])
        except BaseException:
            answer.cancel()
            raise

    async def watch(self) -> None:
        """Find the replicas and probe them, until cancelled."""
        while True:
            with contextlib.suppress(Exception):
                await self.probe()
            self._changed.clear()
            pause = WATCH_S if len(self.known) >= self.want else 0.5
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._changed.wait()

    def suspect(self) -> None:
        """An answer failed: probe now."""
        self._changed.set()

    async def probe(self) -> None:
        """Each known replica's /health, pinned to it; then any others, until `want` are known."""
        for name in list(self.known):
            fwd = Forwarded("GET", "/health", b"", [], b"", replica=name, strict=True)
            try:
                status, _, _ = await self.ask(fwd, PROBE_S)
                missed = status != 200
            except TimeoutError:
                missed = True
            except Exception:  # gone (Ray names its replacement anew)
                self._forget(name)
                continue
            self.known[name] = self.known.get(name, 0) + 1 if missed else 0
            if self.known[name] >= PROBE_MISSES:
                self._forget(name)
        while len(self.known) < self.want:
            fwd = Forwarded("GET", "/health", b"", [], b"", avoid=tuple(self.known))
            try:
                status, head, _ = await self.ask(fwd, PROBE_S)
            except Exception:  # none answered: one is starting, or gone
                break
            name = replica_of(head)
            if status != 200 or name is None or name in self.known:
                break
            self.known[name] = 0
        self._dispatch()

    def _forget(self, replica: str) -> None:
        self.known.pop(replica, None)
        self.kept.pop(replica, None)

    def gauges(self) -> str:
        """The edge's own state, in Prometheus text (with serve.cluster.merge_metrics's)."""
        lines = [
            "# HELP specdec_edge_waiting Generations waiting at the cluster's edge for a slot.",
            "# TYPE specdec_edge_waiting gauge",
            f"specdec_edge_waiting {len(self.queue) + (self._next is not None)}",
            "# HELP specdec_edge_slots_held Slots the edge has sent generations to, per replica.",
            "# TYPE specdec_edge_slots_held gauge",
            *(f'specdec_edge_slots_held{{replica="{r}"}} {self.running[r]}' for r in self.known),
            "# HELP specdec_edge_replicas Engine replicas the edge can reach.",
            "# TYPE specdec_edge_replicas gauge",
            f"specdec_edge_replicas {len(self.known)}",
        ]
        return "\n".join(lines) + "\n"


def _add(counts: Counter[str], key: str, n: int) -> None:
    """counts[key] += n, dropping a key that reaches 0 (the counts hold only what is held)."""
    counts[key] += n
    if counts[key] <= 0:
        del counts[key]


def _mix(affinity: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{affinity}/{replica}".encode(), digest_size=8).digest()


def replica_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The replica that answered, from its x-specdec-replica header."""
    for k, v in headers:
        if k.lower() == b"x-specdec-replica":
            return v.decode("latin-1")
    return None
