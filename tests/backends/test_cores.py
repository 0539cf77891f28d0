"""backends.cores: the cores a process may use (affinity, cgroup quota), the pool that follows the
cores other work leaves free, and that a pool's size never changes a logit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.backends import cores, llamacpp
from specdec.backends.cores import Mark, ThreadGovernor, busy_ticks, cgroup_cores
from specdec.backends.llamacpp import LlamaCppModel


class _Machine:
    """A fake clock, /proc/stat busy ticks (100 a second per core), own CPU time and the run-queue
    wait of this process's threads."""

    def __init__(self) -> None:
        self.t = 0.0
        self.ticks = 0
        self.cpu = 0.0
        self.wait = 0.0

    def run(self, seconds: float, ours: float, others: float, waited: float = 0.0) -> None:
        """`seconds` pass with `ours` and `others` cores busy, our threads `waited` threads'
        worth of run-queue wait."""
        self.t += seconds
        self.cpu += ours * seconds
        self.ticks += round((ours + others) * seconds * 100)
        self.wait += waited * seconds

    def governor(self, cores: int) -> ThreadGovernor:
        mark = Mark(
            clock=lambda: self.t,
            busy=lambda: self.ticks,
            own=lambda: self.cpu,
            waited=lambda: {1: (self.cpu, self.wait)},  # the pool's threads, as one
            tick_s=0.01,
        )
        return ThreadGovernor(cores, window_s=0.5, mark=mark)


def test_threads_that_wait_give_a_core_up_and_try_it_again_later() -> None:
    # a build in another session: an equal competitor, on a 2-core machine
    m = _Machine()
    g = m.governor(2)
    assert g.threads() == 2 and g.others is None  # no window measured yet
    m.run(0.3, ours=2, others=0)
    assert g.threads() == 2 and g.others is None  # within the window: no re-read
    m.run(0.3, ours=2, others=0.1, waited=0.01)  # a daemon's blip: nobody waited
    assert g.threads() == 2 and g.others == pytest.approx(0.05, abs=0.02)
    m.run(0.5, ours=0.7, others=1.3, waited=1.3)  # the build: our threads wait at every turn
    assert g.threads() == 1 and g.waited == pytest.approx(1.3)
    for _ in range(7):  # 3.5 s: the build holds the other core, not tried yet
        m.run(0.5, ours=0.6, others=1.4, waited=0.4)
        assert g.threads() == 1
    m.run(0.5, ours=0.6, others=1.4, waited=0.4)  # 4 s on: one window with a thread more
    assert g.threads() == 2
    m.run(0.5, ours=0.7, others=1.3, waited=1.2)  # it waited: given up, tried after 8 s
    assert g.threads() == 1
    for _ in range(15):
        m.run(0.5, ours=0.6, others=1.4, waited=0.4)
        assert g.threads() == 1
    m.run(0.5, ours=0.6, others=1.4, waited=0.4)
    assert g.threads() == 2  # tried again, 8 s later
    m.run(0.5, ours=0.7, others=1.3, waited=1.2)
    assert g.threads() == 1
    m.run(0.5, ours=0.6, others=0.2, waited=0.0)  # the build ended: the idle core comes back
    assert g.threads() == 2 and g.changes == 6


def test_a_niced_neighbour_keeps_the_pool_whole() -> None:
    # a build under nice in this session: it takes what the pool leaves, and no thread waits
    m = _Machine()
    g = m.governor(2)
    m.run(30.0, ours=0, others=2.0)  # an idle server: the build had both cores
    assert g.threads() == 2  # nobody waited: nothing to give up
    m.run(0.5, ours=1.95, others=0.05, waited=0.03)
    assert g.threads() == 2
    # were it ever down a thread, the try finds that the neighbour yields, and keeps it
    g.n = 1
    m.run(0.5, ours=1, others=1.0, waited=0.0)
    assert g.threads() == 2  # a try (the core is held)
    m.run(0.5, ours=1.95, others=0.05, waited=0.03)
    assert g.threads() == 2  # it did not wait: kept


def test_two_equal_engines_settle_one_thread_each() -> None:
    m = _Machine()
    g = m.governor(2)
    m.run(0.5, ours=1, others=1, waited=1.0)  # both pools spin on the two cores
    assert g.threads() == 1
    m.run(0.5, ours=1, others=1, waited=0.0)  # a core each: nobody waits, the other core held
    assert g.threads() == 1  # not tried before 4 s


def test_a_big_machine_gives_up_as_many_threads_as_others_hold() -> None:
    m = _Machine()
    g = m.governor(8)
    m.run(0.5, ours=6.5, others=1.5, waited=1.0)  # a 2-job build
    assert g.threads() == 6  # 8 - round(1.5)
    m.run(0.5, ours=6, others=2.0, waited=0.02)
    assert g.threads() == 6
    m.run(0.5, ours=6, others=0.9, waited=0.0)  # a job ended: a core idles, 8 - 6 - 0.9 > 0.6
    assert g.threads() == 7


def test_without_proc_the_pool_keeps_its_size() -> None:
    g = ThreadGovernor(
        2, window_s=0.0, mark=Mark(busy=lambda: None, waited=lambda: {1: (9.0, 9.0)})
    )
    assert g.threads() == 2 and g.threads() == 2 and g.others is None
    g = ThreadGovernor(2, window_s=0.0, mark=Mark(waited=lambda: None))
    assert g.threads() == 2 and g.waited is None


def test_this_process_threads_are_read_and_none_read_is_unknown(monkeypatch) -> None:
    times = cores.thread_times()  # Linux: schedstat is there
    assert times and all(ran >= 0 and waited >= 0 for ran, waited in times.values())
    # issue 65: where no thread's schedstat can be read, the wait was 0.0, not unknown
    monkeypatch.setattr(cores.os, "listdir", lambda _: ["999999999"])
    assert cores.thread_times() is None


def test_only_the_pools_threads_wait_counts() -> None:
    """Issue 65: every thread's run-queue wait counted, an HTTP server's too; under HTTP load
    the pool flipped 2 <-> 1 threads every window. The pool is the threads that ran most."""
    now = {"t": 0.0, "http": 0.0, "pool": 0.0}

    def times() -> dict[int, tuple[float, float]]:
        t = now["t"]
        # two pool threads ran the whole window and hardly waited; the HTTP thread (runnable
        # beside them under load) ran little and waited long
        return {1: (t, now["pool"]), 2: (t, now["pool"]), 3: (0.1 * t, now["http"])}

    mark = Mark(clock=lambda: now["t"], busy=lambda: 0, own=lambda: 0.0, waited=times, tick_s=0.01)
    g = ThreadGovernor(2, window_s=0.5, mark=mark)
    for _ in range(6):
        now["t"] += 0.5
        now["http"] += 0.4
        now["pool"] += 0.005
        assert g.threads() == 2
    assert g.waited == pytest.approx(0.02) and g.changes == 0
    now["t"] += 0.5  # the pool's own threads wait: now it gives one up
    now["pool"] += 0.3
    assert g.threads() == 1


def test_proc_and_cgroup_files_no_kernel_writes_never_raise(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "self").write_text("0::/box\n")
    box = tmp_path / "fs" / "box"
    box.mkdir(parents=True)
    (box / "cpu.max").write_text("100000 0\n")  # raised ZeroDivisionError through every decode
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") is None

    def broken() -> int:
        raise ZeroDivisionError

    monkeypatch.setattr(cores, "_governor", None)
    monkeypatch.setattr(cores, "usable_cores", broken)
    assert cores.governor().threads() >= 1  # a pool of the affinity's cores, kept
    g = ThreadGovernor(2, window_s=0.0, mark=Mark(waited=lambda: {1: (0.0, 0.0)}))
    monkeypatch.setattr(g._mark, "since", lambda pool: 1 / 0)
    assert g.threads() == 2 and g.threads() == 2


def test_busy_ticks_counts_the_given_cores_and_not_idle(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 20 30 4000 50 6 7 8 0 0\n"
        "cpu0 1 2 3 1000 5 1 1 1 0 0\n"
        "cpu1 9 18 27 3000 45 5 6 7 0 0\n"
        "intr 123\n"
    )
    assert busy_ticks(None, stat) == (1 + 2 + 3 + 1 + 1 + 1) + (9 + 18 + 27 + 5 + 6 + 7)
    assert busy_ticks({1}, stat) == 9 + 18 + 27 + 5 + 6 + 7  # iowait (45) and idle are not busy
    assert busy_ticks(None, tmp_path / "none") is None


def test_cgroup_quota_v2_takes_the_smallest_up_the_tree(tmp_path: Path) -> None:
    (tmp_path / "self").write_text("0::/box/job\n")
    job = tmp_path / "fs" / "box" / "job"
    job.mkdir(parents=True)
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") is None  # no cpu.max anywhere
    (job / "cpu.max").write_text("max 100000\n")
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") is None
    (job.parent / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") == 1.5
    (job / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") == 0.5


def test_cgroup_quota_v1(tmp_path: Path) -> None:
    (tmp_path / "self").write_text("4:memory:/m\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    d = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") is None
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cores(tmp_path / "self", tmp_path / "fs") == 3.0


def test_usable_cores_is_the_quota_floored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cores, "affinity_cores", lambda: 8)
    monkeypatch.setattr(cores, "cgroup_cores", lambda: 2.5)
    assert cores.usable_cores() == 2
    monkeypatch.setattr(cores, "cgroup_cores", lambda: 0.5)
    assert cores.usable_cores() == 1
    monkeypatch.setattr(cores, "cgroup_cores", lambda: None)
    assert cores.usable_cores() == 8


class _Flip:
    """A governor that answers 1, 2, 1, 2, ... threads: every pass on another pool size."""

    def __init__(self) -> None:
        self.calls = 0

    def threads(self) -> int:
        self.calls += 1
        return 1 + self.calls % 2


@pytest.mark.model
def test_a_pool_resized_between_passes_computes_the_same_bits(
    qwen05_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Q4_K_M: sdmm's K-quant kernels, its Q8_0/Q6_K rows and sdfa, each pass on 1 or 2 threads
    ids = list(range(1000, 1100))
    got, flip = {}, _Flip()
    for mode in ("fixed", "flipping"):
        if mode == "flipping":
            monkeypatch.setattr(llamacpp, "governor", lambda: flip)
        m = LlamaCppModel.load(qwen05_path, n_threads=None if mode == "flipping" else 2)
        prompt = m.extend(ids[:80])  # a prompt pass
        verify = m.extend(ids[80:96])  # a 16-row verify
        steps = torch.cat([m.extend([t]) for t in ids[96:100]])  # single steps
        got[mode] = (prompt, verify, steps)
        if mode == "flipping":  # the last pass ran on the pool the governor gave it
            assert m._llama.llama_n_threads(m._ctx) == 1 + flip.calls % 2
        m.close()
    assert flip.calls == 6
    for a, b in zip(got["fixed"], got["flipping"], strict=True):
        assert torch.equal(a, b)


def test_the_pace_is_recent_time_over_the_fastest_and_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = cores.PassPace(weight=0.5, slow_at=3.0)
    p.record("t", 1, 0.030, 2)
    p.record("t", 16, 0.090, 2)  # another size: its own fastest
    p.record("d", 1, 0.010, 2)  # another model too
    assert p.pace == 1.0 and p.threads == 2
    p.record("t", 1, 0.120, 1)  # 4x the step's fastest: 1 + 0.5 * 3
    assert p.pace == pytest.approx(2.5) and p.threads == 1
    with caplog.at_level("WARNING", logger="specdec.backends.cores"):
        p.record("t", 70, 0.5, 1)  # a 128-size class, first seen: 1, its own fastest
        assert p.pace == pytest.approx(1.75) and not caplog.records
        p.record("t", 16, 0.45, 1)  # 5x
        p.record("t", 16, 0.45, 1)
        p.record("t", 16, 0.45, 1)
    assert p.pace == pytest.approx(4.5, abs=0.1)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "llama.cpp passes run 3.4x their idle cost"
    ]  # once, at the crossing
    assert set(p.gauges()) == {
        "specdec_pass_pace",
        "specdec_threads",
        "specdec_other_cores",
        "specdec_thread_wait",
    }
