"""k="auto"'s verify-cost curves between processes (backends.costs): the file format, the key
that keeps a curve to its model build and settings, and a store that never breaks a generation
(unreadable or unwritable files only cost the next process some learning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TEST_THREADS

from specdec.backends.costs import CurveFiles, curve_key, read_curve, write_curve
from specdec.backends.mock import MockModel
from specdec.core.policy import LOADED_WEIGHT, AutoPolicies, CostModelK


def test_a_curve_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "costs" / "x.json"
    assert write_curve(path, {4: 0.3, 1: 0.1, 2: 0.15})
    assert json.loads(path.read_text()) == {"verify_s": {"1": 0.1, "2": 0.15, "4": 0.3}}
    assert read_curve(path) == {1: 0.1, 2: 0.15, 4: 0.3}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temp file left behind


@pytest.mark.parametrize(
    "text", ["", "not json", "[]", '{"verify_s": 3}', '{"verify_s": {"b": 1}}', '{"other": {}}']
)
def test_an_unreadable_curve_is_no_curve(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert read_curve(path) == {}
    assert read_curve(tmp_path / "missing.json") == {}


def test_an_unwritable_store_is_not_an_error(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"  # where the store's directory should be: mkdir fails
    blocked.write_text("")
    assert not write_curve(blocked / "x.json", {1: 0.1})
    store = CurveFiles(blocked, key=lambda m: "x")
    assert store.save(MockModel(8), {1: 0.1}) is None
    assert list(tmp_path.iterdir()) == [blocked]


def test_the_store_keeps_one_file_per_key(tmp_path: Path) -> None:
    a, b = MockModel(8, seed=0), MockModel(8, seed=1)
    store = CurveFiles(tmp_path, key=lambda m: m.name.replace(":", "-"))
    assert store.save(a, {1: 0.1}) == tmp_path / "mock-vocab=8,seed=0.json"
    assert store.load(a) == {1: 0.1} and store.load(b) == {}
    nameless = CurveFiles(tmp_path)  # mock models have no curve_key: nothing kept
    assert curve_key(a) is None and nameless.path(a) is None
    assert nameless.save(a, {1: 0.1}) is None and nameless.load(a) == {}


def test_the_default_root_is_specdec_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert CurveFiles(key=lambda m: "k").path(MockModel(8)) == tmp_path / "costs" / "k.json"


def test_a_loaded_curve_counts_as_one_measurement_per_point() -> None:
    p = CostModelK(k_max=8)
    p.load_curve({1: 0.1, 4: 0.25, 9: 0.0, 16: -1.0})  # non-positive points are ignored
    assert p.curve == {1: 0.1, 4: 0.25}
    assert p.verify_n == {1: LOADED_WEIGHT, 4: LOADED_WEIGHT}
    assert p.v(4) == pytest.approx(0.25)


def test_policies_hand_a_generation_s_curve_to_the_store_when_it_changed(tmp_path: Path) -> None:
    saved: list[dict[int, float]] = []

    class Store:
        def load(self, target):
            return {1: 0.1, 2: 0.15}

        def save(self, target, curve):
            saved.append(dict(curve))

    target = MockModel(8)
    policies = AutoPolicies(Store())
    p = policies.get(target, "lookup", 8)
    assert p.curve == {1: 0.1, 2: 0.15}  # a new policy starts from the store's curve
    policies.finished(target, p)
    assert saved == []  # nothing learned: nothing written
    p.verify_s[3] = 0.2
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
