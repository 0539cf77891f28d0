"""What a GGUF file's weights are, which kernel multiplies each type, and whether the default
mode is batch-invariant for it (backends/llamacpp.py's module docstring says why each kernel
is or is not).

    matmul_weights(path)            the matmul weight tensors (what a verify pass multiplies)
    matmul_weight_types(path)       their ggml types
    invariant_by_construction(...)  whether those types all get batch-invariant matmuls
    inspect_weights(path, isa)      a WeightReport: architecture, types with their share of the
                                    bytes, the kernel of each, the verdict and what breaks it
                                    (`specdec models inspect`, `specdec doctor`, /v1/models)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Weight types sdmm multiplies (native/sdmm.h): every batch shape gives a row the same bits.
SDMM_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0"})
SDMM_TYPES |= frozenset({"Q5_1", "Q8_0", "IQ4_NL", "F16", "BF16"})
#: Weight types whose ggml CPU kernels give a row the same bits in any batch (one scale per
#: 32-value block, one dot product per row): measured by `specdec invariance` on smollm2 (Q4_1,
#: Q8_0) and the Qwen 0.5B (Q5_0, Q8_0), checked in tests/backends/test_deterministic.py.
ROW_INVARIANT_TYPES = frozenset({"Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def matmul_weights(path: Path) -> list[Any]:
    """A GGUF file's matmul weights (registry.GGUFTensor): every weight matrix but the token
    embedding (looked up row by row) unless the output layer is tied to it."""
    from specdec.backends.registry import gguf_tensors

    tensors = gguf_tensors(path)
    names = {t.name for t in tensors}
    return [
        t
        for t in tensors
        if len(t.dims) >= 2
        and t.name.endswith(".weight")
        and not (t.name == "token_embd.weight" and "output.weight" in names)
    ]


def _type_of(t: Any) -> str:
    """A weight's type; "<type>/3d" for more than two dimensions (MoE experts): sdmm does not
    take those."""
    return t.type if all(d == 1 for d in t.dims[2:]) else f"{t.type}/3d"


def matmul_weight_types(path: Path) -> frozenset[str]:
    """The ggml types of a GGUF file's matmul weights (`matmul_weights`)."""
    return frozenset(_type_of(t) for t in matmul_weights(path))


def invariant_by_construction(types: frozenset[str], isa: str | None) -> bool:
    """Whether weights of these types get batch-invariant matmuls in the default mode: sdmm's
    types while sdmm runs, ggml's per-row types always."""
    return types <= _covered(isa)


def _covered(isa: str | None) -> frozenset[str]:
    return ROW_INVARIANT_TYPES | (SDMM_TYPES if isa is not None else frozenset())


def kernel_of(qtype: str, isa: str | None) -> str:
    """Which kernel multiplies weights of `qtype` in a verify pass, in the default mode."""
    if qtype in SDMM_TYPES and isa is not None:
        return f"sdmm ({isa}): one kernel for every batch size, rows bit-identical"
    if qtype in ROW_INVARIANT_TYPES:
        return "ggml, one dot product per row: rows bit-identical"
    if qtype.endswith("/3d"):
        return "ggml's expert matmul: not batch-invariant"
    return "ggml (repacked or tiled in a batch): a row's bits depend on the batch"


def not_invariant_warning(name: str, types: frozenset[str], isa: str | None) -> str:
    """What a default-mode load of a file that is not batch-invariant says: the types that
    break it and the two ways out."""
    breaking = ", ".join(sorted(types - _covered(isa)))
    return (
        f"{name}: weight types {breaking} are not multiplied batch-invariantly in the default "
        "mode, so greedy speculation may differ from target-only output where two tokens are "
        "nearly tied; load with deterministic=True (--deterministic: ggml's slower invariant "
        "paths) to keep the guarantee, or use a file whose weights sdmm takes ("
        f"{', '.join(sorted(SDMM_TYPES | ROW_INVARIANT_TYPES))})"
    )


@dataclass(frozen=True)
class WeightReport:
    """What `inspect_weights` found in one GGUF file."""

    path: str
    architecture: str | None
    name: str | None
    type_bytes: dict[str, int]  # matmul weight type -> bytes, largest first
    isa: str | None  # sdmm's instruction path in this process (None: off or not built)

    @property
    def invariant(self) -> bool:
        return invariant_by_construction(frozenset(self.type_bytes), self.isa)

    @property
    def breaking(self) -> list[str]:
        return sorted(set(self.type_bytes) - _covered(self.isa))

    def record(self) -> dict[str, Any]:
        total = sum(self.type_bytes.values()) or 1
        return {
            "path": self.path,
            "architecture": self.architecture,
            "name": self.name,
            "weights": [
                {"type": t, "bytes": b, "share": b / total, "kernel": kernel_of(t, self.isa)}
                for t, b in self.type_bytes.items()
            ],
            "sdmm": self.isa,
            "batch_invariant": self.invariant,
            "breaking_types": self.breaking,
        }

    def lines(self) -> list[str]:
        """The report as a person reads it."""
        rec = self.record()
        out = [f"{self.path}", f"  architecture  {self.architecture or '?'} ({self.name or '?'})"]
        out.append("  matmul weights (share of bytes, kernel):")
        for w in rec["weights"]:
            out.append(f"    {w['type']:8s} {w['share']:6.1%}  {w['kernel']}")
        if self.invariant:
            out.append(
                "  default mode: batch-invariant -- greedy speculation equals target-only "
                "token for token"
            )
        else:
            out.append(
                f"  default mode: NOT batch-invariant ({', '.join(self.breaking)}): greedy "
                "speculation may differ from target-only where two tokens are nearly tied;"
            )
            out.append(
                "    deterministic=True (--deterministic) keeps the guarantee on ggml's slower "
                "invariant paths (measure the cost: specdec microbench --deterministic)"
            )
        return out


def inspect_weights(path: Path, isa: str | None) -> WeightReport:
    """The report for a GGUF file, for a process whose sdmm runs `isa` (backends.llamacpp.
    sdmm_isa(); None where sdmm is off)."""
    from specdec.backends.registry import gguf_metadata

    sizes: dict[str, int] = {}
    for t in matmul_weights(path):
        sizes[_type_of(t)] = sizes.get(_type_of(t), 0) + t.size
    meta = gguf_metadata(path)
    ordered = dict(sorted(sizes.items(), key=lambda kv: -kv[1]))
    name = meta.get("general.name")
    return WeightReport(str(path), meta.get("general.architecture"), name, ordered, isa)
