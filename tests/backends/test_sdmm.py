"""sdmm and sdfa, specdec's matmul and attention for verify batches (backends/native/sdmm.h,
sdfa.h), called in the built libggml-cpu through their C API: exact by construction, and checked
here to be.

Every instruction path this build and CPU can run (the scalar reference, AVX2, AVX-512 VNNI),
each weight type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
F16, BF16), random and real weights,
odd shapes, every batch size b = 1..64:
  * batch invariance: row i of a b-row product has the bits of row i computed alone;
  * one answer per build: every path gives the reference path's bits;
  * the right answer: within float32 rounding of a float64 product of gguf-py's dequantized
    weights (the field's own reference) and activations that the type's activation blocks (Q8_K
    per 256 values, 32-value blocks for the others, fp16 or bf16 for the float types) represent
    exactly.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from specdec.backends.llamacpp_kernels import SDMM_ISAS
from specdec.backends.llamacpp_lib import ggml_lib

#: ggml type ids
TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}
TYPES |= {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "IQ4_NL": 20}
TYPES |= {"F16": 1, "BF16": 30}
#: the float types: no integer sums, each output one fma chain over k
FLOAT_TYPES = ("F16", "BF16")
QUANT_TYPES = [t for t in TYPES if t not in FLOAT_TYPES]
BLOCK = {t: 256 if t.endswith("_K") or t == "IQ4_XS" else 32 for t in TYPES}  # per act. block
#: the types the Qwen 0.5B's own weights hold (the others are checked on random blocks and,
#: requantized, on a whole model: tests/backends/test_weights.py)
REAL_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]


def _lib() -> ctypes.CDLL:
    lib = ggml_lib("cpu")
    if not hasattr(lib, "sdmm_matmul"):
        pytest.fail("this llama-cpp-python has no sdmm: it is not specdec's build (make venv)")
    return _bind(lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """sdmm's C API (and sdfa's, where the library has it) typed for ctypes."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sdmm_packed_size.restype = ctypes.c_size_t
    lib.sdmm_packed_size.argtypes = [ctypes.c_int, i64, i64]
    lib.sdmm_pack.restype = None
    lib.sdmm_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.sdmm_matmul.restype = ctypes.c_int
    lib.sdmm_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.sdmm_isa_supported.restype = ctypes.c_int
    lib.sdmm_isa_supported.argtypes = [ctypes.c_int]
    if not hasattr(lib, "sdfa_attend"):
        return lib
    lib.sdfa_attend.restype = ctypes.c_int
    lib.sdfa_attend.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.sdfa_attend.argtypes += [ptr, ctypes.c_size_t, ptr, ctypes.c_size_t, ptr, ptr]
    lib.sdfa_attend.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr]
    lib.sdfa_quantize_query.restype = None
    lib.sdfa_quantize_query.argtypes = [ptr, ctypes.c_int, ptr, ptr]
    return lib


def _isas(lib: ctypes.CDLL) -> list[int]:
    return [i for i in range(len(SDMM_ISAS)) if lib.sdmm_isa_supported(i)]


def _pack(lib: ctypes.CDLL, qtype: str, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    out = np.zeros(lib.sdmm_packed_size(TYPES[qtype], n, k), dtype=np.uint8)
    src = np.ascontiguousarray(blocks)
    lib.sdmm_pack(TYPES[qtype], src.ctypes.data, n, k, out.ctypes.data)
    return out


def _matmul(lib, qtype: str, isa: int, packed: np.ndarray, n: int, k: int, x: np.ndarray):
    """[b, n] float32: sdmm's product of the packed weights with x [b, k] float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], n), dtype=np.float32)
    args = (packed.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.ctypes.data)
    assert lib.sdmm_matmul(TYPES[qtype], isa, *args) == 0
    return y


def _random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k values in ggml's blocks: random quants and scales, sane fp16 multipliers; the
    float types' values normal, of either sign."""
    if qtype in FLOAT_TYPES:
        w = rng.normal(0, 0.05, size=(n, k)).astype(np.float32)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16: truncated
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    halves = lambda lo, hi: rng.uniform(lo, hi, size=(n, k // block)).astype(np.float16)  # noqa: E731
    if qtype in ("Q3_K", "Q6_K"):  # d ends the block
        data[:, :, -2:] = halves(1e-4, 2e-3).view(np.uint8).reshape(n, k // block, 2)
    elif qtype == "Q2_K":  # d, dmin end it
        data[:, :, -4:-2] = halves(1e-3, 2e-2).view(np.uint8).reshape(n, k // block, 2)
        data[:, :, -2:] = halves(1e-4, 5e-3).view(np.uint8).reshape(n, k // block, 2)
    else:  # d (and Q4_K's dmin) lead it
        data[:, :, 0:2] = halves(1e-3, 2e-2).view(np.uint8).reshape(n, k // block, 2)
    if qtype in ("Q4_K", "Q5_K"):  # dmin
        data[:, :, 2:4] = halves(1e-4, 5e-3).view(np.uint8).reshape(n, k // block, 2)
    if qtype in ("Q4_1", "Q5_1"):  # the min m, of either sign
        data[:, :, 2:4] = halves(-2e-1, 2e-1).view(np.uint8).reshape(n, k // block, 2)
    return data.reshape(n, -1)


def _exact(qtype: str, b: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Activations the type's activation blocks represent exactly: integers -127..127 times a
    power of two per block, each block holding +-127 (its max), so quantizing them loses
    nothing."""
    blk = BLOCK[qtype]
    q = rng.integers(-127, 128, size=(b, k // blk, blk))
    q[:, :, 0] = 127 * np.where(rng.random((b, k // blk)) < 0.5, -1, 1)
    scale = 2.0 ** rng.integers(-8, 2, size=(b, k // blk, 1))
    return (q * scale).reshape(b, k).astype(np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (np.array_equal takes -0.0 for +0.0)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _check(lib, qtype: str, blocks: np.ndarray, n: int, k: int, x: np.ndarray, sizes=None) -> None:
    """Every batch size in `sizes` (default 1..rows: the first b rows) gives the bits of all the
    rows at once, on every path, and a row alone its own; every path the reference's; within
    float32 rounding of the float64 product (the quantized types: a few roundings per block;
    the float types: one per value, k of them in a row, so up to k units of float32's last
    place of the sum of |terms|)."""
    packed = _pack(lib, qtype, blocks, n, k)
    w = dequantize(blocks, GGMLQuantizationType[qtype]).astype(np.float64)  # [n, k]
    full = {}
    for isa in _isas(lib):
        y = _matmul(lib, qtype, isa, packed, n, k, x)  # all rows at once
        for b in sizes or range(1, x.shape[0] + 1):
            got = _matmul(lib, qtype, isa, packed, n, k, x[:b])
            assert _same_bits(got, y[:b]), f"{qtype} {SDMM_ISAS[isa]} b={b}"
        for i in (0, x.shape[0] // 2, x.shape[0] - 1):  # a row alone
            alone = _matmul(lib, qtype, isa, packed, n, k, x[i : i + 1])
            assert _same_bits(alone[0], y[i]), f"{qtype} {SDMM_ISAS[isa]} row {i} alone"
        full[isa] = y
    for isa, y in full.items():
        assert _same_bits(y, full[0]), f"{qtype}: {SDMM_ISAS[isa]} differs from ref"
    terms = np.abs(x.astype(np.float64)) @ np.abs(w).T  # float32 rounding scales with these
    err = np.abs(full[0] - x.astype(np.float64) @ w.T) / np.maximum(terms, 1e-30)
    tol = k * 2.0**-24 if qtype in FLOAT_TYPES else 1e-6
    assert err.max() < tol, f"{qtype}: {err.max():.3g} of sum |terms| from the float64 product"


#: (type, n, k): each type at three shapes; k not a multiple of 256 (the Qwen 0.5B's 896, one
#: block) only where the type's blocks are of 32 values
_SHAPES = [
    (qtype, n, k)
    for qtype in TYPES
    for n, k in [(37, 512), (16, 256), (5, 1536), (37, 896), (18, 32)]
    if k % BLOCK[qtype] == 0
]


@pytest.mark.parametrize("qtype,n,k", _SHAPES)
def test_random_weights_every_batch_size_every_path(qtype: str, n: int, k: int) -> None:
    lib = _lib()
    rng = np.random.default_rng(n * 1000 + k)
    _check(lib, qtype, _random_blocks(qtype, n, k, rng), n, k, _exact(qtype, 64, k, rng))


def _q8_0_dequantized(x: np.ndarray) -> np.ndarray:
    """x [b, k] float32 as sdmm quantizes it for the 32-value types (ggml's quantize_row_q8_0_ref
    with the scale kept in float32: d = amax / 127, q = roundf(x / d), half away from zero),
    dequantized, in float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (blocks * inv).astype(np.float64)  # float32 products, as the C code rounds them
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (q * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", [t for t in QUANT_TYPES if BLOCK[t] == 32])
def test_32_value_activation_blocks_round_as_ggml(qtype: str) -> None:
    """Activations no 32-value block holds exactly (the tests above use ones it does): the
    product is that of the weights and of the activations quantized as ggml quantizes them,
    rounding to nearest (truncating would be off by up to a quantum per value), an all-zero
    block included."""
    lib = _lib()
    rng = np.random.default_rng(32)
    n, k = 21, 96
    blocks = _random_blocks(qtype, n, k, rng)
    x = rng.normal(0, 1, (9, k)).astype(np.float32)
    x[3, 32:64] = 0.0
    w = dequantize(blocks, GGMLQuantizationType[qtype]).astype(np.float64)
    ref = _q8_0_dequantized(x) @ w.T
    terms = np.abs(_q8_0_dequantized(x)) @ np.abs(w).T
    for isa in _isas(lib):
        y = _matmul(lib, qtype, isa, _pack(lib, qtype, blocks, n, k), n, k, x)
        err = np.abs(y - ref) / np.maximum(terms, 1e-30)
        assert err.max() < 1e-6, f"{qtype} {SDMM_ISAS[isa]}: {err.max():.3g}"


def _bf16(x: np.ndarray) -> np.ndarray:
    """x float32 rounded to bf16, to nearest even (ggml's ggml_compute_fp32_to_bf16), as
    float64."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("qtype", FLOAT_TYPES)
def test_float_weights_round_the_activations_as_ggml(qtype: str) -> None:
    """Activations neither fp16 nor bf16 holds exactly: the product is that of the weights and
    of the activations rounded to the weight's type to nearest even, as ggml converts them for
    its F16 and BF16 dot products (truncating would be off by up to an ulp of the type), a
    value past fp16's range included (inf, as ggml's)."""
    lib = _lib()
    rng = np.random.default_rng(16)
    n, k = 21, 96
    blocks = _random_blocks(qtype, n, k, rng)
    x = rng.normal(0, 1, (9, k)).astype(np.float32)
    w = dequantize(blocks, GGMLQuantizationType[qtype]).astype(np.float64)
    xr = x.astype(np.float16).astype(np.float64) if qtype == "F16" else _bf16(x)
    ref, terms = xr @ w.T, np.abs(xr) @ np.abs(w).T
    packed = _pack(lib, qtype, blocks, n, k)
    for isa in _isas(lib):
        y = _matmul(lib, qtype, isa, packed, n, k, x)
        err = np.abs(y - ref) / np.maximum(terms, 1e-30)
        assert err.max() < k * 2.0**-24, f"{qtype} {SDMM_ISAS[isa]}: {err.max():.3g}"
    if qtype == "F16":
        x[0, 5] = 1e5  # past 65504: inf in fp16, so row 0 is inf or nan
        y = _matmul(lib, qtype, _isas(lib)[-1], packed, n, k, x)
        assert not np.isfinite(y[0]).any() and np.isfinite(y[1:]).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_more_rows_than_one_pass_over_the_weights(qtype: str) -> None:
    """Past 64 rows the kernels read a group's weights again for the next 64 (a prefill's
    batches): the same bits as one row at a time, across the cut."""
    lib = _lib()
    rng = np.random.default_rng(130)
    n, k = 37, 512
    x = _exact(qtype, 130, k, rng)
    sizes = (1, 16, 17, 63, 64, 65, 100, 128, 129, 130)
    _check(lib, qtype, _random_blocks(qtype, n, k, rng), n, k, x, sizes)


#: where each type's block keeps its fp16 multipliers (d, and dmin or m): bytes [lo, hi)
_MULTIPLIERS = {"Q3_K": (108, 110), "Q6_K": (208, 210), "Q4_0": (0, 2), "Q5_0": (0, 2)}
_MULTIPLIERS |= {"Q8_0": (0, 2), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q4_1": (0, 4), "Q5_1": (0, 4)}
_MULTIPLIERS |= {"Q2_K": (80, 84), "IQ4_XS": (0, 2), "IQ4_NL": (0, 2)}
#: each K-quant's scale bytes, set to their largest so that no scale is 0 (IQ4_XS: ls 63, 31)
_SCALES = {"Q4_K": (4, 16, 0xFF), "Q5_K": (4, 16, 0xFF), "Q6_K": (192, 208, 0x7F)}
_SCALES |= {"Q3_K": (96, 108, 0xFF), "Q2_K": (0, 16, 0xFF), "IQ4_XS": (2, 8, 0xFF)}


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("fill", [0x00, 0x7F, 0x80, 0xFF])
def test_largest_sums_every_path(qtype: str, fill: int) -> None:
    """Every quant byte the same (0xFF: every quant at its largest; 0x00: at 0, which Q6_K
    stores for -32; 0x80 and 0x7F: Q8_0's -128 and 127) against activation rows of all +127,
    all -127 or alternating quants: the largest integer sums a block can hold, where a kernel
    that sums in 16 bits (AVX2's, sdmm-simd.h) would wrap if its bounds were wrong. Every path
    gives the reference's bits and the float64 product."""
    rng = np.random.default_rng(fill)
    n, k = 24, 512
    _check(_lib(), qtype, _filled_blocks(qtype, n, k, fill, rng), n, k, _largest_rows(k))


def _filled_blocks(qtype: str, n: int, k: int, fill: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k values in ggml's blocks: every byte but the fp16 multipliers `fill`, the
    K-quants' scales at their largest."""
    blocks = _random_blocks(qtype, n, k, rng).reshape(n, k // BLOCK[qtype], -1)
    lo, hi = _MULTIPLIERS[qtype]
    quants = np.ones(blocks.shape[2], dtype=bool)
    quants[lo:hi] = False
    blocks[:, :, quants] = fill
    if qtype in _SCALES:
        s0, s1, value = _SCALES[qtype]
        blocks[:, :, s0:s1] = value
    return blocks.reshape(n, -1)


def _largest_rows(k: int) -> np.ndarray:
    """Activation rows whose every block quantizes to all +127, all -127 or alternating signs
    (Q8_K: the max's sign flips), at two scales."""
    sign = np.ones((6, k), dtype=np.float32)
    sign[1] = sign[3] = -1
    sign[4, 1::2] = sign[5, ::2] = -1  # alternating
    x = np.float32(0.5) * sign
    x[2:4] *= np.float32(2.0**-6)
    return x


@pytest.fixture(scope="module")
def evex_twin(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """sdmm built as a library of its own with SD_AVXVNNI_EVEX (sd-isa.h): the AVX-VNNI path's
    code, vpdpbusd in its AVX-512 encoding (the same operation), so that a CPU with AVX-512
    VNNI and without AVX-VNNI (AMD's Zen 4, Intel's Xeons before Sapphire Rapids) runs it. A
    CPU with AVX-VNNI runs the installed build's own AVX-VNNI path in the tests above."""
    from specdec.backends.llamacpp_build import NATIVE, cpu_flags

    if not {"avx512_vnni", "avx512vl"} <= set(cpu_flags()):  # before ~12 s of compiling
        pytest.skip("the twin needs AVX-512 VNNI and VL; this CPU can run neither AVX-VNNI form")
    out = tmp_path_factory.mktemp("evex") / "libsdmm-evex.so"
    srcs = [str(NATIVE / f"{name}.c") for name in ("sdmm", "sdmm-avx2", "sdmm-avxvnni")]
    srcs.append(str(NATIVE / "sdmm-avx512.c"))
    cmd = ["cc", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-DSD_AVXVNNI_EVEX"]
    res = subprocess.run([*cmd, "-o", str(out), *srcs, "-lm"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return _bind(ctypes.CDLL(str(out)))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_avx_vnni_path_gives_every_other_paths_bits(qtype: str, evex_twin) -> None:
    """The AVX-VNNI kernels (sdmm-avxvnni.c: AVX2's 8 lanes with vpdpbusd, as no other path
    has them) in their EVEX twin: random and largest-sum weights, every batch size, the bits
    of the reference, AVX2 and AVX-512 paths built beside them."""
    avxvnni = SDMM_ISAS.index("avxvnni")
    if not evex_twin.sdmm_isa_supported(avxvnni):
        pytest.skip("the twin needs AVX-512 VNNI and VL; this CPU can run neither AVX-VNNI form")
    assert avxvnni in _isas(evex_twin)
    rng = np.random.default_rng(2)
    n, k = 37, 512
    _check(evex_twin, qtype, _random_blocks(qtype, n, k, rng), n, k, _exact(qtype, 64, k, rng))
    for fill in (0x00, 0xFF) if qtype not in FLOAT_TYPES else ():
        _check(evex_twin, qtype, _filled_blocks(qtype, 16, k, fill, rng), 16, k, _largest_rows(k))


def _path_features() -> dict[str, set[str]]:
    """sd-isa.h's feature lists (SD_FEATURES_AVX2 ...: what each path is compiled for), in
    /proc/cpuinfo's spelling, read from the header itself so that the test follows it."""
    from specdec.backends.llamacpp_build import NATIVE

    text = (NATIVE / "sd-isa.h").read_text()
    lists: dict[str, set[str]] = {}
    # a list defined twice (AVX-VNNI's: its tests-only EVEX twin, then the build's) ends with
    # the build's, which comes last
    for m in re.finditer(r"#\s*define (SD_FEATURES_\w+)\(X\)((?:.*\\\n)*.*)", text):
        body = m.group(2)
        feats = set(re.findall(r'X\("(\w+)"\)', body))
        for inner in re.findall(r"(SD_FEATURES_\w+)\(X\)", body):
            feats |= lists[inner]
        lists[m.group(1)] = feats
    cpuinfo = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}  # GCC's name -> the kernel's
    return {k: {cpuinfo.get(f, f) for f in v} for k, v in lists.items()}


def test_each_path_runs_exactly_where_the_cpu_has_what_it_was_compiled_for() -> None:
    """The dispatch asks for every feature a path is compiled for (sd-isa.h), no more: sdmm's
    and sdfa's AVX-512 paths need VNNI, DQ, FMA and F16C (both multiply with vpdpbusd), their
    AVX2 paths F16C too. (Before, sdmm checked four of AVX-512's seven features and sdfa
    borrowed sdmm's answer.)"""
    lib = _lib()
    lib.sdfa_isa_supported.restype = ctypes.c_int
    lib.sdfa_isa_supported.argtypes = [ctypes.c_int]
    from specdec.backends import llamacpp_build

    flags, lists = set(llamacpp_build.cpu_flags()), _path_features()
    assert lists["SD_FEATURES_AVX512_VNNI"] - lists["SD_FEATURES_AVX512"] == {"avx512_vnni"}
    assert {"avx512dq", "f16c", "fma"} <= lists["SD_FEATURES_AVX512"]
    sdmm = {0: None, 1: "SD_FEATURES_AVX2", 2: "SD_FEATURES_AVXVNNI", 3: "SD_FEATURES_AVX512_VNNI"}
    sdfa = {0: None, 1: "SD_FEATURES_AVX2", 2: "SD_FEATURES_AVXVNNI", 3: "SD_FEATURES_AVX512_VNNI"}
    for supported, paths in ((lib.sdmm_isa_supported, sdmm), (lib.sdfa_isa_supported, sdfa)):
        for isa, name in paths.items():
            want = name is None or lists[name] <= flags
            assert bool(supported(isa)) == want, f"{SDMM_ISAS[isa]}: {name}"
    assert not lib.sdmm_isa_supported(len(SDMM_ISAS)) and not lib.sdfa_isa_supported(-1)


def test_a_native_build_holds_the_paths_this_cpu_runs_and_no_other() -> None:
    """The installed build is for this CPU (-march=native: SD_NATIVE_BUILD, sd-isa.h): a path
    the CPU cannot run is not compiled at all (its kernels, its peak probe and sdfa's AVX-512
    kernel are absent from the library, not merely refused), and every path it can run is; the
    AVX2 path and the reference are always there."""
    import llama_cpp

    from specdec.backends import llamacpp_build

    lib = _lib()
    info = llamacpp_build.installed_manifest(Path(llama_cpp.__file__).parent)
    assert info is not None and info["flavor"] == "native", info
    for isa, name in enumerate(SDMM_ISAS):
        kernels = {hasattr(lib, f"sdmm_kernel_{g}_{name}") for g in ("q4k", "q6k", "q8_0", "f16")}
        assert kernels == {name in ("ref", "avx2") or bool(lib.sdmm_isa_supported(isa))}, name
    avx512, avxvnni = SDMM_ISAS.index("avx512"), SDMM_ISAS.index("avxvnni")
    assert hasattr(lib, "sdmm_avx512_peak_macs") == bool(lib.sdmm_isa_supported(avx512))
    assert hasattr(lib, "sdmm_avxvnni_peak_macs") == bool(lib.sdmm_isa_supported(avxvnni))
    assert hasattr(lib, "sdfa_kernel_avx512") == bool(lib.sdfa_isa_supported(avx512))


def test_this_build_runs_the_best_path_the_cpu_has() -> None:
    from specdec.backends.llamacpp_kernels import sdfa_isa, sdmm_isa

    lib = _lib()
    lib.sdfa_isa_supported.restype = ctypes.c_int
    if "SPECDEC_MM_ISA" not in os.environ and os.environ.get("SPECDEC_MM") != "0":
        assert sdmm_isa() == SDMM_ISAS[max(_isas(lib))]
        if os.environ.get("SPECDEC_FA") != "0":
            best = max(i for i in range(len(SDMM_ISAS)) if lib.sdfa_isa_supported(i))
            assert sdfa_isa() == SDMM_ISAS[best]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", REAL_TYPES)
def test_real_weights_every_batch_size_every_path(qtype: str) -> None:
    """Rows of the Qwen 0.5B's own weights of each type (real scales and mins; its ffn_down
    mixes Q4_K and Q6_K, the rest are Q5_0 and Q8_0), real-looking activations: the same three
    properties."""
    from specdec.backends.registry import gguf_tensors, resolve

    path = resolve("qwen2.5-coder-0.5b", progress=False)
    # the first layer weight of this type
    info = next(t for t in gguf_tensors(path) if t.name.startswith("blk.") and t.type == qtype)
    k, n = info.dims[0], 41  # 41 rows: two whole groups of 16 and a partial one
    with path.open("rb") as f:
        f.seek(info.start)
        row_bytes = info.size // info.dims[1]
        blocks = np.frombuffer(f.read(row_bytes * n), dtype=np.uint8).reshape(n, row_bytes)
    rng = np.random.default_rng(7)
    _check(_lib(), qtype, blocks.copy(), n, k, _exact(qtype, 64, k, rng))


_LOGITS = """
import hashlib, json
from specdec.backends import load_model
from specdec.backends.llamacpp_kernels import kernels
m = load_model("llamacpp:qwen2.5-coder-0.5b", n_threads=1, n_ctx=256)
ids = list(range(1000, 1040))
m.prefill(ids[:24])
rows = m.extend(ids[24:40]).numpy()
k = kernels()
print(json.dumps({"sdmm": k["sdmm"], "sdfa": k["sdfa"], "invariant": m.batch_invariant,
                  "digest": hashlib.sha256(rows.tobytes()).hexdigest()}))
"""


def _logits_with(env: dict[str, str]) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _LOGITS],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_path_gives_the_whole_model_the_same_bits() -> None:
    """A CPU without AVX-512 takes the AVX2 path: forced here (matmul and attention), the
    0.5B's logits of a 16-token pass are bit-identical to the best path's, so the AVX2 kernels
    are not a different model."""
    lib = _lib()
    best = _logits_with({})
    assert best["sdmm"] == SDMM_ISAS[max(_isas(lib))] and best["invariant"]
    for isa in _isas(lib)[1:]:  # the scalar reference is far too slow for a whole model
        if best["sdmm"] == best["sdfa"] == SDMM_ISAS[isa]:
            continue  # the run above took this path in both kernels
        forced = _logits_with({"SPECDEC_MM_ISA": SDMM_ISAS[isa]})
        assert forced["sdmm"] == forced["sdfa"] == SDMM_ISAS[isa]
        assert forced["digest"] == best["digest"], f"{SDMM_ISAS[isa]} logits differ"
    stock = _logits_with({"SPECDEC_MM": "0"})  # control: ggml's kernels are another model
    assert stock["sdmm"] is None and stock["sdfa"] is None and not stock["invariant"]
    assert stock["digest"] != best["digest"]


def test_a_path_this_cpu_cannot_run_is_a_clear_error(monkeypatch) -> None:
    from specdec.backends import load_model
    from specdec.core.model import SpecModelError

    monkeypatch.setenv("SPECDEC_MM_ISA", "avx1024")
    with pytest.raises(SpecModelError, match=r"SPECDEC_MM_ISA='avx1024': choose one of ref, avx2"):
        load_model("llamacpp:smollm2-135m", n_threads=1, n_ctx=64)
    lib = _lib()
    missing = [name for i, name in enumerate(SDMM_ISAS) if not lib.sdmm_isa_supported(i)]
    if missing:
        monkeypatch.setenv("SPECDEC_MM_ISA", missing[0])
        with pytest.raises(SpecModelError, match="cannot run that instruction path"):
            load_model("llamacpp:smollm2-135m", n_threads=1, n_ctx=64)


def test_packed_sizes() -> None:
    """16-row groups, one 1,600-byte (Q2_K), 2,368-byte (Q4_K), 2,880-byte (Q5_K), 3,360-byte
    (Q6_K, Q3_K) or 2,208-byte (IQ4_XS) record per 256 columns, one 288-byte (Q4_0, IQ4_NL),
    320-byte (Q4_1), 352-byte (Q5_0), 384-byte (Q5_1), 544-byte (Q8_0) or 1,024-byte (F16, BF16)
    record per 32: ggml's bytes, but the K-quants' unpacked scales; a partial last group is
    padded."""
    lib = _lib()
    assert lib.sdmm_packed_size(12, 32, 512) == 2 * 2 * 2368
    assert lib.sdmm_packed_size(13, 32, 512) == 2 * 2 * 2880
    assert lib.sdmm_packed_size(14, 33, 256) == 3 * 3360
    assert lib.sdmm_packed_size(6, 17, 896) == 2 * 28 * 352
    assert lib.sdmm_packed_size(7, 17, 896) == 2 * 28 * 384
    assert lib.sdmm_packed_size(8, 16, 64) == 2 * 544
    assert lib.sdmm_packed_size(2, 17, 896) == 2 * 28 * 288  # Q4_0
    assert lib.sdmm_packed_size(3, 17, 896) == 2 * 28 * 320  # Q4_1
    assert lib.sdmm_packed_size(11, 33, 256) == 3 * 3360  # Q3_K: in Q6_K's group
    assert lib.sdmm_packed_size(10, 16, 512) == 2 * 1600  # Q2_K: scales and mins unpacked
    assert lib.sdmm_packed_size(23, 16, 512) == 2 * 2208  # IQ4_XS: scales unpacked
    assert lib.sdmm_packed_size(20, 17, 896) == 2 * 28 * 288  # IQ4_NL: Q4_0's group
    assert lib.sdmm_packed_size(1, 17, 64) == 2 * 2 * 1024  # F16: its bytes
    assert lib.sdmm_packed_size(30, 16, 64) == 2 * 1024  # BF16
    assert lib.sdmm_packed_size(16, 16, 256) == 0  # IQ2_XXS: not sdmm's


# ------------------------------------------------------------------------------------- sdfa
def _attend(lib, isa: int, q, k_blocks, v, mask, n_kv: int, group: int = 1, walk: int = 64):
    """sdfa's attention of q [rows, d] over the first n_kv positions of one KV head, in walks of
    `walk` rows; row r's mask is mask[r // group], one pointer for each `group` rows as for the
    query heads of one token."""
    rows, d = q.shape
    out = np.empty((rows, d), dtype=np.float32)
    m = None if mask is None else np.ascontiguousarray(mask[:, :n_kv])
    args = (isa, d, n_kv, 1.0 / np.sqrt(d), k_blocks.ctypes.data, k_blocks.shape[1])
    args += (v.ctypes.data, v.shape[1] * 2, q.ctypes.data, None if m is None else m.ctypes.data)
    assert lib.sdfa_attend(*args, group, rows, walk, out.ctypes.data) == 0
    return out


def _kv(rng: np.random.Generator, n_kv: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """A q8_0 K cache (ggml's block_q8_0: fp16 d, 32 int8, -128 included) and an f16 V cache of
    one KV head."""
    k = np.zeros((n_kv, d // 32, 34), dtype=np.uint8)
    k[:, :, :2] = (
        rng.uniform(0.01, 0.03, (n_kv, d // 32))
        .astype(np.float16)
        .view(np.uint8)
        .reshape(n_kv, -1, 2)
    )
    k[:, :, 2:] = rng.integers(-128, 128, (n_kv, d // 32, 32)).astype(np.int8).view(np.uint8)
    return k.reshape(n_kv, -1), rng.uniform(-1, 1, (n_kv, d)).astype(np.float16)


def _quantized_query(q: np.ndarray) -> np.ndarray:
    """sdfa_quantize_query's query in float64 (sdfa.h: dq = max|q| / 127 per 32 values, qq =
    nearbyint(q * (1 / dq)), in float32 arithmetic), dq * qq."""
    rows, d = q.shape
    qb = q.reshape(rows, d // 32, 32)
    dq = np.abs(qb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(dq > 0, np.float32(1) / np.where(dq > 0, dq, 1), np.float32(0))
    qq = np.rint(qb * inv.astype(np.float32))  # round half to even, as nearbyintf
    return (qq.astype(np.float64) * dq.astype(np.float64)).reshape(rows, d)


@pytest.mark.parametrize(
    "d,n_kv,rows,pad",
    [
        (128, 300, 37, 0),
        (64, 33, 20, 0),
        (128, 1, 5, 0),
        (256, 70, 17, 0),
        (128, 768, 21, 240),
        (128, 130, 150, 0),
        (32, 50, 9, 0),
        (96, 40, 13, 0),
        (160, 35, 11, 0),
    ],
)
def test_attention_is_exact_per_row_on_every_path(d: int, n_kv: int, rows: int, pad: int) -> None:
    """sdfa: every path gives the reference's bits; a row alone, and a row whose cache ends
    where its mask does (a single step sees a shorter cache than the batch it verifies), give
    its bits in a tile, and in walks of any size (150 rows: walks of 64, and of 8 and 1), and
    without a mask too; head sizes 32 to 256, so that a row's V sum ends in a short block; within
    float32 rounding of a float64 softmax attention of the int8-quantized query (sdfa.h), and
    within what that quantization moves of the float query's. `pad` masks the last positions for
    every row, as llama.cpp pads its cache to 256 cells: the SIMD paths stop walking there, the
    reference does not."""
    lib = _lib()
    rng = np.random.default_rng(d + n_kv + rows)
    k, v = _kv(rng, n_kv, d)
    q = rng.uniform(-3, 3, (rows, d)).astype(np.float32)
    # row r sees positions before n_kv - pad - 3 (r % 7); every fifth row also not the first 20
    limit = n_kv - pad - 3 * (np.arange(rows) % 7)
    seen = np.arange(n_kv)[None, :] < limit[:, None]
    seen &= ~((np.arange(rows)[:, None] % 5 == 0) & (np.arange(n_kv)[None, :] < 20))
    mask = np.where(seen, np.float16(0), np.float16(-np.inf))
    outs = {isa: _attend(lib, isa, q, k, v, mask, n_kv) for isa in _isas(lib)}
    for isa, out in outs.items():
        assert _same_bits(out, outs[0]), f"sdfa {SDMM_ISAS[isa]} differs from ref"
        for walk in (1, 8):
            walked = _attend(lib, isa, q, k, v, mask, n_kv, walk=walk)
            assert _same_bits(walked, out), f"{SDMM_ISAS[isa]} in walks of {walk}"
        unmasked = _attend(lib, isa, q, k, v, None, n_kv)  # no mask: every position seen
        assert _same_bits(unmasked, _attend(lib, 0, q, k, v, None, n_kv)), "no mask"
        for r in range(rows):
            alone = _attend(lib, isa, q[r : r + 1], k, v, mask[r : r + 1], n_kv)
            assert _same_bits(alone[0], out[r]), f"{SDMM_ISAS[isa]} row {r} alone"
            if limit[r] >= 1 and r % 5:
                short = _attend(lib, isa, q[r : r + 1], k, v, mask[r : r + 1], int(limit[r]))
                assert _same_bits(short[0], out[r]), f"{SDMM_ISAS[isa]} row {r}, shorter cache"
    kf = dequantize(k, GGMLQuantizationType.Q8_0).astype(np.float64)  # [n_kv, d]

    def attention(qf: np.ndarray) -> np.ndarray:
        scores = np.where(seen, qf @ kf.T / np.sqrt(d), -np.inf)
        top = np.max(scores, axis=1, keepdims=True)
        w = np.where(seen, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0.0)
        total = w.sum(1, keepdims=True)
        return np.where(total > 0, (w @ v.astype(np.float64)) / np.where(total > 0, total, 1), 0)

    assert np.abs(outs[0] - attention(_quantized_query(q))).max() < 1e-5
    # the query's int8 (about 1/254 of its block's largest value) moves these scores, which span
    # tens (q up to 3, keys up to 3.8): the outputs, in [-1, 1], by up to 0.017 in these cases
    assert np.abs(outs[0] - attention(q.astype(np.float64))).max() < 0.05


def test_the_query_is_quantized_as_q8_0() -> None:
    """sdfa_quantize_query, the query's int8 for every path's scores: per 32 values dq = max|q|
    / 127, qq = q / dq rounded half to even (as numpy's rint) in [-127, 127]; a zero block gives
    dq = 0 and zeros; a block holding a NaN or an infinity dq = NaN (its scores NaN, as a float
    dot's would be) and zeros, its neighbours untouched."""
    lib = _lib()
    rng = np.random.default_rng(5)
    d = 256
    q = rng.normal(0, 2, d).astype(np.float32)
    q[32:64] = 0.0
    q[64:96] = np.arange(32) - 15.5  # the largest value at both ends
    q[96:128] = 0.0
    q[100] = 127.0
    q[101] = 0.5  # exactly half a step: rounds to even (0)
    q[102] = 1.5  # rounds to 2
    q[160] = np.nan
    q[200] = -np.inf
    qq = np.zeros(d, np.int8)
    dq = np.zeros(d // 32, np.float32)
    lib.sdfa_quantize_query(q.ctypes.data, d, qq.ctypes.data, dq.ctypes.data)
    assert dq[1] == 0 and not qq[32:64].any()
    assert dq[3] == 1.0 and qq[100] == 127 and qq[101] == 0 and qq[102] == 2
    assert np.isnan(dq[5]) and np.isnan(dq[6]) and not qq[160:224].any()
    fine = [0, 2, 4, 7]
    for c in fine:
        block = q[32 * c : 32 * c + 32]
        want_dq = np.abs(block).max() / np.float32(127)
        assert dq[c] == want_dq
        want = np.rint(block * (np.float32(1) / want_dq))
        assert np.array_equal(qq[32 * c : 32 * c + 32], want.astype(np.int8)), c
        assert np.abs(qq[32 * c : 32 * c + 32]).max() == 127


@pytest.mark.parametrize("group", [1, 2, 6, 7, 12])
def test_attention_rows_sharing_a_mask_row(group: int) -> None:
    """The query heads of one token share one mask row (one pointer, as llama.cpp hands them
    over): sdfa converts it once per block and spreads it over their lanes, up to four such runs
    in a tile, lane by lane beyond (group 1 and 2 on AVX2). The same bits as each row given its
    own copy, on every path, whole blocks and a partial last one, in walks of 64 and of 8."""
    lib = _lib()
    rng = np.random.default_rng(group)
    d, n_kv, tokens = 64, 203, 9
    k, v = _kv(rng, n_kv, d)
    rows = tokens * group
    q = rng.uniform(-3, 3, (rows, d)).astype(np.float32)
    # token t sees positions before n_kv - 9 + t (causal), with an additive bias of its own
    bias = rng.uniform(-2, 2, (tokens, n_kv)).astype(np.float16)
    seen = np.arange(n_kv)[None, :] < (n_kv - tokens + np.arange(tokens))[:, None]
    token_mask = np.where(seen, bias, np.float16(-np.inf))
    own = np.repeat(token_mask, group, axis=0)  # each row its own copy
    for isa in _isas(lib):
        out = _attend(lib, isa, q, k, v, own, n_kv)
        assert _same_bits(out, _attend(lib, 0, q, k, v, own, n_kv)), SDMM_ISAS[isa]
        for walk in (64, 8):
            shared = _attend(lib, isa, q, k, v, token_mask, n_kv, group=group, walk=walk)
            assert _same_bits(shared, out), f"{SDMM_ISAS[isa]}, shared rows, walks of {walk}"
