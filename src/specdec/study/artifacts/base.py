"""What every artifact kind shares: the Record base, the field kinds, plain JSON from records
(to_json), the machine check, the errors, and the blocks several kinds hold (MODEL, the
run's config and models).

A record writes its fields in declaration order. Keys the schema does not name are refused (a
misspelt field is an error, not a null); a field with a default may be left out (the producers
write every field, so only a hand-made artifact does). A statistic a method cannot have is null
in the file and None here, as is one that was not recorded when the artifact was made. Fields
declared `optional()` are left out of the file when None (they exist only for some runs);
`added_later()` fields are left out when the record was not given them (older committed
artifacts lack them); `not_in_file()` fields say where a read artifact came from and are never
written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Record(BaseModel):
    """A block of an artifact: frozen and typed; `to_json` writes its fields in declaration
    order (write_json), `model_validate` reads them (read)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)


def optional() -> Any:
    """A field written only when it is not None (it exists for some runs only)."""
    return Field(None, json_schema_extra={"optional": True})


def added_later() -> Any:
    """A field that committed artifacts written before it existed lack (no migration filled
    it): None when absent, and written only when the record was given it (the file had it, or
    its producer set it, null included), so an older file reads and writes back as it is."""
    return Field(None, json_schema_extra={"added_later": True})


def not_in_file(default: Any) -> Any:
    """A field the reader sets (where the artifact came from); never written."""
    return Field(default, exclude=True)


def schema_field(kind: str) -> Any:
    """The `"schema"` field of an artifact of this kind (a Python name of its own: BaseModel
    has a `schema` method)."""
    return Field(kind, alias="schema")


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------------------ writing
def to_json(obj: Any) -> Any:
    """Plain JSON types from records and dataclasses (fields in declaration order), mappings and
    sequences."""
    if isinstance(obj, BaseModel):
        out = {}
        for name, f in type(obj).model_fields.items():
            v = getattr(obj, name)
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            if f.exclude or (v is None and extra.get("optional")):
                continue
            if extra.get("added_later") and name not in obj.model_fields_set:
                continue
            out[f.alias or name] = to_json(v)
        return out
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def named_artifact(out: str | os.PathLike[str], kind: str, *parts: str | None) -> Path:
    """<out>/<kind>_<part>[_<part>...].json, the parts that are given joined by "_" and made
    filesystem-safe (e.g. a model name with a colon, a --tag)."""
    name = "_".join(x for x in parts if x)
    return Path(out) / f"{kind}_{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.json"


#: What a specdec artifact's meta.machine must name (provenance.meta_block writes them): the CPU,
#: the llama.cpp kernels the process ran (null: it loaded no llama.cpp) and the load average (null
#: where the OS has none). Without them two hosts' or two builds' numbers read as one run's.
MACHINE_KEYS = ("cpu_model", "kernels", "load_avg")


class SchemaError(ValueError):
    """A specdec artifact that does not say where it was made (write_json refuses it)."""


class ArtifactError(ValueError):
    """An artifact that is not one of the known kinds, or lacks a field a reader needs, or has
    one of the wrong type: the message names the file and the field."""


def check_machine(data: Any, src: str) -> None:
    """SchemaError unless a specdec artifact (`"schema": "specdec.*"`) has a meta.machine block
    with MACHINE_KEYS and a CPU model; other JSON passes."""
    if not (isinstance(data, Mapping) and str(data.get("schema", "")).startswith("specdec.")):
        return
    meta = data.get("meta")
    machine = meta.get("machine") if isinstance(meta, Mapping) else None
    if not isinstance(machine, Mapping):
        raise SchemaError(f"{src}: no meta.machine block (provenance.meta_block() makes one)")
    missing = [k for k in MACHINE_KEYS if k not in machine]
    if not missing and not machine["cpu_model"]:
        missing = ["cpu_model"]
    if missing:
        raise SchemaError(f"{src}: meta.machine does not name {', '.join(missing)}")


# ------------------------------------------------------------------------------ reading
def describe(e: ValidationError, src: str, tag: str | None = None) -> str:
    """The first error of a validation, as "FILE: where: field 'x' is V (why)"; `tag`: the
    union member's name that leads the location (the schema id), left out."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if loc and loc[0] == tag:
        loc = loc[1:]
    if not loc:
        return f"{src}: {err['msg']}"
    if err["type"] == "missing":
        return f"{src}: missing field {'.'.join(loc)!r}"
    at = f"{src}: {'.'.join(loc[:-1])}" if len(loc) > 1 else src
    return f"{at}: field {loc[-1]!r} is {err['input']!r} ({err['msg']})"


_A = TypeVar("_A", bound="Artifact")


class Artifact(Record):
    """A whole artifact file: `"schema": "specdec.<kind>/<version>"` (each kind narrows it to
    its own), the `meta` block (provenance.meta_block(): when, where, with what), and where it
    was read from."""

    SCHEMA: ClassVar[str]
    schema_id: str = schema_field("")
    meta: Mapping[str, Any]
    src: str = not_in_file("")  # the file, as the reader named it (relative to a scanned DIR)
    path: Path | None = not_in_file(None)  # the file

    @classmethod
    def from_json(cls: type[_A], d: Any, src: str = "", path: Path | None = None) -> _A:
        """The artifact in `d` (parsed JSON), or ArtifactError naming `src` and the field."""
        try:
            art = cls.model_validate(d)
        except ValidationError as e:
            raise ArtifactError(describe(e, src)) from None
        return art.model_copy(update={"src": src, "path": path})


# ------------------------------------------------------------------------------ MODEL
class Model(Record):
    """MODEL: what was loaded, from where, on what device (backends.configs.model_record)."""

    spec: str | None  # BACKEND:NAME_OR_PATH as given on the command line
    backend: str
    name: str
    device: str
    sha256: str | None = None  # registry pin, or a hash of local files; None for mock models
    vocab_size: int | None = None
    n_ctx: int | None = None
    dtype: str | None = None  # hf: torch dtype name; None for llama.cpp (its own quantization)

    @property
    def short(self) -> str:
        return f"{self.name} ({self.backend}, {self.device})"


# ------------------------------------------------------------------------------ config, models
class _Configured(Protocol):
    @property
    def config(self) -> Mapping[str, Any]: ...


class _Modelled(Protocol):
    @property
    def models(self) -> Mapping[str, Model | None]: ...


class RunConfig:
    """What an artifact's `config` (the run's settings, as written by its command) says, for
    the artifacts that keep one: bench, sweep, gate (each declares `config` in its place)."""

    @property
    def name(self: _Configured) -> str:
        return str(self.config.get("name") or "?")

    @property
    def draft_spec(self: _Configured) -> str:
        """config.draft: what sweeps and microbenches are matched on."""
        return str(self.config.get("draft") or "?")

    @property
    def target_spec(self: _Configured) -> str:
        return str(self.config.get("target") or "?")

    @property
    def temperature(self: _Configured) -> float | None:
        t = self.config.get("temperature")
        return None if t is None else float(t)

    @property
    def max_new_tokens(self: _Configured) -> int | None:
        n = self.config.get("max_new_tokens")
        return None if n is None else int(n)


class RunModels:
    """The draft and target model blocks of an artifact's `models`: bench, microbench, gate."""

    @property
    def draft(self: _Modelled) -> Model | None:
        return self.models.get("draft")

    @property
    def target(self: _Modelled) -> Model | None:
        return self.models.get("target")
