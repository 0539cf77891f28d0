"""k="auto"'s verify-cost curves between processes: JSON files, one per model build and setting.

A k="auto" policy (core.policy.CostModelK) learns v(b), the seconds of a target pass over b
tokens, from the passes a generation makes anyway, and reads and writes no file itself.
`CurveFiles` is the `core.policy.CurveStore` that keeps what it measured for the next process,
and where `specdec microbench` and `specdec doctor` put a measured curve:

    $SPECDEC_HOME/costs/<key>.json
        {"verify_s": {"<b>": seconds, ...},                 the points in use (what k=auto prices)
         "samples": {"<b>": [[seconds, unix time], ...]}}  what they summarize (core.cost.WINDOW)

A save adds its samples to those in the file (another process may have written some since),
so the store keeps samples, never one number, and core.cost.VerifyCurve decides what is used.
A file of the first format (no "samples") is read as one sample per point, as old as the file.

`key` names everything v(b) depends on (backends.llamacpp.cost_key: the GGUF content, the build
and its kernels, threads, batch, K cache type, flash attention, numerics mode), so a curve is
never read for another file, build or setting. Models without a key (HF, mock) are not kept:
their policies start from the prior in every process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.backends.registry import specdec_home
from specdec.core.cost import Sample, VerifyCurve

if TYPE_CHECKING:
    from specdec.core.model import SpecModel

log = logging.getLogger(__name__)


def curve_key(model: SpecModel) -> str | None:
    """The name of `model`'s curve file, without the suffix; None for a model whose curve is
    not kept (only llama.cpp models name their build and settings)."""
    from specdec.backends.llamacpp import LlamaCppModel, cost_key

    return cost_key(model) if isinstance(model, LlamaCppModel) else None


def read_curve(path: str | os.PathLike[str]) -> VerifyCurve:
    """The curve a file holds; an empty one when there is none or it cannot be read (the
    policy learns it again)."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if "samples" in saved:
            return VerifyCurve(
                {
                    int(b): [Sample(float(s), float(t)) for s, t in ss]
                    for b, ss in saved["samples"].items()
                }
            )
        at = path.stat().st_mtime
        return VerifyCurve.of({int(b): float(s) for b, s in saved["verify_s"].items()}, at)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return VerifyCurve()


def write_curve(path: str | os.PathLike[str], curve: VerifyCurve) -> bool:
    """Write a curve atomically (a temp file, then os.replace: a reader in another process never
    sees half of it); False if it could not be written (a read-only cache only costs the next
    process some learning)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {
        "verify_s": {str(b): s for b, s in curve.summary().items()},
        "samples": {str(b): [[x.seconds, x.at] for x in ss] for b, ss in curve.samples().items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True


class CurveFiles:
    """Curves in `root` (default $SPECDEC_HOME/costs, read when used), one file per model key
    (`key`: curve_key unless given); a core.policy.CurveStore."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        key: Callable[[SpecModel], str | None] = curve_key,
    ) -> None:
        self.root = Path(root) if root is not None else None
        self.key = key

    def path(self, target: SpecModel) -> Path | None:
        """Where `target`'s curve is kept; None: it is not kept."""
        name = self.key(target)
        if name is None:
            return None
        return (self.root if self.root is not None else specdec_home() / "costs") / f"{name}.json"

    def load(self, target: SpecModel) -> VerifyCurve:
        path = self.path(target)
        curve = read_curve(path) if path is not None else VerifyCurve()
        if log.isEnabledFor(logging.DEBUG):
            for p in curve.points():
                if not p.used:  # the machine's load, not the kernel: priced by its neighbours
                    log.debug("%s: v(%d) = %.4g s not used (beyond bounds)", path, p.b, p.seconds)
        return curve

    def save(self, target: SpecModel, curve: VerifyCurve, replace: bool = False) -> Path | None:
        """Add `curve`'s samples to what is kept for `target` (`replace`: keep only them, as
        after a deliberate measurement: `specdec microbench`, `specdec doctor`); the file
        written, or None when nothing was."""
        path = self.path(target)
        if path is None:
            return None
        kept = curve if replace else read_curve(path).merged(curve)
        return path if write_curve(path, kept) else None

    def reset(self, target: SpecModel) -> Path | None:
        """Forget `target`'s curve; the file removed, or None when there was none."""
        path = self.path(target)
        if path is None or not path.exists():
            return None
        path.unlink()
        return path
