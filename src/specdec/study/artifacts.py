"""The JSON artifacts the harness writes: one frozen dataclass per block, written and read here.

The producers (bench, sweep, microbench, gate) build these dataclasses and `write_json` writes
them; figures and report read them back with `<Kind>.from_json`. The field comments below are the
schema's documentation; this docstring says only what the fields cannot.

Every artifact is one JSON object with `"schema": "specdec.<kind>/<version>"` and a `"meta"`
block (`meta_block()`: when, where, with what). Kinds:

    specdec.bench/1       BenchArtifact: one `specdec bench` run (bench.py defines the protocol)
    specdec.sweep/1       SweepArtifact: a K-sweep summary; its per-K bench artifacts lie beside it
    specdec.microbench/1  MicrobenchArtifact: cost curves and predicted speedups (microbench.py)
    specdec.gate/1        GateArtifact: the level-3 equivalence gate (gate.py)

`validate` checks the structure a reader relies on; `from_json` then reads the fields, with the
fallbacks that older artifacts (results/, tests/fixtures/) need, and raises ArtifactError naming
the file and the field when one is missing or of the wrong type. A statistic a method cannot have
is null in the file and None here (the baseline's acceptance rate, HF-assisted's TTFT).
Fields marked OPTIONAL are left out of the file when None (they exist only for some runs);
NOT_IN_FILE fields say where a read artifact came from and are never written.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from specdec.backends import llamacpp_build, parse_spec
from specdec.backends.configs import model_record
from specdec.core.metrics import Round

SCHEMAS = ("specdec.bench/1", "specdec.sweep/1", "specdec.microbench/1", "specdec.gate/1")
PHASES = ("draft", "verify", "sampling", "other")  # ms_per_token's latency split, stacking order
OPTIONAL = {"optional": True}  # written only when not None
NOT_IN_FILE = {"in_file": False}  # set by the reader; never written


# ------------------------------------------------------------------------------ writing
def to_json(obj: Any) -> Any:
    """Plain JSON types from dataclasses (fields in declaration order), mappings and sequences."""
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if not f.metadata.get("in_file", True) or (v is None and f.metadata.get("optional")):
                continue
            out[f.name] = to_json(v)
        return out
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


class _Json:
    def to_json(self) -> dict[str, Any]:
        return to_json(self)


def named_artifact(out: str | os.PathLike[str], kind: str, *parts: str | None) -> Path:
    """<out>/<kind>_<part>[_<part>...].json, the parts that are given joined by "_" and made
    filesystem-safe (e.g. a model name with a colon, a --tag)."""
    name = "_".join(x for x in parts if x)
    return Path(out) / f"{kind}_{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.json"


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write an artifact (a dataclass, or a dict) atomically: a temp file in the same directory,
    then os.replace, so a reader, or a Ctrl-C, never sees half a file.

    Indented for diffs, but lists of numbers (token ids, per-position counts) stay on one line.
    A dict's top-level "path" (a caller's note of where the file lives) is not written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_json(obj)
    data = {k: v for k, v in data.items() if k != "path"}
    text = json.dumps(data, indent=1, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def meta_block() -> dict[str, Any]:
    """When, where and with what an artifact was produced."""
    import psutil
    import torch

    versions = {"python": platform.python_version()}
    for mod in ("specdec", "torch", "transformers", "llama_cpp", "gguf", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # a missing optional backend is recorded, not fatal
            versions[mod] = None
    return {
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "versions": versions,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            # 1/5/15-minute load averages when the artifact was made: benchmarks here need an
            # idle machine (llama.cpp's spinning thread pools stall when a core is taken)
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "cpu_model": llamacpp_build.cpu_model(),
            # the ggml CPU variant llama.cpp loaded and its compiled-in features
            "kernels": _kernels(),
        },
    }


def _kernels() -> dict[str, Any] | None:
    try:
        from specdec.backends.llamacpp import kernels

        return kernels()
    except Exception:  # no llama.cpp backend installed: nothing ran on its kernels
        return None


def peak_rss_mb() -> float | None:
    """Process-wide high-water RSS in MiB (never decreases: an upper bound per run)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB else


def peak_vram_mb() -> float | None:
    """torch.cuda.max_memory_allocated in MiB since the last reset; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def reset_peak_vram() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------ reading
class SchemaError(ValueError):
    pass


class ArtifactError(ValueError):
    """An artifact that passed `validate` lacks a field that a reader needs."""


def _get(d: Any, path: str, src: str, optional: bool = False) -> Any:
    """`d["a"]["b"]` for path "a.b", or an ArtifactError naming the file and the field."""
    cur = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if optional:
                return None
            raise ArtifactError(f"{src}: missing field {path!r}")
        cur = cur[part]
    return cur


def _num(d: Any, path: str, src: str, optional: bool = False) -> float | None:
    """A number at `path`; with `optional`, None when the field is missing or null."""
    v = _get(d, path, src, optional)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ArtifactError(f"{src}: field {path!r} is {v!r}, expected a number")
    return float(v)


def _req(d: Any, path: str, src: str) -> float:
    v = _num(d, path, src)
    assert v is not None  # _num raises for a missing required number
    return v


def _int(d: Any, path: str, src: str, optional: bool = True) -> int | None:
    v = _num(d, path, src, optional)
    return None if v is None else int(v)


def _nums(d: Any, path: str, src: str) -> tuple[float, ...] | None:
    """A list of numbers at `path`, or None when it is missing or null."""
    v = _get(d, path, src, optional=True)
    if v is None:
        return None
    if not isinstance(v, list) or any(
        isinstance(x, bool) or not isinstance(x, (int, float)) for x in v
    ):
        raise ArtifactError(f"{src}: field {path!r} must be a list of numbers")
    return tuple(float(x) for x in v)


def _dict(d: Any, path: str, src: str) -> dict[str, Any]:
    v = _get(d, path, src, optional=True)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ArtifactError(f"{src}: field {path!r} must be an object")
    return v


# ------------------------------------------------------------------------------ MODEL
@dataclass(frozen=True, kw_only=True)
class Model(_Json):
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

    @classmethod
    def from_json(cls, d: Any, path: str, src: str) -> Model | None:
        m = _get(d, path, src, optional=True)
        if m is None:
            return None
        if not isinstance(m, dict):
            raise ArtifactError(f"{src}: field {path!r} must be a MODEL object or null")
        return cls(
            spec=m.get("spec"),
            backend=str(m.get("backend", "?")),
            name=str(m.get("name") or m.get("spec") or "?"),
            device=str(m.get("device", "?")),
            sha256=m.get("sha256"),
            vocab_size=m.get("vocab_size"),
            n_ctx=m.get("n_ctx"),
            dtype=m.get("dtype"),
        )


def model_block(spec: str, model: Any) -> Model:
    """The MODEL block of a loaded model: configs.model_record, plus a hash of local
    (non-registry) model files and the HF dtype."""
    record = model_record(spec, model)
    backend, rest = parse_spec(spec)
    if record["sha256"] is None and backend != "mock":
        record["sha256"] = _sha256_path(Path(rest).expanduser())
    dtype = None
    if backend == "hf":
        from specdec.backends.hf import HFModel

        if isinstance(model, HFModel):
            dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
    return Model(**record, dtype=dtype)


def _sha256_path(path: Path) -> str | None:
    """A file's sha256; for a model directory, one digest over its files in sorted path order."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _models(d: Any, src: str, sides: Sequence[str] = ("draft", "target")) -> dict[str, Any]:
    return {s: Model.from_json(d, f"models.{s}", src) for s in sides}


# ------------------------------------------------------------------------------ specdec.bench/1
def drafting_rounds(run: Mapping[str, Any]) -> int | None:
    """A RUN's rounds that drafted at least one token: its `drafting_rounds`, or, in records
    older than that field, drafted_per_pos[0] (core.metrics' definition); None for records
    without positions (HF-assisted)."""
    if run.get("drafting_rounds") is not None:
        return int(run["drafting_rounds"])
    per_pos = run.get("drafted_per_pos")
    if per_pos is None:
        return None
    return int(per_pos[0]) if per_pos else 0


#: The columns of a RUN's `round_log` (one entry per round, in order), core.metrics.Round's fields.
ROUND_LOG_COLUMNS = ("k", "n_accepted", "n_emitted", "draft_s", "verify_s")


def round_log(rounds: Sequence[Round]) -> dict[str, Any]:
    """A RUN's optional `round_log`: every round of the generation, columnar so that the file
    stays one line per column: `sources` names the draft sources, `source[i]` indexes it for
    round i, and ROUND_LOG_COLUMNS hold Round's numbers (a replay reproduces these rounds:
    study.replay)."""
    names = list(dict.fromkeys(r.source for r in rounds))
    out: dict[str, Any] = {"sources": names, "source": [names.index(r.source) for r in rounds]}
    for col in ROUND_LOG_COLUMNS:
        out[col] = [getattr(r, col) for r in rounds]
    return out


def read_round_log(log: Any, src: str = "") -> tuple[Round, ...]:
    """The Rounds of a `round_log` (round_log's inverse); ArtifactError if it is malformed."""
    try:
        names, idx = log["sources"], log["source"]
        cols = [log[c] for c in ROUND_LOG_COLUMNS]
        if any(len(c) != len(idx) for c in cols):
            raise ValueError("columns of different lengths")
        return tuple(
            Round(str(names[i]), int(k), int(a), int(e), float(d), float(v))
            for i, k, a, e, d, v in zip(idx, *cols, strict=True)
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ArtifactError(f"{src}: malformed round_log ({e})") from None


def pooled_acceptance_length(runs: Sequence[Mapping[str, Any]]) -> tuple[int | None, float | None]:
    """(sum drafting rounds, 1 + sum accepted / sum drafting rounds) over RUN records: the pooled
    mean acceptance length (vLLM's), None where a record lacks the counts or nothing drafted."""
    counts = [drafting_rounds(r) for r in runs]
    if not runs or None in counts or any(r.get("accepted") is None for r in runs):
        return None, None
    n = sum(c for c in counts if c is not None)
    return n, (1 + sum(r["accepted"] for r in runs) / n if n else None)


@dataclass(frozen=True, kw_only=True)
class Agg(_Json):
    """AGG: one method of a bench run, pooled over its recorded rows (bench.aggregate_runs)."""

    n: int  # recorded rows
    tok_s_mean: float | None  # mean of the per-prompt rates generated / wall_s
    tok_s_std: float | None  # their sample std (ddof 1; 0.0 for one row)
    tok_s_pooled: float | None = None  # sum generated / sum wall_s (a long prompt weighs more)
    # sum generated / sum (wall_s - prefill_s - catchup_s): the decode phase alone, without the
    # prompt prefills that every method pays once; what the microbench's cost model predicts.
    # None for hf_assisted and for artifacts older than prefill_s.
    decode_tok_s_pooled: float | None = None
    ttft_s_mean: float | None = None
    generated: int | None = None  # sums over the rows; None where a record kind lacks one
    rounds: int | None = None
    drafting_rounds: int | None = None  # rounds that drafted >= 1 token (None: older artifacts)
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None  # sum accepted / sum drafted
    # [K] per draft position: sum accepted_per_pos / sum drafted_per_pos; [] for the baseline
    positional_acceptance: tuple[float, ...] | None = None
    tokens_per_round: float | None = None  # sum generated / sum rounds (K = 0 rounds included)
    # 1 + sum accepted / sum drafting_rounds: vLLM's "mean acceptance length", over rounds that
    # drafted only, the bonus or recovered token included (None: older artifacts, the baseline)
    mean_acceptance_length: float | None = None
    ms_per_token: Mapping[str, float] | None = None  # PHASES -> 1000 * sum <phase>_s / generated

    @property
    def positional(self) -> tuple[float, ...]:
        return self.positional_acceptance or ()

    @classmethod
    def _read(cls, d: Any, path: str, src: str) -> dict[str, Any]:
        def opt(key: str) -> float | None:
            return _num(d, f"{path}.{key}", src, optional=True)

        ms = _get(d, f"{path}.ms_per_token", src, optional=True)
        counts = ("generated", "rounds", "drafting_rounds", "drafted", "accepted")
        rates = ("tok_s_mean", "tok_s_std", "tok_s_pooled", "decode_tok_s_pooled", "ttft_s_mean")
        rates += ("acceptance_rate", "tokens_per_round", "mean_acceptance_length")
        return {
            "n": int(opt("n") or 0),
            **{k: opt(k) for k in rates},
            **{k: _int(d, f"{path}.{k}", src) for k in counts},
            "positional_acceptance": _nums(d, f"{path}.positional_acceptance", src),
            "ms_per_token": (
                None
                if ms is None
                else {p: _req(d, f"{path}.ms_per_token.{p}", src) for p in PHASES}
            ),
        }

    @classmethod
    def from_json(cls, d: Any, path: str, src: str) -> Agg:
        return cls(**cls._read(d, path, src))


@dataclass(frozen=True, kw_only=True)
class VariantAgg(Agg):
    """AGG of one extra speculative method of the run (`--variants`), with its ratios."""

    speedup: float | None = None  # its tok_s_mean / the same run's baseline tok_s_mean
    decode_speedup: float | None = None  # the decode_tok_s_pooled ratio (None: older artifacts)

    @classmethod
    def from_json(cls, d: Any, path: str, src: str, base: Agg | None = None) -> VariantAgg:
        v = cls(
            **cls._read(d, path, src),
            speedup=_num(d, f"{path}.speedup", src, optional=True),
            decode_speedup=_num(d, f"{path}.decode_speedup", src, optional=True),
        )
        if v.speedup is None and base is not None:  # recomputed where the field is missing
            v = replace(v, speedup=_ratio(v.tok_s_mean, base.tok_s_mean))
        return v


@dataclass(frozen=True, kw_only=True)
class CategoryAgg(_Json):
    """One method on the prompts of one category."""

    n: int  # prompts of the category
    tok_s_mean: float | None
    speedup: float | None  # against the baseline mean on the same prompts


@dataclass(frozen=True, kw_only=True)
class Aggregates(_Json):
    """The `aggregates` block of a bench run."""

    baseline: Agg
    speculative: Agg
    hf_assisted: Agg | None = field(default=None, metadata=OPTIONAL)  # --compare hf-assisted
    variants: Mapping[str, VariantAgg] = field(default_factory=dict)  # by name, in run order
    by_category: Mapping[str, Mapping[str, CategoryAgg]] = field(default_factory=dict)
    speedup: float | None  # speculative tok_s_mean / baseline tok_s_mean
    speedup_pooled: float | None  # the same ratio of tok_s_pooled
    decode_speedup: float | None = None  # the same ratio of decode_tok_s_pooled
    speedup_hf_assisted: float | None = field(default=None, metadata=OPTIONAL)  # hf / baseline
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

    @classmethod
    def from_json(cls, d: Any, src: str) -> Aggregates:
        base = Agg.from_json(d, "aggregates.baseline", src)
        spec = Agg.from_json(d, "aggregates.speculative", src)
        hf = None
        if _get(d, "aggregates.hf_assisted", src, optional=True) is not None:
            hf = Agg.from_json(d, "aggregates.hf_assisted", src)
        hf_speedup = _num(d, "aggregates.speedup_hf_assisted", src, optional=True)
        if hf_speedup is None and hf is not None:  # older artifacts lack the field
            hf_speedup = _ratio(hf.tok_s_mean, base.tok_s_mean)
        variants = {
            str(name): VariantAgg.from_json(d, f"aggregates.variants.{name}", src, base)
            for name in _dict(d, "aggregates.variants", src)
        }
        cats = _dict(d, "aggregates.by_category", src)
        by_category = {
            str(c): {
                str(m): CategoryAgg(
                    n=a.get("n"), tok_s_mean=a.get("tok_s_mean"), speedup=a.get("speedup")
                )
                for m, a in per.items()
            }
            for c, per in cats.items()
        }
        return cls(
            baseline=base,
            speculative=spec,
            hf_assisted=hf,
            variants=variants,
            by_category=by_category,
            speedup=_num(d, "aggregates.speedup", src, optional=True),
            speedup_pooled=_num(d, "aggregates.speedup_pooled", src, optional=True),
            decode_speedup=_num(d, "aggregates.decode_speedup", src, optional=True),
            speedup_hf_assisted=hf_speedup,
            peak_rss_mb=_num(d, "aggregates.peak_rss_mb", src, optional=True),
            peak_vram_mb=_num(d, "aggregates.peak_vram_mb", src, optional=True),
        )


#: The methods a bench row holds under their own key; variants are under "variants".
MAIN_METHODS = ("baseline", "speculative", "hf_assisted")


@dataclass(frozen=True, kw_only=True)
class BenchRow(_Json):
    """One recorded (non-warm-up) prompt. A RUN is GenerationStats.to_dict() (core.metrics
    defines each field) + {tokens: [ids], stop_reason}, and for an in-process speculative method
    its rounds (`round_log`, see round_log(); absent in older artifacts); an HF-assisted RUN is
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
    hf_assisted: Mapping[str, Any] | None = field(default=None, metadata=OPTIONAL)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> RUN

    def run(self, method: str) -> Mapping[str, Any]:
        return getattr(self, method) if method in MAIN_METHODS else self.variants[method]

    @classmethod
    def from_json(cls, r: Any, src: str) -> BenchRow:
        if not isinstance(r, dict):
            raise ArtifactError(f"{src}: every row must be an object")
        return cls(
            index=r.get("index"),
            prompt_id=r.get("prompt_id"),
            category=r.get("category"),
            prompt_tokens=r.get("prompt_tokens"),
            seed=r.get("seed"),
            order=r.get("order"),
            sequence=tuple(r.get("sequence") or ()),
            baseline=r["baseline"],
            speculative=r["speculative"],
            hf_assisted=r.get("hf_assisted"),
            variants=r.get("variants") or {},
        )


@dataclass(frozen=True, kw_only=True)
class BenchArtifact(_Json):
    """specdec.bench/1: one `specdec bench` run."""

    SCHEMA: ClassVar[str] = "specdec.bench/1"
    schema: str = "specdec.bench/1"
    meta: Mapping[str, Any]  # meta_block()
    # asdict(bench.BenchConfig), which documents each field. Older artifacts lack some (read
    # with the BenchConfig defaults); `categories` [] or absent means every prompt.
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    rows: tuple[BenchRow, ...]
    aggregates: Aggregates
    variants: tuple[str, ...] = ()  # the variant methods' names, in run order
    complete: bool  # false while running or after an interrupt (Ctrl-C keeps the finished rows)
    # Prompts dropped because an endpoint failed on them: {index, prompt_id, method, kind, error}
    # each (kind: study.endpoint.EndpointError's). Every row holds every method.
    failed: tuple[Mapping[str, Any], ...] | None = field(default=None, metadata=OPTIONAL)
    src: str = field(default="", metadata=NOT_IN_FILE)  # the file, relative to the scanned DIR
    path: Path | None = field(default=None, metadata=NOT_IN_FILE)  # the file
    label: str = field(default="", metadata=NOT_IN_FILE)  # unique among a study's benches

    @property
    def name(self) -> str:
        return str(self.config.get("name") or "?")

    @property
    def k(self) -> int | str:
        """An int, or the policy name ("auto", "schedule") when K varies by round."""
        k = self.config["k"]
        return k if k in ("auto", "schedule") else int(k)

    @property
    def temperature(self) -> float | None:
        t = self.config.get("temperature")
        return None if t is None else float(t)

    @property
    def max_new_tokens(self) -> int | None:
        n = self.config.get("max_new_tokens")
        return None if n is None else int(n)

    @property
    def drafter(self) -> str:
        return str(self.config.get("drafter") or "model")

    @property
    def draft_spec(self) -> str:
        """config.draft: what sweeps and microbenches are matched on."""
        return str(self.config.get("draft") or "?")

    @property
    def target_spec(self) -> str:
        return str(self.config.get("target") or "?")

    @property
    def draft(self) -> Model | None:
        return self.models.get("draft")

    @property
    def target(self) -> Model | None:
        return self.models.get("target")

    @property
    def method(self) -> str:
        """The speculative method, 'model K=4' style."""
        return f"{self.drafter} K={self.k}"

    @property
    def n_prompts(self) -> int:
        """Recorded prompts."""
        return self.aggregates.speculative.n

    @classmethod
    def from_json(cls, d: dict[str, Any], src: str = "", path: Path | None = None) -> BenchArtifact:
        config = _dict(d, "config", src)
        rows = tuple(BenchRow.from_json(r, src) for r in d["rows"])
        k = _get(d, "config.k", src)
        if k not in ("auto", "schedule"):
            _num(d, "config.k", src)
        return cls(
            meta=d.get("meta") or {},
            config=config,
            models=_models(d, src),
            rows=rows,
            aggregates=_acceptance_lengths(Aggregates.from_json(d, src), rows),
            variants=tuple(d.get("variants") or ()),
            complete=bool(d["complete"]),
            failed=tuple(d.get("failed") or ()) or None,
            src=src,
            path=path,
        )


def _acceptance_lengths(agg: Aggregates, rows: Sequence[BenchRow]) -> Aggregates:
    """Artifacts older than mean_acceptance_length: pooled from their rows (the same formula
    as bench.aggregate_runs), where the rows hold the counts."""
    if not rows:
        return agg

    def filled(a: Any, method: str) -> Any:
        if a is None or a.mean_acceptance_length is not None:
            return a
        try:
            n, mal = pooled_acceptance_length([r.run(method) for r in rows])
        except KeyError:  # a variant some row lacks
            return a
        return replace(a, drafting_rounds=n, mean_acceptance_length=mal)

    return replace(
        agg,
        speculative=filled(agg.speculative, "speculative"),
        variants={name: filled(v, name) for name, v in agg.variants.items()},
    )


def variant_method(name: str) -> str:
    """'lookup K=auto' for the variant name 'lookup-kauto' (bench.variant_name)."""
    drafter, sep, k = name.rpartition("-k")
    if sep and drafter and (k.isdigit() or k in ("auto", "schedule")):
        return f"{drafter} K={k}"
    return name  # an endpoint's method (e.g. llama-server-ngram-map-k)


# ------------------------------------------------------------------------------ specdec.sweep/1
@dataclass(frozen=True, kw_only=True)
class SweepPoint(_Json):
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
    mean_acceptance_length: float | None = None  # None in older summaries
    positional_acceptance: tuple[float, ...] | None = None  # [K]
    member: BenchArtifact | None = field(default=None, metadata=NOT_IN_FILE)  # when scanned

    @property
    def positional(self) -> tuple[float, ...]:
        return self.positional_acceptance or ()

    @classmethod
    def from_json(cls, pt: Any, at: str) -> SweepPoint:
        speedup = _num(pt, "speedup", at, optional=True)
        # a K whose run recorded no prompt has null means; any other K must have them
        required = speedup is None
        return cls(
            k=int(_req(pt, "k", at)),
            artifact=pt.get("artifact"),
            baseline_tok_s=_num(pt, "baseline_tok_s", at, optional=required),
            baseline_tok_s_std=_num(pt, "baseline_tok_s_std", at, optional=True),
            speculative_tok_s=_num(pt, "speculative_tok_s", at, optional=required),
            speculative_tok_s_std=_num(pt, "speculative_tok_s_std", at, optional=True),
            speedup=speedup,
            speedup_pooled=_num(pt, "speedup_pooled", at, optional=True),
            acceptance_rate=_num(pt, "acceptance_rate", at, optional=True),
            tokens_per_round=_num(pt, "tokens_per_round", at, optional=True),
            mean_acceptance_length=_num(pt, "mean_acceptance_length", at, optional=True),
            positional_acceptance=_nums(pt, "positional_acceptance", at),
        )


@dataclass(frozen=True, kw_only=True)
class SweepArtifact(_Json):
    """specdec.sweep/1: a K-sweep's summary (sweep.run_sweep), rewritten after every K."""

    SCHEMA: ClassVar[str] = "specdec.sweep/1"
    schema: str = "specdec.sweep/1"
    meta: Mapping[str, Any]
    config: Mapping[str, Any]  # the bench config without k (every K is its own run)
    ks: tuple[int, ...]
    points: tuple[SweepPoint, ...]  # one per finished K, in run order
    complete: bool = True
    src: str = field(default="", metadata=NOT_IN_FILE)
    path: Path | None = field(default=None, metadata=NOT_IN_FILE)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or "?")

    @property
    def draft_spec(self) -> str:
        return str(self.config.get("draft") or "?")

    @property
    def target_spec(self) -> str:
        return str(self.config.get("target") or "?")

    @property
    def temperature(self) -> float | None:
        t = self.config.get("temperature")
        return None if t is None else float(t)

    @property
    def max_new_tokens(self) -> int | None:
        n = self.config.get("max_new_tokens")
        return None if n is None else int(n)

    @property
    def recorded_prompts(self) -> int | None:
        """config.n_prompts - config.warmup."""
        n = self.config.get("n_prompts")
        return None if n is None else int(n - (self.config.get("warmup") or 0))

    @property
    def device(self) -> str | None:
        devs = {p.member.target.device for p in self.points if p.member and p.member.target}
        return devs.pop() if len(devs) == 1 else None

    @classmethod
    def from_json(cls, d: dict[str, Any], src: str = "", path: Path | None = None) -> SweepArtifact:
        for key in ("n_prompts", "warmup", "temperature", "max_new_tokens"):
            _num(d, f"config.{key}", src, optional=True)
        return cls(
            meta=d.get("meta") or {},
            config=_dict(d, "config", src),
            ks=tuple(int(k) for k in d["ks"]),
            points=tuple(
                SweepPoint.from_json(pt, f"{src}: points.{i}") for i, pt in enumerate(d["points"])
            ),
            complete=bool(d.get("complete", True)),
            src=src,
            path=path,
        )


# ------------------------------------------------------------------------------ microbench/1
@dataclass(frozen=True, kw_only=True)
class VerifyPoint(_Json):
    b: int  # tokens in one target extend
    median_ms: float
    ratio: float  # v(b) = median_ms(b) / median_ms(1), in target steps
    samples_ms: tuple[float, ...] = ()  # [repeats]


@dataclass(frozen=True, kw_only=True)
class Acceptance(_Json):
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


@dataclass(frozen=True, kw_only=True)
class Prediction(_Json):
    k: int
    expected_tokens_per_round: float | None  # E(K); None without an acceptance profile
    cost_in_target_steps: float  # v(K+1) + K c: also the break-even tokens per round
    predicted_speedup: float | None  # E(K) / cost(K); None without an acceptance profile


@dataclass(frozen=True, kw_only=True)
class Check(_Json):
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

    @classmethod
    def from_json(cls, ch: Mapping[str, Any]) -> Check:
        names = [f.name for f in fields(cls) if f.name != "p_at_least"]
        return cls(**{n: ch.get(n) for n in names}, p_at_least=tuple(ch.get("p_at_least") or ()))


@dataclass(frozen=True, kw_only=True)
class MicrobenchArtifact(_Json):
    """specdec.microbench/1: cost curves (microbench.py defines each term)."""

    SCHEMA: ClassVar[str] = "specdec.microbench/1"
    schema: str = "specdec.microbench/1"
    meta: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"target": MODEL, "draft": MODEL | None}
    prefix_tokens: int | None  # tokens cached before each probe
    repeats: int | None  # timed passes; medians are over these
    max_batch: int | None = None
    verify: tuple[VerifyPoint, ...]  # sorted by b
    target_step_ms: float
    # max / min - 1 of the single-step samples (one per pass, spread over the whole run): a
    # probe for a contended machine; None in older artifacts
    step_spread: float | None = None
    deterministic: bool | None = None  # llama.cpp deterministic mode; None in older artifacts
    draft_step_ms: float | None  # None without a draft
    draft_samples_ms: tuple[float, ...] | None = None  # [repeats]
    c: float | None  # draft_step_ms / target_step_ms; None without a draft
    acceptance: Acceptance | None = None  # from --acceptance
    prediction_c: float | None  # the c the prediction used: c, or 0.0 for a model-free drafter
    # k = 1..min(max_batch - 1, K of the profile); without a profile k = 1..max_batch - 1
    prediction: tuple[Prediction, ...]  # sorted by k
    best_k: int | None  # argmax of predicted_speedup over k = 0..K (0: cannot pay), or None
    threads: int | None = None  # CPU threads per model; None = all cores
    checks: tuple[Check, ...] = ()  # --check (absent in older artifacts)
    src: str = field(default="", metadata=NOT_IN_FILE)
    path: Path | None = field(default=None, metadata=NOT_IN_FILE)

    @property
    def target(self) -> Model | None:
        return self.models.get("target")

    @property
    def draft(self) -> Model | None:
        return self.models.get("draft")

    @property
    def label(self) -> str:
        t = self.target.short if self.target else "?"
        return t if self.draft is None else f"{self.draft.name} → {t}"

    @property
    def predicts(self) -> bool:
        return any(p.predicted_speedup is not None for p in self.prediction)

    @classmethod
    def from_json(
        cls, d: dict[str, Any], src: str = "", path: Path | None = None
    ) -> MicrobenchArtifact:
        verify = []
        for i, pt in enumerate(d["verify"]):
            at = f"{src}: verify.{i}"
            samples = _nums(pt, "samples_ms", at) or ()
            verify.append(
                VerifyPoint(
                    b=int(_req(pt, "b", at)),
                    median_ms=_req(pt, "median_ms", at),
                    ratio=_req(pt, "ratio", at),
                    samples_ms=samples,
                )
            )
        preds = []
        for i, pt in enumerate(d["prediction"]):
            at = f"{src}: prediction.{i}"
            preds.append(
                Prediction(
                    k=int(_req(pt, "k", at)),
                    expected_tokens_per_round=_num(pt, "expected_tokens_per_round", at, True),
                    cost_in_target_steps=_req(pt, "cost_in_target_steps", at),
                    predicted_speedup=_num(pt, "predicted_speedup", at, optional=True),
                )
            )
        return cls(
            meta=d.get("meta") or {},
            models=_models(d, src, ("target", "draft")),
            prefix_tokens=_int(d, "prefix_tokens", src),
            repeats=_int(d, "repeats", src),
            max_batch=_int(d, "max_batch", src),
            verify=tuple(sorted(verify, key=lambda v: v.b)),
            target_step_ms=float(d["target_step_ms"]),
            draft_step_ms=_num(d, "draft_step_ms", src, optional=True),
            draft_samples_ms=_nums(d, "draft_samples_ms", src),
            c=_num(d, "c", src, optional=True),
            acceptance=_acceptance(d.get("acceptance")),
            prediction_c=_num(d, "prediction_c", src, optional=True),
            prediction=tuple(sorted(preds, key=lambda p: p.k)),
            best_k=_int(d, "best_k", src),
            threads=d.get("threads"),
            checks=tuple(Check.from_json(c) for c in d.get("checks") or () if isinstance(c, dict)),
            src=src,
            path=path,
        )


def _acceptance(a: Any) -> Acceptance | None:
    if not isinstance(a, dict):
        return None
    lists = ("drafted_per_pos", "accepted_per_pos", "positional_acceptance", "p_at_least")
    return Acceptance(
        source=str(a.get("source")),
        config=a.get("config"),
        k=a.get("k"),
        temperature=a.get("temperature"),
        n_rows=a.get("n_rows"),
        **{key: tuple(a.get(key) or ()) for key in lists},
    )


# ------------------------------------------------------------------------------ specdec.gate/1
_POOLED_WORDS = ("pool", "other", "rest")  # a pooled bin's label, for bins without token_id


@dataclass(frozen=True, kw_only=True)
class GateBin(_Json):
    """A bin as tested: a top token by combined count, or the pooled rest (token_id None)."""

    label: str  # the token's text as its repr ("' the'"), or "<other: N tokens>"
    token_id: int | None
    speculative: int  # count among the speculative tokens
    baseline: int
    # older artifacts have no token_id: their pooled bin is told by its label
    no_token_id: bool = field(default=False, metadata=NOT_IN_FILE)

    @property
    def pooled(self) -> bool:
        if self.no_token_id:
            return any(w in self.label.lower() for w in _POOLED_WORDS)
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


@dataclass(frozen=True, kw_only=True)
class SampledLeg(_Json):
    """T > 0: pooled token frequencies of both methods, compared by a two-sample chi-square."""

    n_prompts: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    k: int | None = None
    seeds: Mapping[str, Any] = field(default_factory=dict)  # {rule, baseline [n], speculative [n]}
    acceptance_rate: float | None = None  # accepted / drafted (0.0 when nothing was drafted)
    drafted: int | None = field(default=None, metadata=OPTIONAL)  # by the speculative method
    accepted: int | None = field(default=None, metadata=OPTIONAL)
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
    failed: tuple[Mapping[str, Any], ...] | None = field(default=None, metadata=OPTIONAL)

    @property
    def pooled_bin(self) -> GateBin | None:
        return next((b for b in self.bins if b.pooled), None)

    @property
    def token_bins(self) -> tuple[GateBin, ...]:
        """The bins of single tokens: every bin but the (first) pooled one."""
        pooled = self.pooled_bin
        return tuple(b for b in self.bins if b is not pooled)

    @classmethod
    def from_json(cls, s: dict[str, Any], src: str) -> SampledLeg:
        bins = []
        for i, b in enumerate(s.get("bins") or []):
            at = f"{src}: sampled.bins.{i}"
            bins.append(
                GateBin(
                    label=str(b["label"]),
                    token_id=b.get("token_id"),
                    speculative=int(_req(b, "speculative", at)),
                    baseline=int(_req(b, "baseline", at)),
                    no_token_id="token_id" not in b,
                )
            )
        at = f"{src}: sampled"
        counts = ("n_prompts", "max_new_tokens", "k", "tokens_speculative", "tokens_baseline")
        counts += ("distinct_tokens", "n_bins", "n_permutations", "drafted", "accepted")
        rates = ("temperature", "acceptance_rate", "min_expected", "p_value_permutation")
        rates += ("p_min", "smoothed_kl", "wall_s")
        return cls(
            **{k: _int(s, k, at) for k in counts},
            **{k: _num(s, k, at, optional=True) for k in rates},
            seeds=s.get("seeds") or {},
            chi2=_req(s, "chi2", at),
            dof=int(_req(s, "dof", at)),
            p_value=_req(s, "p_value", at),
            decided_by=s.get("decided_by"),
            passed=bool(s["passed"]),
            kl_definition=s.get("kl_definition"),
            bins=tuple(bins),
            failed=tuple(s.get("failed") or ()) or None,
        )


@dataclass(frozen=True, kw_only=True)
class GreedyRow(_Json):
    prompt_id: Any
    match: bool
    n_baseline: int | None
    n_speculative: int | None
    first_mismatch: int | None  # None when match
    error: str | None = field(default=None, metadata=OPTIONAL)  # a method failed on the prompt


@dataclass(frozen=True, kw_only=True)
class GreedyLeg(_Json):
    """T = 0: speculative tokens must equal target-only tokens exactly."""

    n_prompts: int | None = None
    max_new_tokens: int | None = None
    k: int | None = None
    rows: tuple[GreedyRow, ...]
    passed: bool | None  # every row matches

    @classmethod
    def from_json(cls, g: dict[str, Any], src: str) -> GreedyLeg:
        rows = []
        for i, r in enumerate(g["rows"]):
            at = f"{src}: greedy.rows.{i}"
            rows.append(
                GreedyRow(
                    prompt_id=r.get("prompt_id"),
                    match=bool(_get(r, "match", at)),
                    n_baseline=_int(r, "n_baseline", at),
                    n_speculative=_int(r, "n_speculative", at),
                    first_mismatch=_int(r, "first_mismatch", at),
                    error=r.get("error"),
                )
            )
        passed = g.get("passed")
        return cls(
            n_prompts=_int(g, "n_prompts", f"{src}: greedy"),
            max_new_tokens=_int(g, "max_new_tokens", f"{src}: greedy"),
            k=_int(g, "k", f"{src}: greedy"),
            rows=tuple(rows),
            passed=None if passed is None else bool(passed),
        )


@dataclass(frozen=True, kw_only=True)
class GateArtifact(_Json):
    """specdec.gate/1: level-3 equivalence (gate.py)."""

    SCHEMA: ClassVar[str] = "specdec.gate/1"
    schema: str = "specdec.gate/1"
    meta: Mapping[str, Any]
    # {name, draft, target, quick, threads} + asdict(gate.GateSettings)
    config: Mapping[str, Any]
    models: Mapping[str, Model | None]  # {"draft": MODEL, "target": MODEL}
    sampled: SampledLeg
    greedy: GreedyLeg
    passed: bool  # sampled.passed and greedy.passed
    src: str = field(default="", metadata=NOT_IN_FILE)
    path: Path | None = field(default=None, metadata=NOT_IN_FILE)

    @property
    def name(self) -> str:
        return str(self.config.get("name") or "?")

    @property
    def quick(self) -> bool:
        return bool(self.config.get("quick"))

    @property
    def draft(self) -> Model | None:
        return self.models.get("draft")

    @property
    def target(self) -> Model | None:
        return self.models.get("target")

    @classmethod
    def from_json(cls, d: dict[str, Any], src: str = "", path: Path | None = None) -> GateArtifact:
        return cls(
            meta=d.get("meta") or {},
            config=_dict(d, "config", src),
            models=_models(d, src),
            sampled=SampledLeg.from_json(d["sampled"], src),
            greedy=GreedyLeg.from_json(d["greedy"], src),
            passed=bool(d["passed"]),
            src=src,
            path=path,
        )


ARTIFACTS: dict[str, Any] = {
    a.SCHEMA: a for a in (BenchArtifact, SweepArtifact, MicrobenchArtifact, GateArtifact)
}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
    """Validate a parsed JSON artifact and read it into its dataclass."""
    return ARTIFACTS[validate(data)].from_json(data, src, path)
