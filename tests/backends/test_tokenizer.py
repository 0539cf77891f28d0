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
