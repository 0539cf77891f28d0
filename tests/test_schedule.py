"""The suite's scheduler (tests/schedule.py), run against simulated workers that behave as
xdist's do: a worker starts a test only once it knows the next one or has been told to stop."""

from __future__ import annotations

import heapq
from types import SimpleNamespace

from schedule import load_durations, make_scheduler, scope_of
from xdist.scheduler import LoadScopeScheduling


class Node:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _config() -> SimpleNamespace:
    option = SimpleNamespace(tx=["2*popen"], loadscopereorder=True, dist="loadfile")
    return SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))


def _run(sched, seconds: dict[str, float], workers: int = 2) -> tuple[float, list[list[str]]]:
    """(when the last worker finishes, each worker's modules in the order it started them)."""
    collection = list(seconds)
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    running: list[tuple[float, int, int]] = []  # (ends at, node number, test index)
    busy = [False] * workers
    started: list[list[str]] = [[] for _ in nodes]
    now = 0.0
    while True:
        for i, node in enumerate(nodes):
            if not busy[i] and node.queue and (len(node.queue) >= 2 or node.shutting_down):
                test = collection[node.queue[0]]
                if not started[i] or started[i][-1] != scope_of(test):
                    started[i].append(scope_of(test))
                heapq.heappush(running, (now + seconds[test], i, node.queue[0]))
                busy[i] = True
        if not running:
            break
        now, i, index = heapq.heappop(running)
        busy[i] = False
        nodes[i].queue.pop(0)
        sched.mark_test_complete(nodes[i], index)
    assert all(not n.queue for n in nodes), "a test was never run"
    return now, started


#: Four modules: many short tests in two, two long ones in another (count order puts it last).
SUITE = {
    **{f"tests/a.py::t{i}": 1.0 for i in range(30)},
    **{f"tests/b.py::t{i}": 1.0 for i in range(20)},
    "tests/c.py::slow": 39.0,
    "tests/c.py::short": 1.0,
    **{f"tests/d.py::t{i}": 1.0 for i in range(10)},
}


def test_a_free_worker_takes_the_costliest_module_left() -> None:
    end, started = _run(make_scheduler(_config(), None, seconds=SUITE), SUITE)
    assert started == [["tests/c.py", "tests/d.py"], ["tests/a.py", "tests/b.py"]]
    assert end == 50.0  # the best any split of these modules can do: 40 + 10 | 30 + 20


def test_xdists_own_order_by_count_finishes_later_on_the_same_suite() -> None:
    """The reason for the scheduler: the same simulation, xdist's LoadScopeScheduling."""
    end, _ = _run(LoadScopeScheduling(_config(), None), SUITE)
    assert end > 60.0


def test_an_unknown_module_still_runs_and_every_test_once() -> None:
    suite = {**SUITE, "tests/new.py::t0": 3.0}
    end, started = _run(make_scheduler(_config(), None, seconds=SUITE), suite)
    assert sum(len(s) for s in started) == 5 and end <= 53.0


def test_the_ray_modules_share_a_worker_and_the_durations_file_reads() -> None:
    ray = {scope_of("tests/serve/test_cluster.py::x"), scope_of("tests/serve/test_two_nodes.py::y")}
    assert len(ray) == 1
    seconds = load_durations()
    assert seconds and all(s > 0 for s in seconds.values())
