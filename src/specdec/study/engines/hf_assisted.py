"""transformers' own assisted generation (`generate(assistant_model=...)`) as a bench method:
the outside anchor for our implementation's speed (`specdec bench --compare hf-assisted`).

Timed like our runs (device synchronized before each clock read) and recorded as an HF-assisted
RUN: {tokens, stop_reason, prompt_tokens, generated, wall_s, tokens_per_s, ttft_s (None),
rounds, drafted, accepted, acceptance_rate, tokens_per_round}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from specdec.core.config import Warp
from specdec.core.model import SpecModel


def is_hf(model: SpecModel) -> bool:
    """Whether `model` is the hf backend's (a transformers module behind the contract)."""
    from specdec.backends.hf import HFModel

    return isinstance(model, HFModel)


@contextmanager
def _overrides(obj: Any, **values: Any) -> Iterator[None]:
    saved = {k: getattr(obj, k, None) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def _generate_kwargs(
    target: SpecModel, input_ids: Any, max_new_tokens: int, warp: Warp, stops: Sequence[int]
) -> dict[str, Any]:
    import torch

    pad = getattr(target.tokenizer, "pad_token_id", None)
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "attention_mask": torch.ones_like(input_ids),
        "eos_token_id": list(stops) or None,
        "pad_token_id": pad if pad is not None else (stops[0] if stops else None),
    }
    if warp.temperature > 0:
        # transformers' generate takes Warp's fields by their names (a field it had no such
        # argument for would be refused by generate, naming it). One that is off is passed
        # as the value that switches it off (each field's "off": top_k 0, top_p 1.0, ...), not
        # left out: transformers' default top_k is 50, and a model's generation_config may set
        # top_p or top_k of its own, none of which our engine would apply. Its chain puts
        # typical-p after top-p and min-p (ours: llama.cpp's order, before them), so with
        # typical_p and one of those both set it samples a slightly different distribution.
        kwargs.update(warp.explicit(), do_sample=True, temperature=float(warp.temperature))
    else:
        kwargs.update(do_sample=False)
    return kwargs


def run(
    draft: SpecModel,
    target: SpecModel,
    ids: list[int],
    *,
    k: int | str,
    max_new_tokens: int,
    warp: Warp,
    seed: int,
    stops: Sequence[int],
) -> dict[str, Any]:
    """transformers' `generate(assistant_model=...)` on one prompt, timed like our runs.

    transformers 5.x reads the speculation length from the *assistant's* generation_config (a
    `num_assistant_tokens` passed to `generate` lands in the target's config and is ignored), and
    by default also stops drafting early when the draft's confidence drops below 0.4
    (`assistant_confidence_threshold`). Both are pinned on the assistant for the call — constant
    K, no early stop — so the comparison is at the same K as ours. transformers samples from the
    global torch RNG, so `seed` seeds that.

    Rounds and drafted tokens are counted with forward hooks: each target forward is one round
    (the first also holds the prefill) and each draft forward drafts one token. accepted =
    generated - rounds, since every round commits its matches plus one target token.
    """
    import torch

    from specdec.core.device import synchronize

    hf_target, hf_draft = target.model, draft.model  # the transformers modules (HFModel.model)
    devices = {target.device, draft.device}
    input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)  # [1, n]
    kwargs = _generate_kwargs(target, input_ids, max_new_tokens, warp, stops)
    calls = {"target": 0, "draft": 0}

    def counter(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[key] += 1

        return hook

    hooks = [
        hf_target.register_forward_hook(counter("target")),
        hf_draft.register_forward_hook(counter("draft")),
    ]
    assistant = {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    try:
        torch.manual_seed(seed)
        with _overrides(hf_draft.generation_config, **assistant):
            for d in devices:
                synchronize(d)
            t0 = time.perf_counter()
            out = hf_target.generate(input_ids, assistant_model=hf_draft, **kwargs)
            for d in devices:
                synchronize(d)
            wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    tokens = [int(t) for t in out[0, len(ids) :].tolist()]
    n, rounds, drafted = len(tokens), calls["target"], calls["draft"]
    return {
        "tokens": tokens,
        "stop_reason": "stop" if tokens and tokens[-1] in stops else "length",
        "prompt_tokens": len(ids),
        "generated": n,
        "wall_s": wall,
        "tokens_per_s": n / wall if wall > 0 else 0.0,
        "ttft_s": None,  # generate() gives no hook at the first committed token
        "rounds": rounds,
        "drafted": drafted,
        "accepted": n - rounds,
        "acceptance_rate": (n - rounds) / drafted if drafted else None,
        "tokens_per_round": n / rounds if rounds else None,
    }
