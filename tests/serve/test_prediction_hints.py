"""The rewrites an instruction names reach the prediction drafter wherever a prediction enters:
the server (the last user message, or a text prompt) and `specdec generate` (its prompt).

The drafting itself (hints applied from the first occurrence, forgotten when they fail, output
unchanged) is tested in tests/core/test_prediction.py.
"""

from __future__ import annotations

import pytest

from specdec.backends import chat as prompting
from specdec.serve.models import _instruction
from specdec.serve.wire import ChatRequest, CompletionRequest


@pytest.fixture(scope="module")
def smol_tokenizer(smol_path):
    from specdec.backends.tokenizer import load_tokenizer

    return load_tokenizer(smol_path)


def test_hints_are_the_named_rewrites_tokenized_as_the_prediction(smol_tokenizer) -> None:
    hints = prompting.prediction_hints(smol_tokenizer, "Rename `Inventory` to `Stock` everywhere.")
    enc = lambda s: tuple(prompting.encode_prediction(smol_tokenizer, s))  # noqa: E731
    # alone and after a space: a BPE tokenizer spells the two differently
    assert (enc("Inventory"), enc("Stock")) in hints
    assert (enc(" Inventory"), enc(" Stock")) in hints
    assert prompting.prediction_hints(smol_tokenizer, "Add type hints.") == []
    assert prompting.prediction_hints(None, "Rename `a` to `b`.") == []


def test_the_server_reads_the_instruction_from_the_last_user_message() -> None:
    req = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Rename `x` to `y` (not an instruction)."},
                {"role": "user", "content": "Rename `a` to `b`."},
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "Now rename `Inventory` to `Stock`."},
            ],
        }
    )
    assert _instruction(req) == "Now rename `Inventory` to `Stock`."
    text = CompletionRequest.model_validate({"model": "m", "prompt": "rename `p` to `q`"})
    assert _instruction(text) == "rename `p` to `q`"
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert _instruction(ids) == ""


def test_a_served_prediction_carries_the_hints(smol_llamacpp) -> None:
    from specdec.serve.config import ServeConfig
    from specdec.serve.engine import Engine

    cfg = ServeConfig(target=smol_llamacpp.name, drafter="prediction", draft_pool="off")
    engine = Engine(smol_llamacpp, None, cfg)
    pred = prompting.encode_prediction(smol_llamacpp.tokenizer, "class Inventory:\n    pass\n")
    index = engine.models.tokens.prediction_index(pred, "Rename `Inventory` to `Stock`.")
    assert index.tokens == pred
    assert index.hints == prompting.prediction_hints(
        smol_llamacpp.tokenizer, "Rename `Inventory` to `Stock`."
    )
    assert engine.models.tokens.prediction_index(pred, "Fix the bug.").hints == []
