"""Real models, greedy: speculative decoding reproduces target-only greedy decoding exactly.

The `smoke` pair: hf:smollm2-135m (fp32, dequantized) drafts for llamacpp:smollm2-135m (Q4_1,
flash attention) — the same tokenizer, different numerics, so many drafts are rejected and the
recovered tokens are exercised. Equality needs a batch-invariant target: with flash attention and
a q8_0 K cache, a llama.cpp verify batch gives the same logits as one-token-at-a-time decoding
(tests/backends/test_contract.py).
"""

from __future__ import annotations

import pytest

from specdec.backends import chat as prompting
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate

pytestmark = pytest.mark.model

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget.",
]
N_TOK = 48


@pytest.mark.parametrize("drafter", ["model", "lookup", "composite"])
def test_speculative_greedy_equals_target_only(smol_hf, smol_llamacpp, drafter) -> None:
    target, draft = smol_llamacpp, smol_hf
    tok = target.tokenizer
    for text in PROMPTS:
        ids = prompting.encode(tok, text)
        base = generate(
            target,
            ids,
            max_new_tokens=N_TOK,
            warp=Warp(temperature=0),
        ).tokens
        assert len(base) == N_TOK  # no early stop: the comparison covers all 48 tokens
        ks = (1, 4) if drafter == "model" else (4, "auto")
        for k in ks:
            spec = generate(
                target,
                ids,
                draft=None if drafter == "lookup" else draft,
                spec=SpecConfig(drafter=drafter, k=k),
                warp=Warp(temperature=0),
                max_new_tokens=N_TOK,
                debug=True,
            )
            assert spec.tokens == base, (drafter, k, text)
            if drafter == "model":
                assert spec.stats.drafted > 0
