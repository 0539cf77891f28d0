"""The public API as a user calls it: `specdec.generate` / `specdec.stream` with plain keywords
(the shape of HF's `generate`), the config objects for those who want them, and token ids in
every form a tokenizer hands out, with an error that names what to pass for anything else."""

from __future__ import annotations

import dataclasses
import inspect
from collections import UserDict

import numpy as np
import pytest
import torch
from support import PairSpec

import specdec
from specdec.core.config import SpecConfig, Warp
from specdec.core.model import SpecModelError

V = 16
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1, 2, 3]


@pytest.fixture(scope="module")
def pair_spec() -> PairSpec:
    return PairSpec(v=V, scale=3.0)


def test_generate_and_stream_take_make_generations_arguments(pair) -> None:
    """One signature: generate and stream pass their options to make_generation, which names every
    keyword and takes the settings whole (spec=, warp=); the configs' fields as plain keywords
    are the convenience layer's alone. An unknown keyword is a TypeError naming it, before any
    model work."""
    p = inspect.signature(specdec.make_generation)
    assert "options" not in p.parameters and "max_new_tokens" in p.parameters
    assert {"spec", "warp"} <= set(p.parameters)
    flat = {f.name for c in (SpecConfig, Warp) for f in dataclasses.fields(c)}
    assert not flat & set(p.parameters)
    for f in (specdec.generate, specdec.stream):
        params = inspect.signature(f).parameters
        assert list(params) == ["target", "prompt_ids", "options"], f.__name__
    target, _ = pair
    before = target.n_cached
    with pytest.raises(TypeError, match="max_tokens"):
        specdec.generate(target, PROMPT, max_tokens=4)
    assert target.n_cached == before


@pytest.mark.parametrize(
    ("keywords", "configs"),
    [
        ({"k": 3, "temperature": 0.9}, {"spec": SpecConfig(k=3), "warp": Warp(0.9)}),
        (
            {"drafter": "lookup", "k": "schedule", "k_max": 6, "top_k": 5, "top_p": 0.8},
            {"spec": SpecConfig("lookup", "schedule", 6), "warp": Warp(0.8, 5, 0.8)},
        ),
        ({"p_min": 0.2, "temperature": 0}, {"spec": SpecConfig(p_min=0.2), "warp": Warp(0.0)}),
        ({"min_p": 0.05, "typical_p": 0.9}, {"warp": Warp(min_p=0.05, typical_p=0.9)}),
        ({}, {"spec": SpecConfig(), "warp": Warp()}),  # the defaults: K = 4, temperature 0.8
    ],
)
def test_keywords_build_the_configs_a_caller_could_pass(pair, keywords, configs) -> None:
    """The same settings as keywords or as SpecConfig / Warp give the same tokens and stats."""
    target, draft = pair
    kw = dict(draft=None if keywords.get("drafter") == "lookup" else draft, seed=7)
    a = specdec.generate(target, PROMPT, max_new_tokens=24, **kw, **keywords)
    b = specdec.generate(target, PROMPT, max_new_tokens=24, **kw, **configs)
    assert a.tokens == b.tokens and a.stats.k_histogram == b.stats.k_histogram


def test_a_config_and_its_keywords_together_are_an_error(pair) -> None:
    target, draft = pair
    before = target.n_cached  # the module's target: what the last test left in its cache
    with pytest.raises(ValueError, match=r"spec= or its keywords \(k\), not both"):
        specdec.generate(target, PROMPT, draft=draft, spec=SpecConfig(k=2), k=3)
    with pytest.raises(ValueError, match=r"warp= or its keywords \(temperature, top_p\)"):
        specdec.generate(target, PROMPT, warp=Warp(0.5), temperature=0.7, top_p=0.9)
    with pytest.raises(ValueError, match="spec= takes a SpecConfig, got Warp"):
        specdec.generate(target, PROMPT, spec=Warp())
    assert target.n_cached == before  # refused before any model work


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"typical_p": 0.0}, "typical_p"),
        ({"k": "fast"}, "'auto'"),
        ({"drafter": "ngram"}, "unknown drafter"),
        ({"k_max": 0}, "k_max"),
    ],
)
def test_keywords_are_checked_by_the_configs(pair, keywords, match) -> None:
    target, _ = pair
    with pytest.raises(ValueError, match=match):
        specdec.generate(target, PROMPT, **keywords)


def test_stream_with_keywords_yields_what_generate_returns(pair) -> None:
    target, draft = pair
    kw = dict(draft=draft, k=4, temperature=0.8, max_new_tokens=30, seed=3)
    s = specdec.stream(target, PROMPT, **kw)
    chunks = list(s)
    assert s.result is not None
    assert (
        [t for c in chunks for t in c]
        == s.result.tokens
        == specdec.generate(target, PROMPT, **kw).tokens
    )


class _Encoding(UserDict):
    """What a tokenizer's BatchEncoding is to a caller: a mapping holding input_ids."""


@pytest.mark.parametrize(
    "ids",
    [
        PROMPT,
        tuple(PROMPT),
        torch.tensor(PROMPT),
        torch.tensor([PROMPT]),  # return_tensors="pt": a batch of one
        np.array(PROMPT),
        [PROMPT],
        {"input_ids": PROMPT, "attention_mask": [1] * len(PROMPT)},
        _Encoding(input_ids=[PROMPT], attention_mask=[[1] * len(PROMPT)]),
        _Encoding(input_ids=torch.tensor([PROMPT])),
    ],
    ids=["list", "tuple", "tensor", "tensor-1xn", "numpy", "list-1xn", "dict", "enc", "enc-pt"],
)
def test_token_ids_in_every_form_a_tokenizer_gives(pair, ids) -> None:
    target, _ = pair
    want = specdec.generate(target, PROMPT, temperature=0, max_new_tokens=8).tokens
    assert specdec.generate(target, ids, temperature=0, max_new_tokens=8).tokens == want


def test_a_transformers_batch_encoding_is_token_ids(pair) -> None:
    """The README's quick start: apply_chat_template returns a BatchEncoding under transformers
    5, which used to die with "invalid literal for int() with base 10: 'input_ids'"."""
    from transformers import BatchEncoding

    target, _ = pair
    enc = BatchEncoding({"input_ids": PROMPT, "attention_mask": [1] * len(PROMPT)})
    want = specdec.generate(target, PROMPT, temperature=0, max_new_tokens=8).tokens
    assert specdec.generate(target, enc, temperature=0, max_new_tokens=8).tokens == want
    pt = BatchEncoding({"input_ids": torch.tensor([PROMPT])})
    assert specdec.generate(target, pt, temperature=0, max_new_tokens=8).tokens == want


@pytest.mark.parametrize(
    ("ids", "got"),
    [
        ("Hello there", r"text \('Hello there'\), which must be tokenized first"),
        ({"attention_mask": [1, 1]}, r"a mapping without input_ids \(keys 'attention_mask'\)"),
        (["input_ids"], r"an id of type str \('input_ids'\)"),
        (torch.zeros(2, 3, dtype=torch.long), r"a tensor of shape \(2, 3\)"),
        (torch.tensor([1.0, 2.0]), "a torch.float32 tensor"),
        ([1.5, 2.0], r"an id of type float \(1.5\)"),
        ([True, 2], r"an id of type bool"),
        (7, "an object of type int"),
        (None, "an object of type NoneType"),
    ],
)
def test_anything_else_gets_an_error_naming_what_to_pass(pair, ids, got) -> None:
    target, _ = pair
    with pytest.raises(SpecModelError, match=got) as info:
        specdec.generate(target, ids)
    message = str(info.value)
    assert message.startswith("prompt_ids: got ")
    for needle in ("a list of ints", "a 1-D integer tensor", "BatchEncoding", "input_ids"):
        assert needle in message


def test_a_prediction_takes_the_same_forms(pair) -> None:
    target, _ = pair
    pred = PROMPT[3:]
    want = specdec.generate(target, PROMPT, prediction=pred, temperature=0, max_new_tokens=10)
    enc = _Encoding(input_ids=torch.tensor([pred]))
    got = specdec.generate(target, PROMPT, prediction=enc, temperature=0, max_new_tokens=10)
    assert got.tokens == want.tokens and got.stats.drafted == want.stats.drafted > 0
    with pytest.raises(SpecModelError, match="prediction: got text"):
        specdec.generate(target, PROMPT, prediction="the file")


def test_the_real_tokenizers_chat_template_output_generates(smol_llamacpp) -> None:
    """The README's example as written: the chat template's output goes straight in."""
    tok = smol_llamacpp.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    kw = dict(drafter="lookup", k=4, temperature=0, max_new_tokens=6)
    got = specdec.generate(smol_llamacpp, ids, **kw)
    assert got.tokens == specdec.generate(smol_llamacpp, list(plain), **kw).tokens
    assert got.stats.prompt_tokens == len(plain)


def test_one_drafter_registry() -> None:
    """core.config.DrafterName is the one place that names the drafters: DRAFTER_RUNS has a
    row for each, in its order, and the server's names and the model / model-free / lookup sets
    all follow them."""
    import typing

    from specdec.core.config import (
        DRAFTER_RUNS,
        DRAFTERS,
        FREE_DRAFTERS,
        LOOKUP_DRAFTERS,
        MODEL_DRAFTERS,
        DrafterName,
    )
    from specdec.serve.speculation import SPEC_DRAFTERS

    assert DRAFTERS == typing.get_args(DrafterName) == tuple(DRAFTER_RUNS)
    assert SPEC_DRAFTERS == ("none", *DRAFTERS)
    assert set(MODEL_DRAFTERS) == {"model", "composite"}
    assert set(FREE_DRAFTERS) == {"lookup", "prediction"}
    assert set(LOOKUP_DRAFTERS) == {"lookup", "prediction", "composite"}
