"""Figures and REPORT.md, regenerated from the harness's JSON artifacts and nothing else.

Data flows one way: `scan(DIR)` reads every `*.json` under DIR, checks it with
`schema.validate`, and parses it into a small frozen view (`Bench`, `Sweep`, `Micro`, `Gate`) that
holds exactly the fields a figure or table reads; `write_figures` and `render_report` only see
those views. Every view keeps `src`, the artifact's path relative to DIR, so each plotted or
tabulated number can name the file it came from.

Files under DIR fall into four groups (the CLI's error contract):
    artifact    "schema": "specdec.<kind>/<n>" that validates and has the fields we read: used
    empty       a valid bench artifact interrupted before its first recorded prompt: noted
    skipped     JSON that is not a specdec artifact (no "schema": "specdec.*"): noted, exit 0
    malformed   unreadable JSON, an unknown specdec schema version, or an artifact missing a field
                we read: `warning: malformed artifact FILE: reason` on stderr, everything else is
                still drawn and written, and the command exits with 1 so a CI step notices.
                Never a traceback.
A figure or report section whose inputs are absent is skipped with a note ("No artifact" in the
report), never drawn empty.

Bench artifacts that a sweep summary lists in `points[].artifact` are that sweep's per-K members:
they feed the sweep tables (their std and positional acceptance), not the main results, which
hold the stand-alone bench runs only (as in the paper, Table 3 vs Table 4).

Names follow the paper and `schema.py`: K is the speculation length, v(b) the cost of a b-token
verify pass in single-token target steps, c the draft-step / target-step latency ratio.
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.study import artifacts as schema

PHASES = ("draft", "verify", "sampling", "other")  # the latency split, in stacking order

_DPI = 120
_FOOTNOTE_CHARS = 160  # footnote wraps at this width
_FOOTNOTE_LINE_IN = 0.13  # height of one 7-pt footnote line, inches
_TOP_BINS = 200  # the paper's Figure 2 overlays the top-200 tokens by combined count
_TOP_LABELLED = 15  # bins whose token labels are readable in the right-hand panel
_LABEL_CHARS = 14  # token labels are truncated to this many characters
_POOLED_WORDS = ("pool", "other", "rest")  # a pooled bin's label, for bins without token_id
_MB_PER_GB = 1024  # peak_*_mb are MiB (ru_maxrss / 1024); GB in the tables means GiB
_COLORS = {"baseline": "#8c8c8c", "speculative": "#1f77b4", "hf_assisted": "#ff7f0e"}
_PHASE_COLORS = {"draft": "#9ecae1", "verify": "#3182bd", "sampling": "#e6550d", "other": "#d9d9d9"}
_SIDE_NAMES = {
    "baseline": "target-only",
    "speculative": "speculative",
    "hf_assisted": "HF assisted",
}


class ArtifactError(ValueError):
    """An artifact that passed `schema.validate` lacks a field that a figure or table reads."""


# ------------------------------------------------------------------------------ field access
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


def _nums(d: Any, path: str, src: str) -> tuple[float, ...]:
    v = _get(d, path, src)
    if not isinstance(v, list) or any(
        isinstance(x, bool) or not isinstance(x, (int, float)) for x in v
    ):
        raise ArtifactError(f"{src}: field {path!r} must be a list of numbers")
    return tuple(float(x) for x in v)


def _str(d: Any, path: str, src: str, default: str = "?") -> str:
    v = _get(d, path, src, optional=True)
    return default if v is None else str(v)


# ------------------------------------------------------------------------------ views
@dataclass(frozen=True)
class Model:
    spec: str | None  # BACKEND:NAME_OR_PATH as given on the command line
    name: str
    backend: str
    device: str

    @property
    def short(self) -> str:
        return f"{self.name} ({self.backend}, {self.device})"


def _model(d: Any, path: str, src: str) -> Model | None:
    m = _get(d, path, src, optional=True)
    if m is None:
        return None
    if not isinstance(m, dict):
        raise ArtifactError(f"{src}: field {path!r} must be a MODEL object or null")
    return Model(
        spec=m.get("spec"),
        name=str(m.get("name") or m.get("spec") or "?"),
        backend=str(m.get("backend", "?")),
        device=str(m.get("device", "?")),
    )


@dataclass(frozen=True)
class Agg:
    """One method of a bench run (schema AGG). bench.py writes null where a method has no such
    measurement (HF-assisted has no TTFT, positions or phase timers; no rows means no means)."""

    n: int
    tok_s_mean: float | None
    tok_s_std: float | None
    ttft_s_mean: float | None
    acceptance_rate: float | None
    positional: tuple[float, ...]  # [K] acceptance at draft position 1..K; () when none
    tokens_per_round: float | None
    ms_per_token: dict[str, float] | None  # PHASES -> ms per generated token


def _agg(d: Any, path: str, src: str) -> Agg:
    ms = _get(d, f"{path}.ms_per_token", src, optional=True)
    pos = _get(d, f"{path}.positional_acceptance", src, optional=True)
    return Agg(
        n=int(_num(d, f"{path}.n", src, optional=True) or 0),
        tok_s_mean=_num(d, f"{path}.tok_s_mean", src, optional=True),
        tok_s_std=_num(d, f"{path}.tok_s_std", src, optional=True),
        ttft_s_mean=_num(d, f"{path}.ttft_s_mean", src, optional=True),
        acceptance_rate=_num(d, f"{path}.acceptance_rate", src, optional=True),
        positional=() if pos is None else _nums(d, f"{path}.positional_acceptance", src),
        tokens_per_round=_num(d, f"{path}.tokens_per_round", src, optional=True),
        ms_per_token=(
            None if ms is None else {p: _num(d, f"{path}.ms_per_token.{p}", src) for p in PHASES}
        ),  # type: ignore[misc]
    )


@dataclass(frozen=True)
class Variant:
    """One of a bench run's extra speculative methods (`aggregates.variants[name]`)."""

    name: str  # bench.variant_name: "DRAFTER-kK", e.g. "lookup-kauto"
    agg: Agg
    speedup: float | None  # its tok_s_mean / the same run's baseline tok_s_mean
    decode_speedup: float | None = None  # prompt prefills left out; None in older artifacts

    @property
    def method(self) -> str:
        """'lookup K=auto' for 'lookup-kauto'."""
        drafter, sep, k = self.name.rpartition("-k")
        return f"{drafter} K={k}" if sep and drafter else self.name


@dataclass(frozen=True)
class Bench:
    """A `specdec bench` run with at least one recorded prompt."""

    src: str
    path: Path
    name: str  # config.name
    k: int | str
    temperature: float | None
    max_new_tokens: int | None
    draft: Model | None
    target: Model | None
    draft_spec: str  # config.draft / config.target: what sweeps and microbenches are matched on
    target_spec: str
    complete: bool
    baseline: Agg
    speculative: Agg
    hf_assisted: Agg | None
    speedup: float  # spec tok_s_mean / baseline tok_s_mean
    speedup_pooled: float | None
    speedup_hf_assisted: float | None  # HF-assisted tok_s_mean / baseline tok_s_mean
    peak_rss_mb: float | None
    peak_vram_mb: float | None
    label: str = ""  # unique among the plotted benches (set by `scan`)
    drafter: str = "model"  # config.drafter: the speculative method's drafter
    # aggregates.variants: more speculative methods measured in the same run, in run order
    variants: tuple[Variant, ...] = ()
    decode_speedup: float | None = None  # prompt prefills left out (bench.py); None when older
    # aggregates.by_category: {category: {method: {n, tok_s_mean, speedup}}}, as written
    by_category: dict = field(default_factory=dict)

    @property
    def method(self) -> str:
        """The speculative method, 'model K=4' style."""
        return f"{self.drafter} K={self.k}"

    @property
    def n_prompts(self) -> int:
        return self.speculative.n


class NoRows(Exception):  # a state, not a failure: the artifact is valid, just empty
    """A bench artifact interrupted before its first recorded prompt: nothing to plot."""


def _bench(d: dict, src: str, path: Path) -> Bench:
    base, spec = _agg(d, "aggregates.baseline", src), _agg(d, "aggregates.speculative", src)
    if not d["rows"] or base.tok_s_mean is None or spec.tok_s_mean is None:
        raise NoRows(f"{src}: no recorded prompts (interrupted during warm-up?)")
    hf = _get(d, "aggregates.hf_assisted", src, optional=True)
    hf_agg = None if hf is None else _agg(d, "aggregates.hf_assisted", src)
    hf_speedup = _num(d, "aggregates.speedup_hf_assisted", src, optional=True)
    if hf_speedup is None and hf_agg is not None and hf_agg.tok_s_mean and base.tok_s_mean:
        hf_speedup = hf_agg.tok_s_mean / base.tok_s_mean  # older artifacts lack the field
    return Bench(
        src=src,
        path=path,
        name=_str(d, "config.name", src),
        k=_k_of(d, src),
        temperature=_num(d, "config.temperature", src, optional=True),
        max_new_tokens=_opt_int(_num(d, "config.max_new_tokens", src, optional=True)),
        draft=_model(d, "models.draft", src),
        target=_model(d, "models.target", src),
        draft_spec=_str(d, "config.draft", src),
        target_spec=_str(d, "config.target", src),
        complete=bool(d["complete"]),
        baseline=base,
        speculative=spec,
        hf_assisted=hf_agg,
        speedup=_num(d, "aggregates.speedup", src),  # type: ignore[arg-type]
        speedup_pooled=_num(d, "aggregates.speedup_pooled", src, optional=True),
        speedup_hf_assisted=hf_speedup,
        peak_rss_mb=_num(d, "aggregates.peak_rss_mb", src, optional=True),
        peak_vram_mb=_num(d, "aggregates.peak_vram_mb", src, optional=True),
        drafter=_str(d, "config.drafter", src, default="model"),
        variants=_variants(d, src, base),
        decode_speedup=_num(d, "aggregates.decode_speedup", src, optional=True),
        by_category=dict(_get(d, "aggregates.by_category", src, optional=True) or {}),
    )


def _variants(d: dict, src: str, base: Agg) -> tuple[Variant, ...]:
    """aggregates.variants (absent in older artifacts), each with its speedup over the baseline
    (recomputed from the means when the field is missing)."""
    vs = _get(d, "aggregates.variants", src, optional=True)
    if vs is None:
        return ()
    if not isinstance(vs, dict):
        raise ArtifactError(f"{src}: field 'aggregates.variants' must be an object")
    out = []
    for name in vs:
        path = f"aggregates.variants.{name}"
        agg = _agg(d, path, src)
        if agg.tok_s_mean is None:
            continue
        sp = _num(d, f"{path}.speedup", src, optional=True)
        if sp is None and base.tok_s_mean:
            sp = agg.tok_s_mean / base.tok_s_mean
        dsp = _num(d, f"{path}.decode_speedup", src, optional=True)
        out.append(Variant(str(name), agg, sp, dsp))
    return tuple(out)


def _opt_int(x: float | None) -> int | None:
    return None if x is None else int(x)


@dataclass(frozen=True)
class SweepPoint:
    k: int
    artifact: str | None  # the per-K bench artifact, as the summary names it
    baseline_tok_s: float
    baseline_tok_s_std: float | None
    speculative_tok_s: float
    speculative_tok_s_std: float | None
    speedup: float
    acceptance_rate: float | None
    tokens_per_round: float | None
    positional: tuple[float, ...]
    member: Bench | None = None  # that artifact, when it is under DIR


@dataclass(frozen=True)
class Sweep:
    src: str
    path: Path
    name: str
    draft_spec: str
    target_spec: str
    temperature: float | None
    max_new_tokens: int | None
    recorded_prompts: int | None  # config.n_prompts - config.warmup
    complete: bool
    points: tuple[SweepPoint, ...]  # sorted by k

    @property
    def device(self) -> str | None:
        devs = {p.member.target.device for p in self.points if p.member and p.member.target}
        return devs.pop() if len(devs) == 1 else None


def _sweep(d: dict, src: str, path: Path) -> Sweep:
    points = []
    for i, pt in enumerate(d["points"]):
        at = f"{src}: points.{i}"
        if _num(pt, "speedup", at, optional=True) is None:
            continue  # a K whose run recorded no prompt has nothing to show
        points.append(
            SweepPoint(
                k=int(_num(pt, "k", at)),  # type: ignore[arg-type]
                artifact=pt.get("artifact"),
                baseline_tok_s=_num(pt, "baseline_tok_s", at),  # type: ignore[arg-type]
                baseline_tok_s_std=_num(pt, "baseline_tok_s_std", at, optional=True),
                speculative_tok_s=_num(pt, "speculative_tok_s", at),  # type: ignore[arg-type]
                speculative_tok_s_std=_num(pt, "speculative_tok_s_std", at, optional=True),
                speedup=_num(pt, "speedup", at),  # type: ignore[arg-type]
                acceptance_rate=_num(pt, "acceptance_rate", at, optional=True),
                tokens_per_round=_num(pt, "tokens_per_round", at, optional=True),
                positional=(
                    ()
                    if pt.get("positional_acceptance") is None
                    else _nums(pt, "positional_acceptance", at)
                ),
            )
        )
    n = _num(d, "config.n_prompts", src, optional=True)
    warm = _num(d, "config.warmup", src, optional=True) or 0
    return Sweep(
        src=src,
        path=path,
        name=_str(d, "config.name", src),
        draft_spec=_str(d, "config.draft", src),
        target_spec=_str(d, "config.target", src),
        temperature=_num(d, "config.temperature", src, optional=True),
        max_new_tokens=_opt_int(_num(d, "config.max_new_tokens", src, optional=True)),
        recorded_prompts=None if n is None else int(n - warm),
        complete=bool(d.get("complete", True)),
        points=tuple(sorted(points, key=lambda p: p.k)),
    )


@dataclass(frozen=True)
class Prediction:
    k: int
    expected_tokens_per_round: float | None  # null without an acceptance profile
    cost_in_target_steps: float  # v(k+1) + k c: also the break-even tokens per round
    predicted_speedup: float | None


@dataclass(frozen=True)
class Micro:
    src: str
    target: Model | None
    draft: Model | None
    prefix_tokens: int | None
    repeats: int | None
    verify: tuple[tuple[int, float, float], ...]  # (b, median_ms, v(b) = ratio), sorted by b
    target_step_ms: float
    draft_step_ms: float | None
    c: float | None  # draft step / target step; null without a draft
    prediction_c: float | None  # the c the prediction used (0 for a model-free drafter)
    acceptance_source: str | None
    prediction: tuple[Prediction, ...]
    best_k: int | None
    # microbench --check: [{source, k, drafter, temperature, predicted_speedup,
    # measured_decode_speedup, measured_speedup, relative_error}] as written (schema.py)
    checks: tuple[dict, ...] = ()

    @property
    def label(self) -> str:
        t = self.target.short if self.target else "?"
        return t if self.draft is None else f"{self.draft.name} → {t}"

    @property
    def predicts(self) -> bool:
        return any(p.predicted_speedup is not None for p in self.prediction)


def _micro(d: dict, src: str, path: Path) -> Micro:
    del path
    verify = []
    for i, pt in enumerate(d["verify"]):
        at = f"{src}: verify.{i}"
        verify.append((int(_num(pt, "b", at)), _num(pt, "median_ms", at), _num(pt, "ratio", at)))  # type: ignore[arg-type]
    preds = []
    for i, pt in enumerate(d["prediction"]):
        at = f"{src}: prediction.{i}"
        preds.append(
            Prediction(
                k=int(_num(pt, "k", at)),  # type: ignore[arg-type]
                expected_tokens_per_round=_num(pt, "expected_tokens_per_round", at, optional=True),
                cost_in_target_steps=_num(pt, "cost_in_target_steps", at),  # type: ignore[arg-type]
                predicted_speedup=_num(pt, "predicted_speedup", at, optional=True),
            )
        )
    acc = d.get("acceptance")
    return Micro(
        src=src,
        target=_model(d, "models.target", src),
        draft=_model(d, "models.draft", src),
        prefix_tokens=_opt_int(_num(d, "prefix_tokens", src, optional=True)),
        repeats=_opt_int(_num(d, "repeats", src, optional=True)),
        verify=tuple(sorted(verify)),  # type: ignore[arg-type]
        target_step_ms=float(d["target_step_ms"]),
        draft_step_ms=_num(d, "draft_step_ms", src, optional=True),
        c=_num(d, "c", src, optional=True),
        prediction_c=_num(d, "prediction_c", src, optional=True),
        acceptance_source=str(acc.get("source")) if isinstance(acc, dict) else None,
        prediction=tuple(sorted(preds, key=lambda p: p.k)),
        best_k=_opt_int(_num(d, "best_k", src, optional=True)),
        checks=tuple(c for c in d.get("checks") or () if isinstance(c, dict)),
    )


@dataclass(frozen=True)
class GreedyRow:
    prompt_id: Any
    match: bool
    n_baseline: int | None
    n_speculative: int | None
    first_mismatch: int | None


@dataclass(frozen=True)
class Gate:
    src: str
    name: str
    quick: bool
    draft: Model | None
    target: Model | None
    n_prompts: int | None
    max_new_tokens: int | None
    temperature: float | None
    tokens_speculative: int | None
    tokens_baseline: int | None
    chi2: float
    dof: int
    p_value: float  # the chi-square distribution's p-value (assumes independent tokens)
    p_perm: float | None  # the permutation p-value (gate.py: the verdict when present)
    p_min: float | None  # the sampled leg passes at p > p_min
    min_expected: float | None
    sampled_passed: bool
    smoothed_kl: float | None
    acceptance_rate: float | None
    bins: tuple[tuple[str, float, float], ...]  # (label, speculative, baseline), pooled one apart
    pooled: tuple[str, float, float] | None
    greedy_rows: tuple[GreedyRow, ...]
    greedy_passed: bool | None
    greedy_max_new_tokens: int | None
    passed: bool

    @property
    def n_bins(self) -> int:
        return len(self.bins) + (self.pooled is not None)


def _is_pooled(b: dict) -> bool:
    """gate.py marks the pooled bin with token_id null; older artifacts only by its label."""
    if "token_id" in b:
        return b["token_id"] is None
    return any(w in str(b.get("label", "")).lower() for w in _POOLED_WORDS)


def _gate(d: dict, src: str, path: Path) -> Gate:
    del path
    bins, pooled = [], None
    for i, b in enumerate(_get(d, "sampled.bins", src, optional=True) or []):
        at = f"{src}: sampled.bins.{i}"
        row = (_bin_label(b["label"]), _num(b, "speculative", at), _num(b, "baseline", at))
        if pooled is None and _is_pooled(b):
            pooled = row
        else:
            bins.append(row)
    greedy = []
    for i, r in enumerate(d["greedy"]["rows"]):
        at = f"{src}: greedy.rows.{i}"
        greedy.append(
            GreedyRow(
                prompt_id=r.get("prompt_id"),
                match=bool(_get(r, "match", at)),
                n_baseline=_opt_int(_num(r, "n_baseline", at, optional=True)),
                n_speculative=_opt_int(_num(r, "n_speculative", at, optional=True)),
                first_mismatch=_opt_int(_num(r, "first_mismatch", at, optional=True)),
            )
        )
    gp = _get(d, "greedy.passed", src, optional=True)
    return Gate(
        src=src,
        name=_str(d, "config.name", src),
        quick=bool(_get(d, "config.quick", src, optional=True)),
        draft=_model(d, "models.draft", src),
        target=_model(d, "models.target", src),
        n_prompts=_opt_int(_num(d, "sampled.n_prompts", src, optional=True)),
        max_new_tokens=_opt_int(_num(d, "sampled.max_new_tokens", src, optional=True)),
        temperature=_num(d, "sampled.temperature", src, optional=True),
        tokens_speculative=_opt_int(_num(d, "sampled.tokens_speculative", src, optional=True)),
        tokens_baseline=_opt_int(_num(d, "sampled.tokens_baseline", src, optional=True)),
        chi2=_num(d, "sampled.chi2", src),  # type: ignore[arg-type]
        dof=int(_num(d, "sampled.dof", src)),  # type: ignore[arg-type]
        p_value=_num(d, "sampled.p_value", src),  # type: ignore[arg-type]
        p_perm=_num(d, "sampled.p_value_permutation", src, optional=True),
        p_min=_num(d, "sampled.p_min", src, optional=True),
        min_expected=_num(d, "sampled.min_expected", src, optional=True),
        sampled_passed=bool(d["sampled"]["passed"]),
        smoothed_kl=_num(d, "sampled.smoothed_kl", src, optional=True),
        acceptance_rate=_num(d, "sampled.acceptance_rate", src, optional=True),
        bins=tuple(bins),
        pooled=pooled,
        greedy_rows=tuple(greedy),
        greedy_passed=None if gp is None else bool(gp),
        greedy_max_new_tokens=_opt_int(_num(d, "greedy.max_new_tokens", src, optional=True)),
        passed=bool(d["passed"]),
    )


def _bin_label(label: Any) -> str:
    """gate.py stores a token's text as its repr ("' the'"); show the text itself."""
    s = str(label)
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        try:
            value = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return s
        return value if isinstance(value, str) else s
    return s


_PARSERS: dict[str, Callable[[dict, str, Path], Any]] = {
    "specdec.bench/1": _bench,
    "specdec.sweep/1": _sweep,
    "specdec.microbench/1": _micro,
    "specdec.gate/1": _gate,
}


# ------------------------------------------------------------------------------ scan
@dataclass
class Study:
    """Everything found under one DIR, parsed; lists are sorted by `src`."""

    root: Path
    benches: list[Bench] = field(default_factory=list)  # stand-alone runs (Table 3)
    sweeps: list[Sweep] = field(default_factory=list)
    micros: list[Micro] = field(default_factory=list)
    gates: list[Gate] = field(default_factory=list)
    metas: dict[str, dict] = field(default_factory=dict)  # src -> the artifact's meta block
    schemas: dict[str, str] = field(default_factory=dict)  # src -> schema id
    skipped: list[str] = field(default_factory=list)  # "FILE: why" (not specdec artifacts)
    malformed: list[str] = field(default_factory=list)  # "FILE: why" (specdec, but unusable)
    no_rows: list[str] = field(default_factory=list)  # "FILE: why" (valid bench, nothing recorded)


def scan(root: Path) -> Study:
    """Read, validate and parse every *.json under `root` (recursively)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    study = Study(root=root)
    all_benches: list[Bench] = []
    for path in sorted(root.rglob("*.json")):
        src = path.relative_to(root).as_posix()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            study.malformed.append(f"{src}: not readable JSON ({e})")
            continue
        sid = data.get("schema") if isinstance(data, dict) else None
        if not (isinstance(sid, str) and sid.startswith("specdec.")):
            study.skipped.append(f"{src}: not a specdec artifact (no 'schema': 'specdec.*')")
            continue
        try:
            schema.validate(data)
            view = _PARSERS[sid](data, src, path)
        except (schema.SchemaError, ArtifactError) as e:
            msg = str(e)
            study.malformed.append(msg if msg.startswith(src) else f"{src}: {msg}")
            continue
        except NoRows as e:
            view = None
            study.no_rows.append(str(e))
        except (KeyError, TypeError, AttributeError) as e:  # a shape no validator anticipated
            study.malformed.append(f"{src}: unexpected structure ({type(e).__name__}: {e})")
            continue
        study.metas[src] = data["meta"]
        study.schemas[src] = sid
        if view is None:
            pass
        elif isinstance(view, Bench):
            all_benches.append(view)
        elif isinstance(view, Sweep):
            study.sweeps.append(view)
        elif isinstance(view, Micro):
            study.micros.append(view)
        else:
            study.gates.append(view)
    members: set[str] = set()
    study.sweeps = [_attach_members(s, all_benches, members) for s in study.sweeps]
    study.benches = _labelled([b for b in all_benches if b.src not in members])
    return study


def _attach_members(sweep: Sweep, benches: list[Bench], members: set[str]) -> Sweep:
    """Find each point's per-K artifact among the scanned benches.

    bench.py names it relative to the summary (both go to the same --out); an absolute path also
    works. No match by bare file name elsewhere: a main run in the parent directory often has the
    same name (bench_<config>_k4_t0.8.json) and must stay in the main results.
    """
    by_path = {b.path.resolve(): b for b in benches}
    points = []
    for pt in sweep.points:
        hit = by_path.get((sweep.path.parent / pt.artifact).resolve()) if pt.artifact else None
        if hit is not None and hit.k != pt.k:
            hit = None  # a rerun at another K overwrote it: not this point's run
        if hit is not None:
            members.add(hit.src)
        points.append(replace(pt, member=hit))
    return replace(sweep, points=tuple(points))


def _labelled(benches: list[Bench]) -> list[Bench]:
    """Label each bench by its config name; when names clash, add the first setting that tells
    the clashing runs apart (device, drafter, K, T, tokens); when no one setting does, every
    setting that differs among them (e.g. 'all_gguf (composite, K=auto, T=0)'); when even those
    clash, the file name."""
    settings: tuple[tuple[str, Callable[[Bench], Any]], ...] = (
        ("{}", lambda b: b.target.device if b.target else None),
        ("{}", lambda b: b.drafter),
        ("K={}", lambda b: b.k),
        ("T={:g}", lambda b: b.temperature),
        ("{} tokens", lambda b: b.max_new_tokens),
    )
    out = []
    for b in benches:
        clash = [o for o in benches if o.name == b.name]
        label = b.name
        if len(clash) > 1:
            label = f"{b.name} ({Path(b.src).stem})"
            differing = []
            for fmt, get in settings:
                values = [get(o) for o in clash]
                if None in values or len(set(values)) == 1:
                    continue
                if len(set(values)) == len(values):
                    label = f"{b.name} ({fmt.format(get(b))})"
                    break
                differing.append((fmt, get))
            else:
                combos = [tuple(get(o) for _, get in differing) for o in clash]
                if differing and len(set(combos)) == len(combos):
                    parts = ", ".join(fmt.format(get(b)) for fmt, get in differing)
                    label = f"{b.name} ({parts})"
        out.append(replace(b, label=label))
    return out


def _device_kind(device: str | None) -> str | None:
    return None if device in (None, "?") else device.split(":")[0]  # "cuda:0" -> "cuda"


def _same_pair(draft_spec: str, target_spec: str, device: str | None, micro: Micro) -> bool:
    """A microbench predicts a run that used the same target and draft specs on the same kind of
    device (when both name one). One without a draft predicts for a model-free drafter (c = 0),
    which no bench run here uses, so it matches nothing."""
    if micro.target is None or micro.draft is None:
        return False
    if micro.target.spec != target_spec or micro.draft.spec != draft_spec:
        return False
    a, b = _device_kind(device), _device_kind(micro.target.device)
    return a is None or b is None or a == b


# ------------------------------------------------------------------------------ formatting
def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _pm(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.2f}" if std is None else f"{mean:.2f}±{std:.2f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _f(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _p(v: float) -> str:
    return f"{v:.3g}" if v >= 1e-3 else f"{v:.2e}"


def _gb(mb: float | None) -> str:
    return "—" if mb is None else f"{mb / _MB_PER_GB:.2f}"


def _token(label: str) -> str:
    """A token label on one line: spaces made visible (␣), control characters escaped, cut."""
    t = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in label).replace(" ", "␣")
    return t if len(t) <= _LABEL_CHARS else t[: _LABEL_CHARS - 1] + "…"


def _uniform(values: Iterable[Any]) -> Any:
    vals = set(values)
    return vals.pop() if len(vals) == 1 else None


def _settings(benches: Sequence[Bench]) -> str:
    """'K=4, T=0.8, 128 new tokens, 28 prompts' for the settings all the runs share."""
    parts = []
    for fmt, vals in (
        ("K={}", [b.k for b in benches]),
        ("T={:g}", [b.temperature for b in benches]),
        ("{} new tokens", [b.max_new_tokens for b in benches]),
        ("{} prompts", [b.n_prompts for b in benches]),
    ):
        v = _uniform(vals)
        if v is not None:
            parts.append(fmt.format(v))
    return ", ".join(parts)


def _join(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


# ------------------------------------------------------------------------------ figures
def _pyplot() -> Any:  # matplotlib is imported only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig: Any, path: Path, sources: Iterable[str]) -> Path:
    """Add the sources footnote, lay out, save, close."""
    note = textwrap.fill("source: " + ", ".join(sorted(set(sources))), _FOOTNOTE_CHARS)
    fig.text(0.005, 0.005, note, fontsize=7, color="#555555", va="bottom")
    footnote_in = _FOOTNOTE_LINE_IN * (note.count("\n") + 1) + 0.05
    fig.tight_layout(rect=(0, footnote_in / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=_DPI, metadata={"Software": None})  # no version stamp: stable bytes
    _pyplot().close(fig)
    return path


def _box(ax: Any, text: str, x: float, y: float, ha: str, va: str, size: float = 9) -> None:
    ax.text(
        x,
        y,
        text,
        transform=ax.transAxes,
        fontsize=size,
        ha=ha,
        va=va,
        bbox={"boxstyle": "round", "fc": "white", "ec": "#999999", "alpha": 0.9},
    )


def _p_text(g: Gate) -> str:
    if g.p_perm is None:
        return f"p = {_p(g.p_value)}"
    return f"permutation p = {_p(g.p_perm)} (χ²-table p = {_p(g.p_value)})"


def _gate_lines(g: Gate) -> list[str]:
    rule = f" (threshold p > {g.p_min:g})" if g.p_min is not None else ""
    lines = [
        f"χ² = {g.chi2:.1f}, dof = {g.dof}, {_p_text(g)} "
        f"→ {'pass' if g.sampled_passed else 'FAIL'}{rule}"
    ]
    if g.tokens_speculative is not None and g.tokens_baseline is not None:
        lines.append(f"tokens: {g.tokens_speculative} spec / {g.tokens_baseline} target-only")
    if g.pooled is not None:
        lines.append(
            f"pooled bin {g.pooled[0]}: {g.pooled[1]:.0f} / {g.pooled[2]:.0f} (tested, not plotted)"
        )
    if g.smoothed_kl is not None:
        lines.append(f"smoothed KL = {g.smoothed_kl:.3f} (reference only)")
    if g.greedy_rows:
        n_ok = sum(r.match for r in g.greedy_rows)
        ok = "pass" if g.greedy_passed else "FAIL"
        lines.append(f"greedy leg: {n_ok}/{len(g.greedy_rows)} prompts identical → {ok}")
    return lines


def fig_token_frequency(study: Study, path: Path) -> Path | None:
    """Figure 2: per gate, counts of the top bins, speculative vs target-only, with the test."""
    gates = [g for g in study.gates if g.bins]
    if not gates:
        return None
    plt = _pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(
        len(gates),
        2,
        figsize=(13, 4.8 * len(gates)),
        squeeze=False,
        gridspec_kw={"width_ratios": (2.2, 1)},
    )
    for (ax, bx), g in zip(axes, gates, strict=True):
        bins = sorted(g.bins, key=lambda b: (-(b[1] + b[2]), b[0]))[:_TOP_BINS]
        ranks = range(1, len(bins) + 1)
        for i, side in ((1, "speculative"), (2, "baseline")):
            ax.plot(
                ranks,
                [b[i] for b in bins],
                marker="o",
                ms=2.5,
                lw=1,
                alpha=0.85,
                color=_COLORS[side],
                label=_SIDE_NAMES[side],
            )
        ax.set_yscale("log")
        # Plain numbers ("4", "10", "200"), not 4×10⁰; minor ticks labelled only on short ranges.
        ax.yaxis.set_major_formatter(ticker.LogFormatter())
        ax.yaxis.set_minor_formatter(
            ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5))
        )
        ax.set_xlabel(
            f"token rank by combined count ({len(bins)} of {len(g.bins)} token bins shown)"
        )
        ax.set_ylabel("count (log)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left")  # counts fall with rank, so the lower left stays empty
        _box(ax, "\n".join(_gate_lines(g)), 0.985, 0.97, "right", "top")
        pair = f"{g.draft.name} → {g.target.short}" if g.draft and g.target else ""
        setup = _join(
            f"{g.n_prompts} prompts × {g.max_new_tokens} tokens" if g.n_prompts else "",
            f"T={g.temperature:g}" if g.temperature is not None else "",
            "--quick" if g.quick else "",
        )
        ax.set_title(f"{g.name}: {pair}\n{setup} ({g.src})", fontsize=10)

        top = bins[:_TOP_LABELLED][::-1]  # barh draws bottom-up: most frequent on top
        y = range(len(top))
        h = 0.4
        bx.barh([v + h / 2 for v in y], [b[1] for b in top], h, color=_COLORS["speculative"])
        bx.barh([v - h / 2 for v in y], [b[2] for b in top], h, color=_COLORS["baseline"])
        bx.set_yticks(list(y), [_token(b[0]) for b in top], fontsize=8, family="monospace")
        bx.set_xlabel("count")
        bx.set_title(f"top {len(top)} tokens (␣ = space)", fontsize=10)
        bx.grid(True, axis="x", alpha=0.3)
    fig.suptitle("Token-frequency overlay: speculative vs target-only sampling (level-3 gate)")
    return _finish(fig, path, (g.src for g in gates))


def _bench_tick(b: Bench) -> str:
    """'all_gguf' over 'llamacpp→llamacpp · cpu'; the model names are in the report. A label
    with settings ('all_gguf (composite, K=auto, T=0)') puts them on a line of their own."""
    name, sep, rest = b.label.partition(" (")
    lines = [name, f"({rest}"] if sep else [b.label]
    if b.draft and b.target:
        lines.append(f"{b.draft.backend}→{b.target.backend} · {b.target.device}")
    if not b.complete:
        lines.append("(incomplete)")
    return "\n".join(textwrap.fill(line, _TICK_CHARS) for line in lines)


_TICK_CHARS = 30  # a config's tick label wraps at this width
_VARIANT_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#d62728")


@dataclass(frozen=True)
class _Bar:
    """One method's bar in a config's group: tok/s mean ± std, speedup over the same run's
    baseline (None for the baseline itself)."""

    key: str  # legend entry / colour: a _COLORS side or a variant name
    method: str  # the text in the bar, e.g. "target-only", "lookup K=auto"
    mean: float
    std: float
    speedup: float | None


def _bars(b: Bench) -> list[_Bar]:
    """The methods measured in one bench run, in the order they are drawn."""
    out = []
    for side, sp in (
        ("baseline", None),
        ("speculative", b.speedup),
        ("hf_assisted", b.speedup_hf_assisted),
    ):
        ms = _tok_s(b, side)
        if ms is None:
            continue
        method = {"baseline": "target-only", "speculative": b.method}.get(side, "HF assisted")
        out.append(_Bar(side, method, ms[0], ms[1], sp))
    for v in b.variants:
        if v.agg.tok_s_mean is not None:
            out.append(_Bar(v.name, v.method, v.agg.tok_s_mean, v.agg.tok_s_std or 0.0, v.speedup))
    return out


def _bar_colors(groups: Sequence[Sequence[_Bar]]) -> dict[str, str]:
    colors = dict(_COLORS)
    for bars in groups:
        for bar in bars:
            if bar.key not in colors:
                n = len(colors) - len(_COLORS)
                colors[bar.key] = _VARIANT_COLORS[n % len(_VARIANT_COLORS)]
    return colors


def _legend_name(bar: _Bar) -> str:
    if bar.key == "speculative":
        return "speculative (the run's main method)"
    return _SIDE_NAMES.get(bar.key, f"variant {bar.method}")


def fig_throughput(study: Study, path: Path) -> Path | None:
    """Figure 3a: tok/s per config of target-only, the speculative method, HF-assisted and any
    variants measured in the same run (`aggregates.variants`); each bar names its method and is
    labelled with its speedup over the same run's target-only baseline."""
    benches = study.benches
    if not benches:
        return None
    plt = _pyplot()
    groups = [_bars(b) for b in benches]
    colors = _bar_colors(groups)
    width, gap = 0.8, 0.9  # a bar, and the space between two configs' groups
    n_bars = sum(len(g) for g in groups)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.62 * n_bars + 0.9 * len(benches) + 1.5), 5.5))
    top = max(bar.mean + bar.std for g in groups for bar in g)
    labelled: set[str] = set()
    ticks, x = [], 0.0
    for bars in groups:
        xs = [x + j * width for j in range(len(bars))]
        ticks.append(sum(xs) / len(xs))
        for xi, bar in zip(xs, bars, strict=True):
            ax.bar(
                xi,
                bar.mean,
                width * 0.92,
                yerr=bar.std,
                capsize=3,
                color=colors[bar.key],
                label=None if bar.key in labelled else _legend_name(bar),
            )
            labelled.add(bar.key)
            ax.text(  # the method, inside the bar's foot
                xi,
                0.012 * top,
                bar.method,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7.5,
                color="white" if bar.key != "baseline" else "black",
                clip_on=True,
            )
            if bar.speedup is not None:
                ax.text(
                    xi,
                    bar.mean + bar.std + 0.015 * top,
                    f"{bar.speedup:.2f}×",
                    ha="center",
                    va="bottom",
                    fontsize=8.5 if len(bars) > 3 else 9,
                    fontweight="bold",
                )
        x = xs[-1] + width + gap
    ax.set_xticks(ticks, [_bench_tick(b) for b in benches], fontsize=8.5)
    ax.set_xlim(-width, x - gap)
    ax.set_ylabel("tokens / s (mean ± std over prompts)")
    ax.set_ylim(0, top * 1.15)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8.5)
    settings = _settings(benches)
    ax.set_title(
        "Throughput per method; label = speedup over the same run's target-only"
        + (f"\n({settings})" if settings else ""),
        fontsize=11,
    )
    return _finish(fig, path, (b.src for b in benches))


def _tok_s(b: Bench, side: str) -> tuple[float, float] | None:
    agg = getattr(b, side)
    if agg is None or agg.tok_s_mean is None:
        return None
    return agg.tok_s_mean, agg.tok_s_std or 0.0


def _sweep_label(s: Sweep, sweeps: Sequence[Sweep]) -> str:
    """The config name, with the device (or the file) when two sweeps share a name."""
    if sum(o.name == s.name for o in sweeps) == 1:
        return s.name
    if s.device and sum(o.name == s.name and o.device == s.device for o in sweeps) == 1:
        return f"{s.name} ({s.device})"
    return f"{s.name} ({s.src})"


def fig_speedup_vs_k(study: Study, path: Path) -> Path | None:
    """Figure 3b: measured speedup vs K per sweep; matching microbench predictions dashed."""
    sweeps = [s for s in study.sweeps if s.points]
    if not sweeps:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    sources, ks, top = [], set(), 1.0
    for i, s in enumerate(sweeps):
        color, label = f"C{i % 10}", _sweep_label(s, sweeps)
        ks.update(p.k for p in s.points)
        top = max(top, *(p.speedup for p in s.points))
        ax.plot(
            [p.k for p in s.points],
            [p.speedup for p in s.points],
            marker="o",
            color=color,
            label=f"{label} measured",
        )
        best = max(s.points, key=lambda p: p.speedup)
        ax.annotate(
            f"best {best.speedup:.2f}× at K={best.k}",
            (best.k, best.speedup),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8.5,
            color=color,
            fontweight="bold",
        )
        sources.append(s.src)
        for m in study.micros:
            preds = [p for p in m.prediction if p.predicted_speedup is not None]
            if preds and _same_pair(s.draft_spec, s.target_spec, s.device, m):
                ax.plot(
                    [p.k for p in preds],
                    [p.predicted_speedup for p in preds],
                    ls="--",
                    marker="x",
                    color=color,
                    label=f"{label} predicted ({m.src})",
                )
                ks.update(p.k for p in preds)
                top = max(top, *(p.predicted_speedup for p in preds))  # type: ignore[type-var]
                sources.append(m.src)
    ax.axhline(1.0, color="black", lw=1, ls=":", label="break-even (1.0×)")
    ax.set_xticks(sorted(ks))
    ax.set_xlim(min(ks) - 0.5, max(ks) + 0.5)  # room for the best-K label at either end
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("speedup over target-only (×)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Speedup vs K, each K normalised by its own interleaved baseline", fontsize=11)
    return _finish(fig, path, sources)


def fig_acceptance_by_position(study: Study, path: Path) -> Path | None:
    """Figure 4: speculative acceptance rate at draft position 1..K, per config."""
    benches = [b for b in study.benches if b.speculative.positional]
    if not benches:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, b in enumerate(benches):
        pos = b.speculative.positional
        ax.plot(
            range(1, len(pos) + 1),
            [100 * a for a in pos],
            marker="o",
            color=f"C{i % 10}",
            label=f"{b.label} (pooled {_pct(b.speculative.acceptance_rate)})",
        )
    ax.set_xticks(range(1, max(len(b.speculative.positional) for b in benches) + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance rate at position i (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    settings = _settings(benches)
    ax.set_title(
        "Acceptance by draft position" + (f" ({settings})" if settings else ""), fontsize=11
    )
    return _finish(fig, path, (b.src for b in benches))


def fig_latency_split(study: Study, path: Path) -> Path | None:
    """Figure 5: stacked ms per generated token, draft/verify/sampling/other, per config."""
    benches = [b for b in study.benches if b.baseline.ms_per_token and b.speculative.ms_per_token]
    if not benches:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 * len(benches) + 2), 5))
    stacks = []  # [(x, [ms per PHASES])]: a config's two bars at x = 2.6 i and 2.6 i + 1
    for i, b in enumerate(benches):
        for j, agg in enumerate((b.baseline, b.speculative)):
            stacks.append((i * 2.6 + j, [agg.ms_per_token[p] for p in PHASES]))  # type: ignore[index]
    for n, phase in enumerate(PHASES):
        ax.bar(
            [x for x, _ in stacks],
            [v[n] for _, v in stacks],
            0.8,
            bottom=[sum(v[:n]) for _, v in stacks],
            color=_PHASE_COLORS[phase],
            edgecolor="white",
            label=phase,
        )
    top = max(sum(v) for _, v in stacks)
    for x, v in stacks:
        ax.text(x, sum(v) + 0.01 * top, f"{sum(v):.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([x for x, _ in stacks], ["target-only", "spec"] * len(benches), fontsize=8)
    for i, b in enumerate(benches):  # the config under its pair of bars
        ax.annotate(
            _bench_tick(b),
            (i * 2.6 + 0.5, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -18),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
        )
    ax.set_ylabel("ms per generated token")
    ax.set_ylim(0, top * 1.12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="phase", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(
        "Per-token latency split, target-only vs speculative (bar label = total ms)", fontsize=11
    )
    return _finish(fig, path, (b.src for b in benches))


def fig_verify_scaling(study: Study, path: Path) -> Path | None:
    """Verify-batch scaling: v(b), the cost of a b-token pass in single-token target steps."""
    micros = [m for m in study.micros if m.verify]
    if not micros:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    bmax = max(v[0] for m in micros for v in m.verify)
    bs = list(range(1, bmax + 1))
    ax.plot(bs, bs, color="#999999", ls=":", label="serial, v(b) = b")
    ax.plot(bs, [1] * len(bs), color="#999999", ls="--", label="ideal parallel, v(b) = 1")
    for i, m in enumerate(micros):
        step = f"target step {m.target_step_ms:.1f} ms"
        if m.draft_step_ms is not None:
            step += f", draft step {m.draft_step_ms:.1f} ms"
        c = f"c = {m.c:.3f}" if m.c is not None else "no draft: c not measured"
        ax.plot(
            [v[0] for v in m.verify],
            [v[2] for v in m.verify],
            marker="o",
            color=f"C{i % 10}",
            label=f"{m.label}\n{step}; {c}",
        )
    ax.set_xticks(bs)
    ax.set_xlabel("b (tokens in one verify pass)")
    ax.set_ylabel("v(b) = median ms(b) / median ms(1)")
    ax.set_ylim(0, max(bmax, *(v[2] for m in micros for v in m.verify)) * 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")  # above the serial line, where no v(b) <= b can be
    ax.set_title("Verify-batch scaling of the target: is verification parallel?", fontsize=11)
    return _finish(fig, path, (m.src for m in micros))


#: file name -> (function, what it needs when skipped)
_FIGURES: dict[str, tuple[Callable[[Study, Path], Path | None], str]] = {
    "token_frequency.png": (fig_token_frequency, "a gate artifact with bins"),
    "throughput.png": (fig_throughput, "a stand-alone bench artifact (outside a sweep)"),
    "speedup_vs_k.png": (fig_speedup_vs_k, "a sweep summary with points"),
    "acceptance_by_position.png": (fig_acceptance_by_position, "a bench with speculative rounds"),
    "latency_split.png": (fig_latency_split, "a bench artifact with ms_per_token"),
    "verify_scaling.png": (fig_verify_scaling, "a microbench artifact"),
}
FIGURES = tuple(_FIGURES)


def write_figures(study: Study, out: Path) -> tuple[list[Path], list[str]]:
    """Draw every figure whose inputs exist into `out`; return (paths written, skip notes)."""
    out.mkdir(parents=True, exist_ok=True)
    written, notes = [], []
    for name, (func, needs) in _FIGURES.items():
        p = func(study, out / name)
        if p is None:
            notes.append(f"{name}: skipped, needs {needs}")
        else:
            written.append(p)
    return written, notes


# ------------------------------------------------------------------------------ report
def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _cite(src: str) -> str:
    return f"`{src}`"


def _figure(name: str, figures: Path, report: Path) -> list[str]:
    if not (figures / name).is_file():
        return []
    rel = Path(os.path.relpath(figures / name, report.parent)).as_posix()
    return [f"![{name}]({rel})", ""]


def _section_machine(s: Study) -> list[str]:
    out = ["## Machine and versions", ""]
    groups: dict[str, list[str]] = {}
    for src, meta in sorted(s.metas.items()):
        key = json.dumps([meta.get("machine"), meta.get("versions")], sort_keys=True)
        groups.setdefault(key, []).append(src)
    for n, (key, srcs) in enumerate(groups.items(), 1):
        machine, versions = (x or {} for x in json.loads(key))
        if len(groups) > 1:
            out += [f"### Machine {n}", ""]
        out += [f"From the `meta` block of {', '.join(map(_cite, srcs))}:", ""]
        for k, label in (
            ("platform", "Platform"),
            ("processor", "Processor"),
            ("cpu_count", "CPU cores"),
            ("ram_gb", "RAM (GB)"),
            ("torch_threads", "Torch threads"),
            ("cuda", "CUDA device"),
        ):
            v = machine.get(k)
            shown = "none" if v is None and k == "cuda" else "not recorded" if v is None else v
            out.append(f"- {label}: {shown}")
        vers = ", ".join(f"{k} {'not recorded' if v is None else v}" for k, v in versions.items())
        out += [f"- Versions: {vers or 'not recorded'}", ""]
    return out


def _section_main(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## Main results (Table 3 shape)", ""]
    if not s.benches:
        return [*out, "No artifact: no stand-alone `specdec bench` run under this directory.", ""]
    benches = sorted(s.benches, key=lambda b: (-b.speedup, b.label))
    hf = any(b.hf_assisted for b in benches)
    vram = any(b.peak_vram_mb is not None for b in benches)
    settings = _settings(benches)
    out += [
        (f"Settings shared by every run: {settings}. " if settings else "")
        + "Throughput is the mean ± std over the recorded prompts of per-prompt tok/s; Speedup "
        "is spec mean / baseline mean (`aggregates.speedup`); Pooled is the ratio of total "
        "tokens / total wall time (`aggregates.speedup_pooled`). Accept. is the pooled "
        "acceptance rate. Peak RSS is a process-wide high-water mark, an upper bound; 1 GB = "
        "1024 MB as recorded."
        + (
            " HF-assisted is transformers' `generate(assistant_model=...)` on the same prompts "
            "and pair (`aggregates.hf_assisted`, `aggregates.speedup_hf_assisted`)."
            if hf
            else ""
        ),
        "",
    ]
    header = [
        "Config",
        "Base tok/s",
        "Spec tok/s",
        "Speedup",
        "Pooled",
        "Accept.",
        "TTFT_b (s)",
        "TTFT_s (s)",
        "Peak RSS (GB)",
    ]
    header += ["Peak VRAM (GB)"] * vram + ["HF-assisted tok/s", "HF-assisted speedup"] * hf
    header += ["K / T / tokens / prompts"] * (not settings) + ["Source"]
    best = benches[0].speedup
    rows = []
    for b in benches:
        sp = _x(b.speedup)
        row = [
            b.label + ("" if b.complete else " (incomplete)"),
            _pm(b.baseline.tok_s_mean, b.baseline.tok_s_std),
            _pm(b.speculative.tok_s_mean, b.speculative.tok_s_std),
            f"**{sp}**" if b.speedup == best and len(benches) > 1 else sp,
            _x(b.speedup_pooled),
            _pct(b.speculative.acceptance_rate),
            _f(b.baseline.ttft_s_mean),
            _f(b.speculative.ttft_s_mean),
            _gb(b.peak_rss_mb),
        ]
        if vram:
            row.append(_gb(b.peak_vram_mb))
        if hf:
            h = b.hf_assisted
            row += (
                ["not run", "—"]
                if h is None
                else [_pm(h.tok_s_mean, h.tok_s_std), _x(b.speedup_hf_assisted)]
            )
        if not settings:
            t = "—" if b.temperature is None else f"{b.temperature:g}"
            row.append(f"{b.k} / {t} / {b.max_new_tokens} / {b.n_prompts}")
        rows.append([*row, _cite(b.src)])
    out += _table(header, rows)
    out += ["", "Models:", ""]
    out += _table(
        ["Config", "Draft", "Target", "Source"],
        [
            [
                b.label,
                b.draft.short if b.draft else b.draft_spec,
                b.target.short if b.target else b.target_spec,
                _cite(b.src),
            ]
            for b in benches
        ],
    )
    for b in benches:
        out += _methods_table(b)
    return [*out, "", *_figure("throughput.png", figures, report)]


def _methods_table(b: Bench) -> list[str]:
    """Every method of one run (main + variants) and its speedup by prompt category."""
    if not b.variants and not b.by_category:
        return []
    out = [
        "",
        f"Methods measured in one run, {b.label} ({_cite(b.src)}): Decode is the "
        "speedup with the prompt prefills (paid once by every method) left out "
        "(`decode_speedup`).",
        "",
    ]
    rows = [
        ["target-only", _pm(b.baseline.tok_s_mean, b.baseline.tok_s_std), "1.00x", "—", "—", "—"]
    ]
    rows.append(
        [
            b.method,
            _pm(b.speculative.tok_s_mean, b.speculative.tok_s_std),
            _x(b.speedup),
            _x(b.decode_speedup),
            _pct(b.speculative.acceptance_rate),
            _f(b.speculative.tokens_per_round, 2),
        ]
    )
    for v in b.variants:
        rows.append(
            [
                v.method,
                _pm(v.agg.tok_s_mean, v.agg.tok_s_std),
                _x(v.speedup),
                _x(v.decode_speedup),
                _pct(v.agg.acceptance_rate),
                _f(v.agg.tokens_per_round, 2),
            ]
        )
    out += _table(["Method", "tok/s", "Speedup", "Decode", "Accept.", "Tokens/round"], rows)
    if b.by_category:
        methods = [m for m in next(iter(b.by_category.values())) if m != "baseline"]
        names = {"speculative": b.method, **{v.name: v.method for v in b.variants}}
        out += [
            "",
            "Speedup by prompt category (vs the same prompts' target-only mean; n "
            "prompts per category):",
            "",
        ]
        crow = []
        for cat, per in sorted(b.by_category.items()):
            n = per.get("baseline", {}).get("n")
            crow.append([f"{cat} ({n})", *(_x(per.get(m, {}).get("speedup")) for m in methods)])
        out += _table(["Category", *(names.get(m, m) for m in methods)], crow)
    return out


def _sweep_cell(mean: float, std: float | None, member_std: float | None) -> str:
    return _pm(mean, std if std is not None else member_std)


def _section_sweeps(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## K-sweeps (Table 4 shape)", ""]
    if not s.sweeps:
        return [*out, "No artifact: no `specdec sweep` summary under this directory.", ""]
    for sw in s.sweeps:
        setup = _join(
            f"{sw.max_new_tokens} new tokens" if sw.max_new_tokens else "",
            f"{sw.recorded_prompts} recorded prompts" if sw.recorded_prompts else "",
            f"T={sw.temperature:g}" if sw.temperature is not None else "",
        )
        out += [f"### {_sweep_label(sw, s.sweeps)}: {sw.draft_spec} → {sw.target_spec}", ""]
        out += [
            f"From {_cite(sw.src)}"
            + (f" ({setup})" if setup else "")
            + ("" if sw.complete else "; **incomplete** (interrupted)")
            + ". Every K reruns its own interleaved target-only baseline.",
            "",
        ]
        if not sw.points:
            out += ["No K finished a recorded prompt.", ""]
            continue
        best = max(p.speedup for p in sw.points)
        rows = []
        for p in sw.points:
            m = p.member
            b = "**" if p.speedup == best and len(sw.points) > 1 else ""
            base = _sweep_cell(
                p.baseline_tok_s, p.baseline_tok_s_std, m.baseline.tok_s_std if m else None
            )
            spec = _sweep_cell(
                p.speculative_tok_s, p.speculative_tok_s_std, m.speculative.tok_s_std if m else None
            )
            where = (
                _cite(m.src) if m else (f"`{p.artifact}` (not under DIR)" if p.artifact else "—")
            )
            rows.append(
                [
                    f"{b}{p.k}{b}",
                    base,
                    f"{b}{spec}{b}",
                    _pct(p.acceptance_rate),
                    _f(p.tokens_per_round, 2),
                    f"{b}{_x(p.speedup)}{b}",
                    where,
                ]
            )
        out += _table(
            [
                "K",
                "Base tok/s",
                "Spec tok/s",
                "Acceptance",
                "Tokens/round",
                "Speedup",
                "Per-K artifact",
            ],
            rows,
        )
        pos = [
            [str(p.k), " · ".join(_pct(a) for a in p.positional)] for p in sw.points if p.positional
        ]
        if pos:
            out += ["", f"Positional acceptance at each K (from {_cite(sw.src)}):", ""]
            out += _table(["K", "Position 1 … K"], pos)
        out.append("")
    return [*out, *_figure("speedup_vs_k.png", figures, report)]


def _section_positional(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## Acceptance by draft position", ""]
    benches = [b for b in s.benches if b.speculative.positional]
    if not benches:
        return [*out, "No artifact: no stand-alone bench run with speculative rounds.", ""]
    kmax = max(len(b.speculative.positional) for b in benches)
    rows = []
    for b in benches:
        pos = [_pct(a) for a in b.speculative.positional]
        rows.append(
            [
                b.label,
                *pos,
                *["—"] * (kmax - len(pos)),
                _pct(b.speculative.acceptance_rate),
                _f(b.speculative.tokens_per_round, 2),
                _cite(b.src),
            ]
        )
    out += [
        "Acceptance at position i = rounds whose i-th draft was accepted / rounds that "
        "drafted an i-th token; tokens per round includes the bonus or recovered token.",
        "",
    ]
    out += _table(
        ["Config", *(f"Pos {i}" for i in range(1, kmax + 1)), "Pooled", "Tokens/round", "Source"],
        rows,
    )
    return [*out, "", *_figure("acceptance_by_position.png", figures, report)]


def _section_latency(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## Per-token latency split", ""]
    benches = [b for b in s.benches if b.baseline.ms_per_token and b.speculative.ms_per_token]
    if not benches:
        return [*out, "No artifact: no stand-alone bench run with phase timings.", ""]
    out += [
        "Milliseconds per generated token (`aggregates.*.ms_per_token`); verify includes the "
        "prefill, other is wall time outside the three timed phases.",
        "",
    ]
    rows = []
    for b in benches:
        for side in ("baseline", "speculative"):
            ms = getattr(b, side).ms_per_token
            total = sum(ms.values())
            rows.append(
                [
                    b.label,
                    _SIDE_NAMES[side],
                    *(f"{ms[p]:.2f}" for p in PHASES),
                    f"{total:.2f}",
                    _pct(ms["sampling"] / total if total else None),
                    _cite(b.src),
                ]
            )
    out += _table(
        [
            "Config",
            "Path",
            *(f"{p} (ms)" for p in PHASES),
            "Total (ms)",
            "Sampling share",
            "Source",
        ],
        rows,
    )
    return [*out, "", *_figure("latency_split.png", figures, report)]


def _k_of(d: dict, src: str) -> int | str:
    """config.k: an int, or the policy name ("auto", "schedule") when K varies by round."""
    k = _get(d, "config.k", src)
    return k if k in ("auto", "schedule") else int(_num(d, "config.k", src))  # type: ignore[arg-type]


def _measured(s: Study, m: Micro, k: int) -> tuple[float, str] | None:
    """The measured speedup at K for the microbench's pair: a sweep point, else a bench run."""
    for sw in s.sweeps:
        if _same_pair(sw.draft_spec, sw.target_spec, sw.device, m):
            for p in sw.points:
                if p.k == k:
                    return p.speedup, sw.src
    for b in s.benches:
        device = b.target.device if b.target else None
        if b.k == k and _same_pair(b.draft_spec, b.target_spec, device, m):
            return b.speedup, b.src
    return None


def _section_micro(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## Microbenchmarks: verify scaling and draft cost", ""]
    if not s.micros:
        return [*out, "No artifact: no `specdec microbench` run under this directory.", ""]
    for m in s.micros:
        what = _join(
            f"cached prefix of {m.prefix_tokens} tokens" if m.prefix_tokens is not None else "",
            f"median of {m.repeats} repeats" if m.repeats is not None else "",
        )
        out += [f"### {m.label}", "", f"From {_cite(m.src)}" + (f" ({what})" if what else "") + ":"]
        out += ["", f"- target step: {m.target_step_ms:.2f} ms"]
        if m.draft_step_ms is not None:
            out.append(f"- draft step: {m.draft_step_ms:.2f} ms")
        out.append(f"- c = draft step / target step: {_f(m.c) if m.c is not None else 'no draft'}")
        out += [
            "",
            *_table(
                ["b", "median ms", "v(b)"],
                [[str(b), f"{ms:.2f}", f"{r:.2f}"] for b, ms, r in m.verify],
            ),
        ]
        if m.predicts:
            src = f"acceptance profile from `{m.acceptance_source}`" if m.acceptance_source else ""
            c = f"c = {m.prediction_c:.3f}" if m.prediction_c is not None else ""
            out += [
                "",
                f"Predicted speedup = E[tokens/round] / (v(K+1) + K·c) ({_join(c, src)}), "
                "against the measured one for the same pair:",
                "",
            ]
            rows = []
            for p in m.prediction:
                got = _measured(s, m, p.k)
                rows.append(
                    [
                        str(p.k),
                        _f(p.expected_tokens_per_round, 2),
                        f"{p.cost_in_target_steps:.2f}",
                        _x(p.predicted_speedup),
                        _x(got[0]) if got else "not measured",
                        _cite(got[1]) if got else "—",
                    ]
                )
            out += _table(
                [
                    "K",
                    "E[tokens/round]",
                    "Cost (target steps)",
                    "Predicted",
                    "Measured",
                    "Measured in",
                ],
                rows,
            )
            if m.best_k is not None:
                best = "0 (speculation cannot pay)" if m.best_k == 0 else str(m.best_k)
                out += ["", f"Predicted best K: {best} (`best_k`)."]
        if m.checks:
            out += [
                "",
                "Prediction checked against fixed-K benches (`microbench --check`), each "
                "with its own acceptance profile; measured on the decode phase (prompt "
                "prefills left out), end to end beside it:",
                "",
            ]
            rows = []
            for ch in m.checks:
                err = ch.get("relative_error")
                rows.append(
                    [
                        str(ch.get("k")),
                        str(ch.get("drafter")),
                        _f(ch.get("temperature"), 2),
                        _x(ch.get("predicted_speedup")),
                        _x(ch.get("measured_decode_speedup")),
                        _x(ch.get("measured_speedup")),
                        "—" if err is None else f"{err:+.1%}",
                        _cite(str(ch.get("source"))),
                    ]
                )
            out += _table(
                [
                    "K",
                    "Drafter",
                    "T",
                    "Predicted",
                    "Measured (decode)",
                    "Measured (end to end)",
                    "Error",
                    "Bench",
                ],
                rows,
            )
        elif m.prediction:
            out += [
                "",
                "No acceptance profile in this artifact, so no predicted speedup; the "
                "break-even tokens per round at each K (= cost in target steps):",
                "",
            ]
            out += _table(
                ["K", "Break-even tokens/round"],
                [[str(p.k), f"{p.cost_in_target_steps:.2f}"] for p in m.prediction],
            )
        out.append("")
    return [*out, *_figure("verify_scaling.png", figures, report)]


def _section_gate(s: Study, figures: Path, report: Path) -> list[str]:
    out = ["## Correctness gate (level 3)", ""]
    if not s.gates:
        return [*out, "No artifact: no `specdec gate` run under this directory.", ""]
    for g in s.gates:
        pair = f"{g.draft.short} → {g.target.short}" if g.draft and g.target else "?"
        verdict = "PASS" if g.passed else "FAIL"
        quick = " (`--quick`: CI-sized, low power)" if g.quick else ""
        out += [f"### {g.name}: {pair}", "", f"From {_cite(g.src)}: **{verdict}**{quick}.", ""]
        setup = _join(
            f"{g.n_prompts} prompts × {g.max_new_tokens} tokens per method" if g.n_prompts else "",
            f"T = {g.temperature:g}" if g.temperature is not None else "",
            f"{g.tokens_speculative} speculative and {g.tokens_baseline} target-only tokens"
            if g.tokens_speculative is not None
            else "",
        )
        rule = f" (threshold p > {g.p_min:g})" if g.p_min is not None else ""
        binning = f"{g.n_bins} bins" + (" (top tokens + one pooled bin)" if g.pooled else "")
        if g.min_expected is not None:
            binning += f", every expected count ≥ {g.min_expected:g}"
        out.append(
            f"- Sampled leg ({setup}): χ² = {g.chi2:.2f}, dof = {g.dof}, "
            f"{_p_text(g)} → {'pass' if g.sampled_passed else 'FAIL'}{rule}; "
            f"{binning}."
        )
        if g.acceptance_rate is not None:
            out.append(f"- Acceptance rate during the sampled leg: {_pct(g.acceptance_rate)}.")
        if g.smoothed_kl is not None:
            out.append(
                f"- Smoothed symmetric KL (reference only, not the test): {g.smoothed_kl:.4f}."
            )
        if g.greedy_rows:
            n_ok = sum(r.match for r in g.greedy_rows)
            cap = f", up to {g.greedy_max_new_tokens} tokens" if g.greedy_max_new_tokens else ""
            lens = ", ".join(str(r.n_speculative) for r in g.greedy_rows)
            out.append(
                f"- Greedy leg (T = 0{cap}): {n_ok}/{len(g.greedy_rows)} prompts "
                f"identical ({lens} tokens) → {'pass' if g.greedy_passed else 'FAIL'}."
            )
            bad = [r for r in g.greedy_rows if not r.match]
            if bad:
                out += [
                    "",
                    *_table(
                        ["Prompt", "n baseline", "n speculative", "First mismatch"],
                        [
                            [
                                str(r.prompt_id),
                                str(r.n_baseline),
                                str(r.n_speculative),
                                str(r.first_mismatch),
                            ]
                            for r in bad
                        ],
                    ),
                ]
        else:
            out.append("- Greedy leg: no rows in the artifact.")
        out.append("")
    return [*out, *_figure("token_frequency.png", figures, report)]


def _section_files(s: Study) -> list[str]:
    out = ["## Artifacts", ""]
    rows = []
    for src in sorted(s.metas):
        meta = s.metas[src]
        cmd = str(meta.get("command") or "—").replace("|", "\\|")
        rows.append([_cite(src), s.schemas[src], str(meta.get("created", "—")), f"`{cmd}`"])
    out += _table(["File", "Schema", "Created", "Command"], rows)
    members = sorted(p.member.src for sw in s.sweeps for p in sw.points if p.member)
    if members:
        out += [
            "",
            "Per-K sweep artifacts (in the K-sweep tables, not the main results): "
            + ", ".join(map(_cite, members))
            + ".",
        ]
    for title, items in (
        ("Valid but empty (not used)", s.no_rows),
        ("Malformed (not used)", s.malformed),
        ("Skipped (not specdec artifacts)", s.skipped),
    ):
        if items:
            out += ["", f"{title}:", "", *(f"- {m}" for m in items)]
    return [*out, ""]


def render_report(study: Study, figures: Path, report: Path) -> str:
    """REPORT.md's text; figures under `figures` are linked relative to `report` when present."""
    n = len(study.metas)
    out = [
        "# specdec study report",
        "",
        f"Generated by `specdec report` from the {n} JSON artifact{'s' * (n != 1)} under this "
        "directory and nothing else; every number names the file it came from.",
        "",
        *_section_machine(study),
    ]
    for section in (
        _section_main,
        _section_sweeps,
        _section_positional,
        _section_latency,
        _section_micro,
        _section_gate,
    ):
        out += section(study, figures, report)
    out += _section_files(study)
    text = "\n".join(out)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip() + "\n"
