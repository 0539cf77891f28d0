"""Device selection and clock synchronization.

Models may compute on CUDA, MPS or the CPU; sampling always happens on the CPU in float32
(paper, section 4, "Numerics"). Timers call `synchronize(device)` before reading a clock so that
asynchronous kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import os

import torch


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """CUDA -> MPS -> CPU, unless `prefer` (or $SPECDEC_DEVICE) names one explicitly."""
    choice = prefer if prefer is not None else os.environ.get("SPECDEC_DEVICE")
    if choice is not None:
        dev = torch.device(choice)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device; use 'cpu'")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("device 'mps' requested but MPS is not available; use 'cpu'")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued work on `device` so a following clock read is honest."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
