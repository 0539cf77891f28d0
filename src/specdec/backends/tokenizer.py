"""One tokenizer (paper, section 4, "One tokenizer"): loading it.

The Hugging Face tokenizer is the single source of truth for token ids; llama.cpp receives ids and
never re-tokenizes. Whether two models share one is `core.pair.check_pair`.

    load_tokenizer(path)        the HF tokenizer for a model directory or a .gguf file. Converting
                                a GGUF vocabulary with transformers takes seconds to tens of
                                seconds (150k tokens + merges), so the converted tokenizer is
                                saved once under $SPECDEC_HOME/tokenizers/<key>/ and reloaded
                                from there (well under a second). A file requantized from
                                another holds the same tokenizer: its conversion is the first's,
                                found by the metadata's key (gguf_metadata_key), not made again.
    gguf_tokenizer(path)        the conversion itself: transformers' own GGUF tokenizer, built
                                without the model config it reads only to choose the class.
"""

from __future__ import annotations

import hashlib
import json
import logging
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

#: GGUF architecture -> the tokenizer class transformers' AutoTokenizer gives a file of it. The
#: class is all AutoTokenizer needs the model config for, and it builds that config with gguf-py's
#: reader, which makes an array per vocabulary entry (most of a conversion's time); the class
#: builds the tokenizer from the file alike either way. Each entry is checked against
#: AutoTokenizer (tests/backends/test_tokenizer.py); other files take AutoTokenizer's path.
GGUF_TOKENIZER_CLASSES = {
    "llama": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "gemma3": "GemmaTokenizer",
}

log = logging.getLogger(__name__)


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


#: What llama.cpp's quantize rewrites in the metadata it copies (llama_model_quantize_impl)
_REQUANT_KEYS = ("general.file_type", "general.quantization_version")


def gguf_metadata_key(path: str | os.PathLike[str]) -> str:
    """A key for what a GGUF file's conversions depend on: sha256 over its metadata's key-value
    records as stored, but those a requantization rewrites (_REQUANT_KEYS, quantize.*), so every
    file requantized from one model shares it (the header walked, well under a second)."""
    from specdec.backends.registry import gguf_records

    h = hashlib.sha256(b"gguf-metadata:")

    def visit(key: str, record: bytes) -> None:
        if key not in _REQUANT_KEYS and not key.startswith("quantize."):
            h.update(record)

    gguf_records(Path(path), visit)
    return h.hexdigest()[:_KEY_HEX]


def converted_dir(kind: str, gguf_path: str | os.PathLike[str], key: str | None = None) -> Path:
    """$SPECDEC_HOME/<kind>/<key>: where conversions of `gguf_path` of this kind are cached
    (`key`: under that name instead of the file's)."""
    from specdec.backends.registry import specdec_home

    return specdec_home() / kind / (key or gguf_cache_key(gguf_path))


def _is_current(final: Path, version: str) -> bool:
    try:
        return json.loads((final / _META).read_text()).get("transformers") == version
    except (OSError, ValueError, AttributeError):  # missing, unreadable, or not a JSON object
        return False


def _remove(path: Path) -> None:
    """Delete whatever is at `path`: a directory tree, a file or a link; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def cached_conversion(
    kind: str,
    gguf_path: str | os.PathLike[str],
    save: Any,
    *,
    redo: bool = False,
    key: str | None = None,
) -> Path:
    """Directory holding the `kind` conversion of `gguf_path` (under `key` if given), created by
    `save(tmp_dir)` if absent (or if `redo`).

    The directory is written under a temporary name and renamed into place, so a crash or a
    concurrent loader never sees a half-written conversion. A conversion made by another
    transformers version is redone: the GGUF converters change between releases.
    """
    import transformers

    final = converted_dir(kind, gguf_path, key)
    version = transformers.__version__
    if not redo and _is_current(final, version):
        return final
    # Whatever else is at `final` is ours and unusable: another version's conversion, a directory
    # a crash or a stray file left without its stamp, or a file where the directory belongs.
    # Left in place it would make the rename below fail on every load.
    _remove(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save(tmp)
        (tmp / _META).write_text(json.dumps({"transformers": version, "source": str(gguf_path)}))
        for attempt in (1, 2):
            try:
                os.rename(tmp, final)
                break
            except OSError as e:
                if _is_current(final, version):
                    break  # a concurrent loader renamed its conversion into place first
                if attempt == 2:
                    raise OSError(
                        f"cannot put the {kind} conversion of {gguf_path} at {final} ({e}); "
                        f"delete {final} and load again"
                    ) from e
                _remove(final)  # appeared since: something not written by a loader
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_conversion(
    kind: str, gguf_path: str | os.PathLike[str], save: Any, load: Any, key: str | None = None
) -> Any:
    """`load(dir)` of the cached `kind` conversion of `gguf_path` (made by `save` if absent;
    under `key` if given).

    A cached conversion that fails to load (a file in it damaged or replaced) is made again, once:
    the cache is ours and disposable, so any failure to read it is the cache's until a fresh
    conversion fails too.
    """
    final = cached_conversion(kind, gguf_path, save, key=key)  # a failing conversion raises here
    try:
        return load(final)
    except Exception as e:  # see the docstring; the retry re-raises
        log.warning("cached conversion %s failed to load (%s); converting again", final, e)
        return load(cached_conversion(kind, gguf_path, save, redo=True, key=key))


def gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The HF tokenizer transformers converts from a .gguf file, as AutoTokenizer gives it."""
    import transformers

    from specdec.backends.registry import gguf_metadata

    path = Path(path)
    meta = gguf_metadata(path)
    name = GGUF_TOKENIZER_CLASSES.get(meta.get("general.architecture", ""))
    # AutoTokenizer's own choice differs for a "llama" file of a Mistral model, and for a
    # directory with a tokenizer_config.json beside the file (it reads the class from there)
    if (
        name is None
        or "mistral" in meta.get("general.name", "").lower()
        or (path.parent / "tokenizer_config.json").exists()
    ):
        name = "AutoTokenizer"
    return getattr(transformers, name).from_pretrained(path.parent, gguf_file=path.name)


def load_tokenizer(path_or_dir: str | os.PathLike[str]) -> Any:
    """The HF tokenizer of a model directory or a .gguf file (GGUF conversions are cached)."""
    from transformers import AutoTokenizer

    path = Path(path_or_dir)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)

    def convert_file(out: Path) -> None:
        gguf_tokenizer(path).save_pretrained(out)

    def loads(d: Path) -> Path:
        AutoTokenizer.from_pretrained(d)
        return d

    def convert(out: Path) -> None:
        # by the metadata's key first: a requantized file's tokenizer is its source's, converted
        # once and copied (a copy: damage to one stays there; one that fails to load is made
        # again, as the file's own conversion is)
        meta = "m" + gguf_metadata_key(path)
        shared = load_conversion("tokenizers", path, convert_file, loads, key=meta)
        shutil.copytree(shared, out, ignore=shutil.ignore_patterns(_META), dirs_exist_ok=True)

    return load_conversion("tokenizers", path, convert, AutoTokenizer.from_pretrained)
