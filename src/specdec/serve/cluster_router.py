"""serve.cluster's request router, a module of its own because it subclasses Ray's (imported
here, so only where Ray runs it: the edge's process)."""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec.serve.front_door import Forwarded


class EdgeChoice(RequestRouter):
    """Carries out the edge's choice (serve.front_door keeps every count, in one loop): a
    request named for a replica goes there; if that replica is gone, a generation goes to
    another (the edge moves its count by the answer's x-specdec-replica) and a probe goes
    nowhere (`strict`: it fails at its time-out); a request named for none goes to any but
    those it avoids. No state: nothing here can be left counted."""

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
            if pinned or fwd.strict:
                return [pinned] if pinned else []
        avoid = fwd.avoid if fwd is not None else ()
        rest = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        random.shuffle(rest)
        return [rest] if rest else []


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    args: Any = getattr(pending_request, "args", None) or ()
    return args[0] if args and isinstance(args[0], Forwarded) else None
