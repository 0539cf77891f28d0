"""k="auto"'s verify-cost curves: what a curve uses of its samples (core.cost.VerifyCurve: a
robust summary within physical bounds, the newer point standing where two disagree), and between
processes (backends.costs): the file format, the key that keeps a curve to its model build and
settings, and a store that never breaks a generation (unreadable or unwritable files only cost
the next process some learning) and that no hiccup can poison (a stored outlier, a curve from a
busier time: k=auto drafts again within a bounded number of rounds)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from support import TEST_THREADS

from specdec.backends.costs import CurveFiles, curve_key, read_curve, write_curve
from specdec.backends.mock import MockModel
from specdec.core.cost import WINDOW, VerifyCurve
from specdec.core.metrics import Round
from specdec.core.policy import LOADED_WEIGHT, PROBE_SHARE, AutoPolicies, CostModelK


def test_a_curve_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "costs" / "x.json"
    curve = VerifyCurve.of({4: 0.3, 1: 0.1, 2: 0.15}, at=100.0)
    curve.add(1, 0.12, at=101.0)
    assert write_curve(path, curve)
    assert json.loads(path.read_text()) == {
        "verify_s": {"1": 0.1, "2": 0.15, "4": 0.3},  # the points in use (the lower median)
        "samples": {"1": [[0.1, 100.0], [0.12, 101.0]], "2": [[0.15, 100.0]], "4": [[0.3, 100.0]]},
    }
    assert read_curve(path) == curve
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temp file left behind


def test_a_file_of_the_first_format_is_one_sample_per_point_as_old_as_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.json"
    path.write_text('{"verify_s": {"1": 0.0308, "4": 0.042}}')
    curve = read_curve(path)
    assert curve.summary() == {1: 0.0308, 4: 0.042}
    assert {s.at for ss in curve.samples().values() for s in ss} == {path.stat().st_mtime}


@pytest.mark.parametrize(
    "text", ["", "not json", "[]", '{"verify_s": 3}', '{"verify_s": {"b": 1}}', '{"other": {}}']
)
def test_an_unreadable_curve_is_no_curve(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert read_curve(path) == VerifyCurve()
    assert read_curve(tmp_path / "missing.json") == VerifyCurve()


def test_an_unwritable_store_is_not_an_error(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"  # where the store's directory should be: mkdir fails
    blocked.write_text("")
    assert not write_curve(blocked / "x.json", VerifyCurve.of({1: 0.1}))
    store = CurveFiles(blocked, key=lambda m: "x")
    assert store.save(MockModel(8), VerifyCurve.of({1: 0.1})) is None
    assert list(tmp_path.iterdir()) == [blocked]


def test_the_store_keeps_one_file_per_key(tmp_path: Path) -> None:
    a, b = MockModel(8, seed=0), MockModel(8, seed=1)
    store = CurveFiles(tmp_path, key=lambda m: m.name.replace(":", "-"))
    one = VerifyCurve.of({1: 0.1})
    assert store.save(a, one) == tmp_path / "mock-vocab=8,seed=0.json"
    assert store.load(a) == one and store.load(b) == VerifyCurve()
    nameless = CurveFiles(tmp_path)  # mock models have no curve_key: nothing kept
    assert curve_key(a) is None and nameless.path(a) is None
    assert nameless.save(a, one) is None and nameless.load(a) == VerifyCurve()
    assert (
        store.reset(a) == tmp_path / "mock-vocab=8,seed=0.json" and store.load(a) == VerifyCurve()
    )
    assert store.reset(a) is None  # nothing left to forget


def test_a_save_adds_to_what_other_processes_saved_and_a_measurement_replaces(
    tmp_path: Path,
) -> None:
    store, target = CurveFiles(tmp_path, key=lambda m: "k"), MockModel(8)
    store.save(target, VerifyCurve.of({1: 0.10, 2: 0.11}, at=1.0))  # one process
    store.save(target, VerifyCurve.of({1: 0.12, 4: 0.14}, at=2.0))  # another, meanwhile
    kept = store.load(target).samples()
    assert [s.seconds for s in kept[1]] == [0.10, 0.12] and set(kept) == {1, 2, 4}
    store.save(target, store.load(target))  # what it loaded comes back: each sample once
    assert len(store.load(target).samples()[1]) == 2
    store.save(target, VerifyCurve.of({1: 0.2}, at=3.0), replace=True)  # specdec doctor's
    assert store.load(target).summary() == {1: 0.2}


def test_the_default_root_is_specdec_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert CurveFiles(key=lambda m: "k").path(MockModel(8)) == tmp_path / "costs" / "k.json"


def test_a_loaded_curve_counts_as_one_measurement_per_point() -> None:
    p = CostModelK(k_max=8)
    p.load_curve({1: 0.1, 4: 0.25, 9: 0.0, 16: -1.0, 17: float("nan")})  # not times: ignored
    assert p.curve == {1: 0.1, 4: 0.25}
    assert p.verify_n == {1: LOADED_WEIGHT, 4: LOADED_WEIGHT}
    assert p.v(4) == pytest.approx(0.25)


def test_policies_hand_a_generation_s_curve_to_the_store_when_it_changed(tmp_path: Path) -> None:
    saved: list[dict[int, float]] = []

    class Store:
        def load(self, target):
            return VerifyCurve.of({1: 0.1, 2: 0.15})

        def save(self, target, curve, replace=False):
            saved.append(curve.summary())

    target = MockModel(8)
    policies = AutoPolicies(Store())
    p = policies.get(target, "lookup", 8)
    assert p.curve == {1: 0.1, 2: 0.15}  # a new policy starts from the store's curve
    policies.finished(target, p)
    assert saved == []  # nothing learned: nothing written
    p.costs.add(3, 0.2)
    policies.finished(target, p)
    policies.finished(target, p)
    assert saved == [{1: 0.1, 2: 0.15, 3: 0.2}]  # written once per change
    policies.finished(target, CostModelK(k_max=8))  # not one of its policies: ignored
    assert len(saved) == 1


def test_a_llamacpp_model_names_its_build_and_settings(smol_llamacpp) -> None:
    key = curve_key(smol_llamacpp)
    assert key is not None and "/" not in key
    threads = f"-t{TEST_THREADS}-"  # the thread count the model was loaded with
    for part in ("lcp", threads, "det" if smol_llamacpp.deterministic else "def", "tiled"):
        assert part in key, part
    assert CurveFiles(Path("/x")).path(smol_llamacpp) == Path("/x") / f"{key}.json"


# ------------------------------------------------------------------ a curve no hiccup can poison
#: This AMD host's verify curve (1.5B Q4_K_M, 2 threads, 512 cached tokens), in steps of 31.5 ms.
STEP = 0.0315
AMD = {1: 1.0, 2: 0.92, 4: 1.36, 8: 2.26, 16: 3.95, 32: 7.15, 64: 14.39}


def _true_v(b: int) -> float:
    """The machine's real v(b), in seconds: AMD interpolated (and its last slope past 64)."""
    ks = sorted(AMD)
    for lo, hi in itertools.pairwise(ks):
        if lo <= b <= hi:
            w = (b - lo) / (hi - lo)
            return STEP * ((1 - w) * AMD[lo] + w * AMD[hi])
    return STEP * (AMD[64] + (b - 64) * 0.22)


def _copy(policy: CostModelK, rounds: int = 100, edit_every: int = 40) -> tuple[int, int]:
    """A whole-file edit drafted from its prediction: every draft is accepted up to the next
    edit, one every `edit_every` tokens; passes cost `_true_v`. (drafted, accepted)."""
    t = drafted = accepted = 0
    for _ in range(rounds):
        k = policy.choose("prediction", 10_000)
        n = min(k, edit_every - 1 - t % edit_every)
        policy.observe(Round("prediction" if k else "none", k, n, n + 1, 0.0, _true_v(k + 1)))
        t, drafted, accepted = t + n + 1, drafted + k, accepted + n
    return drafted, accepted


def test_a_point_is_a_robust_summary_of_its_newest_samples() -> None:
    curve = VerifyCurve()
    for i in range(4):
        curve.add(8, 0.07, at=i)
    curve.add(8, 7.0, at=4)  # one hiccup: held back
    assert curve.summary() == {8: 0.07}
    for i in range(5, 9):
        curve.add(8, 7.0, at=i)  # it repeats until it is most of the window: taken
    assert curve.summary() == {8: 7.0}
    for i in range(9, 9 + WINDOW):
        curve.add(8, 0.08, at=i)  # the newest WINDOW samples only
    assert curve.summary() == {8: 0.08} and curve.points()[0].n == WINDOW
    low = VerifyCurve.of({4: 0.05}, at=0.0)
    low.add(4, 0.04, at=1.0)  # a cheaper sample is taken at once: the drafts it invites check it
    assert low.summary() == {4: 0.04}


@pytest.mark.parametrize(
    ("stored", "used"),
    [
        ({1: 0.0308, 2: 3.207}, {1: 0.0308}),  # the store found on a busy AMD host: 104 steps
        ({b: STEP * v * (100 if b > 1 else 1) for b, v in AMD.items()}, {1: STEP}),
        ({b: STEP * v for b, v in AMD.items()}, {b: STEP * v for b, v in AMD.items()}),
        ({1: 0.03, 2: 0.03 * 4.0, 8: 0.03 * 16.0}, {1: 0.03, 2: 0.12, 8: 0.48}),  # v(b) = 2b steps
        ({1: 0.03, 2: 0.03 * 4.1}, {1: 0.03}),  # a little more than that: dropped
    ],
)
def test_a_point_beyond_the_physical_bounds_is_not_used(
    stored: dict[int, float], used: dict[int, float]
) -> None:
    """A pass over b rows costs at most ROW_SLACK * b times the cheapest point: beyond it the
    point measured the machine's load, and k=auto prices that pass by its neighbours."""
    assert VerifyCurve.of(stored, at=0.0).summary() == pytest.approx(used)


def test_of_two_points_that_disagree_the_newer_stands() -> None:
    """A 28.5 s step stored long ago against this morning's passes: the step goes; and where a
    fresh step says the machine got slower than an old idle curve, the old cheap points that
    contradict it go (ties in age: the cheaper per token stands, as in the cases above)."""
    curve = VerifyCurve.of({1: 28.5}, at=0.0)
    for b in (2, 8, 16):
        curve.add(b, _true_v(b), at=100.0)
    assert set(curve.summary()) == {2, 8, 16} and not curve.points()[0].used
    idle = VerifyCurve.of({b: STEP * v for b, v in AMD.items()}, at=0.0)
    for i in range(3):
        idle.add(1, 3 * STEP, at=100.0 + i)  # busy now: every step 3x
    assert set(idle.summary()) == {1, 8, 16, 32, 64}  # v(2), v(4) cost under half of it


@pytest.mark.parametrize(
    "stored",
    [
        '{"verify_s": {"1": 0.0308, "2": 3.207}}',  # exactly as found
        json.dumps({"verify_s": {b: STEP * v * (100 if b > 1 else 1) for b, v in AMD.items()}}),
    ],
    ids=["as-found", "x100"],
)
def test_k_auto_drafts_a_copy_after_a_stored_hiccup(tmp_path: Path, stored: str) -> None:
    """The issue's store: after it, a rename drafted 0 tokens in 100 rounds. Now the policy a
    new process builds from that store drafts the copy as if the store were empty."""
    store = CurveFiles(tmp_path, key=lambda m: "target")
    (tmp_path / "target.json").write_text(stored)
    target = MockModel(8)
    drafted, accepted = _copy(AutoPolicies(store).get(target, "prediction", 64))
    clean = _copy(CostModelK(k_max=64))  # no store: 1,208 drafted, 968 accepted
    assert drafted >= max(300, 0.8 * clean[0]) and accepted >= 0.8 * drafted


def test_a_curve_measured_under_a_busy_sibling_does_not_stop_a_copy() -> None:
    """Every multi-row pass 3x dearer (a sibling thread at every barrier), which the bounds
    allow: the first PROBE_AFTER rounds draft nothing, then probes re-measure the passes that
    price deeper drafts, and the copy is drafted; without probes it drafts 20 tokens."""
    busy = VerifyCurve.of({b: STEP * v * (3 if b > 1 else 1) for b, v in AMD.items()}, at=0.0)
    drafted, accepted = _copy(_loaded(busy, PROBE_SHARE))
    assert drafted >= 300 and accepted >= 0.85 * drafted
    assert _copy(_loaded(busy, 0.0))[0] < 50


def _loaded(curve: VerifyCurve, probe: float) -> CostModelK:
    p = CostModelK(k_max=64, probe=probe)
    p.load_curve(curve)
    return p
