"""k="auto"'s verify-cost curves between processes: JSON files, one per model build and setting.

A k="auto" policy (core.policy.CostModelK) learns v(b), the seconds of a target pass over b
tokens, from the passes a generation makes anyway, and reads and writes no file itself.
`CurveFiles` is the `core.policy.CurveStore` that keeps what it learned for the next process,
and where `specdec microbench` and `specdec doctor` put a measured curve:

    $SPECDEC_HOME/costs/<key>.json   {"verify_s": {"<b>": seconds, ...}}

`key` names everything v(b) depends on (backends.llamacpp.cost_key: the GGUF content, the build
and its kernels, threads, batch, K cache type, flash attention, numerics mode), so a curve is
never read for another file, build or setting. Models without a key (HF, mock) are not kept:
their policies start from the prior in every process.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.backends.registry import specdec_home

if TYPE_CHECKING:
    from specdec.core.model import SpecModel


def curve_key(model: SpecModel) -> str | None:
    """The name of `model`'s curve file, without the suffix; None for a model whose curve is
    not kept (only llama.cpp models name their build and settings)."""
    from specdec.backends.llamacpp import LlamaCppModel, cost_key

    return cost_key(model) if isinstance(model, LlamaCppModel) else None


def read_curve(path: str | os.PathLike[str]) -> dict[int, float]:
    """The curve a file holds, {b: seconds}; {} when there is none or it cannot be read (the
    policy learns it again)."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))["verify_s"]
        return {int(b): float(s) for b, s in saved.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_curve(path: str | os.PathLike[str], curve: Mapping[int, float]) -> bool:
    """Write a curve {b: seconds} atomically (a temp file, then os.replace: a reader in another
    process never sees half of it); False if it could not be written (a read-only cache only
    costs the next process some learning)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"verify_s": {str(b): s for b, s in sorted(curve.items())}}))
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

    def load(self, target: SpecModel) -> dict[int, float]:
        path = self.path(target)
        return read_curve(path) if path is not None else {}

    def save(self, target: SpecModel, curve: Mapping[int, float]) -> Path | None:
        """Keep `curve` for `target`; the file written, or None when nothing was."""
        path = self.path(target)
        return path if path is not None and write_curve(path, curve) else None
