"""serve.cluster's request router, a module of its own because it subclasses Ray's (imported
here, so only where Ray runs it: the ingress replica's process)."""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.serve.cluster import AFFINITY_MEMORY, Forwarded

#: Seconds a choice counts against its replica's slots before it is carried out.
CHOSEN_S = 10.0


class AffinityRouter(RequestRouter):
    """A request with an affinity goes to the replica that answered it last while that replica
    has a free slot; else to another with a free slot, the least loaded first; else it waits
    here (Ray's loop backs off and asks again) until a slot frees, so a replica that dies takes
    only its running generations with it. Requests without one (/health, /metrics,
    /v1/models) go anywhere: a replica takes LIGHT_REQUESTS of them beyond its slots
    (serve.cluster.build_app).

    Slots are counted here, of the generations this router sent (`_sent`), with the choices
    made but not yet carried out (`_chosen`): Ray routes several requests at once, and each
    would otherwise see the same free replica."""

    def initialize_state(self, slots: int = 1, **kwargs: Any) -> None:
        self._slots = slots  # --parallel: generations a replica runs at once, prompts it keeps
        # (key, prefix) -> the replica that answered it last, least recently routed first
        self._home: OrderedDict[str, ReplicaID] = OrderedDict()
        self._sent: dict[str, ReplicaID] = {}  # generations running, by Ray's request id
        self._chosen: dict[str, tuple[ReplicaID, float]] = {}  # first choices, by request id

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        fwd = _forwarded(pending_request)
        if pending_request is not None:  # past these ranks, back off before the next try
            pending_request.routing_context.should_backoff = True
        if fwd is not None and fwd.replica is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == fwd.replica]
            return [pinned] if pinned else []
        affinity = fwd.affinity if fwd is not None else None
        if not affinity or pending_request is None:  # anywhere (but where `avoid` says not)
            avoid = fwd.avoid if fwd is not None else ()
            rest = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
            random.shuffle(rest)
            return [rest] if rest else []
        load = self._load()
        free = [r for r in candidate_replicas if load[r.replica_id] < self._slots]
        home_id = self._home.get(affinity)
        # home; else the least loaded, then where the new prompt evicts the least recently
        # used one (`_evicts`), then a hash of the pair; one replica a rank, so that the order
        # holds (within a rank Ray prefers a replica whose queue length it has cached)
        evicts = self._evicts()
        free.sort(
            key=lambda r: (
                r.replica_id != home_id,
                load[r.replica_id],
                evicts.get(r.replica_id, (0, 0)),
                _mix(affinity, r.replica_id.unique_id),
            )
        )
        if free:
            rid = pending_request.metadata.internal_request_id
            self._chosen[rid] = (free[0].replica_id, time.monotonic())
        return [[r] for r in free]

    def _load(self) -> Counter[ReplicaID]:
        """Generations per replica: those sent, and those chosen in the last CHOSEN_S."""
        now = time.monotonic()
        for rid, (_, at) in list(self._chosen.items()):
            if now - at > CHOSEN_S:  # never carried out (cancelled while it waited)
                del self._chosen[rid]
        chosen = (replica for replica, _ in self._chosen.values())
        return Counter(self._sent.values()) + Counter(chosen)

    def _evicts(self) -> dict[ReplicaID, tuple[int, int]]:
        """Per replica, what a new prompt would cost its slots, which keep the last `slots`
        pairs routed to it: (0, 0) while it holds fewer (a replica not listed too), else (1,
        minus the age of the oldest it keeps), so the least recently used prompt goes."""
        held: dict[ReplicaID, list[int]] = {}
        for age, replica in enumerate(reversed(self._home.values())):
            kept = held.setdefault(replica, [])
            if len(kept) < self._slots:
                kept.append(age)
        return {r: (0, 0) if len(k) < self._slots else (1, -k[-1]) for r, k in held.items()}

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        fwd = _forwarded(pending_request)
        if fwd is None or not fwd.affinity or fwd.replica is not None:
            return
        self._home[fwd.affinity] = replica_id
        self._home.move_to_end(fwd.affinity)
        while len(self._home) > AFFINITY_MEMORY:
            self._home.popitem(last=False)
        rid = pending_request.metadata.internal_request_id
        self._chosen.pop(rid, None)
        self._sent[rid] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._sent.pop(internal_request_id, None)


def _mix(affinity: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{affinity}/{replica}".encode(), digest_size=8).digest()


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    args = getattr(pending_request, "args", None) or ()
    return args[0] if args and isinstance(args[0], Forwarded) else None
