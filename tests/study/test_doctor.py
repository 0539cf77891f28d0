"""`specdec doctor`: planted cost curves give the verdicts they must, the measured curve seeds
k=auto's cost store, the report is a table and JSON, and a real smollm2 run completes.

The planted curves are exact: mock models whose every pass advances a virtual clock by a planted
number of seconds, the microbench's timer reading that clock (no sleeping, so no machine load
can move a number). Expected values are worked out here from the planted formulas, not with
core.cost, so a wrong formula there fails here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import TEST_THREADS

from specdec.backends.costs import CurveFiles
from specdec.backends.mock import MockModel
from specdec.core.cost import VerifyCurve
from specdec.core.model import SpecModel
from specdec.core.policy import AutoPolicies
from specdec.study.artifacts import DoctorArtifact, read, to_json
from specdec.study.artifacts.provenance import model_block
from specdec.study.run import microbench
from specdec.study.run.doctor import BATCHES, diagnose, format_report, format_stored, run

V = 48
STEP_S = 0.05  # the planted target step


class VirtualClock:
    """Stands in for the `time` module inside run.microbench: perf_counter reads this clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


class PlantedMock(MockModel):
    """A mock model whose pass over n tokens takes seconds(n) on the virtual clock."""

    def __init__(self, clock: VirtualClock, seconds: Callable[[int], float], seed: int) -> None:
        super().__init__(V, seed=seed, name=f"mock:vocab={V},seed={seed}")
        self.clock = clock
        self.seconds = seconds

    def _extend(self, ids: list[int]) -> Any:
        self.clock.t += self.seconds(len(ids))
        return super()._extend(ids)


def planted(
    monkeypatch: pytest.MonkeyPatch, v: Callable[[int], float], c: float | None
) -> tuple[SpecModel, SpecModel | None]:
    clock = VirtualClock()
    monkeypatch.setattr(microbench, "time", clock)
    target = PlantedMock(clock, lambda n: STEP_S * v(n), seed=0)
    draft = None if c is None else PlantedMock(clock, lambda n: STEP_S * c * n, seed=1)
    return target, draft


def blocks(target: SpecModel, draft: SpecModel | None) -> dict[str, Any]:
    models = {"target": target, "draft": draft}
    return {k: model_block(m.name, m) if m is not None else None for k, m in models.items()}


def doctor(target: SpecModel, draft: SpecModel | None, **kw: Any) -> Any:
    return run(target, draft, blocks(target, draft), seconds=5, progress=False, **kw)


def flat(n: int) -> float:
    """A GPU-like curve: a pass over n tokens costs little more than one token's."""
    return 1 + 0.02 * (n - 1)


def linear(n: int) -> float:
    """No batching gain at all: n tokens cost n steps."""
    return float(n)


def cpu(n: int) -> float:
    """The portable-kernel CPU of an earlier round: ~0.6 steps per extra token."""
    return 0.4 + 0.6 * n


def _alpha(cost: float, k: int) -> float:
    """The root in [0, 1] of 1 + a + ... + a^k = cost (numpy's polynomial roots)."""
    roots = np.roots([1.0] * k + [1.0 - cost])
    real = [r.real for r in roots if abs(r.imag) < 1e-9 and -1e-9 <= r.real <= 1 + 1e-9]
    assert len(real) == 1
    return real[0]


# ---------------------------------------------------------------------------- planted curves
def test_a_draft_model_as_slow_as_the_target_cannot_pay(monkeypatch, tmp_path: Path) -> None:
    target, draft = planted(monkeypatch, flat, c=1.01)
    store = CurveFiles(tmp_path / "costs", key=lambda m: "target")
    rep = doctor(target, draft, curves=store)
    d = rep.diagnosis
    assert rep.target_step_ms == pytest.approx(STEP_S * 1e3)
    assert d.c == pytest.approx(1.01)
    assert {b: round(x, 9) for b, x in d.v.items()} == {b: round(flat(b), 9) for b in BATCHES}
    best = max(BATCHES, key=lambda b: b / flat(b))
    assert (d.ceiling_b, d.ceiling) == (best, pytest.approx(best / flat(best)))
    assert d.verdict[0].startswith(
        f"prompt lookup and predictions pay on edits up to ~{64 / flat(64):.1f}x"
    )
    assert d.verdict[1].startswith("a draft model cannot pay here: c = 1.01")
    assert not rep.contended and rep.repeats >= 3
    data = json.loads(json.dumps(to_json(rep)))  # as written: b keys are strings
    again = read(data)
    assert isinstance(again, DoctorArtifact) and again == rep and to_json(again) == data
    # k=auto's curve store now holds the measured curve, in seconds, and k=auto starts from it
    assert rep.cost_store == str(tmp_path / "costs" / "target.json")
    saved = json.loads((tmp_path / "costs" / "target.json").read_text())["verify_s"]
    assert {int(b): s for b, s in saved.items()} == pytest.approx(
        {b: STEP_S * flat(b) for b in BATCHES}
    )
    policy = AutoPolicies(store).get(target, "lookup", 8)
    assert policy.v(16) == pytest.approx(STEP_S * flat(16))
    assert policy.v(3) == pytest.approx(STEP_S * (flat(2) + flat(4)) / 2)  # between 2 and 4


def test_no_batching_gain_means_no_lossless_method_can_pay(monkeypatch) -> None:
    target, draft = planted(monkeypatch, linear, c=0.1)
    d = doctor(target, draft, curves=None).diagnosis
    assert d.ceiling == pytest.approx(1.0) and d.ceiling_b == 1
    assert d.verdict[0].startswith("no lossless method can pay here")
    assert d.verdict[1].startswith("a draft model cannot pay here: c = 0.10")
    assert all(
        r.free_acceptance is None or r.free_acceptance == pytest.approx(1) for r in d.break_even
    )


def test_a_cpu_curve_pays_on_edits_and_a_cheap_draft_pays_above_its_break_even(monkeypatch) -> None:
    target, draft = planted(monkeypatch, cpu, c=0.1)
    d = doctor(target, draft, curves=None).diagnosis
    ceiling = 64 / cpu(64)  # b / v(b) grows with b on this curve
    assert d.ceiling == pytest.approx(ceiling) and d.ceiling_b == 64
    assert d.verdict[0].startswith(
        f"prompt lookup and predictions pay on edits up to ~{ceiling:.1f}x"
    )
    # break-even at K = 1 without a draft: E(1) = 1 + alpha = v(2)
    assert d.break_even[0].free_acceptance == pytest.approx(cpu(2) - 1)
    assert f"they need {cpu(2) - 1:.0%} of drafts accepted at K = 1" in d.verdict[0]
    for row in d.break_even:
        k = row.k
        assert row.free_cost == pytest.approx(cpu(k + 1))
        assert row.model_cost == pytest.approx(cpu(k + 1) + 0.1 * k)
        want = _alpha(cpu(k + 1) + 0.1 * k, k) if cpu(k + 1) + 0.1 * k < k + 1 else None
        assert row.model_acceptance == (None if want is None else pytest.approx(want, abs=1e-9))
    alphas = [(r.model_acceptance, r.k) for r in d.break_even if r.model_acceptance is not None]
    alpha, k = min(alphas)
    assert d.verdict[1] == (
        f"a draft model pays where more than {alpha:.0%} of its drafts are accepted (at K = {k}; "
        f"c = 0.10), up to ~{d.draft_ceiling:.1f}x if all are"
    )
    draft_ceiling = max((kk + 1) / (cpu(kk + 1) + 0.1 * kk) for kk in (1, 3, 7, 15, 31, 63))
    assert d.draft_ceiling == pytest.approx(draft_ceiling)


def test_without_a_draft_the_verdict_says_how_to_judge_one(monkeypatch) -> None:
    target, _ = planted(monkeypatch, flat, c=None)
    rep = doctor(target, None, curves=None)
    assert rep.diagnosis.c is None and rep.draft_step_ms is None
    assert rep.diagnosis.verdict[1] == "no draft model measured: give --draft SPEC to judge one"
    assert all(r.model_cost is None for r in rep.diagnosis.break_even)


def test_diagnose_interpolates_as_k_auto_does_and_needs_b_1() -> None:
    d = diagnose({1: 1.0, 4: 2.5}, None)  # K = 3 only
    assert [r.k for r in d.break_even] == [3]
    assert d.break_even[0].v == 2.5
    with pytest.raises(ValueError, match="b = 1"):
        diagnose({2: 1.5}, None)
    # one draft per round cannot pay, long copies can
    d = diagnose({1: 1.0, 2: 2.5, 16: 4.0}, None)
    assert d.break_even[0].free_acceptance is None and d.ceiling == pytest.approx(4.0)
    assert "one draft per round cannot pay (a pass over 2 tokens costs 2.50 steps)" in d.verdict[0]


# ---------------------------------------------------------------------------- table, JSON, CLI
def test_report_table_names_every_number(monkeypatch) -> None:
    target, draft = planted(monkeypatch, cpu, c=0.1)
    text = format_report(doctor(target, draft, curves=None))
    for needle in (
        "one step 50.0 ms",
        "v(b)",
        "b / v(b)",
        "c = 0.10",
        "ceiling",
        "break-even",
        "verdict",
        "cpu flags",
    ):
        assert needle in text, needle
    assert text.count("\n   ") >= len(BATCHES) - 1  # a break-even row per K


def test_the_stored_curve_is_shown_with_its_samples_and_ages_and_what_looks_wrong() -> None:
    """The store as found on a busy host (v(2) = 104 steps) and a point 3x this run's."""
    stored = VerifyCurve.of({1: 0.0308, 2: 3.207, 4: 0.125}, at=1000.0)
    stored.add(1, 0.0310, at=1000.0 + 3600)
    text = format_stored(stored, {1: 30.8, 2: 28.0, 4: 41.0}, now=1000.0 + 2 * 86400)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:5]}
    assert rows["1"][:8] == ["1", "30.8", "1.00", "2", "2", "d", "ago", "yes"]  # 2 samples
    assert rows["2"][2:10] == ["104.12", "1", "2", "d", "ago", "no", "dropped:", "over"]
    assert " ".join(rows["2"][-7:]) == "2 x b x the cheapest point"
    assert " ".join(rows["4"][7:]) == "yes 3.05x this run's 41.0 ms"
    assert "looks wrong at b = 2, 4" in text and "--reset-costs" in text
    assert "no k=auto curve" in format_stored(VerifyCurve())


@pytest.mark.slow
def test_cli_doctor_reset_costs_forgets_the_stored_curve(smol_llamacpp) -> None:
    """`specdec doctor --reset-costs` removes the target's stored curve (the session's home
    holds only what this test writes) and measures nothing."""
    path = CurveFiles().path(smol_llamacpp)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"verify_s": {"1": 0.0308, "2": 3.207}}')
    cmd = [sys.executable, "-m", "specdec.cli.main", "doctor", "--reset-costs", "--target"]
    cmd += ["llamacpp:smollm2-135m", "--threads", str(TEST_THREADS)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"removed {path}" and not path.exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "no stored k=auto curve" in again.stdout


@pytest.mark.slow
def test_cli_doctor_json_on_mock_models(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli.main",
            "doctor",
            "--target",
            "mock:vocab=48,seed=0",
            "--draft",
            "mock:vocab=48,seed=1",
            "--batches",
            "1,2,8",
            "--seconds",
            "1",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout)
    assert rep["schema"] == "specdec.doctor/1" and rep == json.loads(out.read_text())
    assert rep["batches"] == [1, 2, 8] and list(rep["verify_ms"]) == ["1", "2", "8"]
    assert rep["diagnosis"]["v"]["1"] == 1.0 and len(rep["diagnosis"]["verdict"]) == 2
    assert rep["target"]["spec"] == "mock:vocab=48,seed=0" and rep["repeats"] >= 3
    assert "machine" in rep["meta"] and isinstance(rep["cpu_flags"], list)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli.main",
            "doctor",
            "--target",
            "mock:vocab=48",
            "--seconds",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--seconds must be > 0" in bad.stderr


# ---------------------------------------------------------------------------- a real model
@pytest.mark.model
def test_a_real_smollm2_run_completes(smol_llamacpp, smol_hf, tmp_path: Path) -> None:
    """The doctor on smollm2-135m (llama.cpp) with its HF copy as the draft: it completes, its
    numbers are sane (not their values: this machine is shared), and its store is written."""
    models = blocks(smol_llamacpp, smol_hf)
    curves = CurveFiles(tmp_path)  # never the user's store from a test
    # a 1-second budget: the doctor still takes its floor of MIN_REPEATS, what is checked here
    rep = run(smol_llamacpp, smol_hf, models, seconds=1, progress=False, curves=curves)
    d = rep.diagnosis
    assert rep.repeats >= 3 and rep.target_step_ms > 0 and rep.draft_step_ms > 0
    assert d.v[1] == 1.0 and all(math.isfinite(x) and x > 0 for x in d.v.values())
    assert d.ceiling >= 1.0 and d.c is not None and d.c > 0
    assert len(d.verdict) == 2 and len(d.break_even) == len(BATCHES) - 1
    assert rep.cost_store == str(curves.path(smol_llamacpp))
    saved = json.loads(curves.path(smol_llamacpp).read_text())["verify_s"]
    assert sorted(map(int, saved)) == list(BATCHES)
    # the other work beside it, measured (this is Linux), and the pool the passes ran on
    assert rep.other_cores is not None and rep.other_cores >= 0.0
    assert rep.thread_wait is not None and rep.thread_wait >= 0.0
    assert rep.threads == TEST_THREADS
    assert "other work on this process's cores while it measured" in format_report(rep)
