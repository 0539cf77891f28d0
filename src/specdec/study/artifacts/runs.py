"""RUN records, the per-method entries of a bench row, and what is computed from them.

A RUN is a plain mapping, not a typed record: core.metrics.GenerationStats.to_dict() (which
defines each field) + {tokens: [ids], stop_reason} for an in-process method, and for an
in-process speculative one its rounds (`round_log`); hf_assisted.run's record for HF-assisted;
endpoint.run_record's for a server. Kinds differ in the fields they have, so a reader asks for
a field by name (a missing count is None in the aggregates).

`aggregate_runs` pools one method's RUNs into its AGG and `aggregate` a run's rows into the
`aggregates` block: each AGG field's formula is written here, once (bench.Agg says what each
field means).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.core.metrics import Round
from specdec.study.artifacts.base import ArtifactError
from specdec.study.artifacts.bench import (
    MAIN_METHODS,
    PHASES,
    Agg,
    Aggregates,
    BenchRow,
    CategoryAgg,
    VariantAgg,
)
from specdec.study.artifacts.provenance import peak_rss_mb, peak_vram_mb


def drafting_rounds(run: Mapping[str, Any]) -> int | None:
    """A RUN's rounds that drafted at least one token (core.metrics' definition); None for
    records without per-position counts (HF-assisted, endpoints)."""
    n = run.get("drafting_rounds")
    return None if n is None else int(n)


def phase_seconds(run: Mapping[str, Any]) -> dict[str, float]:
    """A RUN's latency split, PHASES -> seconds (core.metrics' fields), with "verify" the
    target's passes, the prompt prefill included (what ms_per_token stacks)."""
    return {
        "draft": run["draft_s"],
        "verify": run["verify_s"] + run["prefill_s"],
        "sampling": run["sampling_s"],
        "other": run["other_s"],
    }


#: The columns of a RUN's `round_log` (one entry per round, in order), core.metrics.Round's fields.
ROUND_LOG_COLUMNS = ("k", "n_accepted", "n_emitted", "draft_s", "verify_s")


def round_log(rounds: Sequence[Round]) -> dict[str, Any]:
    """A RUN's optional `round_log`: every round of the generation, columnar so that the file
    stays one line per column: `sources` names the draft sources, `source[i]` indexes it for
    round i, and ROUND_LOG_COLUMNS hold Round's numbers (a replay reproduces these rounds:
    study.run.replay)."""
    names = list(dict.fromkeys(r.source for r in rounds))
    out: dict[str, Any] = {"sources": names, "source": [names.index(r.source) for r in rounds]}
    for col in ROUND_LOG_COLUMNS:
        out[col] = [getattr(r, col) for r in rounds]
    return out


def read_round_log(log: Any, src: str = "") -> tuple[Round, ...]:
    """The Rounds of a `round_log` (round_log's inverse); ArtifactError if it is malformed."""
    try:
        names, idx = log["sources"], log["source"]
        cols = [log[c] for c in ROUND_LOG_COLUMNS]
        if any(len(c) != len(idx) for c in cols):
            raise ValueError("columns of different lengths")
        return tuple(
            Round(str(names[i]), int(k), int(a), int(e), float(d), float(v))
            for i, k, a, e, d, v in zip(idx, *cols, strict=True)
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ArtifactError(f"{src}: malformed round_log ({e})") from None


def pooled_acceptance_length(runs: Sequence[Mapping[str, Any]]) -> tuple[int | None, float | None]:
    """(sum drafting rounds, 1 + sum accepted / sum drafting rounds) over RUN records: the pooled
    mean acceptance length (vLLM's), None where a record lacks the counts or nothing drafted."""
    counts = [drafting_rounds(r) for r in runs]
    if not runs or None in counts or any(r.get("accepted") is None for r in runs):
        return None, None
    n = sum(c for c in counts if c is not None)
    return n, (1 + sum(r["accepted"] for r in runs) / n if n else None)


# ------------------------------------------------------------------------------ AGG from RUNs
def aggregate(rows: Sequence[BenchRow], methods: Sequence[str]) -> Aggregates:
    """The `aggregates` block for these rows (bench.Aggregates defines each field)."""
    aggs = {m: aggregate_runs([r.run(m) for r in rows]) for m in methods}
    base, spec = aggs["baseline"], aggs["speculative"]
    variants = {
        m: VariantAgg(
            **dict(agg),
            speedup=_ratio(agg.tok_s_mean, base.tok_s_mean),
            decode_speedup=_ratio(agg.decode_tok_s_pooled, base.decode_tok_s_pooled),
        )
        for m, agg in aggs.items()
        if m not in MAIN_METHODS
    }
    hf_agg = aggs.get("hf_assisted")
    return Aggregates(
        baseline=base,
        speculative=spec,
        hf_assisted=hf_agg,
        variants=variants,
        by_category=_by_category(rows, methods),
        speedup=_ratio(spec.tok_s_mean, base.tok_s_mean),
        speedup_pooled=_ratio(spec.tok_s_pooled, base.tok_s_pooled),
        decode_speedup=_ratio(spec.decode_tok_s_pooled, base.decode_tok_s_pooled),
        speedup_hf_assisted=_ratio(hf_agg.tok_s_mean, base.tok_s_mean) if hf_agg else None,
        peak_rss_mb=peak_rss_mb(),
        peak_vram_mb=peak_vram_mb(),
    )


def _by_category(
    rows: Sequence[BenchRow], methods: Sequence[str]
) -> dict[str, dict[str, CategoryAgg]]:
    """{category: {method: CategoryAgg}}: speedup against the same prompts' baseline mean."""
    out: dict[str, dict[str, CategoryAgg]] = {}
    for cat in sorted({r.category for r in rows}):
        sel = [r for r in rows if r.category == cat]
        base = statistics.fmean(r.baseline["tokens_per_s"] for r in sel)
        out[cat] = {}
        for m in methods:
            mean = statistics.fmean(r.run(m)["tokens_per_s"] for r in sel)
            out[cat][m] = CategoryAgg(n=len(sel), tok_s_mean=mean, speedup=_ratio(mean, base))
    return out


def aggregate_runs(runs: Sequence[Mapping[str, Any]]) -> Agg:
    """AGG for one method's RUN records; sums that a record kind lacks come out None."""

    def total(key: str) -> Any:
        if not runs or any(r.get(key) is None for r in runs):
            return None
        return sum(r[key] for r in runs)

    rates = [r["tokens_per_s"] for r in runs]
    generated, wall = total("generated"), total("wall_s")
    rounds, drafted, accepted = total("rounds"), total("drafted"), total("accepted")
    ttfts = [r["ttft_s"] for r in runs if r.get("ttft_s") is not None]
    decode_s = None  # a record kind without a prefill (HF-assisted) has no decode phase
    if runs and all("prefill_s" in r for r in runs):
        decode_s = sum(r["wall_s"] - r["prefill_s"] - r.get("catchup_s", 0.0) for r in runs)
    ms = None
    if runs and generated and all("draft_s" in r for r in runs):
        split = [phase_seconds(r) for r in runs]
        ms = {ph: 1000 * sum(x[ph] for x in split) / generated for ph in PHASES}
    drafting_rounds, mal = pooled_acceptance_length(runs)
    return Agg(
        n=len(runs),
        tok_s_mean=statistics.fmean(rates) if rates else None,
        tok_s_std=statistics.stdev(rates) if len(rates) > 1 else (0.0 if rates else None),
        tok_s_pooled=_ratio(generated, wall),
        decode_tok_s_pooled=_ratio(generated, decode_s),
        ttft_s_mean=statistics.fmean(ttfts) if ttfts else None,
        generated=generated,
        rounds=rounds,
        drafting_rounds=drafting_rounds,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=_ratio(accepted, drafted),
        positional_acceptance=_positional(runs),
        tokens_per_round=_ratio(generated, rounds),
        mean_acceptance_length=mal,
        ms_per_token=ms,
    )


def _positional(runs: Sequence[Mapping[str, Any]]) -> tuple[float, ...] | None:
    """Pooled per draft position: sum accepted_per_pos / sum drafted_per_pos; None for records
    without positions (HF-assisted)."""
    if not runs or not all("drafted_per_pos" in r for r in runs):
        return None
    width = max(len(r["drafted_per_pos"]) for r in runs)  # K; shorter only near the budget
    dr = [sum(_at(r["drafted_per_pos"], i) for r in runs) for i in range(width)]
    ac = [sum(_at(r["accepted_per_pos"], i) for r in runs) for i in range(width)]
    return tuple(a / d for a, d in zip(ac, dr, strict=True))


def _at(xs: list[int], i: int) -> int:
    return xs[i] if i < len(xs) else 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
