"""specdec.invariance/1: does a verify pass over b tokens compute what b single steps do, op by
op (study/run/invariance.py: the settings and the probe)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from specdec.study.artifacts.base import Artifact, Record, schema_field


class FirstDifference(Record):
    """The earliest node in graph order whose rows differ: the op that breaks invariance."""

    node: str  # llama.cpp's node name ("Qcur-3|MUL_MAT")
    op: str  # the node without its layer ("Qcur|MUL_MAT")
    layer: int | None  # None: a node outside the layers
    max_abs_diff: float
    weight_type: str | None  # a matmul's weight type; None for other ops


class OpDiff(Record):
    """One op over every layer."""

    op: str
    layers: int  # layers whose node differs
    first_layer: int | None
    max_abs_diff: float


class InvarianceProbe(Record):
    """One model, one setting, one context: a pass over `batch` tokens vs one by one."""

    model: str  # the llamacpp: spec
    setting: str  # one of invariance.SETTINGS
    repacked_mib: float | int  # weights repacked at load (0 when none)
    context: int
    batch: int
    logits_max_abs_diff: tuple[float, ...]  # [batch]: per row
    identical: bool  # every logit of every row bit-equal
    first_difference: FirstDifference | None
    ops: tuple[OpDiff, ...]  # in graph order


class InvarianceArtifact(Artifact):
    """specdec.invariance/1: every probe of `specdec invariance`."""

    SCHEMA: ClassVar[str] = "specdec.invariance/1"
    schema_id: Literal["specdec.invariance/1"] = schema_field("specdec.invariance/1")
    settings: Mapping[str, tuple[bool, str, str]]  # setting -> invariance.SETTINGS' switches
    batch: int
    contexts: tuple[int, ...]
    threads: int | None
    probes: tuple[InvarianceProbe, ...]
