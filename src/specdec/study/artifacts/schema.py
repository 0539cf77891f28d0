"""The JSON artifacts the harness writes: one frozen, typed record (a pydantic model) per block,
written and read here.

The producers (study/run/: bench, sweep, microbench, gate) build these records and `write_json`
writes them; study/present/ reads them back with `read` (or `<Kind>.from_json`). The field
comments below are the schema's documentation; this docstring says only what the fields cannot.

Every artifact is one JSON object with `"schema": "specdec.<kind>/<version>"` and a `"meta"`
block (provenance.meta_block(): when, where, with what; write_json refuses one whose
meta.machine does not name the CPU, kernels and load: check_machine). Kinds:

    specdec.bench/1       BenchArtifact: one `specdec bench` run (run/bench.py: the protocol)
    specdec.sweep/1       SweepArtifact: a K-sweep summary; its per-K bench artifacts lie beside it
    specdec.microbench/1  MicrobenchArtifact: cost curves and predicted speedups (run/microbench.py)
    specdec.gate/1        GateArtifact: the level-3 equivalence gate (run/gate.py)

One format per kind: the readers know the current one only. Artifacts written before a field
existed are brought to it once by scripts/migrate_artifacts.py (results/ and tests/fixtures/
have been), which fills the field as it is defined here or with null.

`validate` checks the structure a reader relies on; `read` then validates every field against
its type and raises ArtifactError naming the file and the field when one is missing or of the
wrong type. Keys the schema does not name are refused (a misspelt field is an error, not a
null); a field with a default may be left out (the producers write every field, so only a
hand-made artifact does). A statistic a method cannot have is null in the file and None here
(the baseline's acceptance rate, HF-assisted's TTFT), as is one that was not recorded when the
artifact was made. Fields declared `optional()` are left out of the file when None (they exist
only for some runs); `not_in_file()` fields say where a read artifact came from and are never
written.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMAS = ("specdec.bench/1", "specdec.sweep/1", "specdec.microbench/1", "specdec.gate/1")
PHASES = ("draft", "verify", "sampling", "other")  # ms_per_token's latency split, stacking order


class Record(BaseModel):
    """A block of an artifact: frozen and typed; `to_json` writes its fields in declaration
    order (write_json), `model_validate` reads them (read)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)


def optional() -> Any:
    """A field written only when it is not None (it exists for some runs only)."""
    return Field(None, json_schema_extra={"optional": True})


def not_in_file(default: Any) -> Any:
    """A field the reader sets (where the artifact came from); never written."""
    return Field(default, exclude=True)


def _schema_id(kind: str) -> Any:
    """The `"schema"` field of an artifact of this kind (a Python name of its own: BaseModel
    has a `schema` method)."""
    return Field(kind, alias="schema")


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


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


#: What a specdec artifact's meta.machine must name (provenance.meta_block writes them): the CPU,
#: the llama.cpp kernels the process ran (null: it loaded no llama.cpp) and the load average (null
#: where the OS has none). Without them two hosts' or two builds' numbers read as one run's.
MACHINE_KEYS = ("cpu_model", "kernels", "load_avg")


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


def write_json(path: str | os.PathLike[str], obj: Any, *, rewrite: bool = False) -> None:
    """Write an artifact (a dataclass, or a dict) atomically: a temp file in the same directory,
    then os.replace, so a reader, or a Ctrl-C, never sees half a file.

    A specdec artifact must say where it was made (check_machine; SchemaError, nothing written);
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
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ reading
class SchemaError(ValueError):
    pass


class ArtifactError(ValueError):
    """An artifact that passed `validate` lacks a field that a reader needs, or has one of the
    wrong type."""


def _describe(e: ValidationError, src: str) -> str:
    """The first error of a validation, as "FILE: where: field 'x' is V (why)"."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if not loc:
        return f"{src}: {err['msg']}"
    if err["type"] == "missing":
        return f"{src}: missing field {'.'.join(loc)!r}"
    at = f"{src}: {'.'.join(loc[:-1])}" if len(loc) > 1 else src
    return f"{at}: field {loc[-1]!r} is {err['input']!r} ({err['msg']})"


_A = TypeVar("_A", bound="Artifact")


class Artifact(Record):
    """A whole artifact file (one of ARTIFACTS), with where it was read from."""

    @classmethod
    def from_json(cls: type[_A], d: Any, src: str = "", path: Path | None = None) -> _A:
        """The artifact in `d` (parsed JSON), or ArtifactError naming `src` and the field."""
        try:
            art = cls.model_validate(d)
        except ValidationError as e:
            raise ArtifactError(_describe(e, src)) from None
        return art.model_copy(update={"src": src, "path": path})


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


# ------------------------------------------------------------------------------ specdec.bench/1
class RunConfig:
    """What an artifact's `config` (the run's settings, as written by its command) says, for
    the artifacts that keep one: bench, sweep, gate."""

    @property
    def name(self) -> str:
        return str(self.config.get("name") or "?")  # type: ignore[attr-defined]

    @property
    def draft_spec(self) -> str:
        """config.draft: what sweeps and microbenches are matched on."""
        return str(self.config.get("draft") or "?")  # type: ignore[attr-defined]

    @property
    def target_spec(self) -> str:
        return str(self.config.get("target") or "?")  # type: ignore[attr-defined]

    @property
    def temperature(self) -> float | None:
        t = self.config.get("temperature")  # type: ignore[attr-defined]
        return None if t is None else float(t)

    @property
    def max_new_tokens(self) -> int | None:
        n = self.config.get("max_new_tokens")  # type: ignore[attr-defined]
        return None if n is None else int(n)


class RunModels:
    """The draft and target model blocks of an artifact's `models`: bench, microbench, gate."""

    @property
    def draft(self) -> Model | None:
        return self.models.get("draft")  # type: ignore[attr-defined]

    @property
    def target(self) -> Model | None:
        return self.models.get("target")  # type: ignore[attr-defined]


class Agg(Record):
    """AGG: one method of a bench run, pooled over its recorded rows (runs.aggregate_runs)."""

    n: int  # recorded rows
    tok_s_mean: float | None  # mean of the per-prompt rates generated / wall_s
    tok_s_std: float | None  # their sample std (ddof 1; 0.0 for one row)
    tok_s_pooled: float | None = None  # sum generated / sum wall_s (a long prompt weighs more)
    # sum generated / sum (wall_s - prefill_s - catchup_s): the decode phase alone, without the
    # prompt prefills that every method pays once; what the microbench's cost model predicts.
    # None for hf_assisted (no prefill in its records) and where it was not recorded.
    decode_tok_s_pooled: float | None = None
    ttft_s_mean: float | None = None
    generated: int | None = None  # sums over the rows; None where a record kind lacks one
    rounds: int | None = None
    drafting_rounds: int | None = None  # rounds that drafted >= 1 token (None: not counted)
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None  # sum accepted / sum drafted
    # [K] per draft position: sum accepted_per_pos / sum drafted_per_pos; [] for the baseline
    positional_acceptance: tuple[float, ...] | None = None
    tokens_per_round: float | None = None  # sum generated / sum rounds (K = 0 rounds included)
    # 1 + sum accepted / sum drafting_rounds: vLLM's "mean acceptance length", over rounds that
    # drafted only, the bonus or recovered token included (None: the baseline, HF-assisted)
    mean_acceptance_length: float | None = None
    # PHASES -> 1000 * sum of the phase's seconds / generated (runs.phase_seconds: "verify" is the
    # target's passes, the prefill included)
    ms_per_token: Mapping[str, float] | None = None

    @property
    def positional(self) -> tuple[float, ...]:
        return self.positional_acceptance or ()

    @field_validator("ms_per_token")
    @classmethod
    def _every_phase(cls, v: Mapping[str, float] | None) -> Mapping[str, float] | None:
        if v is not None and set(v) != set(PHASES):
            raise ValueError(f"ms_per_token holds {PHASES}")
        return v


class VariantAgg(Agg):
    """AGG of one extra speculative method of the run (`--variants`), with its ratios."""

    speedup: float | None = None  # its tok_s_mean / the same run's baseline tok_s_mean
    decode_speedup: float | None = None  # the decode_tok_s_pooled ratio


class CategoryAgg(Record):
    """One method on the prompts of one category."""

    n: int  # prompts of the category
    tok_s_mean: float | None
    speedup: float | None  # against the baseline mean on the same prompts


class Aggregates(Record):
    """The `aggregates` block of a bench run."""

    baseline: Agg
    speculative: Agg
    hf_assisted: Agg | None = optional()  # --compare hf-assisted
    variants: Mapping[str, VariantAgg] = Field(default_factory=dict)  # by name, in run order
    by_category: Mapping[str, Mapping[str, CategoryAgg]] = Field(default_factory=dict)
    speedup: float | None  # speculative tok_s_mean / baseline tok_s_mean
    speedup_pooled: float | None  # the same ratio of tok_s_pooled
    decode_speedup: float | None = None  # the same ratio of decode_tok_s_pooled
    speedup_hf_assisted: float | None = optional()  # hf / baseline
    # The process's high-water RSS (ru_maxrss): it never decreases within one process, so after
    # earlier runs it is an upper bound for this one.
    peak_rss_mb: float | None
    # torch.cuda.max_memory_allocated since this run started; torch allocations only (llama.cpp's
    # own CUDA buffers are invisible to it); None without CUDA.
    peak_vram_mb: float | None

    def of(self, method: str) -> Agg | None:
        """The AGG of a main method ("baseline", "speculative", "hf_assisted") or a variant."""
        if method in ("baseline", "speculative", "hf_assisted"):
            return getattr(self, method)
        return self.variants.get(method)


#: The methods a bench row holds under their own key; variants are under "variants".
MAIN_METHODS = ("baseline", "speculative", "hf_assisted")


class BenchRow(Record):
    """One recorded (non-warm-up) prompt. A RUN is GenerationStats.to_dict() (core.metrics
    defines each field) + {tokens: [ids], stop_reason}, and for an in-process speculative method
    its rounds (`round_log`, see runs.round_log(); absent where not recorded); an HF-assisted RUN is
    hf_assisted.run's record."""

    index: int | None = None  # position in the prompt set, after any category filter
    prompt_id: str
    category: str
    prompt_tokens: int
    seed: int
    order: str  # "base-first" | "spec-first"
    sequence: tuple[str, ...] = ()  # the methods in the order they ran on this prompt
    baseline: Mapping[str, Any]  # RUN
    speculative: Mapping[str, Any]  # RUN
    hf_assisted: Mapping[str, Any] | None = optional()
    variants: Mapping[str, Mapping[str, Any]] = Field(default_factory=dict)  # name -> RUN

    def run(self, method: str) -> Mapping[str, Any]:
        return getattr(self, method) if method in MAIN_METHODS else self.variants[method]


class BenchArtifact(RunConfig, RunModels, Artifact):
    """specdec.bench/1: one `specdec bench` run."""

    SCHEMA: ClassVar[str] = "specdec.bench/1"
    schema_id: Literal["specdec.bench/1"] = _schema_id("specdec.bench/1")
    meta: Mapping[str, Any]  # meta_block()
    # run.bench.BenchConfig.to_json(): its settings, flat (run.bench.CONFIG_KEYS), plus
    # "engines" (what the run started); BenchConfig documents each. `categories` [] means
    # every prompt.
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    rows: tuple[BenchRow, ...]
    aggregates: Aggregates
    variants: tuple[str, ...] = ()  # the variant methods' names, in run order
    complete: bool  # false while running or after an interrupt (Ctrl-C keeps the finished rows)
    # Prompts dropped because an endpoint failed on them: {index, prompt_id, method, kind, error}
    # each (kind: study.engines.endpoint.EndpointError's). Every row holds every method.
    failed: tuple[Mapping[str, Any], ...] | None = optional()
    src: str = not_in_file("")  # the file, relative to the scanned DIR
    path: Path | None = not_in_file(None)  # the file
    label: str = not_in_file("")  # unique among a study's benches

    @property
    def k(self) -> int | str:
        """An int, or the policy name ("auto", "schedule") when K varies by round."""
        k = self.config["k"]
        return k if k in ("auto", "schedule") else int(k)

    @property
    def drafter(self) -> str:
        return str(self.config.get("drafter") or "model")

    @property
    def method(self) -> str:
        """The speculative method, 'model K=4' style."""
        return f"{self.drafter} K={self.k}"

    @property
    def n_prompts(self) -> int:
        """Recorded prompts."""
        return self.aggregates.speculative.n

    @field_validator("config")
    @classmethod
    def _k_is_a_number_or_a_policy(cls, v: Mapping[str, Any]) -> Mapping[str, Any]:
        k = v.get("k")
        if k not in ("auto", "schedule") and not _number(k):
            raise ValueError(f"config.k is {k!r}: a number, 'auto' or 'schedule'")
        return v

    @field_validator("failed")
    @classmethod
    def _none_failed(cls, v: Any) -> Any:
        return v or None


def variant_method(name: str) -> str:
    """'lookup K=auto' for the variant name 'lookup-kauto' (study.run.methods.variant_name)."""
    drafter, sep, k = name.rpartition("-k")
    if sep and drafter and (k.isdigit() or k in ("auto", "schedule")):
        return f"{drafter} K={k}"
    return name  # an endpoint's method (e.g. llama-server-ngram-map-k)


# ------------------------------------------------------------------------------ specdec.sweep/1
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
    schema_id: Literal["specdec.sweep/1"] = _schema_id("specdec.sweep/1")
    meta: Mapping[str, Any]
    config: Mapping[str, Any]  # the bench config without k (every K is its own run)
    ks: tuple[int, ...]
    points: tuple[SweepPoint, ...]  # one per finished K, in run order
    complete: bool = True
    src: str = not_in_file("")
    path: Path | None = not_in_file(None)

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
            if v.get(key) is not None and not _number(v[key]):
                raise ValueError(f"config.{key} is {v[key]!r}, expected a number")
        return v


# ------------------------------------------------------------------------------ microbench/1
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
    schema_id: Literal["specdec.microbench/1"] = _schema_id("specdec.microbench/1")
    meta: Mapping[str, Any]
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
    src: str = not_in_file("")
    path: Path | None = not_in_file(None)

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


# ------------------------------------------------------------------------------ specdec.gate/1
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
    schema_id: Literal["specdec.gate/1"] = _schema_id("specdec.gate/1")
    meta: Mapping[str, Any]
    # {name, draft, target, quick, threads} + asdict(gate.GateSettings)
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    sampled: SampledLeg
    greedy: GreedyLeg
    passed: bool  # sampled.passed and greedy.passed
    src: str = not_in_file("")
    path: Path | None = not_in_file(None)

    @property
    def quick(self) -> bool:
        return bool(self.config.get("quick"))


ARTIFACTS: dict[str, Any] = {
    a.SCHEMA: a for a in (BenchArtifact, SweepArtifact, MicrobenchArtifact, GateArtifact)
}


# ------------------------------------------------------------------------------ validation
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "specdec.bench/1": {
        "config": dict,
        "models": dict,
        "rows": list,
        "aggregates": dict,
        "complete": bool,
    },
    "specdec.sweep/1": {"config": dict, "ks": list, "points": list},
    "specdec.microbench/1": {
        "models": dict,
        "verify": list,
        "target_step_ms": (int, float),
        "prediction": list,
    },
    "specdec.gate/1": {
        "config": dict,
        "models": dict,
        "sampled": dict,
        "greedy": dict,
        "passed": bool,
    },
}
_AGG_KEYS = (
    "n",
    "tok_s_mean",
    "tok_s_std",
    "acceptance_rate",
    "positional_acceptance",
    "tokens_per_round",
    "ms_per_token",
)
_PREDICTION_KEYS = ("k", "expected_tokens_per_round", "cost_in_target_steps", "predicted_speedup")


def validate(artifact: dict[str, Any]) -> str:
    """Check an artifact's structure; return its schema id or raise SchemaError."""
    if not isinstance(artifact, dict):
        raise SchemaError("an artifact is a JSON object")
    schema = artifact.get("schema")
    if schema not in _REQUIRED:
        raise SchemaError(f"unknown schema {schema!r}; expected one of {SCHEMAS}")
    if not isinstance(artifact.get("meta"), dict):
        raise SchemaError(f"{schema}: missing 'meta' block")
    for key, typ in _REQUIRED[schema].items():
        if not isinstance(artifact.get(key), typ):
            raise SchemaError(f"{schema}: field {key!r} missing or not {typ}")
    {
        "specdec.bench/1": _validate_bench,
        "specdec.microbench/1": _validate_microbench,
        "specdec.gate/1": _validate_gate,
    }.get(schema, lambda _: None)(artifact)
    return schema


def _validate_bench(artifact: dict[str, Any]) -> None:
    sides = ("baseline", "speculative")
    if "hf_assisted" in artifact["aggregates"]:
        sides += ("hf_assisted",)
    for side in sides:
        agg = artifact["aggregates"].get(side)
        if not isinstance(agg, dict) or any(k not in agg for k in _AGG_KEYS):
            raise SchemaError(f"bench: aggregates.{side} must hold {_AGG_KEYS}")
    for row in artifact["rows"]:
        for side in sides:
            if not isinstance(row.get(side), dict) or "tokens_per_s" not in row[side]:
                raise SchemaError(f"bench: every row needs {side}.tokens_per_s")


def _validate_microbench(artifact: dict[str, Any]) -> None:
    for pt in artifact["verify"]:
        if not {"b", "median_ms", "ratio"} <= set(pt):
            raise SchemaError("microbench: verify points need b, median_ms, ratio")
    for row in artifact["prediction"]:
        if not set(_PREDICTION_KEYS) <= set(row):
            raise SchemaError(f"microbench: prediction rows need {_PREDICTION_KEYS}")


def _validate_gate(artifact: dict[str, Any]) -> None:
    for key in ("chi2", "dof", "p_value", "passed"):
        if key not in artifact["sampled"]:
            raise SchemaError(f"gate: sampled.{key} missing")
    for b in artifact["sampled"].get("bins", []):
        if not {"label", "speculative", "baseline"} <= set(b):
            raise SchemaError("gate: sampled.bins need label, speculative, baseline")
    if not isinstance(artifact["greedy"].get("rows"), list):
        raise SchemaError("gate: greedy.rows must be a list")


def read(data: dict[str, Any], src: str = "", path: Path | None = None) -> Any:
    """Validate a parsed JSON artifact and read it into its record (ArtifactError if a field is
    missing or of the wrong type)."""
    return ARTIFACTS[validate(data)].from_json(data, src, path)
