"""specdec.gate/1: the level-3 equivalence gate (study/run/gate.py)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from specdec.study.artifacts.base import (
    Artifact,
    Model,
    Record,
    RunConfig,
    RunModels,
    optional,
    schema_field,
)


class GateBin(Record):
    """A bin as tested: a top token by combined count, or the pooled rest (token_id None)."""

    label: str  # the token's text as its repr ("' the'"), or "<other: N tokens>"
    token_id: int | None
    speculative: int  # count among the speculative tokens
    baseline: int

    @property
    def pooled(self) -> bool:
        return self.token_id is None

    @property
    def text(self) -> str:
        """The token's text itself (the label is its repr)."""
        s = self.label
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
            try:
                value = ast.literal_eval(s)
            except (ValueError, SyntaxError):
                return s
            return value if isinstance(value, str) else s
        return s


class SampledLeg(Record):
    """T > 0: pooled token frequencies of both methods, compared by a two-sample chi-square."""

    n_prompts: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    k: int | None = None
    seeds: Mapping[str, Any] = Field(default_factory=dict)  # {rule, baseline [n], speculative [n]}
    acceptance_rate: float | None = None  # accepted / drafted (0.0 when nothing was drafted)
    drafted: int | None = optional()  # by the speculative method
    accepted: int | None = optional()
    tokens_speculative: int | None = None
    tokens_baseline: int | None = None
    distinct_tokens: int | None = None
    min_expected: float | None = None  # every bin's expected count is at least this
    n_bins: int | None = None
    chi2: float
    dof: int
    p_value: float  # the chi2(dof) reference (assumes independent tokens: too small on text)
    # the same statistic calibrated by swapping the methods' generations within prompts
    # (significance.py says why); the verdict when present
    p_value_permutation: float | None = None
    n_permutations: int | None = None
    p_min: float | None = None  # passes at p > p_min
    decided_by: str | None = None  # the p-value field the verdict used
    passed: bool  # dof >= 1 and p_value_permutation > p_min
    smoothed_kl: float | None = None  # reference only
    kl_definition: str | None = None
    bins: tuple[GateBin, ...] = ()  # as tested; the pooled bin last
    wall_s: float | None = None
    # prompts left out because a method failed on them (an endpoint's error): {prompt_id, leg,
    # error} each; n_prompts counts the others, and fewer than gate.MIN_PROMPTS cannot pass
    failed: tuple[Mapping[str, Any], ...] | None = optional()

    @property
    def pooled_bin(self) -> GateBin | None:
        return next((b for b in self.bins if b.pooled), None)

    @property
    def token_bins(self) -> tuple[GateBin, ...]:
        """The bins of single tokens: every bin but the (first) pooled one."""
        pooled = self.pooled_bin
        return tuple(b for b in self.bins if b is not pooled)

    @field_validator("failed")
    @classmethod
    def _none_failed(cls, v: Any) -> Any:
        return v or None


class GreedyRow(Record):
    prompt_id: Any
    match: bool
    n_baseline: int | None
    n_speculative: int | None
    first_mismatch: int | None  # None when match
    error: str | None = optional()  # a method failed on the prompt


class GreedyLeg(Record):
    """T = 0: speculative tokens must equal target-only tokens exactly."""

    n_prompts: int | None = None
    max_new_tokens: int | None = None
    k: int | None = None
    rows: tuple[GreedyRow, ...]
    passed: bool | None  # every row matches


class GateArtifact(RunConfig, RunModels, Artifact):
    """specdec.gate/1: level-3 equivalence (gate.py)."""

    SCHEMA: ClassVar[str] = "specdec.gate/1"
    schema_id: Literal["specdec.gate/1"] = schema_field("specdec.gate/1")
    # {name, draft, target, quick, threads} + asdict(gate.GateSettings)
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    sampled: SampledLeg
    greedy: GreedyLeg
    passed: bool  # sampled.passed and greedy.passed

    @property
    def quick(self) -> bool:
        return bool(self.config.get("quick"))
