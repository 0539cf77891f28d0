"""Where an artifact came from, the blocks every producer adds: `meta_block()` (when, where, with
what: the machine, its load, the versions and llama.cpp kernels), `model_block()` (the MODEL
record of a loaded model, with a hash of its files), and the process's memory high-water marks.

These read the machine, the model files and the loaded backends; the records they fill
(base.Model, every kind's meta) read nothing but JSON.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from specdec.backends import llamacpp_build, parse_spec
from specdec.backends.configs import model_record
from specdec.study.artifacts.base import Model


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
        from specdec.backends.llamacpp_kernels import kernels

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


def model_block(model_spec: str, model: Any) -> Model:
    """The MODEL block of a loaded model (`model_spec` BACKEND:NAME_OR_PATH):
    configs.model_record, plus a hash of local (non-registry) model files and the HF dtype."""
    record = model_record(model_spec, model)
    backend, rest = parse_spec(model_spec)
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
