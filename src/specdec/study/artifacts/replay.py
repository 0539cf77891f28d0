"""specdec.replay/1: drafters and K policies replayed over recorded greedy outputs, costed by a
verify curve (study/run/replay.py: how; the numbers are decode-phase, in target steps)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from specdec.study.artifacts.base import Artifact, Record, schema_field


class ReplayConfig(Record):
    """The `specdec replay` settings."""

    inputs: tuple[str, ...]  # bench artifacts and JSONL files of recorded outputs
    curve: str  # the microbench artifact whose verify curve costs the rounds
    method: str  # whose output a bench artifact gave
    drafter: str
    policies: tuple[str, ...]  # as named on the command line
    k_max: int
    draft_cost: float  # c, in target steps
    fresh: bool  # a new policy object per task


class ReplayTask(Record):
    """One recorded output."""

    id: str
    prompt_tokens: int
    output_tokens: int


class ReplayTaskRun(Record):
    """One task under one policy: core.metrics' counters over the replayed rounds."""

    decode_speedup: float  # generated / steps
    steps: float  # the rounds' cost in target steps, drafting included
    generated: int
    rounds: int
    drafted: int
    accepted: int
    drafted_by_source: Mapping[str, int]
    accepted_by_source: Mapping[str, int]
    k_histogram: Mapping[int, int]  # K -> rounds that verified K drafted tokens


class ReplayPolicy(Record):
    """One policy over every task."""

    decode_speedup: float  # pooled: all tokens / all steps
    geomean_speedup: float  # of the tasks' decode_speedup
    tasks: Mapping[str, ReplayTaskRun]  # by task id, in task order


class ReplayArtifact(Artifact):
    """specdec.replay/1: the settings, the tasks, and per policy the pooled and per-task
    numbers."""

    SCHEMA: ClassVar[str] = "specdec.replay/1"
    schema_id: Literal["specdec.replay/1"] = schema_field("specdec.replay/1")
    config: ReplayConfig
    tasks: tuple[ReplayTask, ...]
    policies: Mapping[str, ReplayPolicy]  # by name ("best fixed (K = 4)"), in run order
