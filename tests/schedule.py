"""How `make test` shares its modules between its workers (pytest-xdist, `--dist loadfile`).

A module's tests run in one worker, so that a module-scoped fixture (a loaded model, a server, a
cluster, a statistical baseline) is built once; the modules of SHARED_WORKER run in the same one.
A free worker takes the costliest module left (longest processing time first: the last module
to start is a short one, so the workers finish together), its cost the sum of its tests'
seconds in tests/durations.json. Costs only order the work: a stale or missing entry makes the
suite slower, never wrong. `SPECDEC_TEST_DURATIONS=1 make test` rewrites the file from the run.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
#: The seconds assumed for a test the file does not know (a new one): the median test's order.
UNKNOWN_S = 0.2
#: Tests shorter than this are left out of the file (UNKNOWN_S stands for them).
KEEP_S = 0.5

#: Modules sent to one worker together, one after the other: both start Ray and look at the
#: whole machine's Ray and engine processes (test_cluster counts them before and after, finds its
#: replicas by name to kill one), which the other's would confuse.
SHARED_WORKER = {"tests/serve/test_cluster.py": "ray", "tests/serve/test_two_nodes.py": "ray"}


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def scope_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(module, module)


def make_scheduler(config, log, seconds: dict[str, float] | None = None):
    """The scheduler for `--dist loadfile`, on xdist's LoadScopeScheduling; `seconds` per test
    id (tests/durations.json unless given). (xdist_group marks cannot group modules: xdist
    3.8's loadgroup renames `item._nodeid`, which pytest 9 no longer reads, so every test is its
    own group.)"""
    from xdist.scheduler import LoadScopeScheduling

    seconds = load_durations() if seconds is None else seconds

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            def cost(scope: str) -> float:
                return sum(seconds.get(t, UNKNOWN_S) for t in self.workqueue[scope])

            self.workqueue.move_to_end(max(self.workqueue, key=cost), last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # A worker runs a test once it knows the next one (or is told to stop), so with one
            # test left it is idle: that is when it takes the next module, not one test earlier
            # (xdist's default), which could give a long module to a worker still busy.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return ModuleScheduling(config, log)


class DurationRecorder:
    """Sums each test's setup, call and teardown seconds as the reports arrive and merges them
    into tests/durations.json at the end; registered in the controller alone under xdist
    (conftest), which receives every worker's reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        merged = load_durations()
        for nodeid, s in self.seconds.items():
            merged.pop(nodeid, None)
            if s >= KEEP_S:
                merged[nodeid] = round(s, 1)
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def wants_recording(config) -> bool:
    """Asked for, and this is not an xdist worker (the controller writes the file)."""
    return os.environ.get("SPECDEC_TEST_DURATIONS") == "1" and not hasattr(config, "workerinput")
