"""Which CPU kernels llama.cpp runs in this process, read from the loaded libraries: the path
specdec's sdmm and sdfa take (native/, docs/kernels.md), the build's manifest, and sdmm's probe of
the int8 peak. Artifacts record `kernels()` (study.artifacts.provenance), and k="auto"'s cost
curves are keyed by it (backends.llamacpp.cost_key): two builds' numbers are not one curve.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from specdec.backends.llamacpp_lib import bindings, ggml_lib, package_dir
from specdec.core.model import SpecModelError

#: sdmm's switches, read by the C library once per process: SDMM_ENV=0 leaves sdmm out (stock
#: llama.cpp's kernels); SDMM_ISA_ENV forces an instruction path (SDMM_ISAS) for tests.
SDMM_ENV, SDMM_ISA_ENV = "SPECDEC_MM", "SPECDEC_MM_ISA"
SDMM_ISAS = ("ref", "avx2", "avxvnni", "avx512")


def sdmm_isa() -> str | None:
    """The instruction path sdmm's kernels run in this process (one of SDMM_ISAS), or
    None: sdmm is off ($SPECDEC_MM=0) or not in this llama-cpp-python (not specdec's build)."""
    lib = ggml_lib("cpu")
    if not hasattr(lib, "sdmm_buffer_isa"):
        return None
    isa = int(lib.sdmm_buffer_isa())
    return SDMM_ISAS[isa] if 0 <= isa < len(SDMM_ISAS) else None


def peak_int8_gops(threads: int, seconds: float = 0.5) -> float | None:
    """The int8 multiply-accumulate peak of `threads` cores at once (GOPS, a multiply-add
    counted as two), measured by sdmm's probe of the path it runs (sdmm_isa()): independent
    vpdpbusd chains (AVX-512 VNNI, AVX-VNNI) or vpmaddubsw chains (AVX2), as its kernels use
    them. None on the scalar reference path or where the build lacks sdmm."""
    import threading

    lib = ggml_lib("cpu")
    if not hasattr(lib, "sdmm_peak_macs"):
        return None
    lib.sdmm_peak_macs.restype = ctypes.c_double
    lib.sdmm_peak_macs.argtypes = [ctypes.c_long]
    if lib.sdmm_peak_macs(1000) == 0.0:
        return None
    iters = max(1000, int(lib.sdmm_peak_macs(200_000) * seconds / 1024))  # ~`seconds` each
    rates: list[float] = []
    # ctypes lets go of the GIL during the call: the threads run on their own cores
    workers = [
        threading.Thread(target=lambda: rates.append(lib.sdmm_peak_macs(iters)))
        for _ in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return 2 * sum(rates) / 1e9


def sdfa_isa() -> str | None:
    """The instruction path of sdfa, specdec's attention for a q8_0 K cache (native/sdfa.h):
    its own dispatch's choice (sdmm's today: both need VNNI for AVX-512); or None: off
    ($SPECDEC_FA=0, or sdmm off) or not in this build."""
    lib = ggml_lib("cpu")
    if not hasattr(lib, "sdfa_op_isa"):
        return None
    isa = int(lib.sdfa_op_isa())
    return SDMM_ISAS[isa] if 0 <= isa < len(SDMM_ISAS) else None


def check_sdmm_env() -> None:
    """A forced instruction path this CPU cannot run is a clear error, not sdmm silently off."""
    want = os.environ.get(SDMM_ISA_ENV, "")
    if not want or os.environ.get(SDMM_ENV) == "0":
        return
    lib = ggml_lib("cpu")
    if want not in SDMM_ISAS:
        raise SpecModelError(f"{SDMM_ISA_ENV}={want!r}: choose one of {', '.join(SDMM_ISAS)}")
    if hasattr(lib, "sdmm_isa_supported") and not lib.sdmm_isa_supported(SDMM_ISAS.index(want)):
        raise SpecModelError(
            f"{SDMM_ISA_ENV}={want}: this CPU cannot run that instruction path; unset it"
        )


def kernels() -> dict[str, Any]:
    """Which CPU kernels llama.cpp runs in this process: how the installed llama-cpp-python was
    built ("native" or "portable" by specdec's build, else "not built by specdec"), the CPU it
    was built on, the instruction sets its ggml reports as compiled in, and the path sdmm's
    kernels take (None: off or absent)."""
    from specdec.backends import llamacpp_build

    llama = bindings()
    where = package_dir()
    info = llamacpp_build.installed_manifest(where) if where is not None else None
    text = llama.llama_print_system_info().decode("utf-8", "replace")
    features = sorted(
        name.split(":")[-1].strip()
        for name, _, value in (part.partition("=") for part in text.split("|"))
        if value.strip() == "1"
    )
    import llama_cpp

    return {
        "build": info["flavor"] if info else "not built by specdec",
        "built_on": info.get("cpu_model") if info else None,
        "patches": info.get("patches", []) if info else [],
        "source": source_digest(),
        "features": features,
        "sdmm": sdmm_isa(),
        "sdfa": sdfa_isa(),
        "cpu_model": llamacpp_build.cpu_model(),
        "llama_cpp_python": llama_cpp.__version__,
    }


@functools.cache
def source_digest() -> str | None:
    """The installed build's digest of specdec's kernel sources (its manifest), None where the
    build is not specdec's or predates the digest."""
    from specdec.backends import llamacpp_build

    where = package_dir()
    info = llamacpp_build.installed_manifest(where) if where is not None else None
    return info.get("source_digest") if info else None
