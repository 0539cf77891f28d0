"""The JSON artifacts the harness writes, and a validator for each kind.

Every artifact is one JSON object with `"schema": "specdec.<kind>/<version>"` and a `"meta"`
block (`meta_block()`): when, where (machine), with what (library versions). Kinds:

specdec.bench/1      one `specdec bench` run
    config      {name, draft, target, k, temperature, top_k, top_p, n_prompts, warmup,
                 max_new_tokens, drafter, compare}
    models      {"draft": MODEL, "target": MODEL}; MODEL = {spec, backend, name, device, sha256,
                 vocab_size, n_ctx}
    rows        one per recorded (non-warm-up) prompt:
                {prompt_id, category, prompt_tokens, seed, order ("base-first"|"spec-first"),
                 baseline: RUN, speculative: RUN, hf_assisted?: RUN}
                RUN = GenerationStats.to_dict() (decode.py defines each field) + {tokens: [ids],
                stop_reason}
    aggregates  {baseline: AGG, speculative: AGG, hf_assisted?: AGG, speedup,
                 speedup_pooled, peak_rss_mb, peak_vram_mb (null without CUDA)}
                AGG = {n, tok_s_mean, tok_s_std, ttft_s_mean, generated, rounds, drafted,
                       accepted, acceptance_rate, positional_acceptance [K], tokens_per_round,
                       ms_per_token: {draft, verify, sampling, other}}
                speedup = spec tok_s_mean / baseline tok_s_mean (mean of per-prompt rates);
                speedup_pooled = (sum tokens / sum wall) ratio
    complete    false if the run was interrupted (Ctrl-C keeps the finished rows)

specdec.sweep/1      summary of a K-sweep: config (without k), ks, points: [{k, artifact,
                     baseline_tok_s, speculative_tok_s, speedup, acceptance_rate,
                     tokens_per_round, positional_acceptance}]

specdec.microbench/1 cost curves:
    models      {"target": MODEL, "draft": MODEL | null}
    prefix_tokens, repeats
    verify      [{b, median_ms, ratio}] ratio = median_ms(b) / median_ms(1): v(b) in steps
    target_step_ms, draft_step_ms (null without a draft), c = draft_step_ms / target_step_ms
    acceptance  {source, positional_acceptance [K], p_at_least [K]} or null
    prediction  [{k, expected_tokens_per_round, cost_in_target_steps, predicted_speedup}]
                predicted_speedup = E[tokens/round] / (v(k+1) + k * c)

specdec.gate/1       level-3 equivalence: config, models,
    sampled     {n_prompts, max_new_tokens, temperature, seeds, tokens_speculative,
                 tokens_baseline, chi2, dof, p_value, passed, smoothed_kl, bins: [{label,
                 speculative, baseline}] (bins as tested: top tokens + one pooled bin)}
    greedy      {n_prompts, max_new_tokens, rows: [{prompt_id, match, n_baseline,
                 n_speculative, first_mismatch}], passed}
    passed
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

SCHEMAS = ("specdec.bench/1", "specdec.sweep/1", "specdec.microbench/1", "specdec.gate/1")

_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "specdec.bench/1": {"config": dict, "models": dict, "rows": list, "aggregates": dict,
                        "complete": bool},
    "specdec.sweep/1": {"config": dict, "ks": list, "points": list},
    "specdec.microbench/1": {"models": dict, "verify": list, "target_step_ms": (int, float),
                             "prediction": list},
    "specdec.gate/1": {"config": dict, "models": dict, "sampled": dict, "greedy": dict,
                       "passed": bool},
}  # fmt: skip

_AGG_KEYS = ("n", "tok_s_mean", "tok_s_std", "acceptance_rate", "positional_acceptance",
             "tokens_per_round", "ms_per_token")  # fmt: skip


class SchemaError(ValueError):
    pass


def validate(artifact: dict[str, Any]) -> str:
    """Check an artifact's structure; return its schema id or raise SchemaError."""
    if not isinstance(artifact, dict):
        raise SchemaError("an artifact is a JSON object")
    schema = artifact.get("schema")
    if schema not in _REQUIRED:
        raise SchemaError(f"unknown schema {schema!r}; expected one of {SCHEMAS}")
    if not isinstance(artifact.get("meta"), dict):
        raise SchemaError(f"{schema}: missing 'meta' block")
    for key, typ in _REQUIRED[schema].items():
        if not isinstance(artifact.get(key), typ):
            raise SchemaError(f"{schema}: field {key!r} missing or not {typ}")
    if schema == "specdec.bench/1":
        for side in ("baseline", "speculative"):
            agg = artifact["aggregates"].get(side)
            if not isinstance(agg, dict) or any(k not in agg for k in _AGG_KEYS):
                raise SchemaError(f"bench: aggregates.{side} must hold {_AGG_KEYS}")
        for row in artifact["rows"]:
            for side in ("baseline", "speculative"):
                if not isinstance(row.get(side), dict) or "tokens_per_s" not in row[side]:
                    raise SchemaError(f"bench: every row needs {side}.tokens_per_s")
    if schema == "specdec.microbench/1":
        for pt in artifact["verify"]:
            if not {"b", "median_ms", "ratio"} <= set(pt):
                raise SchemaError("microbench: verify points need b, median_ms, ratio")
    if schema == "specdec.gate/1":
        for key in ("chi2", "dof", "p_value", "passed"):
            if key not in artifact["sampled"]:
                raise SchemaError(f"gate: sampled.{key} missing")
    return schema


def meta_block() -> dict[str, Any]:
    """When, where and with what an artifact was produced."""
    import psutil

    versions = {"python": platform.python_version()}
    for mod in ("specdec", "torch", "transformers", "llama_cpp", "gguf", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # a missing optional backend is recorded, not fatal
            versions[mod] = None
    import torch

    return {
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "versions": versions,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
    }
