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

    tok = tokenizer.load_tokenizer(smol_path)
    data = bytearray(smol_path.read_bytes())
    at = data.index(b"general.file_type") + len(b"general.file_type")
    assert struct.unpack_from("<I", data, at)[0] == 4  # uint32
    struct.pack_into("<I", data, at + 4, 2)  # MOSTLY_Q4_0
    twin = tmp_path / "smollm2-q4_0.gguf"
    twin.write_bytes(bytes(data) + b"\0" * 64)  # another size and tail: another file key
    assert tokenizer.gguf_cache_key(twin) != tokenizer.gguf_cache_key(smol_path)
    real = tokenizer.gguf_tokenizer

    def no_conversion(path: object) -> object:
        raise AssertionError("the GGUF tokenizer was converted again")

    monkeypatch.setattr(tokenizer, "gguf_tokenizer", no_conversion)
    again = tokenizer.load_tokenizer(twin)
    text = "def count(n):\n    return n + 1  # café"
    assert again(text)["input_ids"] == tok(text)["input_ids"] and len(again) == len(tok)
    assert converted_dir("tokenizers", twin).is_dir()
    # The shared conversion damaged: the next file with that metadata converts it again (as
    # a file's own damaged conversion is) instead of failing on every load.
    monkeypatch.setattr(tokenizer, "gguf_tokenizer", real)
    meta = converted_dir("tokenizers", smol_path, "m" + tokenizer.gguf_metadata_key(smol_path))
    (meta / "tokenizer.json").write_text("{truncated")
    third = tmp_path / "smollm2-other.gguf"
    third.write_bytes(bytes(data) + b"\1" * 64)
    assert tokenizer.load_tokenizer(third)(text)["input_ids"] == tok(text)["input_ids"]


def _tiny_tokenizer_gguf(path: Path, arch: str) -> Path:
    """A GGUF of metadata alone holding a small tokenizer of the kind `arch`'s files hold (BPE
    for llama and qwen2, sentencepiece with scores for gemma3)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(64)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    if arch == "gemma3":
        pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "ab"]
        pieces.append("\u2581ab")
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
        w.add_token_types([3, 3, 3, 2, 1, 1, 1, 1, 1, 1])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
    else:
        pieces = ["a", "b", "\u0120", "ab", "\u0120a", "<|endoftext|>"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_list(pieces)
        w.add_token_merges(["a b", "\u0120 a"])
        w.add_token_types([1, 1, 1, 1, 1, 3])
        w.add_eos_token_id(5)
        w.add_bos_token_id(5)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", sorted(tokenizer.GGUF_TOKENIZER_CLASSES))
def test_a_gguf_tokenizer_is_converted_as_autotokenizer_converts_it(tmp_path, arch):
    """The conversion without the model config (GGUF_TOKENIZER_CLASSES) gives AutoTokenizer's
    class and saves the same files, byte for byte, for every architecture it takes."""
    from transformers import AutoTokenizer

    path = _tiny_tokenizer_gguf(tmp_path / f"{arch}.gguf", arch)
    ours, theirs = (
        tokenizer.gguf_tokenizer(path),
        AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name),
    )
    assert type(ours) is type(theirs)
    assert type(ours).__name__ == tokenizer.GGUF_TOKENIZER_CLASSES[arch]
    for tok, out in ((ours, tmp_path / "ours"), (theirs, tmp_path / "theirs")):
        tok.save_pretrained(out)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert "tokenizer.json" in files and "chat_template.jinja" in files
    for name in files:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()
    assert ours(" ab a b")["input_ids"] == theirs(" ab a b")["input_ids"]


def test_files_autotokenizer_may_read_otherwise_take_its_own_path(tmp_path, monkeypatch):
    """A Mistral model's "llama" file, a file with a tokenizer_config.json beside it and an
    architecture not in the table go through AutoTokenizer itself."""
    from transformers import AutoTokenizer

    calls: list[str] = []
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda d, gguf_file: calls.append(gguf_file) or gguf_file
    )
    mistral = _tiny_tokenizer_gguf(tmp_path / "m.gguf", "llama")
    data = mistral.read_bytes().replace(b"tiny-llama", b"Mistral-7b")
    mistral.write_bytes(data)
    assert tokenizer.gguf_tokenizer(mistral) == "m.gguf"
    other = _tiny_tokenizer_gguf(tmp_path / "phi.gguf", "phi3")
    assert tokenizer.gguf_tokenizer(other) == "phi.gguf"
    beside = tmp_path / "beside"
    beside.mkdir()
    qwen = _tiny_tokenizer_gguf(beside / "q.gguf", "qwen2")
    assert type(tokenizer.gguf_tokenizer(qwen)).__name__ == "Qwen2Tokenizer" and len(calls) == 2
    (beside / "tokenizer_config.json").write_text("{}")
    assert tokenizer.gguf_tokenizer(qwen) == "q.gguf" and len(calls) == 3
