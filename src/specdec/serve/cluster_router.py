"""serve.cluster's request router, a module of its own because it subclasses Ray's (imported
here, so only where Ray runs it: the ingress replica's process)."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.serve.cluster import AFFINITY_MEMORY, Forwarded


class AffinityRouter(RequestRouter):
    """The replica that answered a request's (key, prefix) last, while it has a free slot; else
    the least loaded of the others. Ray's loop tries each rank in turn, taking a replica whose
    queue is under max_ongoing_requests, and backs off when none has room."""

    def initialize_state(self, slots: int = 1, **kwargs: Any) -> None:
        self._slots = slots  # --parallel: the prompts each replica's prompt cache keeps
        # (key, prefix) -> the replica that answered it last, least recently routed first
        self._home: OrderedDict[str, ReplicaID] = OrderedDict()

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
        home_id = self._home.get(affinity) if affinity else None
        home = [r for r in candidate_replicas if r.replica_id == home_id]
        rest = [r for r in candidate_replicas if r.replica_id != home_id]
        # One replica a rank, so that this order holds (within a rank Ray prefers a replica whose
        # queue length it has cached): the least loaded as last seen; then, for a new pair, the
        # replica where its prompt evicts the least recently used one (`_evicts`); then a hash
        # of the pair; a request without one, at random.
        evicts = self._evicts() if affinity else {}
        random.shuffle(rest)
        rest.sort(
            key=lambda r: (
                self._replica_queue_len_cache.get(r.replica_id) or 0,
                evicts.get(r.replica_id, (0, 0)),
                _mix(affinity, r.replica_id.unique_id) if affinity else b"",
            )
        )
        return [[r] for r in home + rest]

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
        if fwd is not None and fwd.affinity and fwd.replica is None:
            self._home[fwd.affinity] = replica_id
            self._home.move_to_end(fwd.affinity)
            while len(self._home) > AFFINITY_MEMORY:
                self._home.popitem(last=False)


def _mix(affinity: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{affinity}/{replica}".encode(), digest_size=8).digest()


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    args = getattr(pending_request, "args", None) or ()
    return args[0] if args and isinstance(args[0], Forwarded) else None
