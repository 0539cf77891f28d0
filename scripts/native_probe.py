#!/usr/bin/env python3
"""What a -march=native build of the same llama.cpp changes, measured with the project's commands.

The wheel `make venv` builds is portable (the Makefile's CMAKE_ARGS: -DGGML_NATIVE=OFF, AVX2
kernels), so that one cached wheel runs on any CI machine. This builds the llama.cpp vendored in
the installed llama-cpp-python's sdist once more, as shared libraries with -DGGML_NATIVE=ON
(~5 min on 2 cores), into $SPECDEC_HOME/native/llama-cpp-python-<version>/, next to a copy of the
installed `llama_cpp` package whose lib/ holds them, and runs the command after `--` with that
copy first on PYTHONPATH (same Python code, other kernels):

    .venv/bin/python scripts/native_probe.py -- .venv/bin/specdec microbench \\
        --target llamacpp:qwen2.5-coder-1.5b --max-batch 64 --repeats 2 --prefix 1024 \\
        --tag native-ctx1024 --out results/cpu

k="auto"'s cost store is keyed by the compiled-in CPU features, so the two builds keep separate
curves. Nothing in the venv is changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec.backends.registry import specdec_home
from specdec.study import anchors

CMAKE = [
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # the libraries find each other beside themselves in lib/, not in the (deleted) build tree
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
]


def build(version: str) -> Path:
    """The shadow site directory holding llama_cpp with native libraries (built once)."""
    import llama_cpp

    root = specdec_home() / "native" / f"{anchors.PACKAGE}-{version}"
    site = root / "site"
    if (site / "llama_cpp" / "lib" / "libllama.so").is_file():
        return site
    anchors._need_tools()
    with tempfile.TemporaryDirectory(prefix="specdec-native-") as tmp:
        print(f"downloading the {anchors.PACKAGE} {version} sdist", file=sys.stderr)
        src = anchors._extract_llama_cpp(anchors._fetch_sdist(version, Path(tmp), 600), Path(tmp))
        out = Path(tmp) / "build"
        print("building llama.cpp with -DGGML_NATIVE=ON (~5 min on 2 cores)", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *CMAKE], check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(out), "--target", "llama", "-j", jobs], check=True)
        pkg = site / "llama_cpp"
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(Path(llama_cpp.__file__).parent, pkg)
        for f in (pkg / "lib").iterdir():
            f.unlink()
        for f in (out / "bin").glob("*.so*"):
            shutil.copy2(f, pkg / "lib" / f.name, follow_symlinks=False)
    return site


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    site = build(anchors.installed_version())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    info = subprocess.run(
        [
            sys.executable,
            "-c",
            "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"native llama_cpp in {site}: {info.stdout.strip()}", file=sys.stderr)
    return subprocess.run(cmd, env=env).returncode if cmd else 0


if __name__ == "__main__":
    sys.exit(main())
