"""The microbench: its cost model on synthetic curves, its measurement loop, its artifact.

Timing values are never asserted (speed belongs in benchmarks, not tests): only structure, the
cost model's arithmetic, and the order in which the probes run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import TEST_THREADS

from specdec.backends.mock import MockModel
from specdec.cli import main as cli
from specdec.study.artifacts import ArtifactError, read
from specdec.study.run.microbench import (
    acceptance_profile,
    artifact_path,
    best_k,
    expected_tokens_per_round,
    measure,
    predicted_speedup,
    round_cost,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
BENCH = FIXTURES / "bench_all_gguf_k4_t0.8.json"
K_MAX = 8
FLAT = [1.0] * (K_MAX + 1)  # v(b) = 1: verification perfectly parallel
LINEAR = [float(b) for b in range(1, K_MAX + 2)]  # v(b) = b: verification fully serial


# ------------------------------------------------------------------------------ cost model
def test_expected_tokens_per_round_sums_the_survival_curve() -> None:
    p = [0.8, 0.6, 0.4]
    assert expected_tokens_per_round(p, 0) == 1.0  # a plain step emits one token
    assert expected_tokens_per_round(p, 1) == pytest.approx(1.8)
    assert expected_tokens_per_round(p, 3) == pytest.approx(2.8)
    with pytest.raises(ValueError, match="k must be in"):
        expected_tokens_per_round(p, 4)  # the profile says nothing about position 4


def test_free_verification_and_free_drafts_give_speedup_equal_to_yield() -> None:
    p = [0.9, 0.7, 0.5, 0.35, 0.2, 0.1, 0.05, 0.02]
    for k in range(K_MAX + 1):
        assert predicted_speedup(FLAT, 0.0, p, k) == pytest.approx(expected_tokens_per_round(p, k))
    assert predicted_speedup(FLAT, 0.0, [1.0] * K_MAX, K_MAX) == pytest.approx(K_MAX + 1)


def test_serial_verification_never_pays_unless_every_draft_is_accepted() -> None:
    poor = [0.3, 0.1, 0.05, 0.02, 0.01, 0.0, 0.0, 0.0]
    for k in range(1, K_MAX + 1):
        assert predicted_speedup(LINEAR, 0.0, poor, k) < 1.0
    # even perfect acceptance only breaks even when v(b) = b and drafting is free
    assert predicted_speedup(LINEAR, 0.0, [1.0] * K_MAX, 4) == pytest.approx(1.0)
    assert best_k(LINEAR, 0.0, poor, K_MAX) == 0  # speculation turns itself off


def test_cost_grows_with_draft_cost_and_k() -> None:
    assert round_cost(LINEAR, 0.0, 0) == 1.0
    assert round_cost(LINEAR, 0.5, 4) == pytest.approx(5 + 4 * 0.5)
    p = [0.8] * K_MAX
    assert predicted_speedup(FLAT, 0.4, p, 4) < predicted_speedup(FLAT, 0.1, p, 4)
    with pytest.raises(ValueError, match="k must be in"):
        round_cost(FLAT, 0.0, len(FLAT))


def test_best_k_follows_the_costs() -> None:
    good = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    # cheap verification, cheap drafts, good acceptance: draft long
    assert best_k(FLAT, 0.02, good, K_MAX) >= 6
    # the same acceptance with this CPU's measured curve (issue 5: v(5) = 3.61) and c = 0.43
    cpu = [1.0, 1.65, 2.27, 3.13, 3.61, 4.2, 4.8, 5.4, 6.0]
    assert best_k(cpu, 0.43, good, K_MAX) == 0
    # ... but a free drafter at the same acceptance pays at a short K
    assert 1 <= best_k(cpu, 0.0, good, K_MAX) <= 3


# ------------------------------------------------------------------------------ acceptance
def _bench_artifact(rows: list[dict]) -> dict:
    """A committed bench artifact (K = 4), its recorded rows replaced by one per `rows` entry,
    whose counts its speculative run takes."""
    art = json.loads(BENCH.read_text())
    row = art["rows"][0]
    art["config"]["name"] = "synthetic"
    art["rows"] = [{**row, "speculative": {**row["speculative"], **r}} for r in rows]
    return art


def test_acceptance_profile_pools_rows_over_rounds_that_drafted_each_position() -> None:
    bench = _bench_artifact(
        [
            # 10 rounds at K = 4, the last one clipped to K = 2 by the token budget
            {"rounds": 10, "drafted_per_pos": [10, 10, 9, 9], "accepted_per_pos": [8, 6, 3, 1]},
            {"rounds": 10, "drafted_per_pos": [10, 10, 10, 10], "accepted_per_pos": [6, 4, 3, 2]},
        ]
    )
    prof = acceptance_profile(bench, source="x.json")
    assert prof.p_at_least == pytest.approx([14 / 20, 10 / 20, 6 / 19, 3 / 19])
    assert prof.positional_acceptance == prof.p_at_least
    assert prof.source == "x.json" and prof.k == 4 and prof.n_rows == 2


def test_acceptance_profile_refuses_other_artifacts() -> None:
    with pytest.raises(ArtifactError, match="missing field 'config'"):
        acceptance_profile({"schema": "specdec.gate/1", "meta": {}})
    gate = json.loads((FIXTURES / "gate_primary.json").read_text())
    with pytest.raises(ValueError, match=r"expected a specdec\.bench/1 artifact"):
        acceptance_profile(gate, "gate.json")


# ------------------------------------------------------------------------------ measurement
class _Recorder(MockModel):
    """A mock that logs each extend's length and checks every probe starts on the prefix."""

    def __init__(self, prefix: int, **kw) -> None:
        super().__init__(**kw)
        self.prefix = prefix
        self.lengths: list[int] = []

    def _extend(self, ids: list[int]):
        if len(ids) != self.prefix:  # a probe, not the prefix itself
            assert self.n_cached == self.prefix, "a probe did not start from the cached prefix"
            self.lengths.append(len(ids))
        return super()._extend(ids)


def test_measure_warms_up_then_alternates_the_b_order() -> None:
    target = _Recorder(prefix=10, vocab_size=48, seed=0)
    draft = _Recorder(prefix=10, vocab_size=48, seed=1)
    ids = list(range(14))
    verify, draft_ms = measure(
        target, draft, ids, prefix=10, max_batch=4, repeats=3, progress=False
    )
    down, up = [4, 3, 2, 1], [1, 2, 3, 4]
    assert target.lengths == [*down, *up, *down, *up]  # warm-up (down), then 3 timed passes
    assert draft.lengths == [1] * 4  # warm-up + one per repeat
    assert {b: len(ms) for b, ms in verify.items()} == {1: 3, 2: 3, 3: 3, 4: 3}
    assert len(draft_ms) == 3
    assert target.n_cached == draft.n_cached == 0  # both caches are left empty


def _write_bench(tmp_path) -> str:
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            _bench_artifact(
                [
                    {"rounds": 5, "drafted_per_pos": [5, 5, 5], "accepted_per_pos": [4, 3, 1]},
                ]
            )
        )
    )
    return str(path)


def test_microbench_cli_on_mock_models_writes_a_valid_artifact(tmp_path, capsys) -> None:
    out = tmp_path / "results"
    rc = cli.main(
        [
            "microbench",
            "--target",
            "mock:vocab=48,seed=0",
            "--draft",
            "mock:vocab=48,seed=1",
            "--prefix",
            "20",
            "--max-batch",
            "5",
            "--repeats",
            "3",
            "--acceptance",
            _write_bench(tmp_path),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    path = artifact_path(out, "mock:vocab=48,seed=0")
    assert path.name == "microbench_mock-vocab-48-seed-0.json"
    art = json.loads(path.read_text())
    assert read(art).SCHEMA == "specdec.microbench/1"
    assert [pt["b"] for pt in art["verify"]] == [1, 2, 3, 4, 5]
    assert art["models"]["target"]["backend"] == "mock" and "dtype" in art["models"]["target"]
    assert art["verify"][0]["ratio"] == 1.0
    assert all(len(pt["samples_ms"]) == 3 for pt in art["verify"])
    assert art["c"] is not None and art["prediction_c"] == art["c"]
    assert art["acceptance"]["p_at_least"] == pytest.approx([0.8, 0.6, 0.2])
    assert [r["k"] for r in art["prediction"]] == [1, 2, 3]  # limited by the profile's K
    assert art["prediction"][2]["expected_tokens_per_round"] == pytest.approx(2.6)
    assert all(r["predicted_speedup"] > 0 for r in art["prediction"])
    assert art["best_k"] in range(4)
    assert "v(b)" in capsys.readouterr().out


def test_microbench_without_draft_or_acceptance_reports_cost_only(tmp_path) -> None:
    out = tmp_path / "results"
    rc = cli.main(
        [
            "microbench",
            "--target",
            "mock:vocab=48",
            "--prefix",
            "8",
            "--max-batch",
            "3",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    art = json.loads(next(out.glob("microbench_*.json")).read_text())
    read(art)
    assert art["draft_step_ms"] is None and art["c"] is None and art["prediction_c"] == 0.0
    assert art["acceptance"] is None and art["best_k"] is None
    assert [r["k"] for r in art["prediction"]] == [1, 2]
    assert all(r["predicted_speedup"] is None for r in art["prediction"])


def test_microbench_bad_acceptance_path_is_a_clean_error(tmp_path, capsys) -> None:
    rc = cli.main(
        [
            "microbench",
            "--target",
            "mock:vocab=48",
            "--acceptance",
            str(tmp_path / "missing.json"),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2
    assert "cannot read the acceptance artifact" in capsys.readouterr().err


@pytest.mark.model
def test_microbench_real_tiny_run(tmp_path) -> None:
    out = tmp_path / "results"
    rc = cli.main(
        [
            "microbench",
            "--target",
            "llamacpp:smollm2-135m",
            "--threads",
            str(TEST_THREADS),
            "--max-batch",
            "4",
            "--repeats",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    art = json.loads(artifact_path(out, "llamacpp:smollm2-135m").read_text())
    assert read(art).SCHEMA == "specdec.microbench/1"
    assert art["prefix_tokens"] == 100 and art["max_batch"] == 4
    assert [pt["b"] for pt in art["verify"]] == [1, 2, 3, 4]
    assert art["models"]["target"]["sha256"] is not None
    assert len(art["prediction"]) == 3


def test_check_prediction_arithmetic_and_fixed_k_requirement() -> None:
    from specdec.study.run.microbench import check_prediction

    v, c = [1.0, 1.5, 1.8], 0.25  # v(b) for b = 1..3, and the draft-step ratio
    bench = _bench_artifact(
        [
            {"rounds": 10, "drafted_per_pos": [10, 10], "accepted_per_pos": [8, 4]},
        ]
    )
    bench["config"].update(k=2, drafter="model")
    bench["aggregates"].update(decode_speedup=0.8, speedup=0.7)
    ch = check_prediction(v, c, bench, "b.json")
    # E = 1 + 0.8 + 0.4 = 2.2 tokens per round; cost = v(3) + 2 c = 1.8 + 0.5 = 2.3 steps
    assert ch.predicted_speedup == pytest.approx(2.2 / 2.3)
    assert ch.relative_error == pytest.approx((2.2 / 2.3 - 0.8) / 0.8)
    assert ch.measured_speedup == 0.7
    bench["config"]["drafter"] = "lookup"  # model-free: no draft cost
    assert check_prediction(v, c, bench, "b.json").predicted_speedup == pytest.approx(2.2 / 1.8)
    bench["config"]["k"] = "auto"
    with pytest.raises(ValueError, match="fixed-K"):
        check_prediction(v, c, bench, "b.json")


def test_microbench_check_refuses_auto_k_before_loading_models(tmp_path, capsys) -> None:
    bench = _bench_artifact([{"rounds": 5, "drafted_per_pos": [5], "accepted_per_pos": [4]}])
    bench["config"]["k"] = "auto"
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(bench))
    rc = cli.main(
        [
            "microbench",
            "--target",
            "hf:does-not-exist",
            "--check",
            str(path),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2
    assert "fixed-K" in capsys.readouterr().err
