"""The cores this process may use, and how many threads its passes should run on.

ggml's threads meet at a barrier after every op, so a pass runs at the pace of its slowest
thread: n threads on n cores where other work holds a share of one core wait for that core at
every barrier. Fewer threads than cores lose far less (docs/serving.md, "A machine shared with
other work"). But other work is not always competition: a build under `nice` in this process's
session (autogroup) takes only the cycles this process leaves. So the pool follows what the
kernel says its threads went through, each half-second window:

  * the time the pool's threads waited on a run queue (/proc/self/task/*/schedstat): they
    wait when others compete for their cores as equals; a niced neighbour makes them wait not
    at all. A quarter of a second waited per second takes a thread away. The pool's threads
    are the n that ran the most in the window (ggml's spin at barriers): an HTTP server's
    threads beside them, runnable under load, are not the pool and do not count.
  * the busy time of this process's cores less its own CPU time (/proc/stat): a core nobody
    uses gives a thread back at once; a core someone uses is tried (one window with a thread
    more): kept if no thread waited, else given up and tried again after twice as long.

A thread count never changes a logit: every op splits its rows among the threads, never a sum
(tests/backends/test_cores.py checks a prompt pass, a verify pass and single steps bit for bit).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds between two decisions: a 160-token answer spans ~10 windows.
WINDOW_S = 0.5
#: Run-queue wait, in threads (seconds waited per second), that takes a thread away: idle and
#: beside a niced build in the same session ~0.01-0.04, beside an equal competitor 0.4-1.3.
WAIT_DROP = 0.25
#: Other work under this many cores beside the pool's leaves a core idle: a thread comes back.
FREE_BELOW = 0.4
#: Seconds before a core held by others is tried again, doubled after each failed try.
TRY_AFTER_S, TRY_AFTER_MAX_S = 4.0, 64.0


def affinity_cores() -> int:
    """The cores this process may run on (a container's cpuset can be smaller than cpu_count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cgroup_cores(
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    root: str | os.PathLike[str] = "/sys/fs/cgroup",
) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in cores (cgroup v2 cpu.max,
    v1 cpu.cfs_quota_us / cpu.cfs_period_us); None where there is none or it cannot be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":  # v2: one hierarchy
            base, reader = Path(root), _v2_quota
        elif "cpu" in controllers.split(","):
            dirs = [Path(root) / d for d in ("cpu,cpuacct", "cpu")]
            base = next((d for d in dirs if d.is_dir()), None)
            if base is None:
                continue
            reader = _v1_quota
        else:
            continue
        rel = Path(path.strip().lstrip("/"))
        for d in [rel, *rel.parents]:  # the process's group and every group above it
            q = reader(base / d)
            if q is not None:
                quotas.append(q)
    return min(quotas) if quotas else None


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cores() -> int:
    """The threads a pass may use: this process's cores, fewer where a cgroup's CPU quota is
    less (a quota of 1.5 cores gets 1 thread: a second would be throttled at every barrier)."""
    n = affinity_cores()
    quota = cgroup_cores()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return n


def busy_ticks(
    cpus: set[int] | None = None, stat: str | os.PathLike[str] = "/proc/stat"
) -> int | None:
    """Busy clock ticks of `cpus` (None: all) since boot: user, nice, system, irq, softirq and
    steal (a hypervisor's other guests hold the core as surely as a process does); None where
    /proc/stat cannot be read."""
    total = 0
    try:
        with open(stat) as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                v = [int(x) for x in fields[:8]]
                total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    except (OSError, ValueError, IndexError):
        return None
    return total


def thread_times() -> dict[int, tuple[float, float]] | None:
    """Per live thread of this process: (seconds it ran, seconds it waited on a run queue), its
    schedstat's first two fields; None where the kernel says nothing of any thread."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    times = {}
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            times[int(t)] = (int(ran) / 1e9, int(waited) / 1e9)
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return times or None


def pool_wait(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], pool: int
) -> float:
    """Seconds waited between two thread_times() by the `pool` threads that ran the most."""
    deltas = [
        (ran - before.get(t, (0.0, 0.0))[0], waited - before.get(t, (0.0, 0.0))[1])
        for t, (ran, waited) in after.items()
    ]
    busiest = sorted(deltas, reverse=True)[: max(1, pool)]
    return sum(max(0.0, waited) for _, waited in busiest)


class Mark:
    """A point to measure from: the clock, the cores' busy ticks, this process's CPU time and
    its threads' run-queue wait. `since` says what happened between it and now."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[], int | None] | None = None,
        own: Callable[[], float] = time.process_time,
        waited: Callable[[], dict[int, tuple[float, float]] | None] = thread_times,
        tick_s: float | None = None,
    ) -> None:
        if busy is None:  # this process's cores, as they are now
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            busy = lambda: busy_ticks(cpus)  # noqa: E731
        self._clock, self._own, self._waited, self._busy = clock, own, waited, busy
        self._tick = tick_s or 1.0 / os.sysconf("SC_CLK_TCK")
        self.t, self.ticks, self.cpu, self.wait = clock(), self._busy(), own(), waited()

    def age(self) -> float:
        """Seconds since this mark."""
        return self._clock() - self.t

    def since(self, pool: int = 1) -> tuple[float | None, float | None, Mark]:
        """(other processes' work on this process's cores, in cores; the run-queue wait of the
        `pool` threads that ran the most, in threads; a mark for now); None where it cannot be
        read."""
        now = Mark(self._clock, self._busy, self._own, self._waited, self._tick)
        wall = now.t - self.t
        if wall <= 0:
            return None, None, now
        others = waited = None
        if self.ticks is not None and now.ticks is not None:
            busy_s = (now.ticks - self.ticks) * self._tick
            others = max(0.0, (busy_s - (now.cpu - self.cpu)) / wall)
        if self.wait is not None and now.wait is not None:
            waited = pool_wait(self.wait, now.wait, pool) / wall
        return others, waited, now


class ThreadGovernor:
    """The pool size for the next pass (the module docstring says how it is chosen).

    `threads()` is called before every pass, from any thread; it reads /proc at most once a
    window. `others` and `waited` are the latest window's (None until one has passed).
    """

    def __init__(self, cores: int, *, window_s: float = WINDOW_S, mark: Mark | None = None) -> None:
        self.cores = cores
        self.n = cores
        self.others: float | None = None
        self.waited: float | None = None
        self.changes = 0  # how often the pool was resized
        self._window = window_s
        self._lock = threading.Lock()
        self._mark = mark or Mark()  # a test's Mark reads a fake machine
        self._trying = False  # this window runs a thread more than the last: on trial
        self._try_after = TRY_AFTER_S
        self._next_try = self._mark.t

    def threads(self) -> int:
        with self._lock:
            if self._mark.age() < self._window:
                return self.n
            # a longer span too (a long prefill, an idle server) is one window: its average
            try:
                others, waited, self._mark = self._mark.since(self.n)
            except Exception as e:  # /proc as no kernel writes it: keep the pool, say so once
                self._unreadable(e)
                return self.n
            if others is None or waited is None:
                return self.n  # the kernel does not say (not Linux): the pool keeps its size
            self.others, self.waited = others, waited
            self._set(self._decide(others, waited, self._mark.t))
            return self.n

    def _unreadable(self, e: Exception) -> None:
        self._mark = Mark(busy=lambda: None, waited=lambda: None)  # measures nothing from now
        log.warning("the thread pool keeps %d thread(s): /proc unreadable (%r)", self.n, e)

    def _decide(self, others: float, waited: float, now: float) -> int:
        n, trial = self.n, self._trying
        self._trying = False
        if waited >= WAIT_DROP and n > 1:  # others compete for these cores as equals
            if trial:  # the thread tried did not get its core: back off
                self._try_after = min(2 * self._try_after, TRY_AFTER_MAX_S)
            self._next_try = now + self._try_after
            return max(1, min(n - 1, self.cores - round(others)))
        if trial:
            self._try_after = TRY_AFTER_S  # the others yielded: the thread stays
        idle_core = others < self.cores - n - 1 + FREE_BELOW
        if n < self.cores and (idle_core or now >= self._next_try):
            self._trying = not idle_core  # a core others hold: a trial
            return n + 1
        return n

    def _set(self, n: int) -> None:
        if n != self.n:
            self.n, self.changes = n, self.changes + 1


#: Weight of a pass in the pace's moving average: ~the last 10 passes.
PACE_WEIGHT = 0.1
#: The pace at which the log says, once, that the machine is contended.
SLOW_AT = 3.0


def _size(tokens: int) -> int:
    """A pass's size class: exact up to 64 tokens (steps and verify passes), then powers of 2."""
    return tokens if tokens <= 64 else 1 << (tokens - 1).bit_length()


class PassPace:
    """How much slower llama.cpp's passes run now than the fastest this process has run a pass
    of the same model and size: 1 on an idle machine, 4 beside a build. The fastest is this
    process's own idle cost; a process that never ran on an idle machine reads low
    (`specdec doctor` measures again after a quiet wait)."""

    def __init__(self, weight: float = PACE_WEIGHT, slow_at: float = SLOW_AT) -> None:
        self.pace = 1.0
        self.threads = 0  # the pool of the latest pass
        self._fastest: dict[tuple[str, int], float] = {}
        self._weight, self._slow_at, self._told = weight, slow_at, False
        self._lock = threading.Lock()

    def record(self, model: str, tokens: int, seconds: float, threads: int) -> None:
        with self._lock:
            key = (model, _size(tokens))
            fastest = self._fastest[key] = min(seconds, self._fastest.get(key, seconds))
            ratio = seconds / fastest if fastest > 0 else 1.0
            self.pace += self._weight * (ratio - self.pace)
            self.threads = threads
            if self.pace >= self._slow_at and not self._told:
                self._told = True
                others = governor().others
                log.warning(
                    "llama.cpp passes run %.1fx their idle cost: other work holds %s of this "
                    "machine's cores; the pool runs %d thread(s) (docs/serving.md, a machine "
                    "shared with other work)",
                    self.pace,
                    "unknown" if others is None else f"{others:.1f}",
                    threads,
                )

    def gauges(self) -> dict[str, float]:
        """/metrics: the pace, the pool, and the cores other work held in the latest window."""
        g = governor()
        return {
            "specdec_pass_pace": round(self.pace, 3),
            "specdec_threads": self.threads,
            "specdec_other_cores": -1.0 if g.others is None else round(g.others, 3),
            "specdec_thread_wait": -1.0 if g.waited is None else round(g.waited, 3),
        }


_pace = PassPace()


def pace() -> PassPace:
    """The process's one pace: every llama.cpp pass records into it."""
    return _pace


_governor: ThreadGovernor | None = None
_governor_lock = threading.Lock()


def governor() -> ThreadGovernor:
    """The process's one governor: every model in a process shares its cores."""
    global _governor
    with _governor_lock:
        if _governor is None:
            try:
                _governor = ThreadGovernor(usable_cores())
            except Exception as e:  # a /proc or cgroup file as no kernel writes it
                _governor = ThreadGovernor(affinity_cores(), mark=Mark(busy=lambda: None))
                _governor._unreadable(e)
        return _governor
