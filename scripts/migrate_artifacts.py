"""Rewrite every JSON artifact under a directory into the schema's one current format.

    python scripts/migrate_artifacts.py results/ [DIR ...]

The readers in study/artifacts/ know one format only; this is where the older ones went. It is
idempotent (a file already current is left untouched, byte for byte), so run it on any
directory of artifacts, as often as you like. Only the four kinds that had older formats are
rewritten (specdec.bench/1, sweep/1, microbench/1, gate/1); other JSON, the other kinds
included, is left alone (together/1's fields added later are artifacts.added_later()).

What an older artifact lacks is filled the way the reader used to fill it, so figures and
REPORT.md read the same numbers after the migration as before:

    RUN          calibration_s (dropped from core.metrics): verify_s loses the prefill it then
                 held (the prefill is prefill_s), calibration_s moves into other_s; a RUN from
                 before prefill_s gets prefill_s 0.0 (its prefill stays inside verify_s, so the
                 latency split sums as it did); drafting_rounds = drafted_per_pos[0]
    AGG          drafting_rounds and mean_acceptance_length pooled from the rows
                 (runs.pooled_acceptance_length, as runs.aggregate_runs does); a variant's
                 speedup and decode_speedup, and the run's speedup ratios, from the AGGs
    bench        config: the BenchConfig defaults for flags it predates; rows: index (warm-up
                 prompts come first) and sequence (the methods in the order the row's `order`
                 ran them); models: dtype
    sweep        a point's mean_acceptance_length from its per-K bench artifact beside it
    the rest     fields the reader read as null when absent are written as null
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdec.study.artifacts import MAIN_METHODS, ArtifactError, read, to_json, write_json
from specdec.study.artifacts.runs import pooled_acceptance_length

#: Fields an AGG holds (artifacts.Agg): absent ones are written as null.
AGG_FIELDS = (
    "n",
    "tok_s_mean",
    "tok_s_std",
    "tok_s_pooled",
    "decode_tok_s_pooled",
    "ttft_s_mean",
    "generated",
    "rounds",
    "drafting_rounds",
    "drafted",
    "accepted",
    "acceptance_rate",
    "positional_acceptance",
    "tokens_per_round",
    "mean_acceptance_length",
    "ms_per_token",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _nulls(d: dict[str, Any], names: Any) -> None:
    for name in names:
        d.setdefault(name, None)


def _model(m: Any) -> None:
    if isinstance(m, dict):
        m.setdefault("dtype", None)


def migrate_run(r: dict[str, Any]) -> None:
    """A RUN record in place (core.metrics.GenerationStats.to_dict's fields)."""
    if "calibration_s" in r:
        cal = r.pop("calibration_s")
        if "prefill_s" in r and "verify_s" in r:
            r["verify_s"] -= r["prefill_s"]
        if "other_s" in r:
            r["other_s"] += cal
    elif "verify_s" in r and "prefill_s" not in r:
        r["prefill_s"] = 0.0
    per_pos = r.get("drafted_per_pos")
    if per_pos is not None and "drafting_rounds" not in r:
        r["drafting_rounds"] = int(per_pos[0]) if per_pos else 0


def _bench_config(config: dict[str, Any]) -> None:
    from specdec.study.run.bench_settings import config_defaults

    for key, value in config_defaults().items():
        config.setdefault(key, value)
    for key, value in config.items():
        if isinstance(value, tuple):
            config[key] = list(value)


def _methods(d: dict[str, Any]) -> list[str]:
    agg = d["aggregates"]
    return [m for m in MAIN_METHODS if agg.get(m) is not None] + list(agg.get("variants") or {})


def _row(r: dict[str, Any], index: int, methods: list[str]) -> None:
    r.setdefault("index", index)
    if "sequence" not in r:
        r["sequence"] = methods if r.get("order") != "spec-first" else methods[::-1]
    for m in MAIN_METHODS:
        if isinstance(r.get(m), dict):
            migrate_run(r[m])
    r.setdefault("variants", {})
    for run in r["variants"].values():
        migrate_run(run)


def _agg(agg: dict[str, Any], runs: list[Mapping[str, Any]]) -> None:
    if "mean_acceptance_length" not in agg:
        n, mal = pooled_acceptance_length(runs)
        agg.setdefault("drafting_rounds", n)
        agg["mean_acceptance_length"] = mal
    _nulls(agg, AGG_FIELDS)


def migrate_bench(d: dict[str, Any]) -> None:
    for m in d["models"].values():
        _model(m)
    _bench_config(d["config"])
    agg = d["aggregates"]
    agg.setdefault("variants", {})
    methods = _methods(d)
    warmup = int(d["config"].get("warmup") or 0)
    for i, r in enumerate(d["rows"]):
        _row(r, warmup + i, methods)

    def runs(method: str) -> list[Mapping[str, Any]]:
        if method in MAIN_METHODS:
            return [r[method] for r in d["rows"]]
        return [r["variants"][method] for r in d["rows"] if method in r["variants"]]

    base, spec = agg["baseline"], agg["speculative"]
    for m in MAIN_METHODS:
        if agg.get(m) is not None:
            _agg(agg[m], runs(m))
    for name, v in agg["variants"].items():
        _agg(v, runs(name))
        if "speedup" not in v:
            v["speedup"] = _ratio(v["tok_s_mean"], base["tok_s_mean"])
        if "decode_speedup" not in v:
            v["decode_speedup"] = _ratio(v["decode_tok_s_pooled"], base["decode_tok_s_pooled"])
    agg.setdefault("by_category", {})
    if "speedup_pooled" not in agg:
        agg["speedup_pooled"] = _ratio(spec["tok_s_pooled"], base["tok_s_pooled"])
    if "decode_speedup" not in agg:
        agg["decode_speedup"] = _ratio(spec["decode_tok_s_pooled"], base["decode_tok_s_pooled"])
    if agg.get("hf_assisted") is not None and "speedup_hf_assisted" not in agg:
        agg["speedup_hf_assisted"] = _ratio(agg["hf_assisted"]["tok_s_mean"], base["tok_s_mean"])
    _nulls(agg, ("speedup", "peak_rss_mb", "peak_vram_mb"))
    d.setdefault("variants", list(agg["variants"]))


def migrate_sweep(d: dict[str, Any], where: Path | None = None) -> None:
    d.setdefault("complete", True)
    for pt in d["points"]:
        if "mean_acceptance_length" not in pt:
            pt["mean_acceptance_length"] = _member_mal(where, pt.get("artifact"))
        _nulls(pt, ("speedup_pooled", "positional_acceptance"))


def _member_mal(where: Path | None, name: str | None) -> float | None:
    """The per-K bench artifact's (migrated) speculative mean acceptance length, when it lies
    beside the summary, as the report read it from there."""
    if where is None or name is None or not (where / name).is_file():
        return None
    member = migrate(json.loads((where / name).read_text(encoding="utf-8")))
    return member["aggregates"]["speculative"]["mean_acceptance_length"]


def migrate_microbench(d: dict[str, Any]) -> None:
    for m in d["models"].values():
        _model(m)
    _nulls(d, ("max_batch", "step_spread", "deterministic", "draft_samples_ms", "acceptance"))
    _nulls(d, ("threads",))
    d.setdefault("checks", [])


def migrate_gate(d: dict[str, Any]) -> None:
    for m in d["models"].values():
        _model(m)
    s = d["sampled"]
    for b in s.get("bins") or ():
        if "token_id" not in b:  # no committed artifact has one; its bins cannot be told apart
            raise ArtifactError(f"gate bin {b.get('label')!r} has no token_id: rerun the gate")
    _nulls(s, ("p_value_permutation", "n_permutations", "p_min", "decided_by"))
    _nulls(s, ("smoothed_kl", "kl_definition", "wall_s"))
    s.setdefault("bins", [])
    s.setdefault("seeds", {})
    _nulls(d["greedy"], ("n_prompts", "max_new_tokens", "k"))


MIGRATIONS: dict[str, Any] = {
    "specdec.bench/1": migrate_bench,
    "specdec.sweep/1": migrate_sweep,
    "specdec.microbench/1": migrate_microbench,
    "specdec.gate/1": migrate_gate,
}


def migrate(data: Any, where: Path | None = None) -> Any:
    """The artifact in the current format (a new object), its fields in the schema's order, as
    a producer writes it; anything else unchanged. `where`: the artifact's directory (a sweep
    summary reads its per-K artifacts there)."""
    kind = data.get("schema") if isinstance(data, dict) else None
    if kind not in MIGRATIONS:
        return data
    out = json.loads(json.dumps(data))
    if kind == "specdec.sweep/1":
        migrate_sweep(out, where)
    else:
        MIGRATIONS[kind](out)
    return to_json(read(out, str(where or "")))


def migrate_dir(root: Path) -> list[Path]:
    """Migrate every *.json under root in place; the files rewritten."""
    changed = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not JSON: not an artifact
        new = migrate(data, path.parent)
        if json.dumps(new) != json.dumps(data):  # the order of the fields counts
            write_json(path, new, rewrite=True)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="directories of artifacts")
    args = ap.parse_args(argv)
    for root in args.dirs:
        if not root.is_dir():
            print(f"not a directory: {root}", file=sys.stderr)
            return 2
        for path in migrate_dir(root):
            print(f"migrated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
