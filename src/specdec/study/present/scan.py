"""Every artifact under one directory, read into the artifact model: what figures and report see.

`scan(DIR)` reads every `*.json` under DIR into its kind's record (artifacts.read, which checks
every field); each read artifact keeps `src`, its path relative to DIR, so each plotted
or tabulated number can name the file it came from.

Files under DIR fall into four groups (the CLI's error contract):
    artifact    "schema": "specdec.<kind>/<n>" that validates and has the fields we read: used
    empty       a valid bench artifact interrupted before its first recorded prompt: noted
    skipped     JSON that is not a specdec artifact (no "schema": "specdec.*"), or one of a kind
                figures and report do not draw (DRAWN_KINDS): noted, exit 0
    malformed   unreadable JSON, an unknown specdec schema version, or an artifact missing a field
                we read: `warning: malformed artifact FILE: reason` on stderr, everything else is
                still drawn and written, and the command exits with 1 so a CI step notices.
                Never a traceback.

Bench artifacts that a sweep summary lists in `points[].artifact` are that sweep's per-K members:
they feed the sweep tables (their std and positional acceptance), not the main results, which
hold the stand-alone bench runs only (as in the paper, Table 3 vs Table 4).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from specdec.study.artifacts import (
    ArtifactError,
    BenchArtifact,
    GateArtifact,
    MicrobenchArtifact,
    SweepArtifact,
    read,
)
from specdec.study.present.fmt import p_value
from specdec.study.present.hosts import Hosts

SIDE_NAMES = {"baseline": "target-only", "speculative": "speculative", "hf_assisted": "HF assisted"}


class NoRows(Exception):  # a state, not a failure: the artifact is valid, just empty
    """A bench artifact interrupted before its first recorded prompt: nothing to plot."""


@dataclass
class Study:
    """Everything found under one DIR, read; lists are sorted by `src`."""

    root: Path
    benches: list[BenchArtifact] = field(default_factory=list)  # stand-alone runs (Table 3)
    sweeps: list[SweepArtifact] = field(default_factory=list)  # points with a speedup, by K
    micros: list[MicrobenchArtifact] = field(default_factory=list)
    gates: list[GateArtifact] = field(default_factory=list)
    metas: dict[str, dict] = field(default_factory=dict)  # src -> the artifact's meta block
    schemas: dict[str, str] = field(default_factory=dict)  # src -> schema id
    skipped: list[str] = field(default_factory=list)  # "FILE: why" (not specdec artifacts)
    malformed: list[str] = field(default_factory=list)  # "FILE: why" (specdec, but unusable)
    no_rows: list[str] = field(default_factory=list)  # "FILE: why" (valid bench, nothing recorded)

    @cached_property
    def hosts(self) -> Hosts:
        """The hosts of `metas` (read once `scan` has filled it)."""
        return Hosts(self.metas)


#: The artifact kinds figures and report read; a newer version of one of these is malformed.
DRAWN_KINDS = ("specdec.bench", "specdec.sweep", "specdec.microbench", "specdec.gate")


def _read(data: dict[str, Any], src: str, path: Path) -> Any:
    art = read(data, src, path)
    if isinstance(art, BenchArtifact):
        agg = art.aggregates
        if not art.rows or agg.baseline.tok_s_mean is None or agg.speculative.tok_s_mean is None:
            raise NoRows(f"{src}: no recorded prompts (interrupted during warm-up?)")
        if agg.speedup is None:
            raise ArtifactError(f"{src}: missing field 'aggregates.speedup'")
    if isinstance(art, SweepArtifact):  # a K whose run recorded no prompt has nothing to show
        points = sorted((p for p in art.points if p.speedup is not None), key=lambda p: p.k)
        art = art.model_copy(update={"points": tuple(points)})
    return art


def scan(root: Path) -> Study:
    """Read, validate and parse every *.json under `root` (recursively)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    study = Study(root=root)
    all_benches: list[BenchArtifact] = []
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
        if sid.split("/")[0] not in DRAWN_KINDS:  # e.g. specdec.invariance/1: a kind of its own
            study.skipped.append(f"{src}: a {sid} artifact, which figures and report do not draw")
            continue
        try:
            art = _read(data, src, path)
        except ArtifactError as e:
            msg = str(e)
            study.malformed.append(msg if msg.startswith(src) else f"{src}: {msg}")
            continue
        except NoRows as e:
            art = None
            study.no_rows.append(str(e))
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # a shape unanticipated
            study.malformed.append(f"{src}: unexpected structure ({type(e).__name__}: {e})")
            continue
        study.metas[src] = data["meta"]
        study.schemas[src] = sid
        if isinstance(art, BenchArtifact):
            all_benches.append(art)
        elif isinstance(art, SweepArtifact):
            study.sweeps.append(art)
        elif isinstance(art, MicrobenchArtifact):
            study.micros.append(art)
        elif isinstance(art, GateArtifact):
            study.gates.append(art)
    members: set[str] = set()
    study.sweeps = [_attach_members(s, all_benches, members) for s in study.sweeps]
    study.benches = _labelled([b for b in all_benches if b.src not in members])
    return study


def _attach_members(
    sweep: SweepArtifact, benches: list[BenchArtifact], members: set[str]
) -> SweepArtifact:
    """Find each point's per-K artifact among the scanned benches.

    The sweep names it relative to the summary (both go to the same --out); an absolute path also
    works. No match by bare file name elsewhere: a main run in the parent directory often has the
    same name (bench_<config>_k4_t0.8.json) and must stay in the main results.
    """
    by_path = {b.path.resolve(): b for b in benches if b.path is not None}
    assert sweep.path is not None
    points = []
    for pt in sweep.points:
        hit = by_path.get((sweep.path.parent / pt.artifact).resolve()) if pt.artifact else None
        if hit is not None and hit.k != pt.k:
            hit = None  # a rerun at another K overwrote it: not this point's run
        if hit is not None:
            members.add(hit.src)
        points.append(pt.model_copy(update={"member": hit}))
    return sweep.model_copy(update={"points": tuple(points)})


def _labelled(benches: list[BenchArtifact]) -> list[BenchArtifact]:
    """Label each bench by its config name; when names clash, add the first setting that tells
    the clashing runs apart (device, drafter, K, T, tokens); when no one setting does, every
    setting that differs among them (e.g. 'all_gguf (composite, K=auto, T=0)'); when even those
    clash, the file name."""
    settings: tuple[tuple[str, Callable[[BenchArtifact], Any]], ...] = (
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
        out.append(b.model_copy(update={"label": label}))
    return out


# ------------------------------------------------------------------------------ matching
def _device_kind(device: str | None) -> str | None:
    return None if device in (None, "?") else device.split(":")[0]  # "cuda:0" -> "cuda"


def same_pair(
    draft_spec: str, target_spec: str, device: str | None, micro: MicrobenchArtifact
) -> bool:
    """A microbench predicts a run that used the same target and draft specs on the same kind of
    device (when both name one). One without a draft predicts for a model-free drafter (c = 0),
    which no bench run here uses, so it matches nothing."""
    if micro.target is None or micro.draft is None:
        return False
    if micro.target.spec != target_spec or micro.draft.spec != draft_spec:
        return False
    a, b = _device_kind(device), _device_kind(micro.target.device)
    return a is None or b is None or a == b


def sweep_label(s: SweepArtifact, sweeps: Sequence[SweepArtifact]) -> str:
    """The config name, with the device (or the file) when two sweeps share a name."""
    if sum(o.name == s.name for o in sweeps) == 1:
        return s.name
    if s.device and sum(o.name == s.name and o.device == s.device for o in sweeps) == 1:
        return f"{s.name} ({s.device})"
    return f"{s.name} ({s.src})"


def _uniform(values: Iterable[Any]) -> Any:
    vals = set(values)
    return vals.pop() if len(vals) == 1 else None


def shared_settings(benches: Sequence[BenchArtifact]) -> str:
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


def timed(b: BenchArtifact) -> tuple[Mapping[str, float], ...]:
    """(baseline, speculative) ms_per_token when both were timed, else () (the latency split
    in the figure and the report)."""
    base, speculative = b.aggregates.baseline.ms_per_token, b.aggregates.speculative.ms_per_token
    return (base, speculative) if base and speculative else ()


def gate_p_text(g: GateArtifact) -> str:
    """The gate's verdict p-value, with the chi-square table's beside it when both exist."""
    s = g.sampled
    if s.p_value_permutation is None:
        return f"p = {p_value(s.p_value)}"
    return f"permutation p = {p_value(s.p_value_permutation)} (χ²-table p = {p_value(s.p_value)})"
