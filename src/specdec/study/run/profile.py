"""Where a verify pass spends its time, op by op and by weight type (llama.cpp backend).

A speculative round on a CPU pays v(b) for a pass over b = K + 1 tokens, and b / v(b) bounds
what any lossless method can gain. This splits v(b) into llama.cpp's graph nodes: every node is
timed through the eval callback (backends.llamacpp_ops.OpTimer), which makes the scheduler compute
the graph one node per call. That adds a fixed launch cost per node, measured on the graph's
no-op nodes (views, reshapes, permutes: they compute nothing) and subtracted; the time outside
the nodes (graph build, input upload, the logits copy-out) is what the profiled pass took beyond
the nodes' raw times. The same pass, timed on a second copy of the model loaded without a
callback, says how well the parts add up (`unaccounted_ms`).

Artifact `specdec.profile/1` (artifacts.ProfileArtifact): a probe per context and b, each with
its `groups` {GROUP: ms} and `ops`. GROUP is one of GROUPS; `ops` lists every category (a
matmul's weight role and type, e.g. "matmul ffn_down (q6_K)", else the op, e.g.
"flash_attn_ext"), heaviest first. Times are the median per node over the repeats. `gops`
(matmuls): 2 x weights x b / time, the kernel's rate in situ, beside `peak_int8_gops` (the int8
multiply-accumulate peak of the threads measured by sdmm's probe, vpdpbusd; null where the CPU
lacks AVX-512 VNNI or the build lacks sdmm).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

from specdec.study.artifacts import ProfileArtifact, ProfileProbe

SCHEMA = ProfileArtifact.SCHEMA
#: Ops that compute nothing (ggml_op_is_empty): their time is the per-node launch cost alone.
NOOP_OPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})
#: Coarse groups of `category`, in table order.
GROUPS = (
    "matmul q4_K",
    "matmul q6_K",
    "matmul other",
    "output matmul",
    "attention",
    "other ops",
    "outside graph",
)
_LAYER = re.compile(r"^blk\.\d+\.")
#: The weight of the output projection: `output.weight`, or the tied token embedding.
_OUTPUT_WEIGHTS = ("output", "token_embd")


def category(op: str, weight: str | None, weight_type: str | None) -> str:
    """'matmul ffn_down (q6_K)' for a matmul (its weight's role and type), else the op name."""
    if op == "MUL_MAT" and weight:
        role = _LAYER.sub("", weight).removesuffix(".weight")
        return f"matmul {role} ({weight_type})"
    return op.lower()


def group(cat: str) -> str:
    """Which of GROUPS a category belongs to."""
    if cat.startswith("matmul "):
        role, wtype = cat[len("matmul ") :].split(" (")
        if role in _OUTPUT_WEIGHTS:
            return "output matmul"
        wtype = wtype.rstrip(")")
        return f"matmul {wtype}" if f"matmul {wtype}" in GROUPS else "matmul other"
    if cat == "flash_attn_ext" or cat.startswith("soft_max"):
        return "attention"
    return "other ops"


def summarize(
    runs: Sequence[list[tuple[str, str, str | None, str | None, float]]],
    profiled_s: Sequence[float],
    pass_s: float,
    elements: dict[str, int] | None = None,
    batch: int = 1,
) -> dict[str, Any]:
    """One probe from the node lists of repeated profiled passes (OpTimer.nodes), their wall
    times, and the median wall time of the same pass without a callback. `elements`: weight
    name -> its element count, for the matmuls' GOPS (`batch` rows each)."""
    nodes = runs[0]
    if any(len(r) != len(nodes) for r in runs):
        raise ValueError("the graph changed between repeats of one probe")
    raw = [statistics.median(r[i][4] for r in runs) for i in range(len(nodes))]  # s per node
    noop = [t for (_, op, *_), t in zip(nodes, raw, strict=True) if op in NOOP_OPS]
    launch = statistics.median(noop) if noop else 0.0
    ops: dict[str, dict[str, Any]] = {}
    for (_, op, weight, wtype, _), t in zip(nodes, raw, strict=True):
        if op in NOOP_OPS:
            continue
        row = ops.setdefault(category(op, weight, wtype), {"ms": 0.0, "nodes": 0, "elems": 0})
        row["ms"] += max(0.0, t - launch) * 1e3
        row["nodes"] += 1
        row["elems"] += (elements or {}).get(weight or "", 0)
    for row in ops.values():
        elems = row.pop("elems")
        row["gops"] = 2 * elems * batch / row["ms"] / 1e6 if elems and row["ms"] > 0 else None
    profiled = statistics.median(profiled_s)
    outside = max(0.0, profiled - sum(raw))
    groups = dict.fromkeys(GROUPS, 0.0)
    for cat, row in ops.items():
        groups[group(cat)] += row["ms"]
    groups["outside graph"] = outside * 1e3
    return {
        "pass_ms": pass_s * 1e3,
        "profiled_ms": profiled * 1e3,
        "nodes": len(nodes),
        "launch_us": launch * 1e6,
        "outside_ms": outside * 1e3,
        "unaccounted_ms": pass_s * 1e3 - sum(groups.values()),
        "groups": groups,
        "ops": [{"category": c, **r} for c, r in sorted(ops.items(), key=lambda kv: -kv[1]["ms"])],
    }


def run_profile(
    spec: str,
    contexts: Sequence[int],
    batches: Sequence[int],
    repeats: int = 3,
    n_threads: int | None = None,
    type_k: int | None = None,
) -> list[ProfileProbe]:
    """Profile a pass over each b in `batches` after each context length, in this process."""
    from specdec.backends import load_model
    from specdec.backends.llamacpp_ops import OpTimer
    from specdec.study.run.invariance import probe_ids

    if not spec.startswith("llamacpp:"):
        raise ValueError(f"the op profile reads llama.cpp's graph; {spec!r} is not llamacpp:")
    if repeats < 1 or min(contexts) < 1 or min(batches) < 1:
        raise ValueError("repeats, contexts and batches must all be >= 1")
    n_ctx = max(512, max(contexts) + max(batches) + 8)
    kwargs: dict[str, Any] = {"n_ctx": n_ctx, "n_threads": n_threads}
    if type_k is not None:
        kwargs["type_k"] = type_k
    timer = OpTimer()
    plain = load_model(spec, **kwargs)
    timed = load_model(spec, op_capture=timer, **kwargs)
    elements = weight_elements(plain)
    try:
        ids = probe_ids(plain.vocab_size, max(contexts) + max(batches))
        probes = []
        for c in contexts:
            for m in (plain, timed):
                m.reset()
                m.prefill(ids[:c])
            for b in batches:
                batch = ids[c : c + b]
                plain.extend(batch)  # warm-up: first use of a shape allocates
                plain.truncate(c)
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    plain.extend(batch)
                    samples.append(time.perf_counter() - t0)
                    plain.truncate(c)
                runs, profiled = [], []
                timer.recording = True
                try:
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        timer.begin()
                        timed.extend(batch)
                        profiled.append(time.perf_counter() - t0)
                        runs.append(timer.nodes)
                        timed.truncate(c)
                finally:
                    timer.recording = False
                probe = summarize(runs, profiled, statistics.median(samples), elements, b)
                probes.append(ProfileProbe(context=c, batch=b, **probe))
        return probes
    finally:
        timed.close()
        plain.close()


def weight_elements(model: Any) -> dict[str, int]:
    """Weight name -> element count, from the model's GGUF header."""
    import math

    from specdec.backends.registry import gguf_tensors

    return {t.name: math.prod(t.dims) for t in gguf_tensors(model.path)}


def format_table(probes: Sequence[ProfileProbe]) -> str:
    """ms per group for each probe, and each group's cost per row relative to b = 1."""
    head = f"{'ctx':>5} {'b':>4} {'pass ms':>8} " + " ".join(f"{g:>14}" for g in GROUPS)
    lines = [head + f" {'launch/node':>11} {'unaccounted':>11}"]
    for p in probes:
        cells = " ".join(f"{p.groups[g]:14.1f}" for g in GROUPS)
        lines.append(
            f"{p.context:>5} {p.batch:>4} {p.pass_ms:8.1f} {cells} "
            f"{p.launch_us:9.1f}us {p.unaccounted_ms:9.1f}ms"
        )
    return "\n".join(lines)


def format_kernel_rates(probes: Sequence[ProfileProbe], peak_gops: float | None) -> str:
    """GOPS of each matmul group per probe, against the measured int8 peak."""
    peak = f"{peak_gops:.0f} GOPS" if peak_gops else "not measured"
    lines = [f"matmul rate (2 x weights x b / time); int8 peak of these threads: {peak}"]
    for p in probes:
        rates = [f"{op.category.removeprefix('matmul ')} {op.gops:.0f}" for op in p.ops if op.gops]
        lines.append(f"  ctx {p.context:>5} b {p.batch:>4}: " + ", ".join(rates[:6]))
    return "\n".join(lines)
