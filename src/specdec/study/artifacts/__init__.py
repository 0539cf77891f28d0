"""The JSON artifacts: what every file under results/ holds, one typed record per kind.

Every artifact is one JSON object with `"schema": "specdec.<kind>/<version>"` and a `"meta"`
block (provenance.meta_block(): when, where, with what; write_json refuses one whose
meta.machine does not name the CPU, kernels and load: check_machine). The kinds, one module
each (their field comments are the schema's documentation):

    specdec.bench/1       bench.py: one `specdec bench` run (run/bench.py: the protocol)
    specdec.sweep/1       sweep.py: a K-sweep summary; its per-K bench artifacts lie beside it
    specdec.microbench/1  microbench.py: cost curves and predicted speedups (run/microbench.py)
    specdec.gate/1        gate.py: the level-3 equivalence gate (run/gate.py)
    specdec.replay/1      replay.py: K policies replayed over recorded outputs (run/replay.py)
    specdec.doctor/1      doctor.py: will speculative decoding pay here (run/doctor.py)
    specdec.invariance/1  invariance.py: a verify pass against single steps, op by op
    specdec.profile/1     profile.py: a verify pass's time, op by op (run/profile.py)
    specdec.together/1    together.py: C requests at once against servers (run/together.py)

base.py holds what they share (Record, the field kinds, the errors, MODEL); kinds.py the
reader and writer of them all (`read`: one union discriminated on `schema`; `write_json`, which
writes only what reads back); runs.py the RUN records inside a bench artifact; provenance.py the
blocks that say where one came from.

One format per kind: the readers know the current one only. Artifacts written before a field
existed are brought to it once by scripts/migrate_artifacts.py (bench, sweep, microbench, gate:
results/ and tests/fixtures/ have been), which fills the field as it is defined here or with
null. Imports no other room of the study.
"""

from specdec.study.artifacts.base import (
    MACHINE_KEYS,
    Artifact,
    ArtifactError,
    Model,
    Record,
    RunConfig,
    RunModels,
    SchemaError,
    added_later,
    check_machine,
    named_artifact,
    not_in_file,
    optional,
    to_json,
)
from specdec.study.artifacts.bench import (
    MAIN_METHODS,
    PHASES,
    Agg,
    Aggregates,
    BenchArtifact,
    BenchRow,
    CategoryAgg,
    VariantAgg,
    variant_method,
)
from specdec.study.artifacts.doctor import BreakEven, Diagnosis, DoctorArtifact
from specdec.study.artifacts.gate import GateArtifact, GateBin, GreedyLeg, GreedyRow, SampledLeg
from specdec.study.artifacts.invariance import (
    FirstDifference,
    InvarianceArtifact,
    InvarianceProbe,
    OpDiff,
)
from specdec.study.artifacts.kinds import ARTIFACTS, SCHEMAS, AnyArtifact, read, write_json
from specdec.study.artifacts.microbench import (
    Acceptance,
    Check,
    MicrobenchArtifact,
    Prediction,
    VerifyPoint,
)
from specdec.study.artifacts.profile import ProfileArtifact, ProfileOp, ProfileProbe
from specdec.study.artifacts.replay import (
    ReplayArtifact,
    ReplayConfig,
    ReplayPolicy,
    ReplayTask,
    ReplayTaskRun,
)
from specdec.study.artifacts.sweep import SweepArtifact, SweepPoint
from specdec.study.artifacts.together import (
    TogetherArtifact,
    TogetherFailure,
    TogetherMethod,
    TogetherReply,
    TogetherRow,
)

__all__ = [
    "ARTIFACTS",
    "MACHINE_KEYS",
    "MAIN_METHODS",
    "PHASES",
    "SCHEMAS",
    "Acceptance",
    "Agg",
    "Aggregates",
    "AnyArtifact",
    "Artifact",
    "ArtifactError",
    "BenchArtifact",
    "BenchRow",
    "BreakEven",
    "CategoryAgg",
    "Check",
    "Diagnosis",
    "DoctorArtifact",
    "FirstDifference",
    "GateArtifact",
    "GateBin",
    "GreedyLeg",
    "GreedyRow",
    "InvarianceArtifact",
    "InvarianceProbe",
    "MicrobenchArtifact",
    "Model",
    "OpDiff",
    "Prediction",
    "ProfileArtifact",
    "ProfileOp",
    "ProfileProbe",
    "Record",
    "ReplayArtifact",
    "ReplayConfig",
    "ReplayPolicy",
    "ReplayTask",
    "ReplayTaskRun",
    "RunConfig",
    "RunModels",
    "SampledLeg",
    "SchemaError",
    "SweepArtifact",
    "SweepPoint",
    "TogetherArtifact",
    "TogetherFailure",
    "TogetherMethod",
    "TogetherReply",
    "TogetherRow",
    "VariantAgg",
    "VerifyPoint",
    "added_later",
    "check_machine",
    "named_artifact",
    "not_in_file",
    "optional",
    "read",
    "to_json",
    "variant_method",
    "write_json",
]
