"""Build the llama-cpp-python that the llamacpp backend runs: pinned source, specdec's patches,
compiled for this machine's CPU (-march=native), as llama.cpp's users build it.

    python -m specdec.backends.llamacpp_build install    (what `make venv` runs)

Why native, measured (docs/kernels.md): on an AVX-512/AMX host, ggml's portable AVX2 kernels
prefill 2.4x slower than native ones and verify 16 tokens 1.7x slower; ggml's every-variant build
(GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, llama.cpp's release configuration) matched native on
the single step and the verify curve but prefilled 7% slower, and took 355 s to build against
166 s. A native wheel only runs on CPUs with the build host's instructions, and the hosts behind
one VM type change from day to day, so it is keyed by the CPU: wheels are cached under
$SPECDEC_HOME/wheels/<key>/ with the CPU's flags in the key, the Makefile rebuilds when the host
changes, and the backend refuses a build made for instructions this CPU lacks (check_build)
instead of dying with SIGILL in the first matmul.

The source is the llama-cpp-python sdist at VERSION, checked against SDIST_SHA256, with every
patch in patches/ applied by `git apply` (a patch that does not apply stops the build):
`fix-*` patches are upstream bug fixes (also given to the stock peer, study.engines.anchors),
`specdec-*` patches are specdec's own changes. specdec-sdmm.patch hooks specdec's matmul for
verify batches (native/, copied into ggml-cpu/sdmm/ before the patches apply) into ggml-cpu as an
extra buffer type: docs/kernels.md. specdec-no-common.patch leaves llama.cpp's common library
(argument parsing, chat templates and downloads for its tools) out of the wheel, which loads
libllama and ggml alone. The "portable" flavor (GGML_NATIVE=OFF, AVX2) is built only
to test that a lesser CPU's code path runs and agrees, and there only its CPU backend
(build_cpu_backend; tests/backends/test_kernels.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
#: The sdist carries no git metadata: its hash names the exact source.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PATCHES = Path(__file__).with_name("patches")
#: specdec's own C/C++ sources (sdmm), copied into the patched tree's ggml-cpu/sdmm/.
NATIVE = Path(__file__).with_name("native")
NATIVE_DEST = Path("vendor/llama.cpp/ggml/src/ggml-cpu/sdmm")
#: Flags every flavor shares: none of the tools, examples or servers the Python package never uses.
_COMMON_FLAGS = (
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
)
#: flavor -> the CMake flags that choose ggml's kernels. "native" is the one `make venv` installs.
KERNEL_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "portable": ("-DGGML_NATIVE=OFF",),
}
#: Written into the wheel's llama_cpp package: what it was built from and for which CPU.
MANIFEST = "specdec_build.json"


class BuildError(RuntimeError):
    """The source could not be fetched, patched or built; the message says what to do."""


def home() -> Path:
    env = os.environ.get("SPECDEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def patch_files(fixes_only: bool = False) -> list[Path]:
    """The patches in the order they apply. fix-*: upstream bug fixes, without which this
    llama.cpp cannot run on some CPUs (also applied to the stock peer, study.engines.anchors);
    specdec-*: specdec's own changes (the wheel only)."""
    return sorted(PATCHES.glob("fix-*.patch" if fixes_only else "*.patch"))


def native_files() -> list[Path]:
    """specdec's kernel sources, in a fixed order (they go with the specdec-* patches)."""
    return sorted(p for p in NATIVE.iterdir() if p.suffix in (".c", ".cpp", ".h"))


def fetch_sdist(
    dest: Path,
    timeout: float = 600.0,
    *,
    package: str = PACKAGE,
    version: str = VERSION,
    sha256: str = SDIST_SHA256,
) -> Path:
    """The pinned sdist of `package` (llama-cpp-python unless told) in `dest` (reused if
    already there), its sha256 checked."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{package.replace('-', '_')}-{version}.tar.gz"
    if not path.is_file():
        # the package from source, its build requirements as wheels: `--no-binary :all:` would
        # build those from source too (cmake and ninja among them) only to read the metadata
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", package, "--no-deps"]
        cmd += ["--quiet", "-d", str(dest), f"{package}=={version}"]
        try:
            subprocess.run(cmd, check=True, timeout=timeout, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            tail = "\n".join(e.stderr.strip().splitlines()[-6:])
            raise BuildError(
                f"pip could not download the {package} {version} sdist:\n{tail}"
            ) from e
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"pip download of the {package} sdist ran past {timeout:.0f} s"
            ) from None
        if not path.is_file():
            raise BuildError(f"pip download left no {path.name} in {dest}")
    digest = _sha256(path)
    if digest != sha256:
        path.unlink()
        raise BuildError(
            f"{path.name} has sha256 {digest}, not the pinned {sha256}: the package was "
            "republished or the download is damaged; it was deleted, run the build again"
        )
    return path


def prepare_source(sdist: Path, dest: Path, fixes_only: bool = False) -> Path:
    """Extract `sdist` into `dest`, add specdec's kernel sources (unless fixes_only) and apply
    the patches (patch_files); the package's source directory (llama.cpp is its
    vendor/llama.cpp)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    roots = [p for p in dest.iterdir() if (p / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file()]
    if len(roots) != 1:
        raise BuildError(f"{sdist.name} has no vendor/llama.cpp with a CMakeLists.txt")
    if not fixes_only:
        (roots[0] / NATIVE_DEST).mkdir(parents=True)
        for f in native_files():
            shutil.copy2(f, roots[0] / NATIVE_DEST / f.name)
    for patch in patch_files(fixes_only):
        for check in (True, False):
            cmd = ["git", "apply", *(["--check"] if check else []), str(patch)]
            res = subprocess.run(cmd, cwd=roots[0], capture_output=True, text=True)
            if res.returncode != 0:
                raise BuildError(
                    f"patch {patch.name} does not apply to {sdist.name}:\n{res.stderr.strip()}\n"
                    f"update the patch in {PATCHES} for this source"
                )
    return roots[0]


def cpu_flags() -> list[str]:
    """The instruction-set flags of this CPU, as Linux reports them (sorted; [] elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cmake_flags(flavor: str = "native") -> tuple[str, ...]:
    if flavor not in KERNEL_FLAGS:
        raise BuildError(f"unknown flavor {flavor!r}; choose from {', '.join(KERNEL_FLAGS)}")
    return (*KERNEL_FLAGS[flavor], *_COMMON_FLAGS)


def wheel_key(flavor: str = "native") -> str:
    """What a wheel is built from: version, sdist, patches, flags, Python, and for a native
    build the CPU's flags (a native wheel runs only where they all are)."""
    h = hashlib.sha256()
    parts = [PACKAGE, VERSION, SDIST_SHA256, *cmake_flags(flavor), sys.implementation.cache_tag]
    if flavor == "native":
        parts += cpu_flags()
    for part in [*parts, source_digest()]:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def source_digest() -> str:
    """specdec's own part of a build, as a name: the patches and the native kernels' sources. A
    kernel's speed is part of what k="auto"'s curves depend on (backends.llamacpp.cost_key)."""
    h = hashlib.sha256()
    for f in [*patch_files(), *native_files()]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def wheel_dir(flavor: str = "native") -> Path:
    return home() / "wheels" / f"{PACKAGE}-{VERSION}-{flavor}-{wheel_key(flavor)}"


def cached_wheel(flavor: str = "native") -> Path | None:
    found = sorted(wheel_dir(flavor).glob("*.whl"))
    return found[0] if found and (wheel_dir(flavor) / MANIFEST).is_file() else None


def build_wheel(flavor: str = "native", jobs: int | None = None, log=print) -> Path:
    """The wheel for wheel_key(flavor), built once (~3 min on 2 cores) and cached."""
    wheel = cached_wheel(flavor)
    if wheel is not None:
        return wheel
    digest = source_digest()  # with the key that names `out`, before the sources are copied
    flags = cmake_flags(flavor)
    out = wheel_dir(flavor)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Built into a temporary directory and moved into place whole: an interrupted build leaves
    # nothing that a later run would take for a finished one.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        sdist = fetch_sdist(home() / "sdists")
        src = prepare_source(sdist, work / "src")
        n = len(patch_files())
        log(f"building {PACKAGE} {VERSION} ({flavor}, {n} patch(es)); ~3 min on 2 cores")
        info = {
            "package": PACKAGE,
            "version": VERSION,
            "sdist_sha256": SDIST_SHA256,
            "patches": [p.name for p in patch_files()],
            "native": [f.name for f in native_files()],
            "source_digest": digest,
            "flavor": flavor,
            "cmake_flags": list(flags),
            # a native build runs only on CPUs with every one of these (check_build)
            "cpu_flags": cpu_flags() if flavor == "native" else [],
            "cpu_model": cpu_model(),
        }
        (src / "llama_cpp" / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
        env = {
            **os.environ,
            "CMAKE_ARGS": " ".join(flags),
            "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 1),
        }
        built = work / "wheel"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir"]
        cmd += ["-w", str(built), str(src)]
        with (work / "build.log").open("w") as f:
            res = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        if res.returncode != 0:
            raise _build_failed(PACKAGE, res.returncode, work / "build.log")
        info["build_s"] = round(time.monotonic() - t0, 1)
        info["built"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (built / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
        shutil.copy2(work / "build.log", built / "build.log")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(built, out)
    log(f"built in {info['build_s']:.0f} s -> {out}")
    # from `out`, whose key was taken before the sources were copied: a source edited during
    # the build gets a build of its own next time
    return next(out.glob("*.whl"))


def build_cpu_backend(flavor: str = "portable", jobs: int | None = None, log=print) -> Path:
    """libggml-cpu.so alone for `flavor`, from the wheel's patched source, built once and cached:
    the CPU kernels are all a flavor changes, so the rest of llama.cpp (libllama, ggml's other
    libraries) need not be compiled again. A copy of the installed package with this
    library in place of its own runs the flavor's kernels (tests/backends/test_kernels.py)."""
    out = home() / "wheels" / f"ggml-cpu-{VERSION}-{flavor}-{wheel_key(flavor)}"
    lib = out / "libggml-cpu.so"
    if lib.is_file():
        return lib
    if shutil.which("cmake") is None:
        raise BuildError("building ggml-cpu alone needs cmake (apt-get install cmake)")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        src = prepare_source(fetch_sdist(home() / "sdists"), work / "src") / "vendor" / "llama.cpp"
        build = work / "build"
        log(f"building ggml-cpu of {PACKAGE} {VERSION} ({flavor})")
        configure = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
        configure += ["-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_COMMON=OFF", *cmake_flags(flavor)]
        compile_ = ["cmake", "--build", str(build), "--target", "ggml-cpu"]
        compile_ += ["-j", str(jobs or os.cpu_count() or 1)]
        with (work / "build.log").open("w") as f:
            for cmd in (configure, compile_):
                res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
                if res.returncode != 0:
                    raise _build_failed("ggml-cpu", res.returncode, work / "build.log")
        built = [p for p in build.rglob("libggml-cpu.so") if p.is_file()]
        if len(built) != 1:
            raise BuildError(f"the ggml-cpu build left {len(built)} libggml-cpu.so, not one")
        staged = work / "out"
        staged.mkdir()
        shutil.copy2(built[0], staged / lib.name)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staged, out)
    log(f"built in {time.monotonic() - t0:.0f} s -> {lib}")
    return lib


def _build_failed(what: str, returncode: int, log: Path) -> BuildError:
    """The error for a failed compile, with the last lines of its log."""
    tail = "\n".join(log.read_text().splitlines()[-20:])
    return BuildError(f"building {what} failed ({returncode}):\n{tail}")


def install(jobs: int | None = None) -> Path:
    """Build (or reuse) the native wheel and install it into this Python, replacing any other
    llama-cpp-python."""
    wheel = build_wheel("native", jobs)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall"]
    subprocess.run([*cmd, str(wheel)], check=True)
    return wheel


def installed_manifest(package_dir: Path) -> dict | None:
    """The manifest of the llama_cpp package in `package_dir` (None: not built by specdec)."""
    path = package_dir / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def check_build(package_dir: Path) -> None:
    """BuildError if the llama_cpp in `package_dir` was compiled for instructions this CPU
    lacks: loading it would end the process with SIGILL at the first matmul."""
    info = installed_manifest(package_dir)
    if not info or not info.get("cpu_flags"):
        return  # not a native specdec build: ggml's own builds run anywhere they install
    here = set(cpu_flags())
    missing = sorted(set(info["cpu_flags"]) - here) if here else []
    if missing:
        raise BuildError(
            f"this llama-cpp-python was compiled with -march=native on another CPU "
            f"({info.get('cpu_model')}), and this one ({cpu_model()}) lacks "
            f"{', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}; rebuild it for "
            "this CPU with `make venv` (or python -m specdec.backends.llamacpp_build install)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("install", "wheel", "source"))
    ap.add_argument("--flavor", choices=tuple(KERNEL_FLAGS), default="native", help="wheel only")
    ap.add_argument("--dest", type=Path, help="source: where to extract the patched source")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all)")
    args = ap.parse_args(argv)
    try:
        if args.action == "install":
            print(install(args.jobs))
        elif args.action == "wheel":
            print(build_wheel(args.flavor, args.jobs))
        else:
            if args.dest is None:
                ap.error("source needs --dest DIR")
            print(prepare_source(fetch_sdist(home() / "sdists"), args.dest))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
