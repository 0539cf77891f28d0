"""The artifact schema (study/artifacts/): one format, typed, and the migration to it.

Every kind the library writes is a record, and every committed artifact of those kinds reads
into it and writes back as it is (SCRIPT_KINDS, the scripts' own records, stay untyped). The
readers know the current format only; scripts/migrate_artifacts.py brings older artifacts to
it, filling what they lack as the readers used to, idempotently.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import specdec
from specdec.study.artifacts import (
    SCHEMAS,
    ArtifactError,
    InvarianceArtifact,
    MicrobenchArtifact,
    SchemaError,
    check_machine,
    read,
    runs,
    to_json,
    write_json,
)

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures"
#: The scripts' own records (scripts/*.py write them; no reader in the library): not typed.
SCRIPT_KINDS = (
    "specdec.arrivals/1",
    "specdec.cluster_check/1",
    "specdec.completion_replay/1",
    "specdec.extraction/1",
    "specdec.front_door_check/1",
    "specdec.kernel_classes/1",
    "specdec.llama_bench/1",
    "specdec.loadtest_hostile/1",
    "specdec.loadtest_parallel/1",
    "specdec.loadtest_soak/1",
    "specdec.oneshot/1",
    "specdec.shared_machine/1",
)


def _committed() -> list[tuple[Path, dict]]:
    """Every specdec artifact under results/ and tests/fixtures/."""
    out = []
    for root in (ROOT / "results", FIXTURES):
        for path in sorted(root.rglob("*.json")):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and str(data.get("schema")).startswith("specdec."):
                out.append((path, data))
    return out


def test_every_kind_the_library_writes_is_typed() -> None:
    """A "specdec.<kind>/<n>" the package names, or a committed artifact holds, is a kind of
    SCHEMAS, or one of the scripts' own."""
    named = set()
    for path in Path(specdec.__file__).parent.rglob("*.py"):
        named |= set(re.findall(r'"(specdec\.[a-z_]+/\d+)"', path.read_text()))
    assert named - set(SCHEMAS) == set(), "type these kinds in study/artifacts/"
    committed = {data["schema"] for _, data in _committed()}
    assert committed - set(SCHEMAS) - set(SCRIPT_KINDS) == set(), "a new kind: type it"


def test_every_committed_artifact_reads_and_writes_back_as_it_is() -> None:
    """read -> to_json gives the file's JSON, every key in its place, for each kind committed."""
    kinds = set()
    for path, data in _committed():
        if data["schema"] in SCRIPT_KINDS:
            continue
        src = str(path.relative_to(ROOT))
        art = read(data, src, path)
        assert type(art).SCHEMA == data["schema"] and art.src == src and art.path == path
        assert json.dumps(to_json(art)) == json.dumps(data), f"{src} does not write back as read"
        kinds.add(data["schema"])
    # the kinds with a committed example; replay and invariance: test_replay, below
    assert kinds >= {f"specdec.{k}/1" for k in ("bench", "sweep", "microbench", "gate")}
    assert kinds >= {f"specdec.{k}/1" for k in ("doctor", "profile", "together")}


def test_an_older_together_artifact_writes_back_without_the_fields_added_later() -> None:
    """A together artifact committed before the requests' draft counts and the methods'
    percentiles: read, they are None; written back, absent; a record given them writes them,
    null included."""
    path = next(
        p
        for p, d in _committed()
        if d["schema"] == "specdec.together/1" and "drafted" not in d["rows"][0]["requests"][0]
    )
    art = read(json.loads(path.read_text()))
    reply = art.rows[0].requests[0]
    assert reply.drafted is None and "drafted" not in to_json(reply)
    given = type(reply).model_validate({**to_json(reply), "drafted": None})
    assert to_json(given)["drafted"] is None
    method = next(iter(art.methods.values()))
    assert method.latency_p50_s is None and "latency_p50_s" not in to_json(method)
    failed = {"prompt_id": "p", "error": "timeout: no answer"}
    row = {**to_json(art.rows[0]), "requests": [failed]}
    assert to_json(type(art.rows[0]).model_validate(row))["requests"] == [failed]


def test_an_invariance_artifact_reads_back_and_tabulates() -> None:
    """specdec.invariance/1, as `specdec invariance` assembles it from run_setting's probes
    (no committed example: built here from planted node outputs)."""
    from specdec.study.artifacts.provenance import meta_block
    from specdec.study.run.invariance import SETTINGS, compare_nodes, format_table, summarize

    b, n = 2, 3
    same = np.zeros((b, n), dtype=np.float32)
    off = same.copy()
    off[1, 2] = 1e-3
    batched = {"attn_norm-0|MUL": [same], "Qcur-0|MUL_MAT": [off]}
    single = {k: [same[i : i + 1] for i in range(b)] for k in batched}
    probe = {"model": "llamacpp:x", "setting": "stock", "repacked_mib": 0, "context": 4}
    probe |= {"batch": b, "logits_max_abs_diff": [0.0, 0.5], "identical": False}
    probe |= summarize(compare_nodes(batched, single, b), {"Qcur-0|MUL_MAT": "q4_K"})
    art = {"schema": InvarianceArtifact.SCHEMA, "meta": meta_block(), "settings": SETTINGS}
    art |= {"batch": b, "contexts": [4], "threads": None, "probes": [probe]}
    data = to_json(art)
    again = read(data)
    assert isinstance(again, InvarianceArtifact) and to_json(again) == data
    assert again.probes[0].first_difference.op == "Qcur|MUL_MAT"
    assert "Qcur|MUL_MAT (layer 0, q4_K weight)" in format_table(again) == format_table(data)


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
    spec = read(new).aggregates.speculative
    n, mal = runs.pooled_acceptance_length([r["speculative"] for r in new["rows"]])
    assert (spec.drafting_rounds, spec.mean_acceptance_length) == (n, mal)


def test_a_record_round_trips_and_refuses_unknown_or_mistyped_fields() -> None:
    with pytest.raises(ArtifactError, match=r"x\.json: unknown schema 'specdec\.bench/9'"):
        read({"schema": "specdec.bench/9"}, "x.json")
    with pytest.raises(ArtifactError, match=r"x\.json: an artifact is a JSON object"):
        read([], "x.json")
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    got = read(art, "m.json")
    assert isinstance(got, MicrobenchArtifact) and got.src == "m.json"
    again = to_json(got)
    assert again == art and list(again) == list(art)  # every field, in the file's order
    with pytest.raises(ArtifactError, match=r"m.json: field 'step_sprad'"):
        read({**art, "step_sprad": 0.1}, "m.json")
    bad = json.loads(json.dumps(art))
    bad["prediction"][0]["k"] = "four"
    with pytest.raises(ArtifactError, match=r"m.json: prediction.0: field 'k' is 'four'"):
        read(bad, "m.json")
    del bad["target_step_ms"]
    with pytest.raises(ArtifactError, match=r"missing field 'target_step_ms'"):
        MicrobenchArtifact.from_json(bad, "m.json")


def test_an_artifact_that_does_not_name_its_machine_is_refused_at_write(tmp_path) -> None:
    """write_json refuses a specdec artifact whose meta.machine lacks the CPU, the kernels or the
    load, and writes nothing; the migration's rewrite of an old file is let through."""
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    path = tmp_path / "m.json"
    assert "cpu_model" not in art["meta"]["machine"]  # the fixture predates the machine block
    with pytest.raises(SchemaError, match="does not name cpu_model, kernels, load_avg"):
        write_json(path, art)
    for meta in ({}, {"machine": None}, None):
        with pytest.raises(SchemaError, match=r"no meta\.machine block"):
            write_json(path, {**art, "meta": meta})
    machine = {**art["meta"]["machine"], "cpu_model": "", "kernels": None, "load_avg": None}
    with pytest.raises(SchemaError, match="does not name cpu_model"):
        write_json(path, {**art, "meta": {**art["meta"], "machine": machine}})
    assert not path.exists()
    machine["cpu_model"] = "Test CPU"  # kernels and load may be null: no llama.cpp, no loadavg
    write_json(path, {**art, "meta": {**art["meta"], "machine": machine}})
    assert read(json.loads(path.read_text())).meta["machine"]["cpu_model"] == "Test CPU"
    write_json(path, art, rewrite=True)  # scripts/migrate_artifacts.py
    write_json(tmp_path / "other.json", {"schema": "not-specdec", "x": [1]})


def test_an_artifact_that_does_not_read_back_is_refused_at_write(tmp_path) -> None:
    """write_json checks a library kind against its record, whether it was built as the record
    or as a dict, and writes nothing when a field is missing or of the wrong type."""
    art = json.loads((FIXTURES / "microbench_qwen2.5-coder-1.5b.json").read_text())
    machine = {**art["meta"]["machine"], "cpu_model": "Test CPU", "kernels": None, "load_avg": None}
    art = {**art, "meta": {**art["meta"], "machine": machine}}
    path = tmp_path / "m.json"
    bad = json.loads(json.dumps(art))
    bad["prediction"][0]["k"] = "four"
    with pytest.raises(ArtifactError, match=r"m\.json: prediction\.0: field 'k' is 'four'"):
        write_json(path, bad)
    with pytest.raises(ArtifactError, match=r"m\.json: field 'step_sprad'"):
        write_json(path, {**art, "step_sprad": 0.1})
    assert not path.exists()
    write_json(path, art)
    assert to_json(read(json.loads(path.read_text()))) == art


def test_the_meta_block_names_the_machine() -> None:
    from specdec.study.artifacts.provenance import meta_block

    check_machine({"schema": "specdec.bench/1", "meta": meta_block()}, "now")


def test_every_committed_result_names_its_machine() -> None:
    """results/ holds only artifacts a reader can place: the CPU, the kernels, the load."""
    for path in sorted((ROOT / "results").rglob("*.json")):
        data, src = json.loads(path.read_text()), str(path.relative_to(ROOT))
        assert str(data.get("schema")).startswith("specdec."), f"{src}: not a specdec artifact"
        check_machine(data, src)
