"""The conversion cache under $SPECDEC_HOME/<kind>/<key>/: whatever stray state is left there, the
next load converts again instead of failing forever.

The fast tests drive `cached_conversion` / `load_conversion` with a stand-in converter on a small
file (the key only hashes bytes); the slow one loads the real smollm2 tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.backends import tokenizer
from specdec.backends.tokenizer import cached_conversion, converted_dir, load_conversion


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return path


class Converter:
    """save(dir) writes one file; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "tokenizer.json").write_text(json.dumps({"ok": True}))


def read(d: Path) -> dict:
    return json.loads((d / "tokenizer.json").read_text())


def test_conversion_is_made_once_then_reused(gguf):
    save = Converter()
    first = cached_conversion("tokenizers", gguf, save)
    assert cached_conversion("tokenizers", gguf, save) == first and save.calls == 1


@pytest.mark.parametrize("stray", ["file_in_dir", "file_at_key", "bad_stamp", "link_at_key"])
def test_stray_state_at_the_key_is_replaced(gguf, tmp_path, stray):
    final = converted_dir("tokenizers", gguf)
    final.parent.mkdir(parents=True)
    if stray == "file_in_dir":  # e.g. .DS_Store, or a conversion a crash left without its stamp
        final.mkdir()
        (final / ".DS_Store").write_bytes(b"\0")
    elif stray == "file_at_key":
        final.write_text("stray")
    elif stray == "bad_stamp":
        final.mkdir()
        (final / tokenizer._META).write_text("[not, an, object")
    else:
        final.symlink_to(tmp_path / "elsewhere")
    save = Converter()
    got = cached_conversion("tokenizers", gguf, save)
    assert got == final and read(got) == {"ok": True} and save.calls == 1
    assert cached_conversion("tokenizers", gguf, save) == final and save.calls == 1


def test_a_conversion_that_fails_to_load_is_made_again(gguf):
    save = Converter()
    final = cached_conversion("tokenizers", gguf, save)
    (final / "tokenizer.json").write_text("{truncated")  # stamp intact, contents damaged
    assert load_conversion("tokenizers", gguf, save, read) == {"ok": True}
    assert save.calls == 2

    # A loader that fails on a fresh conversion too is not retried forever.
    def broken(d: Path) -> dict:
        raise ValueError("unsupported tokenizer")

    with pytest.raises(ValueError, match="unsupported tokenizer"):
        load_conversion("tokenizers", gguf, save, broken)
    assert save.calls == 3


@pytest.mark.model
def test_real_tokenizer_loads_past_a_stray_file(smol_path):
    final = converted_dir("tokenizers", smol_path)
    final.mkdir(parents=True)
    (final / "stray.txt").write_text("left by someone")
    tok = tokenizer.load_tokenizer(smol_path)
    assert len(tok) == 49152 and (final / tokenizer._META).is_file()
    assert not (final / "stray.txt").exists()


def _tiny_gguf(
    path: Path, file_type: int, extra: dict[str, str] | None = None, **kv: object
) -> Path:
    """A GGUF of metadata alone: a tokenizer's fields (`kv` overrides them), `file_type`."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_quantization_version(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(kv.get("tokens", ["a", "b", "ab"]))
    w.add_token_merges(kv.get("merges", ["a b"]))
    w.add_token_types([1, 1, 1])
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_metadata_key_leaves_out_what_a_requantization_rewrites(tmp_path):
    """Equal for files that differ in what llama.cpp's quantize rewrites (the file type, the
    quantization version, its quantize.* records); different when a tokenizer field differs."""
    key = tokenizer.gguf_metadata_key
    base = key(_tiny_gguf(tmp_path / "a.gguf", 2))
    assert key(_tiny_gguf(tmp_path / "b.gguf", 15, {"quantize.imatrix.file": "x.dat"})) == base
    assert key(_tiny_gguf(tmp_path / "c.gguf", 2, tokens=["a", "b", "ba"])) != base
    assert key(_tiny_gguf(tmp_path / "d.gguf", 2, merges=["b a"])) != base
    assert key(_tiny_gguf(tmp_path / "e.gguf", 2, {"general.name": "other"})) != base
    (tmp_path / "f.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        key(tmp_path / "f.gguf")


@pytest.mark.model
def test_a_requantized_file_takes_its_sources_tokenizer_without_converting(
    smol_path, tmp_path, monkeypatch
):
    """A file whose metadata differs from smollm2's only in the file type (as a requantization's
    does) and whose bytes differ elsewhere (another file key) gets smollm2's conversion: the
    GGUF converter is not called again, and the tokenizer encodes alike."""
    import struct

    from transformers import AutoTokenizer

    tok = tokenizer.load_tokenizer(smol_path)
    data = bytearray(smol_path.read_bytes())
    at = data.index(b"general.file_type") + len(b"general.file_type")
    assert struct.unpack_from("<I", data, at)[0] == 4  # uint32
    struct.pack_into("<I", data, at + 4, 2)  # MOSTLY_Q4_0
    twin = tmp_path / "smollm2-q4_0.gguf"
    twin.write_bytes(bytes(data) + b"\0" * 64)  # another size and tail: another file key
    assert tokenizer.gguf_cache_key(twin) != tokenizer.gguf_cache_key(smol_path)
    real = AutoTokenizer.from_pretrained

    def no_conversion(*args: object, **kw: object) -> object:
        assert "gguf_file" not in kw, "the GGUF tokenizer was converted again"
        return real(*args, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    again = tokenizer.load_tokenizer(twin)
    text = "def count(n):\n    return n + 1  # café"
    assert again(text)["input_ids"] == tok(text)["input_ids"] and len(again) == len(tok)
    assert converted_dir("tokenizers", twin).is_dir()
    # The shared conversion damaged: the next file with that metadata converts it again (as
    # a file's own damaged conversion is) instead of failing on every load.
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    meta = converted_dir("tokenizers", smol_path, "m" + tokenizer.gguf_metadata_key(smol_path))
    (meta / "tokenizer.json").write_text("{truncated")
    third = tmp_path / "smollm2-other.gguf"
    third.write_bytes(bytes(data) + b"\1" * 64)
    assert tokenizer.load_tokenizer(third)(text)["input_ids"] == tok(text)["input_ids"]
