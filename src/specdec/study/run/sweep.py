"""The K-sweep (paper, Table 4): `run_bench` at every K, each K against its own interleaved
baseline, because the paper normalizes every K by its own. Writes the per-K bench artifacts and
a `specdec.sweep/1` summary beside them (artifacts.SweepArtifact)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from specdec.core.checks import check_int
from specdec.core.model import SpecModel
from specdec.study.artifacts import (
    BenchArtifact,
    SweepArtifact,
    SweepPoint,
    write_json,
)
from specdec.study.artifacts.provenance import meta_block
from specdec.study.present import fmt
from specdec.study.run import methods
from specdec.study.run.bench import artifact_name, categories_part, run_bench
from specdec.study.run.bench_settings import BenchConfig, tag_suffix


def sweep_name(cfg: BenchConfig, tag: str | None = None) -> str:
    """sweep_<config>_t<T>[_cat-...][_<tag>].json."""
    t = cfg.warp.temperature
    return f"sweep_{cfg.name}_t{t:g}{categories_part(cfg)}{tag_suffix(tag)}.json"


def run_sweep(
    cfg: BenchConfig,
    ks: Sequence[int],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    models: tuple[SpecModel, SpecModel] | None = None,
    tag: str | None = None,
) -> SweepArtifact:
    """`run_bench` at every K in `ks` (cfg.spec.k is ignored), the models loaded once. The summary
    is rewritten after every K (and on Ctrl-C, which is re-raised); returned with its `path`
    set."""
    ks = list(dict.fromkeys(ks))
    if not ks:
        raise ValueError("the sweep needs at least one K")
    for k in ks:
        check_int("every K of the sweep", k, 1)
    path = Path(out_dir) / sweep_name(cfg, tag)
    if models is None:
        with methods.loaded_pair(cfg) as pair:
            return run_sweep(cfg, ks, out_dir, progress, pair, tag)
    summary = SweepArtifact(
        meta=meta_block(),
        config={key: v for key, v in cfg.to_json().items() if key != "k"},
        ks=tuple(ks),
        points=(),
        complete=False,
        path=path,
    )
    for c in (replace(cfg, spec=replace(cfg.spec, k=k)) for k in ks):
        try:
            art = run_bench(c, out_dir, progress, models, tag)
        except KeyboardInterrupt:
            write_json(path, summary)
            raise
        point = sweep_point(art, artifact_name(c, tag))
        summary = summary.model_copy(update={"points": (*summary.points, point)})
        write_json(path, summary)
    summary = summary.model_copy(update={"complete": True})
    write_json(path, summary)
    return summary


def sweep_point(art: BenchArtifact, artifact: str) -> SweepPoint:
    """A per-K bench run's headline numbers, as the summary lists them."""
    agg = art.aggregates
    base, spec = agg.baseline, agg.speculative
    return SweepPoint(
        k=int(art.k),
        artifact=artifact,
        baseline_tok_s=base.tok_s_mean,
        baseline_tok_s_std=base.tok_s_std,
        speculative_tok_s=spec.tok_s_mean,
        speculative_tok_s_std=spec.tok_s_std,
        speedup=agg.speedup,
        speedup_pooled=agg.speedup_pooled,
        acceptance_rate=spec.acceptance_rate,
        tokens_per_round=spec.tokens_per_round,
        mean_acceptance_length=spec.mean_acceptance_length,
        positional_acceptance=spec.positional_acceptance,
    )


def format_sweep_table(summary: SweepArtifact) -> str:
    """A sweep summary in the shape of the paper's Table 4."""
    rows = [
        [
            str(p.k),
            fmt.pm(p.speculative_tok_s, p.speculative_tok_s_std, plain=True),
            fmt.pm(p.baseline_tok_s, p.baseline_tok_s_std, plain=True),
            fmt.pct(p.acceptance_rate, plain=True),
            fmt.num(p.mean_acceptance_length, ".2f", plain=True),
            fmt.x(p.speedup, plain=True),
        ]
        for p in summary.points
    ]
    header = ["K", "spec tok/s", "base tok/s", "acceptance", "accept. length", "speedup"]
    return fmt.text_table(header, rows)
