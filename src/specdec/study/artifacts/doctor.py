"""specdec.doctor/1: `specdec doctor`'s measurement, its diagnosis, and where the curve went
(study/run/doctor.py says how each number is made)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from specdec.study.artifacts.base import Artifact, Model, Record, added_later, schema_field


class BreakEven(Record):
    """What drafting K tokens per round must achieve to pay for itself."""

    k: int
    v: float  # v(K + 1), in target steps
    free_cost: float  # cost(K) with c = 0: the tokens per round lookup or a prediction must emit
    free_acceptance: float | None  # the alpha that gets there; None: not even alpha = 1
    model_cost: float | None = None  # cost(K) with the draft model's c; None: no draft measured
    model_acceptance: float | None = None


class Diagnosis(Record):
    """The answers, from a verify curve and a step ratio alone (so a test can plant them)."""

    v: Mapping[int, float]  # b -> v(b) in target steps, at the measured b
    c: float | None  # draft step / target step; None without a draft model
    ceiling: float  # max b / v(b)
    ceiling_b: int
    draft_ceiling: float | None  # max (K + 1) / (v(K + 1) + K c); None without a draft
    draft_ceiling_k: int | None
    break_even: tuple[BreakEven, ...]
    verdict: tuple[str, ...]


class DoctorArtifact(Artifact):
    """specdec.doctor/1: the measurement, the diagnosis, where the curve went."""

    SCHEMA: ClassVar[str] = "specdec.doctor/1"
    schema_id: Literal["specdec.doctor/1"] = schema_field("specdec.doctor/1")
    cpu_flags: tuple[str, ...]  # this CPU's vector instruction sets (beside the kernels' own)
    target: Model
    draft: Model | None
    prefix_tokens: int
    repeats: int  # timed passes per b (medians over them)
    batches: tuple[int, ...]
    target_step_ms: float
    step_spread: float  # max/min - 1 of the single step over the passes: > 10% = a busy machine
    verify_ms: Mapping[int, float]  # b -> median ms of a pass over b tokens
    draft_step_ms: float | None
    diagnosis: Diagnosis
    contended: bool  # step_spread above microbench.CONTENDED_SPREAD: the numbers are flattened
    cost_store: str | None  # the file k=auto's curve was written to; None: not written
    measure_s: float  # seconds the timed passes took
    # cores' worth of other processes' work while they ran (backends.cores; None: not measured)
    other_cores: float | None = added_later()
    # seconds a second its threads waited for a core (run queues; >= 0.25: others compete)
    thread_wait: float | None = added_later()
    threads: int | None = added_later()  # llama.cpp's pool in the timed passes (None: another)
