"""One tokenizer (paper, section 4, "One tokenizer"): loading it.

The Hugging Face tokenizer is the single source of truth for token ids; llama.cpp receives ids and
never re-tokenizes. Whether two models share one is `core.pair.check_pair`.

    load_tokenizer(path)        the HF tokenizer for a model directory or a .gguf file. Converting
                                a GGUF vocabulary with transformers takes seconds to tens of
                                seconds (150k tokens + merges), so the converted tokenizer is
                                saved once under $SPECDEC_HOME/tokenizers/<key>/ and reloaded
                                from there (well under a second).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# The converted tokenizer (and config) depend only on the GGUF metadata, which sits at the start of
# the file; the tail and the size tell two models with equal metadata apart. Hashing these samples
# instead of the whole file keeps the key cheap for multi-GB models (a full sha256 of a 1 GB file
# costs seconds on every load).
_KEY_HEAD_BYTES = 16 * 1024 * 1024
_KEY_TAIL_BYTES = 1024 * 1024
_KEY_HEX = 16
_META = "specdec-conversion.json"


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
    from specdec.backends.registry import specdec_home

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
