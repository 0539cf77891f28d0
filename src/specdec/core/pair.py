"""Whether a draft can draft for a target: they must share one tokenizer.

    check_pair(draft, target)   refuse a draft/target pair that does not share a tokenizer, and
                                return the shared sampling width: the min of the two logit
                                widths, since families pad their output layers differently.

Tokenizers are compared through their HF interface (`get_vocab`, `added_tokens_decoder`) only,
so this needs no backend: a model's `tokenizer` attribute is the contract.
"""

from __future__ import annotations

import weakref
from typing import Any

from specdec.core.model import SpecModel

# How many differing tokens an IncompatiblePairError quotes.
_N_EXAMPLES = 3


class IncompatiblePairError(ValueError):
    """Draft and target do not share a tokenizer, so the draft's ids mean nothing to the target."""


def _added(tok: Any) -> dict[int, tuple[str, bool]]:
    return {i: (t.content, bool(t.special)) for i, t in tok.added_tokens_decoder.items()}


def _describe_difference(vocab_d: dict[str, int], vocab_t: dict[str, int]) -> str:
    """A few concrete disagreements: token texts the two vocabularies map to different ids."""
    inv_t = {i: s for s, i in vocab_t.items()}
    examples = []
    for text, i in sorted(vocab_d.items(), key=lambda kv: kv[1]):
        j = vocab_t.get(text)
        if j == i:
            continue
        where = f"id {j}" if j is not None else "absent"
        other = f", and the target's id {i} is {inv_t[i]!r}" if i in inv_t else ""
        examples.append(f"{text!r} is id {i} in the draft but {where} in the target{other}")
        if len(examples) >= _N_EXAMPLES:
            break
    return "; ".join(examples) if examples else "the added/special tokens differ"


def check_tokenizers(
    draft_tok: Any,
    target_tok: Any,
    *,
    draft_width: int,
    target_width: int,
    draft_name: str = "draft",
    target_name: str = "target",
) -> int:
    """Validate that two HF tokenizers are the same and return the shared sampling width.

    Same means: equal `get_vocab()` (text -> id, added tokens included) and equal added tokens
    (content and special flag per id). Both are dict comparisons, ~0.1 s for a 150k vocabulary.
    The width is min(draft_width, target_width); every tokenizer id must fit below it.
    """
    width = min(draft_width, target_width)
    if draft_tok is not target_tok:
        vocab_d, vocab_t = draft_tok.get_vocab(), target_tok.get_vocab()
        if vocab_d != vocab_t or _added(draft_tok) != _added(target_tok):
            raise IncompatiblePairError(
                f"draft {draft_name!r} and target {target_name!r} do not share a tokenizer: "
                f"the draft's vocabulary has {len(vocab_d)} tokens (logit width {draft_width}), "
                f"the target's {len(vocab_t)} (logit width {target_width}); e.g. "
                f"{_describe_difference(vocab_d, vocab_t)}. Draft token ids would mean "
                "other tokens to the target. Fix: use a draft from the same model family / "
                "tokenizer as the target."
            )
    else:
        vocab_d = draft_tok.get_vocab()
    top = max(vocab_d.values()) + 1 if vocab_d else 0
    if top > width:
        raise IncompatiblePairError(
            f"tokenizer ids reach {top - 1}, but the shared logit width of {draft_name!r} "
            f"({draft_width}) and {target_name!r} ({target_width}) is {width}: some tokens "
            "could be produced by the tokenizer yet never scored. Fix: pair models whose output "
            "layers cover the whole tokenizer (same family and size class)."
        )
    return width


#: Pairs already checked: draft -> {target: width}, both held weakly. A loaded model's
#: tokenizer never changes, and the vocabulary comparison costs ~0.1 s for 150k-token
#: vocabularies, which a server would otherwise pay on every request.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_pair(draft: SpecModel, target: SpecModel) -> int:
    """`_check_pair`, once per (draft, target) pair of loaded models."""
    try:
        seen = _CHECKED.setdefault(draft, weakref.WeakKeyDictionary())
        if target not in seen:
            seen[target] = _check_pair(draft, target)
        return seen[target]
    except TypeError:  # not weak-referenceable (a stand-in object): check every time
        return _check_pair(draft, target)


def _check_pair(draft: SpecModel, target: SpecModel) -> int:
    """Refuse a pair that does not share a tokenizer; return the shared sampling width.

    HF tokenizers on both sides (any backend: llama.cpp models carry the HF tokenizer converted
    from their GGUF) -> vocabulary comparison. Tokenizer-less models (mocks) -> their
    `vocab_fingerprint`s must match. A mock paired with a real model is refused.
    """
    d_tok, t_tok = draft.tokenizer, target.tokenizer
    if d_tok is not None and t_tok is not None:
        return check_tokenizers(
            d_tok,
            t_tok,
            draft_width=draft.vocab_size,
            target_width=target.vocab_size,
            draft_name=draft.name,
            target_name=target.name,
        )
    fp_d = None if d_tok is not None else getattr(draft, "vocab_fingerprint", None)
    fp_t = None if t_tok is not None else getattr(target, "vocab_fingerprint", None)
    if fp_d is None or fp_t is None or fp_d != fp_t:

        def what(m: SpecModel, fp: str | None) -> str:
            if m.tokenizer is not None:
                return f"an HF tokenizer of {len(m.tokenizer)} tokens"
            return f"vocabulary fingerprint {fp!r}" if fp else "no tokenizer and no fingerprint"

        raise IncompatiblePairError(
            f"draft {draft.name!r} ({what(draft, fp_d)}, logit width {draft.vocab_size}) and "
            f"target {target.name!r} ({what(target, fp_t)}, logit width {target.vocab_size}) "
            "do not share a tokenizer. Fix: use a draft from the same model family / tokenizer "
            "(mock models pair only with mock models of the same vocab size)."
        )
    return min(draft.vocab_size, target.vocab_size)
