"""Batch invariance, op by op: does a verify pass over b tokens compute what b single steps do?

Speculative decoding verifies K drafted tokens in one target pass of b = K + 1 tokens; greedy
output equals target-only output only if every logit of that pass equals the logits of decoding
the same tokens one at a time. When it does not, this finds where the two first part: every
float32 node of llama.cpp's graph is captured (backends.llamacpp_ops.OpCapture) in both runs, and
node outputs are compared row by row (row i of the batched node vs the single step of token i).

The settings, each run in a process of its own because llama.cpp reads its tiled-matmul switch
and sdmm its switch once per process:
    default         specdec's: weights of sdmm's types (weights.SDMM_TYPES) in sdmm's buffer
                    (backends/native), the rest as stock llama.cpp has it
    stock           stock llama.cpp's defaults: weights repacked (AMX where the CPU has it),
                    tiled K-quant matmul on ($SPECDEC_MM=0)
    tiled-off       stock, tiled matmul off
    no-repack       stock, weights not repacked, tiled matmul on
    ggml-invariant  stock, neither: ggml's slow invariant paths (deterministic mode for a file
                    sdmm does not cover)

Artifact `specdec.invariance/1` (artifacts.InvarianceArtifact, whose field comments say what
each holds): the settings, and a probe per model, setting and context, with its per-row logit
differences, the first differing node, and a row per op.
`first_difference` is the earliest node in graph order whose rows differ: the op that breaks
invariance; later nodes differ because their inputs do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specdec.study.artifacts import InvarianceArtifact

SCHEMA = InvarianceArtifact.SCHEMA
#: setting -> (repack weights, GGML_CPU_TILED_MM, SPECDEC_MM)
SETTINGS: dict[str, tuple[bool, str, str]] = {
    "default": (True, "1", "1"),
    "stock": (True, "1", "0"),
    "tiled-off": (True, "0", "0"),
    "no-repack": (False, "1", "0"),
    "ggml-invariant": (False, "0", "0"),
}
_LAYER = re.compile(r"^(?P<op>.*?)-(?P<layer>\d+)(?P<rest>\|.*)$")


def _split(node: str) -> tuple[str, int | None]:
    """'Qcur-3|MUL_MAT' -> ('Qcur|MUL_MAT', 3); nodes outside a layer keep their name."""
    m = _LAYER.match(node)
    return (m["op"] + m["rest"], int(m["layer"])) if m else (node, None)


def compare_nodes(
    batched: dict[str, list[np.ndarray]], single: dict[str, list[np.ndarray]], b: int
) -> list[tuple[str, float]]:
    """(node, max |Δ| over its rows) for every node present once in the batched pass as a
    [b, n] activation and b times in the single steps as [1, n], in graph order."""
    out = []
    for node, runs in batched.items():
        steps = single.get(node, [])
        if len(runs) != 1 or len(steps) != b or runs[0].shape[0] != b or runs[0].ndim != 2:
            continue  # not a per-token activation (weights views, attention internals)
        if any(s.shape != (1, runs[0].shape[1]) for s in steps):
            continue
        rows = np.concatenate(steps)  # [b, n]
        out.append((node, float(np.abs(runs[0] - rows).max())))
    return out


def summarize(
    nodes: Sequence[tuple[str, float]], weight_types: dict[str, str] | None = None
) -> dict[str, Any]:
    """First differing node and the per-op table of a probe (see the module docstring);
    `weight_types` names the weight type of MUL_MAT nodes."""
    weight_types = weight_types or {}
    first = next(((n, d) for n, d in nodes if d > 0), None)
    ops: dict[str, dict[str, Any]] = {}
    for node, d in nodes:
        op, layer = _split(node)
        row = ops.setdefault(op, {"op": op, "layers": 0, "first_layer": None, "max_abs_diff": 0.0})
        if d > 0:
            row["layers"] += 1
            if row["first_layer"] is None or (layer is not None and layer < row["first_layer"]):
                row["first_layer"] = layer
        row["max_abs_diff"] = max(row["max_abs_diff"], d)
    first_difference = None
    if first is not None:
        op, layer = _split(first[0])
        first_difference = {
            "node": first[0],
            "op": op,
            "layer": layer,
            "max_abs_diff": first[1],
            "weight_type": weight_types.get(first[0]),
        }
    return {"first_difference": first_difference, "ops": list(ops.values())}


def probe(model: Any, capture: Any, context: list[int], batch: list[int]) -> dict[str, Any]:
    """One model, one context: logits and node outputs of `batch` as one pass vs one by one.

    `model` is a LlamaCppModel loaded with `op_capture=capture`; its cache is left empty.
    """
    model.reset()
    model.prefill(context)
    capture.tensors, capture.recording = {}, True
    try:
        together = model.extend(batch).numpy()  # [b, V]
        batched, capture.tensors = capture.tensors, {}
        model.truncate(len(context))
        alone = np.stack([model.extend([t]).numpy()[0] for t in batch])  # [b, V]
        single = capture.tensors
    finally:
        capture.recording, capture.tensors = False, {}
        model.reset()
    diff = np.abs(together - alone).max(axis=1)  # [b]
    return {
        "context": len(context),
        "batch": len(batch),
        "logits_max_abs_diff": [float(x) for x in diff],
        "identical": bool((together == alone).all()),
        **summarize(compare_nodes(batched, single, len(batch)), capture.weight_types),
    }


def probe_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from the middle of the vocabulary (content is irrelevant to
    invariance; ids below 100 and the special tokens at the top are avoided)."""
    rng = np.random.default_rng(seed)
    hi = max(101, min(vocab_size, 100_000) - 1)
    return [int(x) for x in rng.integers(100, hi, size=n)]


def run_setting(
    model_spec: str, setting: str, contexts: Sequence[int], batch: int, n_threads: int | None
) -> list[dict[str, Any]]:
    """Every context for one model under one setting, in this process. The process's
    GGML_CPU_TILED_MM and SPECDEC_MM must already be the setting's (see `SETTINGS`)."""
    from specdec.backends import load_model
    from specdec.backends.llamacpp_ops import OpCapture

    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {', '.join(SETTINGS)}")
    repack, _, _ = SETTINGS[setting]
    capture = OpCapture()
    n_ctx = max(contexts) + batch + 8
    model = load_model(
        model_spec,
        n_ctx=max(512, n_ctx),
        n_threads=n_threads,
        repack=repack,
        deterministic=setting == "ggml-invariant",
        op_capture=capture,
    )
    try:
        ids = probe_ids(model.vocab_size, max(contexts) + batch)
        probes = []
        for c in contexts:
            row = probe(model, capture, ids[:c], ids[c : c + batch])
            probes.append(
                {"model": model_spec, "setting": setting, "repacked_mib": model.repacked_mib, **row}
            )
        return probes
    finally:
        model.close()


def format_table(art: InvarianceArtifact | Mapping[str, Any]) -> str:
    """One line per probe: identical or not, and the op that breaks invariance first."""
    if not isinstance(art, InvarianceArtifact):
        art = InvarianceArtifact.model_validate(art)
    lines = [f"{'model':34} {'setting':14} {'ctx':>5} {'b':>3}  max|Δlogit|  first differing op"]
    for p in art.probes:
        first = p.first_difference
        where = "-"
        if first is not None:
            wt = f", {first.weight_type} weight" if first.weight_type else ""
            where = f"{first.op} (layer {first.layer}{wt})"
        worst = max(p.logits_max_abs_diff)
        lines.append(
            f"{p.model:34} {p.setting:14} {p.context:>5} {p.batch:>3}  {worst:11.3g}  {where}"
        )
    return "\n".join(lines)
