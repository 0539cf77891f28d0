"""The artifact schema (study/artifacts/): one format, typed, and the migration to it.

The readers know the current format only; scripts/migrate_artifacts.py brings older artifacts to
it, filling what they lack as the readers used to, idempotently.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from specdec.study.artifacts import runs, schema

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def migrate():
    spec = importlib.util.spec_from_file_location("migrate", ROOT / "scripts/migrate_artifacts.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_from_before_calibration_s_was_dropped(migrate) -> None:
    """verify_s then held the prefill: the split stays the same, calibration_s joins other_s."""
    old = {"draft_s": 1.0, "verify_s": 2.5, "prefill_s": 0.5, "sampling_s": 0.25}
    old |= {"other_s": 0.1, "calibration_s": 0.125, "drafted_per_pos": [4, 3]}
    new = dict(old)
    migrate.migrate_run(new)
    assert "calibration_s" not in new and new["verify_s"] == 2.0 and new["other_s"] == 0.225
    assert runs.phase_seconds(new)["verify"] == 2.5
    assert new["drafting_rounds"] == 4


def test_committed_fixtures_and_results_are_current(migrate, tmp_path) -> None:
    """Migrating what is committed changes nothing: it has been migrated."""
    for src in (FIXTURES, ROOT / "results"):
        if not src.is_dir():
            continue
        copy = tmp_path / src.name
        shutil.copytree(src, copy)
        assert migrate.migrate_dir(copy) == []


def test_migration_fills_an_old_bench_and_is_idempotent(migrate, tmp_path) -> None:
    art = json.loads((FIXTURES / "bench_all_gguf_k4_t0.8.json").read_text())
    for row in art["rows"]:
        for m in ("baseline", "speculative"):
            row[m].pop("drafting_rounds", None)
        row.pop("sequence")
    for m in ("baseline", "speculative"):
        art["aggregates"][m].pop("mean_acceptance_length")
    art["config"].pop("k_max")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(art))
    assert migrate.migrate_dir(tmp_path) == [path]
    text = path.read_text()
    assert migrate.migrate_dir(tmp_path) == [] and path.read_text() == text
    new = json.loads(text)
    assert "k_max" in new["config"]
    assert all(r["sequence"][0] in ("baseline", "speculative") for r in new["rows"])
    spec = schema.read(new).aggregates.speculative
    n, mal = runs.pooled_acceptance_length([r["speculative"] for r in new["rows"]])
    assert (spec.drafting_rounds, spec.mean_acceptance_length) == (n, mal)


def test_a_record_round_trips_and_refuses_unknown_or_mistyped_fields() -> None:
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    read = schema.read(art, "m.json")
    assert isinstance(read, schema.MicrobenchArtifact) and read.src == "m.json"
    again = schema.to_json(read)
    assert again == art and list(again) == list(art)  # every field, in the file's order
    with pytest.raises(schema.ArtifactError, match=r"m.json: field 'step_sprad'"):
        schema.read({**art, "step_sprad": 0.1}, "m.json")
    bad = json.loads(json.dumps(art))
    bad["prediction"][0]["k"] = "four"
    with pytest.raises(schema.ArtifactError, match=r"m.json: prediction.0: field 'k' is 'four'"):
        schema.read(bad, "m.json")
    del bad["target_step_ms"]
    with pytest.raises(schema.ArtifactError, match=r"missing field 'target_step_ms'"):
        schema.MicrobenchArtifact.from_json(bad, "m.json")


def test_an_artifact_that_does_not_name_its_machine_is_refused_at_write(tmp_path) -> None:
    """write_json refuses a specdec artifact whose meta.machine lacks the CPU, the kernels or the
    load, and writes nothing; the migration's rewrite of an old file is let through."""
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    path = tmp_path / "m.json"
    assert "cpu_model" not in art["meta"]["machine"]  # the fixture predates the machine block
    with pytest.raises(schema.SchemaError, match="does not name cpu_model, kernels, load_avg"):
        schema.write_json(path, art)
    for meta in ({}, {"machine": None}, None):
        with pytest.raises(schema.SchemaError, match=r"no meta\.machine block"):
            schema.write_json(path, {**art, "meta": meta})
    machine = {**art["meta"]["machine"], "cpu_model": "", "kernels": None, "load_avg": None}
    with pytest.raises(schema.SchemaError, match="does not name cpu_model"):
        schema.write_json(path, {**art, "meta": {**art["meta"], "machine": machine}})
    assert not path.exists()
    machine["cpu_model"] = "Test CPU"  # kernels and load may be null: no llama.cpp, no loadavg
    schema.write_json(path, {**art, "meta": {**art["meta"], "machine": machine}})
    assert schema.read(json.loads(path.read_text())).meta["machine"]["cpu_model"] == "Test CPU"
    schema.write_json(path, art, rewrite=True)  # scripts/migrate_artifacts.py
    schema.write_json(tmp_path / "other.json", {"schema": "not-specdec", "x": [1]})


def test_the_meta_block_names_the_machine() -> None:
    from specdec.study.artifacts.provenance import meta_block

    schema.check_machine({"schema": "specdec.bench/1", "meta": meta_block()}, "now")


def test_every_committed_result_names_its_machine() -> None:
    """results/ holds only artifacts a reader can place: the CPU, the kernels, the load."""
    for path in sorted((ROOT / "results").rglob("*.json")):
        data, src = json.loads(path.read_text()), str(path.relative_to(ROOT))
        assert str(data.get("schema")).startswith("specdec."), f"{src}: not a specdec artifact"
        schema.check_machine(data, src)
