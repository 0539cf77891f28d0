"""REPORT.md names each artifact's host, day and run tag (study/present/hosts.py).

A results directory may hold two hosts' runs, and one measurement under two tags (specdec's
kernels and ggml's): each section's heading must tell them apart, and the report opens with one
table of hosts instead of a block per artifact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specdec.cli.main import main
from specdec.study.present import hosts
from specdec.study.present.report import render_report
from specdec.study.present.scan import scan

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures"
RESULTS = ROOT / "results" / "cpu"

XEON = "Intel(R) Xeon(R) Processor @ 2.60GHz"
FEATURES = ["AVX", "AVX2", "AVX512", "AVX512_VNNI", "F16C", "FMA"]


def _kernels(sdmm: str | None, patched: bool = True, amx: bool = False) -> dict:
    patches = ["fix-amx-tile-config.patch", *["specdec-sdmm.patch"] * patched]
    features = ["AMX_INT8", *FEATURES] if amx else FEATURES
    return {"build": "native", "patches": patches, "features": features, "sdmm": sdmm, "sdfa": sdmm}


def _micro(d: Path, name: str, cpu: str, created: str, kernels: dict, tag: str) -> None:
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    machine = {**art["meta"]["machine"], "cpu_model": cpu, "kernels": kernels}
    command = f"specdec microbench --target llamacpp:qwen2.5-coder-1.5b --tag {tag}"
    art["meta"] = {**art["meta"], "machine": machine, "created": created, "command": command}
    (d / name).write_text(json.dumps(art))


def test_one_measurement_on_two_hosts_and_two_kernels_reads_as_three_sections(tmp_path) -> None:
    _micro(tmp_path, "a.json", XEON, "2026-12-02T07:08:12Z", _kernels("avx512"), "ctx512")
    _micro(tmp_path, "b.json", XEON, "2026-12-02T07:12:27Z", _kernels(None), "ctx512-stock")
    old = _kernels(None, patched=False, amx=True)
    _micro(tmp_path, "c.json", "Intel(R) Xeon(R) Processor", "2026-12-01T22:37:20Z", old, "ctx1024")
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "REPORT.md").read_text()
    headings = [h for h in report.splitlines() if h.startswith("### ")]
    assert len(headings) == len(set(headings)) == 3
    assert any(h.endswith("— ctx512 — Intel Xeon @ 2.60GHz, 2026-12-02") for h in headings)
    assert any(h.endswith("— ctx512-stock — Intel Xeon @ 2.60GHz, 2026-12-02") for h in headings)
    assert any(h.endswith("— ctx1024 — Intel Xeon, 2026-12-01") for h in headings)
    assert "Kernels: specdec's (sdmm avx512, sdfa avx512)" in report
    assert "Kernels: ggml's (sdmm and sdfa off)" in report
    assert "Kernels: ggml's (a build without sdmm and sdfa), AMX" in report
    assert "### Machine" not in report
    host_rows = report.split("## Hosts")[1].split("\n## ")[0].splitlines()
    assert sum(r.startswith("| Intel Xeon") for r in host_rows) == 2  # one row per host


def test_a_tag_comes_from_the_command_and_an_untagged_run_is_named_by_its_file() -> None:
    assert hosts.tag({"command": "specdec microbench --tag ctx512 --out r"}) == "ctx512"
    assert hosts.tag({"command": "specdec bench --tag=served"}) == "served"
    assert hosts.tag({"command": "specdec gate --config all_gguf"}) is None
    h = hosts.Hosts({"gate_all_gguf.json": {"created": "2026-12-02T08:45:50Z"}})
    assert h.heading("all_gguf", "gate_all_gguf.json") == (
        "### all_gguf — gate_all_gguf.json — CPU not recorded, 2026-12-02"
    )


def test_hosts_that_share_a_short_name_are_numbered() -> None:
    m = {"cpu_model": "Intel(R) Xeon(R) CPU", "kernels": {"features": ["AVX2"]}}
    metas = {"a": {"machine": m}, "b": {"machine": {**m, "cpu_count": 4}}}
    assert sorted(hosts.Hosts(metas).names.values()) == ["Intel Xeon", "Intel Xeon (host 2)"]


def test_the_committed_report_is_current_and_names_each_sections_host_and_tag() -> None:
    """results/cpu/REPORT.md is what `specdec report results/cpu` writes today, and every
    artifact section's heading ends in a tag (or its file), a host of the table and a day."""
    study = scan(RESULTS)
    committed = (RESULTS / "REPORT.md").read_text(encoding="utf-8")
    assert render_report(study, RESULTS / "figures", RESULTS / "REPORT.md") == committed
    names = set(study.hosts.names.values())
    headings = [h for h in committed.splitlines() if h.startswith("### ")]
    assert headings
    for h in headings:
        m = re.fullmatch(r"### .+ — (\S+) — (.+), (\d{4}-\d\d-\d\d)", h)
        assert m and m.group(2) in names, h
