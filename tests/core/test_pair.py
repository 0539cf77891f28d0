"""check_pair: a draft and a target must share a tokenizer; the sampling width is the min width."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.backends.mock import MockModel
from specdec.backends.tokenizer import load_tokenizer
from specdec.core.pair import IncompatiblePairError, check_pair, check_tokenizers

QWEN = "qwen2.5-coder-0.5b"


def test_mock_pairs() -> None:
    target = MockModel(vocab_size=48, seed=0)
    assert check_pair(MockModel.near(target), target) == 48
    with pytest.raises(IncompatiblePairError, match=r"mock-32.*mock-48"):
        check_pair(MockModel(vocab_size=32), target)


@pytest.mark.model
def test_hf_and_llamacpp_on_one_gguf_pair(smol_hf, smol_llamacpp) -> None:
    assert check_pair(smol_hf, smol_llamacpp) == 49152
    assert check_pair(smol_llamacpp, smol_hf) == 49152


@pytest.mark.model
def test_real_model_and_mock_do_not_pair(smol_llamacpp) -> None:
    mock = MockModel(vocab_size=48)
    with pytest.raises(IncompatiblePairError, match=r"HF tokenizer of 49152 tokens.*mock-48"):
        check_pair(smol_llamacpp, mock)
    with pytest.raises(IncompatiblePairError, match="same model family"):
        check_pair(mock, smol_llamacpp)


def test_smollm2_and_qwen_do_not_pair(smol_path, qwen05_path) -> None:
    """Checked on tokenizers alone: no need to load a 150k-vocabulary model for a refusal."""
    smol_tok, qwen_tok = load_tokenizer(smol_path), load_tokenizer(qwen05_path)
    smol = SimpleNamespace(name="llamacpp:smollm2-135m", tokenizer=smol_tok, vocab_size=49152)
    qwen = SimpleNamespace(name=f"llamacpp:{QWEN}", tokenizer=qwen_tok, vocab_size=151936)
    with pytest.raises(IncompatiblePairError) as info:
        check_pair(smol, qwen)
    message = str(info.value)
    for needle in ("49152", "151936", "smollm2-135m", QWEN, "same model family / tokenizer"):
        assert needle in message
    assert "is id 0 in the draft but" in message  # quotes concrete differing tokens


@pytest.mark.model
def test_tokenizer_must_fit_the_shared_width(smol_path) -> None:
    tok = load_tokenizer(smol_path)
    assert check_tokenizers(tok, tok, draft_width=49152, target_width=49280) == 49152
    with pytest.raises(IncompatiblePairError, match=r"ids reach 49151.*width.*is 1000"):
        check_tokenizers(tok, tok, draft_width=1000, target_width=49152)


@pytest.mark.model
def test_converted_tokenizer_is_cached(smol_path) -> None:
    from specdec.backends.tokenizer import converted_dir

    tok = load_tokenizer(smol_path)  # converts on first use, then reads the cache
    cache = converted_dir("tokenizers", smol_path)
    assert (cache / "tokenizer.json").is_file()
    again = load_tokenizer(smol_path)
    assert again.get_vocab() == tok.get_vocab()
