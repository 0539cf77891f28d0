"""The JSON artifacts the harness writes, and a validator for each kind.

Every artifact is one JSON object with `"schema": "specdec.<kind>/<version>"` and a `"meta"`
block (`meta_block()`): when, where (machine), with what (library versions). Kinds:

specdec.bench/1      one `specdec bench` run (bench.py defines each statistic)
    config      {name, draft, target, k, temperature, top_k, top_p, n_prompts, warmup,
                 max_new_tokens, drafter, compare, device, categories? ([] or absent: every
                 prompt; else the run took the first n_prompts prompts of these categories)}
    models      {"draft": MODEL, "target": MODEL}; MODEL = {spec, backend, name, device, sha256,
                 vocab_size, n_ctx, dtype (hf: torch dtype name; null for llama.cpp and mock)}
    rows        one per recorded (non-warm-up) prompt:
                {index (position in the prompt set, after any category filter), prompt_id,
                 category, prompt_tokens, seed, order ("base-first"|"spec-first"),
                 sequence [methods in the order run], baseline: RUN, speculative: RUN,
                 hf_assisted?: HF_RUN}
                RUN = GenerationStats.to_dict() (decode.py defines each field) + {tokens: [ids],
                stop_reason}
                HF_RUN = {tokens, stop_reason, prompt_tokens, generated, wall_s, tokens_per_s,
                          ttft_s (null), rounds, drafted, accepted, acceptance_rate,
                          tokens_per_round} (transformers' assisted generation; bench.py says
                          how rounds and drafted are counted)
    aggregates  {baseline: AGG, speculative: AGG, hf_assisted?: AGG, speedup,
                 speedup_pooled, decode_speedup, speedup_hf_assisted?, peak_rss_mb, peak_vram_mb
                 (null without CUDA), variants: {name: AGG + {speedup, decode_speedup}},
                 by_category}
                AGG = {n, tok_s_mean, tok_s_std, tok_s_pooled, decode_tok_s_pooled (null for
                       hf_assisted and for artifacts older than prefill_s), ttft_s_mean,
                       generated, rounds,
                       drafted, accepted, acceptance_rate, positional_acceptance [K],
                       tokens_per_round, ms_per_token: {draft, verify, sampling, other}}
                tok_s_std is the sample std (ddof 1; 0.0 for one row); a statistic a method
                cannot have is null (baseline acceptance_rate, its positional list being [];
                hf_assisted ttft_s_mean, positional_acceptance, ms_per_token)
                speedup = spec tok_s_mean / baseline tok_s_mean (mean of per-prompt rates);
                speedup_pooled = (sum tokens / sum wall) ratio; decode_speedup = the
                decode_tok_s_pooled ratio (prompt prefills excluded); speedup_hf_assisted =
                hf_assisted tok_s_mean / baseline tok_s_mean
    complete    false if the run was interrupted (Ctrl-C keeps the finished rows)

specdec.sweep/1      summary of a K-sweep: config (without k), ks, complete, points: [{k,
                     artifact (file name, beside the summary), baseline_tok_s,
                     baseline_tok_s_std, speculative_tok_s, speculative_tok_s_std, speedup,
                     speedup_pooled, acceptance_rate, tokens_per_round, positional_acceptance}]

specdec.microbench/1 cost curves (microbench.py defines each term):
    models      {"target": MODEL, "draft": MODEL | null}
    prefix_tokens, repeats, max_batch, threads (CPU threads per model; null = all cores),
    checks      [{source, config, drafter, k, temperature, c, p_at_least, predicted_speedup,
                  measured_decode_speedup, measured_speedup, relative_error}] (--check; may be
                  absent in older artifacts)
    verify      [{b, median_ms, ratio, samples_ms [repeats]}] ratio = median_ms(b) / median_ms(1):
                v(b) in steps
    target_step_ms, draft_step_ms (null without a draft), c = draft_step_ms / target_step_ms
                (null without a draft), draft_samples_ms [repeats] | null
    acceptance  {source, config, k, temperature, n_rows, drafted_per_pos [K],
                 accepted_per_pos [K], positional_acceptance [K], p_at_least [K]} or null
                (pooled over a bench artifact's speculative rows; the two lists are equal by
                definition: acceptance at position i implies all earlier positions accepted)
    prediction_c  the c the prediction used: c, or 0.0 without a draft (a model-free drafter)
    prediction  [{k, expected_tokens_per_round, cost_in_target_steps, predicted_speedup}] for
                k = 1..min(max_batch - 1, len(p_at_least)); without acceptance, k = 1..max_batch-1
                with expected_tokens_per_round and predicted_speedup null (cost is then the
                break-even tokens per round)
                predicted_speedup = E[tokens/round] / (v(k+1) + k * c)
    best_k      argmax of predicted_speedup over k = 0..K (0: speculation cannot pay), or null

specdec.gate/1       level-3 equivalence (gate.py):
    config      {name, draft, target, quick, threads, prompts, max_new_tokens, temperature, k,
                 greedy_prompts, greedy_tokens}
    models      {"draft": MODEL, "target": MODEL}
    sampled     {n_prompts, max_new_tokens, temperature, k, seeds: {rule, baseline [n],
                 speculative [n]}, tokens_speculative, tokens_baseline, distinct_tokens,
                 min_expected, n_bins, chi2, dof, p_value, p_value_permutation, n_permutations,
                 p_min, decided_by, passed, smoothed_kl, kl_definition, acceptance_rate, wall_s,
                 bins: [{label, token_id, speculative, baseline}] (bins as tested: top tokens by
                 combined count, then one pooled bin with token_id null; every expected count
                 >= min_expected)}
                p_value is the chi2(dof) reference; p_value_permutation calibrates the same
                statistic by swapping the methods' generations within prompts (stats.py says
                why the reference is too small on real text)
                passed = dof >= 1 and p_value_permutation > p_min  (decided_by names the field)
    greedy      {n_prompts, max_new_tokens, k, rows: [{prompt_id, match, n_baseline,
                 n_speculative, first_mismatch (null when match)}], passed}
    passed      sampled.passed and greedy.passed
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

SCHEMAS = ("specdec.bench/1", "specdec.sweep/1", "specdec.microbench/1", "specdec.gate/1")

_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "specdec.bench/1": {
        "config": dict,
        "models": dict,
        "rows": list,
        "aggregates": dict,
        "complete": bool,
    },
    "specdec.sweep/1": {"config": dict, "ks": list, "points": list},
    "specdec.microbench/1": {
        "models": dict,
        "verify": list,
        "target_step_ms": (int, float),
        "prediction": list,
    },
    "specdec.gate/1": {
        "config": dict,
        "models": dict,
        "sampled": dict,
        "greedy": dict,
        "passed": bool,
    },
}

_AGG_KEYS = (
    "n",
    "tok_s_mean",
    "tok_s_std",
    "acceptance_rate",
    "positional_acceptance",
    "tokens_per_round",
    "ms_per_token",
)


_PREDICTION_KEYS = ("k", "expected_tokens_per_round", "cost_in_target_steps", "predicted_speedup")


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
        sides = ("baseline", "speculative")
        if "hf_assisted" in artifact["aggregates"]:
            sides += ("hf_assisted",)
            agg = artifact["aggregates"]["hf_assisted"]
            if not isinstance(agg, dict) or any(k not in agg for k in _AGG_KEYS):
                raise SchemaError(f"bench: aggregates.hf_assisted must hold {_AGG_KEYS}")
        for row in artifact["rows"]:
            for side in sides:
                if not isinstance(row.get(side), dict) or "tokens_per_s" not in row[side]:
                    raise SchemaError(f"bench: every row needs {side}.tokens_per_s")
    if schema == "specdec.microbench/1":
        for pt in artifact["verify"]:
            if not {"b", "median_ms", "ratio"} <= set(pt):
                raise SchemaError("microbench: verify points need b, median_ms, ratio")
        for row in artifact["prediction"]:
            if not set(_PREDICTION_KEYS) <= set(row):
                raise SchemaError(f"microbench: prediction rows need {_PREDICTION_KEYS}")
    if schema == "specdec.gate/1":
        for key in ("chi2", "dof", "p_value", "passed"):
            if key not in artifact["sampled"]:
                raise SchemaError(f"gate: sampled.{key} missing")
        for b in artifact["sampled"].get("bins", []):
            if not {"label", "speculative", "baseline"} <= set(b):
                raise SchemaError("gate: sampled.bins need label, speculative, baseline")
        if not isinstance(artifact["greedy"].get("rows"), list):
            raise SchemaError("gate: greedy.rows must be a list")
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
