"""scripts/llama_bench_classes.py's table of a committed run: the single step's paired ratios
are each round's ratio, their median and quartiles, and the rounds the twin won."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results/cpu/kernel-classes/llama-bench-avx2-zen4-steps.json"


def _script():
    spec = importlib.util.spec_from_file_location(
        "llama_bench_classes", ROOT / "scripts/llama_bench_classes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_rows_are_the_rounds_paired_ratios() -> None:
    record = json.loads(RUN.read_text())
    steps = record["steps"]["rounds"]
    twin, ik = steps["twin-avx2"], steps["ik-avx2"]
    ratios = [b / a for a, b in zip(twin, ik, strict=True)]  # the twin's time / ik's
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    won = sum(a > b for a, b in zip(twin, ik, strict=True))
    rows = [x for x in _script().table(record).splitlines() if x.startswith("| ik-avx2 |")]
    row = rows[-1]  # the step table's, after llama-bench's own
    assert row.endswith(f"| {q2:.2f} ({q1:.2f}-{q3:.2f}) | {won} of {len(twin)} |")
    assert len(twin) == 20 and q1 <= q2 <= q3


def test_a_run_without_step_rounds_has_no_step_table() -> None:
    record = json.loads(RUN.read_text())
    record["steps"]["rounds"] = {p: [] for p in record["steps"]["rounds"]}
    assert "short runs" not in _script().table(record)
