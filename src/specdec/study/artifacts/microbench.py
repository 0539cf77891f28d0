"""specdec.microbench/1: cost curves and predicted speedups (study/run/microbench.py defines
each term)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import field_validator

from specdec.study.artifacts.base import Artifact, Model, Record, RunModels, schema_field


class VerifyPoint(Record):
    b: int  # tokens in one target extend
    median_ms: float
    ratio: float  # v(b) = median_ms(b) / median_ms(1), in target steps
    samples_ms: tuple[float, ...] = ()  # [repeats]


class Acceptance(Record):
    """An acceptance profile, pooled over a bench artifact's speculative rows."""

    source: str  # the bench artifact's path
    config: str | None
    k: int | str | None
    temperature: float | None
    n_rows: int
    drafted_per_pos: tuple[int, ...]  # [K]
    accepted_per_pos: tuple[int, ...]  # [K]
    # accepted / drafted at position i, which IS P(>= i accepted) (acceptance is a prefix): both
    # kept under their own names so neither reader has to know that.
    positional_acceptance: tuple[float, ...]
    p_at_least: tuple[float, ...]


class Prediction(Record):
    k: int
    expected_tokens_per_round: float | None  # E(K); None without an acceptance profile
    cost_in_target_steps: float  # v(K+1) + K c: also the break-even tokens per round
    predicted_speedup: float | None  # E(K) / cost(K); None without an acceptance profile


class Check(Record):
    """`microbench --check`: this cost curve's prediction against one fixed-K bench."""

    source: str | None  # the bench artifact
    config: str | None
    drafter: str | None
    k: int | None
    temperature: float | None
    c: float | None  # the c used: 0 for a model-free drafter
    p_at_least: tuple[float, ...] = ()  # the bench's own acceptance profile
    predicted_speedup: float | None
    measured_decode_speedup: float | None  # the bench's decode_speedup (prefills left out)
    measured_speedup: float | None  # its end-to-end speedup
    relative_error: float | None  # (predicted - measured decode) / measured decode


class MicrobenchArtifact(RunModels, Artifact):
    """specdec.microbench/1: cost curves (microbench.py defines each term)."""

    SCHEMA: ClassVar[str] = "specdec.microbench/1"
    schema_id: Literal["specdec.microbench/1"] = schema_field("specdec.microbench/1")
    models: Mapping[str, Model | None]  # {"target": MODEL, "draft": MODEL | None}
    prefix_tokens: int | None  # tokens cached before each probe
    repeats: int | None  # timed passes; medians are over these
    max_batch: int | None = None
    verify: tuple[VerifyPoint, ...]  # sorted by b
    target_step_ms: float
    # max / min - 1 of the single-step samples (one per pass, spread over the whole run): a
    # probe for a contended machine; None: not recorded
    step_spread: float | None = None
    deterministic: bool | None = None  # llama.cpp deterministic mode; None: not recorded
    draft_step_ms: float | None  # None without a draft
    draft_samples_ms: tuple[float, ...] | None = None  # [repeats]
    c: float | None  # draft_step_ms / target_step_ms; None without a draft
    acceptance: Acceptance | None = None  # from --acceptance
    prediction_c: float | None  # the c the prediction used: c, or 0.0 for a model-free drafter
    # k = 1..min(max_batch - 1, K of the profile); without a profile k = 1..max_batch - 1
    prediction: tuple[Prediction, ...]  # sorted by k
    best_k: int | None  # argmax of predicted_speedup over k = 0..K (0: cannot pay), or None
    threads: int | None = None  # CPU threads per model; None = all cores
    checks: tuple[Check, ...] = ()  # --check

    @property
    def label(self) -> str:
        t = self.target.short if self.target else "?"
        return t if self.draft is None else f"{self.draft.name} → {t}"

    @property
    def predicts(self) -> bool:
        return any(p.predicted_speedup is not None for p in self.prediction)

    @field_validator("verify")
    @classmethod
    def _by_b(cls, v: tuple[VerifyPoint, ...]) -> tuple[VerifyPoint, ...]:
        return tuple(sorted(v, key=lambda p: p.b))

    @field_validator("prediction")
    @classmethod
    def _by_k(cls, v: tuple[Prediction, ...]) -> tuple[Prediction, ...]:
        return tuple(sorted(v, key=lambda p: p.k))
