"""The named draft -> target configurations (paper, Table 2, on the models we have here).

The paper's 3B and 7B configurations (mixed_3b, stretch_7b) have no weights available on this
machine, so they are absent rather than substituted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PairConfig:
    name: str
    draft: str  # model spec, BACKEND:NAME_OR_PATH
    target: str


CONFIGS: dict[str, PairConfig] = {
    c.name: c
    for c in (
        PairConfig("all_gguf", "llamacpp:qwen2.5-coder-0.5b", "llamacpp:qwen2.5-coder-1.5b"),
        PairConfig("primary", "hf:qwen2.5-coder-0.5b", "llamacpp:qwen2.5-coder-1.5b"),
        PairConfig("mixed", "llamacpp:qwen2.5-coder-0.5b", "hf:qwen2.5-coder-1.5b"),
        PairConfig("all_hf", "hf:qwen2.5-coder-0.5b", "hf:qwen2.5-coder-1.5b"),
        PairConfig("smoke", "hf:smollm2-135m", "llamacpp:smollm2-135m"),  # the tests' pair
    )
}


def resolve_config(name: str) -> PairConfig:
    """The named configuration; ValueError naming the known ones otherwise."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known configs: {', '.join(CONFIGS)}")
    return CONFIGS[name]


def model_record(spec: str, model: Any) -> dict[str, Any]:
    """The MODEL block of an artifact (study.artifacts.Model): what was loaded, from where, on
    what device.

    sha256 is the registry's pinned hash for registry names (verified on fetch), else None.
    """
    from specdec.backends import parse_spec
    from specdec.backends.registry import MODELS

    backend, rest = parse_spec(spec)
    entry = MODELS.get(rest)
    return {
        "spec": spec,
        "backend": backend,
        "name": model.name,
        "device": str(model.device),
        "sha256": entry.sha256 if entry is not None else None,
        "vocab_size": int(model.vocab_size),
        "n_ctx": int(model.n_ctx),
    }
