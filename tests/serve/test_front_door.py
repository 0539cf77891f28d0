"""serve.front_door, the cluster edge's routing state, without HTTP or Ray: slots counted where a
request is sent and freed once where its answer ends (so nothing leaks, whatever order things
end in), n samples as n slots, per-key turns and bounds, each key's own affinity memory,
deadlines from arrival, a waiter that leaves freeing its place at once; and Ray's side of the
choice (serve.cluster_router.EdgeChoice). The edge over HTTP: test_hostile.py; with Ray:
test_cluster.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from specdec.serve.config import ServeConfig
from specdec.serve.edge import replica_error
from specdec.serve.errors import ApiError
from specdec.serve.front_door import AFFINITY_PER_KEY, Forwarded, FrontDoor, samples_of

LONG = 60.0  # a deadline no test reaches


def _door(replicas: tuple[str, ...] = ("a", "b"), **cfg: Any) -> FrontDoor:
    """A door that knows `replicas` (the probes' job, here done by hand)."""
    door = FrontDoor(None, ServeConfig(target="mock", replicas=len(replicas), **cfg))  # type: ignore[arg-type]
    for name in replicas:
        door.known[name] = 0
    return door


async def _admit(door: FrontDoor, tenant: str = "t", need: int = 1, affinity: str | None = None):
    return await door.admit(tenant, need, affinity, time.perf_counter() + LONG)


async def _pending(door: FrontDoor, *args: Any) -> asyncio.Task:
    """An admission that must wait: its task, once it is queued."""
    task = asyncio.create_task(_admit(door, *args))
    await asyncio.sleep(0)
    assert not task.done()
    return task


def test_a_pair_stays_home_new_pairs_spread_and_a_full_home_sends_it_elsewhere() -> None:
    async def run() -> None:
        door = _door(parallel=1)
        first = []
        for pair in ("p0", "p1"):
            sent = await _admit(door, "t", 1, pair)
            door.answered("t", pair, sent.replica)
            first.append(sent.replica)
            sent.free()
        assert sorted(first) == ["a", "b"]  # an empty slot first: no replica holds both
        again = await _admit(door, "t", 1, "p0")
        assert again.replica == first[0]  # home
        elsewhere = await _admit(door, "t", 1, "p0")
        assert elsewhere.replica == first[1]  # its home is full: the free one
        waiting = await _pending(door, "t", 1, "p0")  # every slot taken: it waits
        elsewhere.free()
        assert (await waiting).replica == first[1]
        assert door.running == {"a": 1, "b": 1}

    asyncio.run(run())


def test_a_new_pair_evicts_the_least_recently_used_prompt() -> None:
    async def run() -> None:
        for slots in (1, 2):
            door = _door(parallel=slots)
            homes = {}
            for i in range(2 * slots):  # each replica keeps `slots` prompts
                sent = await _admit(door, "t", 1, f"p{i}")
                door.answered("t", f"p{i}", sent.replica)
                homes[f"p{i}"] = sent.replica
                sent.free()
            assert sorted(homes.values()) == ["a"] * slots + ["b"] * slots
            again = await _admit(door, "t", 1, "p0")  # p0's replica now used it last
            door.answered("t", "p0", again.replica)
            again.free()
            new = await _admit(door, "t", 1, "new")
            assert new.replica == homes["p1"], (slots, homes)  # p1's is the oldest prompt kept
            new.free()

    asyncio.run(run())


def test_slots_are_freed_once_whatever_ends_first() -> None:
    async def run() -> None:
        door = _door(parallel=2)
        sent = await _admit(door, need=2)
        sent.moved("b" if sent.replica == "a" else "a")  # the answer came from the other
        sent.free()
        sent.free()  # the stream's end and the handler's error path both free: counted once
        assert not door.running and not door.by_tenant
        # an answer that ends at once (a fast 404) frees before anything else happens
        for _ in range(100):
            (await _admit(door)).free()
        assert not door.running and not door.by_tenant and not len(door.queue)

    asyncio.run(run())


def test_n_samples_take_n_slots_up_to_a_replicas_slots() -> None:
    async def run() -> None:
        door = _door(("a",), parallel=4)
        three = await _admit(door, need=3)
        assert door.running["a"] == 3
        two = await _pending(door, "t", 2)  # 3 + 2 > 4: waits
        three.free()
        (await two).free()
        assert (await _admit(door, need=16)).waiter.need == 4  # more than a replica runs at once

    asyncio.run(run())
    assert samples_of({"n": 3}) == 3
    assert [samples_of(x) for x in ({"n": 99}, {"n": True}, {"n": "2"}, None, [])] == [1] * 5


def test_a_waiter_that_leaves_frees_its_place_at_once() -> None:
    async def run() -> None:
        door = _door(("a",), parallel=1, max_queue=1)
        running = await _admit(door, "t")
        waiter = await _pending(door, "t")
        with pytest.raises(ApiError) as full:  # the one place is taken
            await _admit(door, "u")
        assert full.value.status == 429 and full.value.code == "queue_full"
        waiter.cancel()  # its client went away
        await asyncio.sleep(0)
        assert not len(door.queue)
        third = await _pending(door, "u")  # the place is free again
        running.free()
        assert (await third).replica == "a" and door.by_tenant == {"u": 1}

    asyncio.run(run())


def test_a_deadline_runs_from_arrival_while_waiting() -> None:
    async def run() -> None:
        door = _door(("a",))
        held = await _admit(door)
        started = time.perf_counter()
        with pytest.raises(ApiError) as late:
            await door.admit("t", 1, None, started + 0.2)
        assert late.value.status == 504 and late.value.code == "timeout"
        assert 0.15 < time.perf_counter() - started < 2
        assert not len(door.queue) and door._next is None
        held.free()
        assert not door.running

    asyncio.run(run())


def test_keys_take_turns_and_each_has_its_share_of_the_queue() -> None:
    async def run() -> None:
        # one replica, one slot, 4 places per replica, 2 per key (two keys: half each)
        door = _door(("a",), parallel=1, max_queue=4, api_keys=("k1", "k2"))
        running = await _admit(door, "flood")
        backlog = [await _pending(door, "flood") for _ in range(2)]
        with pytest.raises(ApiError) as share:
            await _admit(door, "flood")
        assert share.value.status == 429 and "this API key" in share.value.message
        other = await _pending(door, "other")
        running.free()  # the other key goes next, ahead of the flood's backlog
        assert (await other).waiter.tenant == "other"
        assert not any(t.done() for t in backlog)

    asyncio.run(run())


def test_a_key_runs_at_most_its_share_of_the_slots() -> None:
    async def run() -> None:
        door = _door(("a", "b"), parallel=2, api_keys=("k1", "k2"))  # 1 slot per key a replica
        held = [await _admit(door, "k1") for _ in range(2)]
        third = await _pending(door, "k1")  # slots are free, but not for this key
        other = await _admit(door, "k2")
        held[0].free()
        assert (await third).waiter.tenant == "k1"
        other.free()

    asyncio.run(run())


def test_each_keys_affinity_memory_evicts_only_its_own() -> None:
    door = _door()
    door.answered("quiet", "home", "a")
    for i in range(AFFINITY_PER_KEY + 50):
        door.answered("busy", f"pair{i}", "b")
    assert door.homes["quiet"] == {"home": "a"}
    assert len(door.homes["busy"]) == AFFINITY_PER_KEY and "pair0" not in door.homes["busy"]


def test_draining_fails_the_waiting_and_refuses_new_ones() -> None:
    async def run() -> None:
        door = _door(("a",))
        held = await _admit(door)
        waiter = await _pending(door)
        door.drain()
        with pytest.raises(ApiError) as gone:
            await waiter
        assert gone.value.status == 503
        with pytest.raises(ApiError):
            await _admit(door)
        held.free()
        assert not door.running

    asyncio.run(run())


class _Id:
    def __init__(self, name: str) -> None:
        self.unique_id = name


def _choose(names: list[str], fwd: Forwarded) -> list[list[str]]:
    from specdec.serve.cluster_router import EdgeChoice

    router = EdgeChoice.__new__(EdgeChoice)  # its choice alone, without Ray's loop
    replicas = [SimpleNamespace(replica_id=_Id(n)) for n in names]
    pending = SimpleNamespace(args=[fwd], routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.routing_context.should_backoff
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def test_rays_router_carries_out_the_edges_choice() -> None:
    gen = Forwarded("POST", "/v1/completions", b"", [], b"", replica="a")
    assert _choose(["a", "b"], gen) == [["a"]]
    assert _choose(["b", "c"], gen) == [["b", "c"]]  # gone: a generation goes elsewhere
    probe = Forwarded("GET", "/health", b"", [], b"", replica="a", strict=True)
    assert _choose(["b"], probe) == []  # a probe of a gone replica goes nowhere
    find = Forwarded("GET", "/health", b"", [], b"", avoid=("a",))
    assert _choose(["a", "b", "c"], find) == [["b", "c"]]


def test_a_failed_replica_is_a_503_with_retry_after() -> None:
    from ray.exceptions import ActorDiedError

    dead = replica_error(ActorDiedError())
    assert dead.status == 503 and "ActorDiedError" in dead.body()["error"]["message"]
    assert dead.headers["Retry-After"]


def test_a_configs_repr_holds_no_key() -> None:
    cfg = ServeConfig(target="m", api_key="sk-one", api_keys=("sk-two",), metrics_key="sk-op")
    assert "sk-" not in repr(cfg) and cfg.keys() == ("sk-one", "sk-two")


def test_replicas_without_threads_share_the_cores() -> None:
    from specdec.serve.cluster import replica_threads

    assert replica_threads(ServeConfig(target="m", replicas=2), cores=8) == 4
    assert replica_threads(ServeConfig(target="m", replicas=3), cores=2) == 1
    assert replica_threads(ServeConfig(target="m", replicas=2, threads=3), cores=8) == 3
