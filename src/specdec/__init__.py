"""specdec: lossless speculative decoding, and the harness that measures when it pays.

    import specdec
    target = specdec.load_model("llamacpp:qwen2.5-coder-1.5b")
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = specdec.generate(target, ids, drafter="lookup", k="auto", temperature=0.7)

Public API (imported lazily, so `import specdec` stays cheap):
    load_model(spec, device=None, **kw) -> SpecModel       specdec.backends
    generate(target, prompt_ids, *, draft, drafter, k, temperature, ...) -> GenerationResult,
    stream(...) -> SpecStream, make_generation(...) -> Generation   specdec.core.generate
                 (make_generation takes the settings whole, spec=SpecConfig, warp=Warp; generate
                 and stream take its keywords, or the configs' fields as plain keywords; a
                 Generation is stepped by the caller: specdec.core.decode)
    SpecConfig, Warp (the same settings as objects)          specdec.core.config
    AutoPolicies (k="auto" kept across generations), CurveFiles (its cost curves on disk)
                                                             specdec.core.policy, backends.costs
    complete(model, prefix, suffix, extra, current, **generate's) -> GenerationResult: the
                 middle a FIM code model fills in, as an editor asks  specdec.backends.fim
    check_pair(draft, target) -> int                         specdec.core.pair
    rejection_sample, greedy_verify, probs_from_logits       specdec.core.sampling
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
    "generate": "specdec.core.generate",
    "complete": "specdec.backends.fim",
    "stream": "specdec.core.generate",
    "make_generation": "specdec.core.generate",
    "Generation": "specdec.core.decode",
    "SpecStream": "specdec.core.decode",
    "GenerationResult": "specdec.core.metrics",
    "GenerationStats": "specdec.core.metrics",
    "SpecConfig": "specdec.core.config",
    "Warp": "specdec.core.config",
    "AutoPolicies": "specdec.core.policy",
    "CurveFiles": "specdec.backends.costs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
