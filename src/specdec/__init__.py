"""specdec: lossless speculative decoding, and the harness that measures when it pays.

Public API (imported lazily so `import specdec` stays cheap):
    load_model(spec, device=None) -> SpecModel      models/
    check_pair(draft, target) -> int                tokenizer.py
    rejection_sample, greedy_verify, probs_from_logits   sampling.py
    generate(...), stream(...)                       decode.py
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "specdec.backends",
    "SpecModel": "specdec.core.model",
    "MockModel": "specdec.backends.mock",
    "check_pair": "specdec.core.pair",
    "get_device": "specdec.core.device",
    "synchronize": "specdec.core.device",
    "probs_from_logits": "specdec.core.sampling",
    "rejection_sample": "specdec.core.sampling",
    "greedy_verify": "specdec.core.sampling",
    "generate": "specdec.core.decode",
    "stream": "specdec.core.decode",
    "GenerationResult": "specdec.core.decode",
    "GenerationStats": "specdec.core.decode",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
