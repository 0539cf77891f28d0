"""`specdec figures` and `specdec report`, regenerated from the hand-made artifacts in fixtures/.

The fixtures follow artifacts.py and the producers' shapes (bench.py, microbench.py, gate.py): three
stand-alone bench runs (all_gguf and all_hf on CPU, the second with `--compare hf-assisted`;
primary on CUDA), a K-sweep of all_gguf in sweep/ with its per-K artifacts, a microbench of the
all_gguf pair and a level-3 gate of primary. Timings are simulated; only the shapes are real.

Error contract under test: JSON that is not a specdec artifact is skipped with a note (exit 0); a
file that claims a specdec schema but is malformed is named on stderr, left out, everything else
is still written, and the exit status is 1.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from specdec.cli.main import main
from specdec.study.artifacts import read
from specdec.study.present.figures import FIGURES
from specdec.study.present.scan import DRAWN_KINDS

FIXTURES = Path(__file__).parents[1] / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000  # a figure with axes, data and text; an empty canvas is ~2-5 KB
MAIN_BENCHES = {
    "bench_all_gguf_k4_t0.8.json": "all_gguf",
    "bench_all_hf_k4_t0.8.json": "all_hf",
    "gpu/bench_primary_k4_t0.8.json": "primary",
}
SWEEP = "sweep/sweep_all_gguf_t0.8.json"
MICRO = "microbench_qwen2.5-coder-1.5b.json"
GATE = "gate_primary.json"


def _load(rel: str) -> dict:
    return json.loads((FIXTURES / rel).read_text())


def _copy(dst: Path, *rels: str) -> Path:
    for rel in rels:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / rel, dst / rel)
    return dst


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def _section(report: str, title: str) -> str:
    """The text of one `## title` section of REPORT.md."""
    start = report.index(f"## {title}")
    end = report.find("\n## ", start + 1)
    return report[start : end if end != -1 else None]


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All fixtures copied to a fresh DIR, then `figures DIR` and `report DIR` run once."""
    d = tmp_path_factory.mktemp("study")
    shutil.copytree(FIXTURES, d, dirs_exist_ok=True)
    assert main(["figures", str(d)]) == 0
    assert main(["report", str(d)]) == 0
    return d


# ------------------------------------------------------------------------------ fixtures
def test_fixtures_read_as_every_drawn_kind() -> None:
    kinds = {}
    for path in sorted(FIXTURES.rglob("*.json")):
        kinds[path.relative_to(FIXTURES).as_posix()] = read(json.loads(path.read_text())).SCHEMA
    assert {k.split("/")[0] for k in kinds.values()} == set(DRAWN_KINDS)
    assert {k for k, v in kinds.items() if v == "specdec.bench/1"} >= set(MAIN_BENCHES)
    assert any("hf_assisted" in _load(rel)["aggregates"] for rel in MAIN_BENCHES)


def test_fixture_sweep_points_name_their_per_k_artifacts() -> None:
    sweep = _load(SWEEP)
    for pt in sweep["points"]:
        member = _load(f"sweep/{pt['artifact']}")
        assert member["config"]["k"] == pt["k"]
        assert member["aggregates"]["speedup"] == pytest.approx(pt["speedup"])


# ------------------------------------------------------------------------------ figures
def test_every_figure_is_a_nontrivial_png(study: Path) -> None:
    written = sorted(p.name for p in (study / "figures").iterdir())
    assert written == sorted(FIGURES)
    for name in FIGURES:
        path = study / "figures" / name
        width, height = _png_size(path)
        assert width >= 600 and height >= 400, name
        assert path.stat().st_size > MIN_PNG_BYTES, name


def test_no_figure_cuts_a_text_at_its_edge(tmp_path: Path) -> None:
    """Issue 64: `make demo`'s throughput figure had its title cut at the left edge ("ughput per
    method; ..."): tight_layout centres a title over axes narrowed by the legend beside them."""
    from specdec.study.present import figures

    figures.CLIPPED.clear()
    d = tmp_path / "study"
    shutil.copytree(FIXTURES, d)
    assert main(["figures", str(d)]) == 0
    assert figures.CLIPPED == []


def test_a_title_wider_than_the_figure_is_wrapped_until_it_fits(tmp_path: Path) -> None:
    from specdec.study.present import figures

    plt = figures._pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.bar([0, 1], [1, 2], label="a method with a long legend entry")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = "Throughput per method; label = speedup over the same run's target-only " * 2
    ax.set_title(title + "\n(T = 0.8, 128 new tokens, 10 prompts, 2 warm-up, native kernels)")
    fig.tight_layout()
    assert figures.clipped(fig), "the case no longer clips: the test needs a longer title"
    figures.CLIPPED.clear()
    figures._finish(fig, tmp_path / "t.png", ["x.json"])
    assert figures.CLIPPED == [] and (tmp_path / "t.png").stat().st_size > 0


def test_figures_out_option_and_rerun_are_stable(study: Path, tmp_path: Path) -> None:
    d = _copy(tmp_path / "in", MICRO, SWEEP)  # the two quickest figures
    assert main(["figures", str(d), "--out", str(tmp_path / "again")]) == 0
    for name in ("verify_scaling.png", "speedup_vs_k.png"):  # the same JSON draws the same PNG
        assert (tmp_path / "again" / name).read_bytes() == (study / "figures" / name).read_bytes()


# ------------------------------------------------------------------------------ report
def test_report_main_table_has_each_config_and_its_numbers(study: Path) -> None:
    main_table = _section((study / "REPORT.md").read_text(), "Main results")
    for rel, name in MAIN_BENCHES.items():
        agg = _load(rel)["aggregates"]
        row = next(line for line in main_table.splitlines() if f"`{rel}`" in line)
        assert row.startswith(f"| {name} |")
        assert f"{agg['speedup']:.2f}×" in row
        for side in ("baseline", "speculative"):
            assert f"{agg[side]['tok_s_mean']:.2f}±{agg[side]['tok_s_std']:.2f}" in row
        assert f"{100 * agg['speculative']['acceptance_rate']:.1f}%" in row
        assert f"{agg['peak_rss_mb'] / 1024:.2f}" in row
        if "hf_assisted" in agg:
            assert f"{agg['speedup_hf_assisted']:.2f}×" in row
        else:
            assert "not run" in row
    # The per-K artifacts of the sweep belong to Table 4, not Table 3.
    assert "sweep/bench_all_gguf" not in main_table
    assert "![throughput.png](figures/throughput.png)" in main_table


def test_report_sweep_table_in_table_4_shape(study: Path) -> None:
    table = _section((study / "REPORT.md").read_text(), "K-sweeps")
    sweep = _load(SWEEP)
    assert f"`{SWEEP}`" in table
    best = max(p["speedup"] for p in sweep["points"])
    for pt in sweep["points"]:
        row = next(line for line in table.splitlines() if f"`sweep/{pt['artifact']}`" in line)
        bold = "**" if pt["speedup"] == best else ""
        assert row.startswith(f"| {bold}{pt['k']}{bold} |")
        assert f"{bold}{pt['speedup']:.2f}×{bold}" in row
        assert f"{pt['speculative_tok_s']:.2f}±{pt['speculative_tok_s_std']:.2f}" in row
        assert f"{100 * pt['acceptance_rate']:.1f}%" in row


def test_report_microbench_gate_and_provenance(study: Path) -> None:
    report = (study / "REPORT.md").read_text()
    micro, gate = _load(MICRO), _load(GATE)
    mb = _section(report, "Microbenchmarks")
    assert f"c = draft step / target step: {micro['c']:.3f}" in mb
    for pt in micro["prediction"]:
        assert f"{pt['predicted_speedup']:.2f}×" in mb
    assert (
        f"| 5 | {micro['verify'][4]['median_ms']:.2f} | {micro['verify'][4]['ratio']:.2f} |" in mb
    )
    measured_k4 = next(p for p in _load(SWEEP)["points"] if p["k"] == 4)["speedup"]
    assert f"| {measured_k4:.2f}× | `{SWEEP}` |" in mb  # predicted vs measured, cited
    g = _section(report, "Correctness gate")
    s = gate["sampled"]
    assert f"χ² = {s['chi2']:.2f}, dof = {s['dof']}, p = {s['p_value']:.3g}" in g
    assert "**PASS**" in g and "5/5 prompts identical" in g
    hosts = _section(report, "Hosts")  # the fixtures predate meta.machine.cpu_model
    assert "| CPU not recorded + NVIDIA H200 |" in hosts and "| CPU not recorded |" in hosts
    files = _section(report, "Artifacts")
    for path in FIXTURES.rglob("*.json"):
        assert f"`{path.relative_to(FIXTURES).as_posix()}`" in files
    for name in FIGURES:
        assert f"(figures/{name})" in report


def test_report_links_figures_relative_to_its_own_location(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "docs" / "STUDY.md"
    assert main(["report", str(study), "--out", str(out)]) == 0
    prefix = "![throughput.png]("
    link = next(line for line in out.read_text().splitlines() if line.startswith(prefix))
    target = (out.parent / link[len(prefix) : -1]).resolve()
    assert target == (study / "figures" / "throughput.png").resolve()


# ------------------------------------------------------------------------------ partial inputs
@pytest.mark.parametrize(
    ("rels", "expected"),
    [
        ((GATE,), {"token_frequency.png"}),
        ((MICRO,), {"verify_scaling.png"}),
        (
            ("bench_all_gguf_k4_t0.8.json",),
            {"throughput.png", "acceptance_by_position.png", "latency_split.png"},
        ),
        ((SWEEP,), {"speedup_vs_k.png"}),  # the summary alone, without its per-K artifacts
    ],
    ids=["gate", "microbench", "bench", "sweep-summary"],
)
def test_one_kind_of_artifact_draws_only_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rels: tuple[str, ...], expected: set[str]
) -> None:
    d = _copy(tmp_path, *rels)
    assert main(["figures", str(d)]) == 0
    assert {p.name for p in (d / "figures").iterdir()} == expected
    err = capsys.readouterr().err
    for name in set(FIGURES) - expected:
        assert f"note: {name}: skipped" in err
    assert main(["report", str(d)]) == 0
    report = (d / "REPORT.md").read_text()
    assert report.count("No artifact:") >= 2  # honest-empty sections, not placeholders
    for name in expected:
        assert f"(figures/{name})" in report


def test_sweep_summary_without_its_per_k_artifacts_says_so(tmp_path: Path) -> None:
    d = _copy(tmp_path, SWEEP)
    assert main(["report", str(d)]) == 0
    table = _section((d / "REPORT.md").read_text(), "K-sweeps")
    assert "`bench_all_gguf_k4_t0.8.json` (not under DIR)" in table


def test_malformed_artifacts_are_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _copy(tmp_path, SWEEP, "bench_all_gguf_k4_t0.8.json")
    bad = _load("bench_all_hf_k4_t0.8.json")
    del bad["aggregates"]["speculative"]
    (d / "bad_bench.json").write_text(json.dumps(bad))
    wrong = _load(MICRO)
    wrong["verify"][3]["ratio"] = "fast"
    (d / "bad_micro.json").write_text(json.dumps(wrong))
    (d / "truncated.json").write_text('{"schema": "specdec.gate/1", "meta": {')
    (d / "future.json").write_text(json.dumps({**_load(GATE), "schema": "specdec.gate/9"}))
    (d / "package.json").write_text('{"name": "not-ours"}')

    assert main(["figures", str(d)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "malformed artifact bad_bench.json: missing field 'aggregates.speculative'" in err
    assert "warning: malformed artifact bad_micro.json: verify.3: field 'ratio' is 'fast'" in err
    assert "warning: malformed artifact truncated.json: not readable JSON" in err
    assert "warning: malformed artifact future.json: unknown schema 'specdec.gate/9'" in err
    assert "note: skipping package.json: not a specdec artifact" in err
    # Everything valid is still drawn.
    assert (d / "figures" / "speedup_vs_k.png").is_file()
    assert (d / "figures" / "throughput.png").is_file()
    assert not (d / "figures" / "verify_scaling.png").exists()

    assert main(["report", str(d)]) == 1
    files = _section((d / "REPORT.md").read_text(), "Artifacts")
    assert "Malformed (not used):" in files and "- bad_micro.json:" in files
    assert "Skipped (not specdec artifacts):" in files and "- package.json:" in files


def test_only_unrelated_json_is_skipped_without_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy(tmp_path, SWEEP)
    (tmp_path / "notes.json").write_text("[1, 2, 3]")
    assert main(["figures", str(tmp_path)]) == 0
    assert "note: skipping notes.json" in capsys.readouterr().err


def test_bench_interrupted_before_any_row_is_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = _load("bench_all_gguf_k4_t0.8.json")
    art["rows"], art["complete"] = [], False
    for side in ("baseline", "speculative"):
        agg = art["aggregates"][side]
        for key in (
            "tok_s_mean",
            "tok_s_std",
            "acceptance_rate",
            "positional_acceptance",
            "tokens_per_round",
            "ms_per_token",
        ):
            agg[key] = None
        agg["n"] = 0
    art["aggregates"].update(speedup=None, speedup_pooled=None)
    (tmp_path / "bench_all_gguf_k4_t0.8.json").write_text(json.dumps(art))
    assert main(["figures", str(tmp_path)]) == 0
    assert "no recorded prompts" in capsys.readouterr().err
    assert not any((tmp_path / "figures").iterdir())


def test_directory_without_artifacts_or_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["figures", str(tmp_path)]) == 1
    assert "no specdec artifacts" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_clashing_config_names_are_told_apart_by_the_setting_that_differs(tmp_path: Path) -> None:
    from specdec.study.present.scan import scan

    art = _load("bench_all_gguf_k4_t0.8.json")
    (tmp_path / "a.json").write_text(json.dumps(art))
    art["config"]["k"] = 2
    (tmp_path / "b.json").write_text(json.dumps(art))
    assert [b.label for b in scan(tmp_path).benches] == ["all_gguf (K=4)", "all_gguf (K=2)"]


def test_variants_get_a_bar_each_labelled_with_its_speedup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec.study.present import figures
    from specdec.study.present.scan import scan

    art = _load("bench_all_gguf_k4_t0.8.json")
    agg = art["aggregates"]
    base = agg["baseline"]["tok_s_mean"]
    agg["variants"] = {}
    for name, scale in (("lookup-kauto", 1.3), ("model-k2", 0.9)):
        agg["variants"][name] = dict(agg["speculative"], tok_s_mean=base * scale, speedup=scale)
    art["config"]["drafter"] = "composite"
    (tmp_path / "a.json").write_text(json.dumps(art))
    other = _load("bench_all_gguf_k4_t0.8.json")
    other["config"]["temperature"] = 0.0  # same name and K, no variants
    (tmp_path / "b.json").write_text(json.dumps(other))
    study = scan(tmp_path)
    b = next(b for b in study.benches if b.aggregates.variants)
    bars = figures._bars(b)
    assert [bar.method for bar in bars] == [
        "target-only",
        "composite K=4",
        "lookup K=auto",
        "model K=2",
    ]
    assert [bar.speedup for bar in bars[2:]] == [pytest.approx(1.3), pytest.approx(0.9)]
    assert sorted(x.label for x in study.benches) == ["all_gguf (composite)", "all_gguf (model)"]

    drawn: dict[str, list] = {}

    def capture(fig, path, sources):
        ax = fig.axes[0]
        drawn["bars"] = [p for p in ax.patches if p.get_height() > 0]
        drawn["texts"] = [t.get_text() for t in ax.texts]
        return path

    monkeypatch.setattr(figures, "_finish", capture)
    assert figures.fig_throughput(study, tmp_path / "t.png") is not None
    assert len(drawn["bars"]) == 4 + 2  # this run's four methods, the other's two
    for text in ("lookup K=auto", "model K=2", "1.30×", "0.90×"):
        assert text in drawn["texts"]


def test_clashing_names_with_no_single_telling_setting_combine_the_differing_ones(
    tmp_path: Path,
) -> None:
    from specdec.study.present.scan import scan

    for i, (drafter, t) in enumerate((("composite", 0.8), ("composite", 0.0), ("model", 0.8))):
        art = _load("bench_all_gguf_k4_t0.8.json")
        art["config"].update(drafter=drafter, temperature=t)
        (tmp_path / f"{i}.json").write_text(json.dumps(art))
    assert sorted(b.label for b in scan(tmp_path).benches) == [
        "all_gguf (composite, T=0)",
        "all_gguf (composite, T=0.8)",
        "all_gguf (model, T=0.8)",
    ]
