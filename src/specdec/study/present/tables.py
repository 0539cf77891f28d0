"""The bench's terminal tables: a run's results as `specdec bench` prints them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specdec.study.artifacts import Aggregates, BenchArtifact
from specdec.study.present import fmt
from specdec.study.present.sessions import format_sessions


def _bench(art: BenchArtifact | Mapping[str, Any]) -> BenchArtifact:
    return art if isinstance(art, BenchArtifact) else BenchArtifact.from_json(dict(art))


def format_table(artifacts: BenchArtifact | Mapping[str, Any] | Sequence[Any]) -> str:
    """Bench artifacts (read or as run) as a table in the shape of the paper's Table 3 (one line
    per artifact), then each run's extra methods and per-category speedups."""
    many = isinstance(artifacts, Sequence) and not isinstance(artifacts, Mapping)
    arts = [_bench(a) for a in (artifacts if many else [artifacts])]
    header = ["config", "K", "base tok/s", "spec tok/s", "speedup", "accept."]
    header += ["TTFT_b (s)", "TTFT_s (s)", "peak RSS (GB)"]
    rows, notes = [], []
    for a in arts:
        agg = a.aggregates
        b, s = agg.baseline, agg.speculative
        rss = agg.peak_rss_mb
        rows.append(
            [
                a.name + ("" if a.complete else " (partial)"),
                str(a.config["k"]),
                fmt.pm(b.tok_s_mean, b.tok_s_std, plain=True),
                fmt.pm(s.tok_s_mean, s.tok_s_std, plain=True),
                fmt.x(agg.speedup, plain=True),
                fmt.pct(s.acceptance_rate, plain=True),
                fmt.num(b.ttft_s_mean, ".3f", plain=True),
                fmt.num(s.ttft_s_mean, ".3f", plain=True),
                fmt.num(rss / 1024 if rss is not None else None, ".2f", plain=True),
            ]
        )
        notes += _notes(a)
    n = {a.aggregates.baseline.n for a in arts}
    foot = f"mean ± sample std over {'/'.join(map(str, sorted(n)))} recorded prompts; peak RSS is"
    foot += " a process-wide high-water mark (an upper bound)"
    return "\n".join([fmt.text_table(header, rows), *notes, foot])


def _notes(a: BenchArtifact) -> list[str]:
    """format_table's lines under the table for one run: HF-assisted, variants, categories."""
    agg, notes = a.aggregates, []
    h = agg.hf_assisted
    if h is not None:
        notes.append(
            f"{a.name} K={a.config['k']}: transformers assisted generation "
            f"{fmt.pm(h.tok_s_mean, h.tok_s_std, plain=True)} tok/s, "
            f"{fmt.x(agg.speedup_hf_assisted, plain=True)} of baseline, "
            f"acceptance {fmt.pct(h.acceptance_rate, plain=True)}"
        )
    for vname, v in agg.variants.items():
        mal = v.mean_acceptance_length
        notes.append(
            f"{a.name} {vname}: {fmt.pm(v.tok_s_mean, v.tok_s_std, plain=True)} tok/s, "
            f"{fmt.x(v.speedup, plain=True)} of baseline, acceptance "
            f"{fmt.pct(v.acceptance_rate, plain=True)}, "
            f"{fmt.num(v.tokens_per_round, '.2f', plain=True)} tokens/round"
            + ("" if mal is None else f", mean acceptance length {mal:.2f}")
        )
    sessions = format_sessions(a)
    if sessions is not None:
        notes.append(sessions)
    cats = agg.by_category
    if cats:
        methods = list(next(iter(cats.values())))
        crow = [[c, *(fmt.x(cats[c][m].speedup, plain=True) for m in methods)] for c in cats]
        notes.append("speedup by prompt category (vs the same prompts' baseline):")
        notes.append(fmt.text_table(["category", *methods], crow))
    return notes


def postfix(agg: Aggregates) -> str:
    parts = [f"base {agg.baseline.tok_s_mean:.1f}", f"spec {agg.speculative.tok_s_mean:.1f}"]
    if agg.hf_assisted is not None:
        parts.append(f"hf {agg.hf_assisted.tok_s_mean:.1f}")
    return " | ".join(parts) + f" tok/s ({fmt.x(agg.speedup, plain=True)})"
