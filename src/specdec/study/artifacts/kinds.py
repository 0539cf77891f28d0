"""Every artifact kind the library writes; `read`, one pydantic union discriminated on the
`"schema"` field that parses a file of any of them into its record; and `write_json`, which
writes one only if it reads back.

The scripts' own records (scripts/: specdec.arrivals/1, extraction/1, loadtest_*/1, oneshot/1)
are no kind of the library's: they are not read here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import Field, TypeAdapter, ValidationError

from specdec.study.artifacts.base import ArtifactError, check_machine, describe, to_json
from specdec.study.artifacts.bench import BenchArtifact
from specdec.study.artifacts.doctor import DoctorArtifact
from specdec.study.artifacts.gate import GateArtifact
from specdec.study.artifacts.invariance import InvarianceArtifact
from specdec.study.artifacts.microbench import MicrobenchArtifact
from specdec.study.artifacts.profile import ProfileArtifact
from specdec.study.artifacts.replay import ReplayArtifact
from specdec.study.artifacts.sweep import SweepArtifact
from specdec.study.artifacts.together import TogetherArtifact

AnyArtifact = Annotated[
    BenchArtifact
    | SweepArtifact
    | MicrobenchArtifact
    | GateArtifact
    | ReplayArtifact
    | DoctorArtifact
    | InvarianceArtifact
    | ProfileArtifact
    | TogetherArtifact,
    Field(discriminator="schema_id"),
]
#: schema id -> its record, for every kind the library writes (the union's members)
ARTIFACTS: dict[str, Any] = {k.SCHEMA: k for k in get_args(get_args(AnyArtifact)[0])}
SCHEMAS = tuple(ARTIFACTS)
_ANY: TypeAdapter[Any] = TypeAdapter(AnyArtifact)


def read(data: Any, src: str = "", path: Path | None = None) -> AnyArtifact:
    """The record of a parsed JSON artifact of any kind in SCHEMAS; ArtifactError naming `src`
    and the field when it is not one, lacks a field or has one of the wrong type."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{src}: an artifact is a JSON object")
    sid = data.get("schema")
    if sid not in ARTIFACTS:
        raise ArtifactError(f"{src}: unknown schema {sid!r}; expected one of {SCHEMAS}")
    try:
        art = _ANY.validate_python(data)
    except ValidationError as e:
        raise ArtifactError(describe(e, src, sid)) from None
    return art.model_copy(update={"src": src, "path": path})


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def write_json(path: str | os.PathLike[str], obj: Any, *, rewrite: bool = False) -> None:
    """Write an artifact (a record, a dataclass, or a dict) atomically: a temp file in the same
    directory, then os.replace, so a reader, or a Ctrl-C, never sees half a file.

    A specdec artifact must say where it was made (check_machine; SchemaError, nothing written),
    and one of a kind in SCHEMAS must read back as its record (`read`; ArtifactError naming the
    field, nothing written), whether it was built as the record or as a dict;
    `rewrite=True` only brings an existing file to the current format (migrate_artifacts.py),
    which cannot add what was never recorded. Indented for diffs, but lists of numbers (token
    ids, per-position counts) stay on one line. A dict's top-level "path" (a caller's note of
    where the file lives) is not written.
    """
    path = Path(path)
    data = to_json(obj)
    data = {k: v for k, v in data.items() if k != "path"}
    if not rewrite:
        check_machine(data, str(path))
    if data.get("schema") in ARTIFACTS:
        read(data, str(path))  # what is written reads back as its record, or nothing is written
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
