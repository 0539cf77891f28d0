"""HF backend: a pass that raises midway leaves the cache as it was; weights load from safetensors.

The rollback tests make one attention layer append its keys and values to the cache and then
raise, as an out-of-memory error partway through the stack would: the layers before it hold the
new positions, the layers after it do not. A tiny random Llama runs the contract in well under a
second; the real smollm2 (model-marked) checks that the next greedy generation is still exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from specdec.backends.hf import HFModel
from specdec.core.config import Warp
from specdec.core.generate import generate
from specdec.core.model import SpecModel, SpecModelError

TINY_V = 64
TINY_LAYERS = 4
FAILING_LAYER = 2  # layers 0..2 receive the new positions, layer 3 does not
TOL = 1e-4  # fp32 CPU, a chunk vs one pass: rounding level (see tests/backends/test_contract.py)


class FakeOOM(RuntimeError):
    pass


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=TINY_V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny() -> HFModel:
    return HFModel(_tiny_llama(), name="hf:tiny")


@contextmanager
def failing_layer(model: HFModel, layer: int) -> Iterator[None]:
    """While active, attention layer `layer` updates the cache and then raises FakeOOM."""
    attn = model.model.model.layers[layer].self_attn
    real = attn.forward

    def write_then_raise(*args, **kwargs):
        real(*args, **kwargs)  # appends this layer's keys and values to the cache
        raise FakeOOM("CUDA out of memory (simulated)")

    attn.forward = write_then_raise
    try:
        yield
    finally:
        del attn.forward  # back to the class's method


def layer_lengths(model: HFModel) -> list[int]:
    return [layer.get_seq_length() for layer in model.cache.layers]


@pytest.mark.parametrize("call", ["extend", "prefill"])
@pytest.mark.parametrize("n_before", [0, 5])
def test_a_pass_that_raises_midway_leaves_the_cache_as_it_was(
    tiny: HFModel, call: str, n_before: int
) -> None:
    seq = [(7 * i + 3) % TINY_V for i in range(12)]
    full = tiny.forward(seq)  # [12, V]
    if n_before:
        tiny.prefill(seq[:n_before])
    with failing_layer(tiny, FAILING_LAYER), pytest.raises(FakeOOM):
        getattr(tiny, call)(seq[n_before:])
    assert tiny.n_cached == n_before
    assert layer_lengths(tiny) == [n_before] * TINY_LAYERS
    # No reset in between: the next pass builds on the rolled-back cache, as a drafter does.
    rest = tiny.extend(seq[n_before:])  # [12 - n_before, V]
    assert (rest - full[n_before:]).abs().max().item() < TOL


def test_the_truncate_path_still_crops_a_consistent_cache(tiny: HFModel) -> None:
    seq = [(5 * i + 1) % TINY_V for i in range(10)]
    full = tiny.forward(seq)
    tiny.extend(seq)
    tiny.truncate(4)
    assert layer_lengths(tiny) == [4] * TINY_LAYERS
    assert (tiny.extend(seq[4:]) - full[4:]).abs().max().item() < TOL


@pytest.mark.model
def test_failed_first_prefill_then_greedy_generation_is_exact(
    smol_hf: SpecModel, smol_prompt_ids: list[int]
) -> None:
    prompt = smol_prompt_ids[:64]
    greedy = {"warp": Warp(temperature=0.0), "max_new_tokens": 12}
    expected = generate(smol_hf, prompt, **greedy).tokens
    smol_hf.reset()
    n_layers = len(smol_hf.cache.layers)
    with failing_layer(smol_hf, n_layers // 2), pytest.raises(FakeOOM):
        generate(smol_hf, prompt, **greedy)
    assert smol_hf.n_cached == 0 and all(n == 0 for n in layer_lengths(smol_hf))
    assert generate(smol_hf, prompt, **greedy).tokens == expected

    # A failure on top of a cached prefix (a drafter's catch-up prefill): back to the prefix.
    smol_hf.reset()
    smol_hf.prefill(prompt[:40])
    with failing_layer(smol_hf, n_layers // 2), pytest.raises(FakeOOM):
        smol_hf.prefill(prompt[40:])
    assert layer_lengths(smol_hf) == [40] * n_layers
    got = smol_hf.extend(prompt[40:])[-1]  # [V]
    want = smol_hf.forward(prompt)[-1]  # [V]
    assert (got - want).abs().max().item() < 1e-3  # the contract tolerance for hf


# ------------------------------------------------------------------------------ weight formats
def _save_tiny(path: Path, *, safetensors: bool) -> None:
    model = _tiny_llama()
    if safetensors:
        model.save_pretrained(path)
    else:  # transformers 5 writes safetensors only; older checkpoints come like this
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")


def _tiny_logits(ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of a fresh _tiny_llama(): the same seed, the same weights."""
    with torch.inference_mode():
        return _tiny_llama()(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny directories carry no tokenizer; HFModel takes None."""
    monkeypatch.setattr("specdec.backends.tokenizer.load_tokenizer", lambda path: None)


def test_pickle_only_directory_is_refused_with_the_fix(tmp_path, monkeypatch, no_tokenizer):
    monkeypatch.delenv("SPECDEC_ALLOW_PICKLE", raising=False)
    _save_tiny(tmp_path, safetensors=False)
    assert (tmp_path / "pytorch_model.bin").is_file()
    with pytest.raises(SpecModelError) as ei:
        HFModel.load(tmp_path)
    msg = str(ei.value)
    assert "pytorch_model.bin" in msg and "only pickled weights" in msg
    assert "save_pretrained" in msg and "allow_pickle=True" in msg and "SPECDEC_ALLOW_PICKLE" in msg
    # The explicit opt-ins load it (the saved weights, not a fresh initialization).
    want = _tiny_logits([1, 2, 3])
    got = HFModel.load(tmp_path, allow_pickle=True).forward([1, 2, 3])
    assert (got - want).abs().max().item() < TOL
    monkeypatch.setenv("SPECDEC_ALLOW_PICKLE", "1")
    assert HFModel.load(tmp_path).vocab_size == TINY_V


def test_safetensors_are_preferred_over_pickles_beside_them(tmp_path, no_tokenizer):
    _save_tiny(tmp_path, safetensors=True)
    # A pickle that must never be opened: unpickling it would raise (or worse).
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle: loading me is the bug")
    got = HFModel.load(tmp_path).forward([1, 2, 3])
    assert (got - _tiny_logits([1, 2, 3])).abs().max().item() < TOL
