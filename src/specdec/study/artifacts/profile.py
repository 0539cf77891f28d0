"""specdec.profile/1: where a llama.cpp verify pass spends its time, op by op and by weight type
(study/run/profile.py says how each number is measured)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from specdec.study.artifacts.base import Artifact, Record, schema_field


class ProfileOp(Record):
    """One category of nodes: a matmul's weight role and type ("matmul ffn_down (q6_K)"), else
    the op ("flash_attn_ext")."""

    category: str
    ms: float  # summed over its nodes, the launch cost taken off each
    nodes: int
    gops: float | None  # matmuls: 2 x weights x b / time; None for other ops


class ProfileProbe(Record):
    """One pass over `batch` tokens after `context` cached ones; times are medians per node over
    the repeats."""

    context: int
    batch: int
    pass_ms: float  # the pass without a callback (median)
    profiled_ms: float  # the same pass timed node by node
    nodes: int
    launch_us: float  # the per-node cost of the callback, measured on the no-op nodes
    outside_ms: float  # what the profiled pass took beyond its nodes' raw times
    unaccounted_ms: float  # pass_ms - the groups' sum
    groups: Mapping[str, float]  # profile.GROUPS -> ms, in table order
    ops: tuple[ProfileOp, ...]  # every category, heaviest first


class ProfileArtifact(Artifact):
    """specdec.profile/1: the probes of one llama.cpp target."""

    SCHEMA: ClassVar[str] = "specdec.profile/1"
    schema_id: Literal["specdec.profile/1"] = schema_field("specdec.profile/1")
    target: str  # the llamacpp: spec
    threads: int | None  # None: all cores
    type_k: str  # the K cache type (q8_0, f16)
    repeats: int
    # the int8 multiply-accumulate peak of the threads (sdmm's probe); None where the CPU or the
    # build has none
    peak_int8_gops: float | None
    probes: tuple[ProfileProbe, ...]
