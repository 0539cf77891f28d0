"""specdec.sweep/1: a K-sweep's summary (study/run/sweep.py); its per-K bench artifacts lie
beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from specdec.study.artifacts.base import (
    Artifact,
    Record,
    RunConfig,
    not_in_file,
    number,
    schema_field,
)
from specdec.study.artifacts.bench import BenchArtifact


class SweepPoint(Record):
    """One K of a sweep: the headline numbers of its bench artifact."""

    k: int
    artifact: str | None  # the per-K bench artifact's file name, beside the summary
    baseline_tok_s: float | None  # that run's baseline tok_s_mean (None: no recorded prompt)
    baseline_tok_s_std: float | None
    speculative_tok_s: float | None
    speculative_tok_s_std: float | None
    speedup: float | None
    speedup_pooled: float | None = None
    acceptance_rate: float | None
    tokens_per_round: float | None
    mean_acceptance_length: float | None = None  # None: not recorded
    positional_acceptance: tuple[float, ...] | None = None  # [K]
    member: BenchArtifact | None = not_in_file(None)  # when scanned

    @property
    def positional(self) -> tuple[float, ...]:
        return self.positional_acceptance or ()

    @model_validator(mode="after")
    def _means_where_a_speedup(self) -> SweepPoint:
        # a K whose run recorded no prompt has null means; any other K must have them
        if self.speedup is not None and None in (self.baseline_tok_s, self.speculative_tok_s):
            raise ValueError("a K with a speedup needs baseline_tok_s and speculative_tok_s")
        return self


class SweepArtifact(RunConfig, Artifact):
    """specdec.sweep/1: a K-sweep's summary (sweep.run_sweep), rewritten after every K."""

    SCHEMA: ClassVar[str] = "specdec.sweep/1"
    schema_id: Literal["specdec.sweep/1"] = schema_field("specdec.sweep/1")
    config: Mapping[str, Any]  # the bench config without k (every K is its own run)
    ks: tuple[int, ...]
    points: tuple[SweepPoint, ...]  # one per finished K, in run order
    complete: bool = True

    @property
    def recorded_prompts(self) -> int | None:
        """config.n_prompts - config.warmup."""
        n = self.config.get("n_prompts")
        return None if n is None else int(n - (self.config.get("warmup") or 0))

    @property
    def device(self) -> str | None:
        devs = {p.member.target.device for p in self.points if p.member and p.member.target}
        return devs.pop() if len(devs) == 1 else None

    @field_validator("config")
    @classmethod
    def _numbers(cls, v: Mapping[str, Any]) -> Mapping[str, Any]:
        for key in ("n_prompts", "warmup", "temperature", "max_new_tokens"):
            if v.get(key) is not None and not number(v[key]):
                raise ValueError(f"config.{key} is {v[key]!r}, expected a number")
        return v
