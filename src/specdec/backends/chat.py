"""Text in, token ids out: chat templating, stop ids, decoding.

Every decoding path (baseline, speculative, any drafter, any backend) receives the ids produced
here, so prompts are templated identically everywhere (paper, section 5, "Prompts").
"""

from __future__ import annotations

from typing import Any

from specdec.core.edits import hint_ids, named_rewrites

#: End-of-turn markers of the chat formats we ship models for (ChatML, Llama 3, Gemma).
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<eos>")


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template (a mock or a base model): send raw text instead."""


def encode_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template, ready for the assistant;
    `tools` (OpenAI's function definitions) rendered by the template too.

    The one chat encoding of the project: the CLI, the bench and the server all use it.
    NoChatTemplateError when there is no template; ValueError when the template rejects the
    messages (jinja raises TemplateError, e.g. for an unsupported role).
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model has no chat template (a mock or base model)")
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    # The template already holds any BOS token: do not let the tokenizer add a second one.
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def encode(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids for `text`: the user turn of the model's chat template when it has one."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (a mock?); pass token ids instead of text")
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


def encode_prediction(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prediction (OpenAI's Predicted Outputs): the text alone, no chat template
    and no special tokens, so it tokenizes as the answer would when it repeats the text."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (a mock?); pass the prediction as ids")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prediction_hints(tokenizer: Any, instruction: str) -> list[tuple[tuple[int, ...], ...]]:
    """The rewrites an instruction names ("rename `X` to `Y`", core.edits.named_rewrites) as
    (old ids, new ids) pairs, tokenized as the prediction is, for PredictionIndex's `hints`: a
    prediction is then drafted with them applied from the first occurrence on. [] without a
    tokenizer or a named rewrite."""
    pairs = named_rewrites(instruction)
    if tokenizer is None or not pairs:
        return []
    return hint_ids(pairs, lambda text: encode_prediction(tokenizer, text))


def stop_ids(tokenizer: Any) -> list[int]:
    """EOS plus the end-of-turn markers present in this vocabulary."""
    if tokenizer is None:
        return []
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in _END_OF_TURN if t in vocab)
    return sorted(ids)


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Text of generated ids, without special tokens."""
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=True)
