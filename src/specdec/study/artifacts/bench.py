"""specdec.bench/1: one `specdec bench` run (study/run/bench.py: the protocol). The RUN records
inside its rows, and the formulas of its AGG fields, are runs.py's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from specdec.study.artifacts.base import (
    Artifact,
    Model,
    Record,
    RunConfig,
    RunModels,
    not_in_file,
    number,
    optional,
    schema_field,
)

PHASES = ("draft", "verify", "sampling", "other")  # ms_per_token's latency split, stacking order


class Agg(Record):
    """AGG: one method of a bench run, pooled over its recorded rows (runs.aggregate_runs)."""

    n: int  # recorded rows
    tok_s_mean: float | None  # mean of the per-prompt rates generated / wall_s
    tok_s_std: float | None  # their sample std (ddof 1; 0.0 for one row)
    tok_s_pooled: float | None = None  # sum generated / sum wall_s (a long prompt weighs more)
    # sum generated / sum (wall_s - prefill_s - catchup_s): the decode phase alone, without the
    # prompt prefills that every method pays once; what the microbench's cost model predicts.
    # None for hf_assisted (no prefill in its records) and where it was not recorded.
    decode_tok_s_pooled: float | None = None
    ttft_s_mean: float | None = None
    generated: int | None = None  # sums over the rows; None where a record kind lacks one
    rounds: int | None = None
    drafting_rounds: int | None = None  # rounds that drafted >= 1 token (None: not counted)
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None  # sum accepted / sum drafted
    # [K] per draft position: sum accepted_per_pos / sum drafted_per_pos; [] for the baseline
    positional_acceptance: tuple[float, ...] | None = None
    tokens_per_round: float | None = None  # sum generated / sum rounds (K = 0 rounds included)
    # 1 + sum accepted / sum drafting_rounds: vLLM's "mean acceptance length", over rounds that
    # drafted only, the bonus or recovered token included (None: the baseline, HF-assisted)
    mean_acceptance_length: float | None = None
    # PHASES -> 1000 * sum of the phase's seconds / generated (runs.phase_seconds: "verify" is the
    # target's passes, the prefill included)
    ms_per_token: Mapping[str, float] | None = None

    @property
    def positional(self) -> tuple[float, ...]:
        return self.positional_acceptance or ()

    @field_validator("ms_per_token")
    @classmethod
    def _every_phase(cls, v: Mapping[str, float] | None) -> Mapping[str, float] | None:
        if v is not None and set(v) != set(PHASES):
            raise ValueError(f"ms_per_token holds {PHASES}")
        return v


class VariantAgg(Agg):
    """AGG of one extra speculative method of the run (`--variants`), with its ratios."""

    speedup: float | None = None  # its tok_s_mean / the same run's baseline tok_s_mean
    decode_speedup: float | None = None  # the decode_tok_s_pooled ratio


class CategoryAgg(Record):
    """One method on the prompts of one category."""

    n: int  # prompts of the category
    tok_s_mean: float | None
    speedup: float | None  # against the baseline mean on the same prompts


class Aggregates(Record):
    """The `aggregates` block of a bench run."""

    baseline: Agg
    speculative: Agg
    hf_assisted: Agg | None = optional()  # --compare hf-assisted
    variants: Mapping[str, VariantAgg] = Field(default_factory=dict)  # by name, in run order
    by_category: Mapping[str, Mapping[str, CategoryAgg]] = Field(default_factory=dict)
    speedup: float | None  # speculative tok_s_mean / baseline tok_s_mean
    speedup_pooled: float | None  # the same ratio of tok_s_pooled
    decode_speedup: float | None = None  # the same ratio of decode_tok_s_pooled
    speedup_hf_assisted: float | None = optional()  # hf / baseline
    # The process's high-water RSS (ru_maxrss): it never decreases within one process, so after
    # earlier runs it is an upper bound for this one.
    peak_rss_mb: float | None
    # torch.cuda.max_memory_allocated since this run started; torch allocations only (llama.cpp's
    # own CUDA buffers are invisible to it); None without CUDA.
    peak_vram_mb: float | None

    def of(self, method: str) -> Agg | None:
        """The AGG of a main method ("baseline", "speculative", "hf_assisted") or a variant."""
        if method in ("baseline", "speculative", "hf_assisted"):
            return getattr(self, method)
        return self.variants.get(method)


#: The methods a bench row holds under their own key; variants are under "variants".
MAIN_METHODS = ("baseline", "speculative", "hf_assisted")


class BenchRow(Record):
    """One recorded (non-warm-up) prompt. A RUN is GenerationStats.to_dict() (core.metrics
    defines each field) + {tokens: [ids], stop_reason}, and for an in-process speculative method
    its rounds (`round_log`, see runs.round_log(); absent where not recorded); an HF-assisted RUN is
    hf_assisted.run's record."""

    index: int | None = None  # position in the prompt set, after any category filter
    prompt_id: str
    category: str
    prompt_tokens: int
    seed: int
    order: str  # "base-first" | "spec-first"
    sequence: tuple[str, ...] = ()  # the methods in the order they ran on this prompt
    baseline: Mapping[str, Any]  # RUN
    speculative: Mapping[str, Any]  # RUN
    hf_assisted: Mapping[str, Any] | None = optional()
    variants: Mapping[str, Mapping[str, Any]] = Field(default_factory=dict)  # name -> RUN

    def run(self, method: str) -> Mapping[str, Any]:
        return getattr(self, method) if method in MAIN_METHODS else self.variants[method]


class BenchArtifact(RunConfig, RunModels, Artifact):
    """specdec.bench/1: one `specdec bench` run."""

    SCHEMA: ClassVar[str] = "specdec.bench/1"
    schema_id: Literal["specdec.bench/1"] = schema_field("specdec.bench/1")
    # run.bench_settings.BenchConfig.to_json(): its settings, flat
    # (run.bench_settings.CONFIG_KEYS), plus "engines" (what the run started); BenchConfig
    # documents each. `categories` [] means every prompt.
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    rows: tuple[BenchRow, ...]
    aggregates: Aggregates
    variants: tuple[str, ...] = ()  # the variant methods' names, in run order
    complete: bool  # false while running or after an interrupt (Ctrl-C keeps the finished rows)
    # Prompts dropped because an endpoint failed on them: {index, prompt_id, method, kind, error}
    # each (kind: study.engines.endpoint.EndpointError's). Every row holds every method.
    failed: tuple[Mapping[str, Any], ...] | None = optional()
    label: str = not_in_file("")  # unique among a study's benches

    @property
    def k(self) -> int | str:
        """An int, or the policy name ("auto", "schedule") when K varies by round."""
        k = self.config["k"]
        return k if k in ("auto", "schedule") else int(k)

    @property
    def drafter(self) -> str:
        return str(self.config.get("drafter") or "model")

    @property
    def method(self) -> str:
        """The speculative method, 'model K=4' style."""
        return f"{self.drafter} K={self.k}"

    @property
    def n_prompts(self) -> int:
        """Recorded prompts."""
        return self.aggregates.speculative.n

    @field_validator("config")
    @classmethod
    def _k_is_a_number_or_a_policy(cls, v: Mapping[str, Any]) -> Mapping[str, Any]:
        k = v.get("k")
        if k not in ("auto", "schedule") and not number(k):
            raise ValueError(f"config.k is {k!r}: a number, 'auto' or 'schedule'")
        return v

    @field_validator("failed")
    @classmethod
    def _none_failed(cls, v: Any) -> Any:
        return v or None


def variant_method(name: str) -> str:
    """'lookup K=auto' for the variant name 'lookup-kauto' (study.run.methods.variant_name)."""
    drafter, sep, k = name.rpartition("-k")
    if sep and drafter and (k.isdigit() or k in ("auto", "schedule")):
        return f"{drafter} K={k}"
    return name  # an endpoint's method (e.g. llama-server-ngram-map-k)
