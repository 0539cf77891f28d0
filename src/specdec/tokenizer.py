"""One tokenizer (paper, section 4, "One tokenizer").

The Hugging Face tokenizer is the single source of truth for token ids; llama.cpp receives ids and
never re-tokenizes. Two jobs live here:

    load_tokenizer(path)        the HF tokenizer for a model directory or a .gguf file. Converting
                                a GGUF vocabulary with transformers takes seconds to tens of
                                seconds (150k tokens + merges), so the converted tokenizer is
                                saved once under $SPECDEC_HOME/tokenizers/<key>/ and reloaded
                                from there (well under a second).
    check_pair(draft, target)   refuse a draft/target pair that does not share a tokenizer, and
                                return the shared sampling width: the min of the two logit
                                widths, since families pad their output layers differently.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models.base import SpecModel

# The converted tokenizer (and config) depend only on the GGUF metadata, which sits at the start of
# the file; the tail and the size tell two models with equal metadata apart. Hashing these samples
# instead of the whole file keeps the key cheap for multi-GB models (a full sha256 of a 1 GB file
# costs seconds on every load).
_KEY_HEAD_BYTES = 16 * 1024 * 1024
_KEY_TAIL_BYTES = 1024 * 1024
_KEY_HEX = 16
_META = "specdec-conversion.json"
# How many differing tokens an IncompatiblePairError quotes.
_N_EXAMPLES = 3


class IncompatiblePairError(ValueError):
    """Draft and target do not share a tokenizer, so the draft's ids mean nothing to the target."""


# --------------------------------------------------------------------------------- conversion cache
def gguf_cache_key(path: str | os.PathLike[str]) -> str:
    """A short content key for a GGUF file: sha256 over its size, first 16 MiB and last 1 MiB."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_KEY_HEAD_BYTES))
        if size > _KEY_HEAD_BYTES:
            f.seek(max(_KEY_HEAD_BYTES, size - _KEY_TAIL_BYTES))
            h.update(f.read())
    return h.hexdigest()[:_KEY_HEX]


def converted_dir(kind: str, gguf_path: str | os.PathLike[str]) -> Path:
    """$SPECDEC_HOME/<kind>/<key>: where conversions of `gguf_path` of this kind are cached."""
    from .registry import specdec_home

    return specdec_home() / kind / gguf_cache_key(gguf_path)


def cached_conversion(kind: str, gguf_path: str | os.PathLike[str], save: Any) -> Path:
    """Directory holding the `kind` conversion of `gguf_path`, created by `save(tmp_dir)` if absent.

    The directory is written under a temporary name and renamed into place, so a crash or a
    concurrent loader never sees a half-written conversion. A conversion made by another
    transformers version is redone: the GGUF converters change between releases.
    """
    import transformers

    final = converted_dir(kind, gguf_path)
    stamp = {"transformers": transformers.__version__}
    meta = final / _META
    if meta.is_file():
        try:
            if json.loads(meta.read_text()).get("transformers") == stamp["transformers"]:
                return final
        except (OSError, ValueError):
            pass  # unreadable stamp: convert again
        shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save(tmp)
        (tmp / _META).write_text(json.dumps({**stamp, "source": str(gguf_path)}) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _META).is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_tokenizer(path_or_dir: str | os.PathLike[str]) -> Any:
    """The HF tokenizer of a model directory or a .gguf file (GGUF conversions are cached)."""
    from transformers import AutoTokenizer

    path = Path(path_or_dir)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)

    def convert(out: Path) -> None:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tok.save_pretrained(out)

    return AutoTokenizer.from_pretrained(cached_conversion("tokenizers", path, convert))


# ----------------------------------------------------------------------------------- pair check
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


def check_pair(draft: SpecModel, target: SpecModel) -> int:
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
