"""The llama.cpp build runs the best kernels this CPU has (backends/llamacpp_build.py).

`make venv` builds llama-cpp-python with -march=native for the machine it runs on. These tests
read what the loaded ggml says it was compiled with and hold it against the CPU's own flags, so
they fail on a portable build on an AVX-512 host and on a native build carried to a lesser
CPU; a build for instructions the CPU lacks is refused before it loads; the portable (AVX2)
code path a lesser CPU would take still runs and agrees.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.backends import llamacpp_build
from specdec.backends.llamacpp_kernels import kernels
from specdec.backends.llamacpp_lib import package_with_cpu_backend

#: llama.cpp's feature name -> the /proc/cpuinfo flag: with -march=native, each one the CPU has
#: is compiled in, and none it lacks.
FEATURES = {
    "AVX": "avx",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "BMI2": "bmi2",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AVX_VNNI": "avx_vnni",
    "AMX_INT8": "amx_int8",
}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/cpuinfo")


def test_the_installed_build_is_native_for_this_cpu() -> None:
    k = kernels()
    assert k["build"] == "native", k
    flags = set(llamacpp_build.cpu_flags())
    have = set(k["features"])
    wrong = sorted(f for f in have & set(FEATURES) if FEATURES[f] not in flags)
    assert not wrong, f"compiled with {wrong}, which this CPU lacks"
    missing = sorted(f for f, flag in FEATURES.items() if flag in flags and f not in have)
    assert not missing, f"this CPU has {missing}, but the build does not use them"
    assert [p.name for p in llamacpp_build.patch_files()] == k["patches"]
    # built from these kernels' sources: k="auto"'s stored curves are keyed by the digest
    assert k["source"] == llamacpp_build.source_digest(), "a stale build: make venv"


def test_the_source_digest_follows_every_kernel_source(tmp_path: Path, monkeypatch) -> None:
    """A change to any of specdec's kernel sources gives a new digest, and so a new wheel and
    new keys for k="auto"'s curves (a faster kernel moves the whole verify curve)."""
    files = []
    for name in ("sdmm.c", "sdfa.c"):
        (tmp_path / name).write_text("int x;\n")
        files.append(tmp_path / name)
    monkeypatch.setattr(llamacpp_build, "native_files", lambda: files)
    before = llamacpp_build.source_digest(), llamacpp_build.wheel_key()
    (tmp_path / "sdfa.c").write_text("int y;\n")
    after = llamacpp_build.source_digest(), llamacpp_build.wheel_key()
    assert before[0] != after[0] and before[1] != after[1]


def test_a_build_for_another_cpu_is_refused_before_it_loads(tmp_path: Path) -> None:
    info = {"flavor": "native", "cpu_model": "a bigger CPU"}
    info["cpu_flags"] = [*llamacpp_build.cpu_flags(), "avx1024"]
    (tmp_path / llamacpp_build.MANIFEST).write_text(json.dumps(info))
    with pytest.raises(llamacpp_build.BuildError, match=r"lacks avx1024; rebuild.*make venv"):
        llamacpp_build.check_build(tmp_path)
    info["cpu_flags"] = llamacpp_build.cpu_flags()[:5]  # fewer than this CPU has: runs
    (tmp_path / llamacpp_build.MANIFEST).write_text(json.dumps(info))
    llamacpp_build.check_build(tmp_path)


@pytest.mark.slow
def test_the_backend_refuses_such_a_build_with_the_fix(tmp_path: Path) -> None:
    """A whole process: a shadow llama_cpp package whose manifest names a CPU flag this one
    lacks is refused by the backend before libllama is loaded (no SIGILL)."""
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('libllama was imported')\n")
    info = {"flavor": "native", "cpu_model": "x", "cpu_flags": ["avx1024"]}
    (pkg / llamacpp_build.MANIFEST).write_text(json.dumps(info))
    code = "from specdec.backends.llamacpp_lib import bindings; bindings()"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "SpecModelError" in res.stderr and "lacks avx1024" in res.stderr, res.stderr[-800:]


_GREEDY = """
import hashlib, json
from specdec.backends import load_model
from specdec.backends.llamacpp_kernels import kernels
from specdec.backends.llamacpp_lib import package_dir
from specdec.core.config import Warp
from specdec.core.generate import generate
m = load_model("llamacpp:smollm2-135m", n_threads=1)
ids = m.tokenizer.encode("The three primary colours are")
out = generate(m, ids, warp=Warp(0.0), max_new_tokens=32)
row = m.forward(ids)[-1]
# top-1 minus top-2 logit where each generated token was chosen
top2 = m.forward(ids + out.tokens)[len(ids) - 1 : -1].topk(2).values
margins = (top2[:, 0] - top2[:, 1]).tolist()
# the libggml-cpu this process mapped, by content: which build's kernels ran
cpu_lib = next(line.split()[-1] for line in open("/proc/self/maps") if "libggml-cpu" in line)
lib = hashlib.sha256(open(cpu_lib, "rb").read()).hexdigest()
print(json.dumps({"kernels": kernels(), "tokens": out.tokens, "row": row.tolist(), "lib": lib,
                  "margins": margins}))
"""


def _greedy(pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, "-c", _GREEDY], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


#: sdmm's matmul (each of its types) and sdfa's attention on fixed random inputs, through
#: the C API of whichever libggml-cpu the process loads, on the instruction path argv[1] names: a
#: digest of the outputs. Every path of every build must give the same one (sdmm.h, sdfa.h).
_KERNEL_DIGEST = """
import ctypes, hashlib, sys
import numpy as np
from specdec.backends.llamacpp_kernels import SDMM_ISAS
from specdec.backends.llamacpp_lib import ggml_lib
lib, isa = ggml_lib("cpu"), SDMM_ISAS.index(sys.argv[1])
P = ctypes.c_void_p
rng = np.random.default_rng(3)
h = hashlib.sha256()
# (type, values, bytes) per block of every type sdmm takes; d (and a min) lead the block, but
# Q3_K's and Q6_K's d end it
for qtype, block, size in ((11, 256, 110), (12, 256, 144), (13, 256, 176), (14, 256, 210),
                           (2, 32, 18), (3, 32, 20), (6, 32, 22), (7, 32, 24), (8, 32, 34)):
    n, k, b = 40, 512, 9
    w = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = rng.uniform(1e-4, 1e-2, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if qtype in (11, 14):
        w[:, :, -2:] = halves[:, :, :2]
    else:
        w[:, :, :4] = halves  # d, and the min of Q4_K, Q5_K, Q4_1, Q5_1 (Q8_0's: 2 quants)
    nk = (ctypes.c_int64(n), ctypes.c_int64(k))
    packed = np.zeros(lib.sdmm_packed_size(qtype, *nk), np.uint8)
    lib.sdmm_pack(qtype, P(w.ctypes.data), *nk, P(packed.ctypes.data))
    x = rng.uniform(-1, 1, (b, k)).astype(np.float32)
    y = np.zeros((b, n), np.float32)
    args = (P(packed.ctypes.data), ctypes.c_int64(n), ctypes.c_int64(k), P(x.ctypes.data))
    assert lib.sdmm_matmul(qtype, isa, *args, ctypes.c_int64(b), P(y.ctypes.data)) == 0
    h.update(y.tobytes())
d, n_kv, rows = 64, 40, 11
kb = np.zeros((n_kv, d // 32, 34), np.uint8)
dk = rng.uniform(0.01, 0.03, (n_kv, d // 32)).astype(np.float16)
kb[:, :, :2] = dk.view(np.uint8).reshape(n_kv, -1, 2)
kb[:, :, 2:] = rng.integers(-127, 128, (n_kv, d // 32, 32)).astype(np.int8).view(np.uint8)
v = rng.uniform(-1, 1, (n_kv, d)).astype(np.float16)
q = rng.uniform(-2, 2, (rows, d)).astype(np.float32)
out = np.zeros((rows, d), np.float32)
kv = (P(kb.ctypes.data), ctypes.c_size_t(d // 32 * 34), P(v.ctypes.data), ctypes.c_size_t(2 * d))
res = lib.sdfa_attend(isa, d, n_kv, ctypes.c_float(0.125), *kv, P(q.ctypes.data), None, 1, rows,
                      64, P(out.ctypes.data))
assert res == 0
h.update(out.tobytes())
print(h.hexdigest())
"""


def _kernel_digest(isa: str, pythonpath: str | None = None) -> str:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, "-c", _KERNEL_DIGEST, isa],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()[-1]


@pytest.mark.slow
def test_the_portable_code_path_runs_and_agrees(smol_path: Path, tmp_path: Path) -> None:
    """The kernels a CPU without AVX-512 would run: the installed package with its CPU backend
    rebuilt portable (GGML_NATIVE=OFF, AVX2; llamacpp_build.build_cpu_backend, built once and
    cached). Same greedy tokens on smollm2 (Q4_1) as the native build up to the first near-tie
    (ggml's other ops, rms_norm and the like, sum in another order at another vector width:
    the 19th token was a 0.017 tie and parted), the same top-3 of the last position, logits
    within 1.5 (other kernels quantize activations and sum in another order: 0.79 measured
    between AVX2 and AMX). On a CPU with none of the wider paths the native build already is
    that code (GGML_NATIVE=OFF turns on AVX2's set, which such a CPU's -march=native builds too),
    and every model test ran it: nothing to compare, so no portable build (~60 s)."""
    wider = {"avx512f", "avx_vnni", "amx_int8"} & set(llamacpp_build.cpu_flags())
    if not wider:
        assert "AVX512" not in kernels()["features"]  # the installed build: the portable path
        pytest.skip("this CPU's native build is the portable (AVX2) code path the suite ran")
    package_with_cpu_backend("portable", tmp_path, log=lambda s: None)
    lib = llamacpp_build.build_cpu_backend("portable", log=lambda s: None)  # built: its path
    low, best = _greedy(str(tmp_path)), _greedy(None)
    portable = hashlib.sha256(lib.read_bytes()).hexdigest()
    assert low["lib"] == portable != best["lib"]  # each process ran the build it was given
    assert "AVX2" in low["kernels"]["features"]
    assert "AVX512" not in low["kernels"]["features"]
    pairs = list(zip(low["tokens"], best["tokens"], strict=False))
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if same is None:
        assert low["tokens"] == best["tokens"]
    else:
        assert best["margins"][same] < 0.1, f"parted at token {same}, not at a near-tie"

    def top3(row: list[float]) -> list[int]:
        return sorted(range(len(row)), key=lambda i: -row[i])[:3]

    # the same top token and top-3 (2nd and 3rd are a near-tie here, so not their order)
    assert top3(low["row"])[0] == top3(best["row"])[0]
    assert set(top3(low["row"])) == set(top3(best["row"]))
    worst = max(abs(a - b) for a, b in zip(low["row"], best["row"], strict=True))
    assert worst < 1.5, f"portable vs native: max |logit diff| {worst}"
    # specdec's kernels: the portable build's AVX2 code, compiled without AVX-512 (what a CPU
    # without it runs), gives the native build's bits on every path it has
    best_isa = best["kernels"]["sdmm"]
    assert best_isa and low["kernels"]["sdmm"] == best_isa  # dispatched at run time
    native = _kernel_digest(best_isa)
    assert _kernel_digest("avx2", str(tmp_path)) == native
    assert _kernel_digest("ref", str(tmp_path)) == native


@pytest.mark.slow
def test_the_patches_apply_to_the_pinned_sdist(tmp_path: Path) -> None:
    """The build's source: the pinned sdist (sha256 checked) with every patch applied and
    specdec's kernels (sdmm) hooked into ggml-cpu; the stock peer's source gets the fixes only."""
    sdist = llamacpp_build.fetch_sdist(llamacpp_build.home() / "sdists")
    src = llamacpp_build.prepare_source(sdist, tmp_path / "wheel")
    cpu = src / "vendor/llama.cpp/ggml/src/ggml-cpu"
    assert "static const tile_config_t tc" in (cpu / "amx/mmq.cpp").read_text()
    assert "ggml-cpu/sdmm/sdmm-buft.cpp" in (cpu / "CMakeLists.txt").read_text()
    assert "ggml_backend_sdmm_buffer_type()" in (cpu / "ggml-cpu.cpp").read_text()
    copied = sorted(p.name for p in (cpu / "sdmm").iterdir())
    assert copied == [p.name for p in llamacpp_build.native_files()]
    # the package's own build leaves out llama.cpp's common library (nothing it loads needs it)
    common_on = "set(LLAMA_BUILD_COMMON ON CACHE BOOL"
    assert common_on not in (src / "CMakeLists.txt").read_text()
    stock = llamacpp_build.prepare_source(sdist, tmp_path / "stock", fixes_only=True)
    assert common_on in (stock / "CMakeLists.txt").read_text()
    stock_cpu = stock / "vendor/llama.cpp/ggml/src/ggml-cpu"
    assert "static const tile_config_t tc" in (stock_cpu / "amx/mmq.cpp").read_text()
    assert not (stock_cpu / "sdmm").exists()
    assert "sdmm" not in (stock_cpu / "ggml-cpu.cpp").read_text()


@pytest.mark.slow
def test_a_patch_that_does_not_apply_stops_the_build(tmp_path: Path, monkeypatch) -> None:
    sdist = llamacpp_build.fetch_sdist(llamacpp_build.home() / "sdists")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-broken.patch").write_text(
        "--- a/vendor/llama.cpp/CMakeLists.txt\n+++ b/vendor/llama.cpp/CMakeLists.txt\n"
        "@@ -1,1 +1,1 @@\n-this line is not in the file\n+nor is this one\n"
    )
    monkeypatch.setattr(llamacpp_build, "PATCHES", patches)
    with pytest.raises(llamacpp_build.BuildError, match=r"0001-broken\.patch does not apply"):
        llamacpp_build.prepare_source(sdist, tmp_path / "src")


def test_a_damaged_sdist_is_refused_and_deleted(tmp_path: Path) -> None:
    bad = tmp_path / f"llama_cpp_python-{llamacpp_build.VERSION}.tar.gz"
    bad.write_bytes(b"not the sdist")
    with pytest.raises(llamacpp_build.BuildError, match="not the pinned"):
        llamacpp_build.fetch_sdist(tmp_path)
    assert not bad.exists()
