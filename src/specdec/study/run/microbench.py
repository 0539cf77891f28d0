"""Microbenchmarks that make acceptance a predictor of speedup (paper, sections 6.4-6.5 and 7).

The paper asks every implementation to report a verify-batch scaling curve and a draft-step /
target-step latency ratio next to its acceptance rates: without them acceptance says nothing
about speed. This module measures both and turns them, with a measured acceptance profile, into
a predicted speedup per speculation length K.

Glossary (all costs in target steps: one target `extend` of 1 token on a ~100-token prefix = 1):
    v(b)            cost of one target `extend` of b tokens (all-position logits, as the engine
                    verifies), relative to b = 1; v(1) = 1. A round at K verifies b = K + 1.
    c               draft step cost: the draft's extend(1 token) / the target's, same prefix
    p_at_least[i-1] P(at least i of the K drafts are accepted). Acceptance is a prefix (the walk
                    stops at the first rejection), so this is the paper's positional acceptance
                    at position i, and it does not depend on later drafts: a profile measured at
                    K_max predicts every K <= K_max.
    E(K)            expected tokens per round = 1 + sum_{i<=K} P(>= i accepted)  (the 1 is the
                    recovered or bonus token every round emits)
    cost(K)         v(K+1) + K c   (K draft steps, one verify of K+1 tokens)
    speedup(K)      E(K) / cost(K) against target-only decoding (1 token per target step); cost(K)
                    is also the break-even tokens per round.

The cost model ignores sampling and bookkeeping (the paper measures them at ~2% of wall time) and
the draft's catch-up extend of the tokens committed last round. The formulas are core.cost's, the
same ones `k="auto"` (core.policy.CostModelK) evaluates with online estimates of v, c and
p_at_least.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.core.checks import check_int
from specdec.core.cost import (
    best_k,
    expected_tokens_per_round,
    predicted_speedup,
    round_cost,
)
from specdec.core.device import synchronize
from specdec.core.model import SpecModel
from specdec.study.artifacts import (
    Acceptance,
    BenchArtifact,
    Check,
    MicrobenchArtifact,
    Model,
    Prediction,
    VerifyPoint,
    named_artifact,
    read,
)
from specdec.study.artifacts.provenance import meta_block
from specdec.study.present import fmt

SCHEMA = MicrobenchArtifact.SCHEMA


# ------------------------------------------------------------------------------ acceptance
def acceptance_profile(bench: Mapping[str, Any], source: str = "") -> Acceptance:
    """Pooled P(>= i accepted) from the speculative runs of a `specdec.bench/1` artifact.

    p_at_least[i] = sum over rows of accepted_per_pos[i] / sum of drafted_per_pos[i]. The
    denominator is the rounds that drafted position i+1, not all rounds: the last round of a
    generation drafts fewer (or no) tokens when the token budget runs out, and counting it would
    bias every position down.
    """
    if not isinstance(read(dict(bench), source), BenchArtifact):
        raise ValueError(f"{source or 'acceptance source'}: expected a specdec.bench/1 artifact")
    accepted: list[int] = []
    drafted: list[int] = []
    for row in bench["rows"]:
        run = row["speculative"]
        for name, total in (("accepted_per_pos", accepted), ("drafted_per_pos", drafted)):
            counts = run[name]
            total.extend([0] * (len(counts) - len(total)))
            for i, n in enumerate(counts):
                total[i] += n
    k_max = next((i for i, d in enumerate(drafted) if d == 0), len(drafted))
    if k_max == 0:
        raise ValueError(f"{source or 'acceptance source'}: no speculative rounds drafted a token")
    p = [a / d for a, d in zip(accepted[:k_max], drafted[:k_max], strict=True)]
    cfg = bench.get("config", {})
    return Acceptance(
        source=source,
        config=cfg.get("name"),
        k=cfg.get("k"),
        temperature=cfg.get("temperature"),
        n_rows=len(bench["rows"]),
        drafted_per_pos=tuple(drafted[:k_max]),
        accepted_per_pos=tuple(accepted[:k_max]),
        positional_acceptance=tuple(p),
        p_at_least=tuple(p),
    )


def check_prediction(
    v: Sequence[float], c: float | None, bench: Mapping[str, Any], source: str = ""
) -> Check:
    """Predicted vs measured speedup for one fixed-K bench artifact, from a microbench's cost
    curve (v[b-1] = v(b), its measured c or None without a draft) and the bench's own acceptance
    profile (the paper's claim that acceptance plus v(b) and c predict speed, tested).

    Measured is compared on the decode phase (bench `decode_speedup`: prompt prefills, paid
    once per request by every method, left out), which is what the per-round model describes;
    the end-to-end `speedup` is recorded beside it.
    """
    cfg = bench.get("config", {})
    k = cfg.get("k")
    check_int(f"{source}: the prediction check needs a fixed-K bench; its config.k", k, 1)
    prof = acceptance_profile(bench, source)
    model_free = cfg.get("drafter") == "lookup"
    if not model_free and c is None:
        raise ValueError(f"{source}: drafts with a model but this microbench measured no draft")
    c_used = 0.0 if model_free or c is None else c
    k_eff = min(k, len(prof.p_at_least), len(v) - 1)
    pred = predicted_speedup(v, c_used, prof.p_at_least, k_eff)
    agg = bench["aggregates"]
    measured = agg.get("decode_speedup")
    return Check(
        source=source,
        config=cfg.get("name"),
        drafter=cfg.get("drafter"),
        k=k,
        temperature=cfg.get("temperature"),
        c=c_used,
        p_at_least=prof.p_at_least,
        predicted_speedup=pred,
        measured_decode_speedup=measured,
        measured_speedup=agg.get("speedup"),
        relative_error=(pred - measured) / measured if measured else None,
    )


# ------------------------------------------------------------------------------ measurement
def probe_ids(tokenizer: Any, vocab_size: int, n: int) -> list[int]:
    """n token ids of real text: the vendored prompts, chat-templated, concatenated.

    Without a tokenizer (mock models) a fixed pseudo-random id sequence stands in.
    """
    if tokenizer is None:
        return [(7 * i + 3) % vocab_size for i in range(n)]
    from specdec.backends.chat import encode
    from specdec.study.run.prompts import load_prompts

    ids: list[int] = []
    for p in load_prompts():
        ids += encode(tokenizer, p.text)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the vendored prompts hold only {len(ids)} tokens, fewer than {n}")


def _timed_extend_ms(model: SpecModel, ids: list[int]) -> float:
    """Wall ms of one `extend(ids)`; the cache is rolled back afterwards (untimed)."""
    n = model.n_cached
    synchronize(model.device)
    t0 = time.perf_counter()
    model.extend(ids)
    synchronize(model.device)
    ms = (time.perf_counter() - t0) * 1e3
    model.truncate(n)
    return ms


def measure(
    target: SpecModel,
    draft: SpecModel | None,
    ids: list[int],
    prefix: int,
    max_batch: int,
    repeats: int,
    progress: bool = True,
    batches: Sequence[int] | None = None,
) -> tuple[dict[int, list[float]], list[float]]:
    """Time target extend(b) for b = 1..max_batch and draft extend(1), both on ids[:prefix].

    ids      [prefix + max_batch] token ids: the cached prefix, then the tokens each probe appends
    batches  the b to time instead of all of 1..max_batch, each in [1, max_batch] (specdec
             doctor times a few)
    returns ({b: [repeats] ms}, [repeats] draft ms, empty without a draft)

    One untimed warm-up pass, then `repeats` timed passes. Within a pass every b and the draft
    step run once, the b order alternating ascending / descending between passes, so slow drift
    of the machine (thermal, other processes) lands on every b alike instead of biasing the curve.
    """
    from tqdm import tqdm

    if len(ids) < prefix + max_batch:
        raise ValueError(f"need {prefix + max_batch} probe ids, got {len(ids)}")
    models = [m for m in (target, draft) if m is not None]
    for m in models:
        m.reset()
        m.extend(ids[:prefix])
    probe = ids[prefix : prefix + max_batch]
    sizes = sorted(set(batches)) if batches is not None else list(range(1, max_batch + 1))
    if not sizes or not 1 <= sizes[0] <= sizes[-1] <= max_batch:
        raise ValueError(f"batches must lie in [1, {max_batch}], got {sizes}")
    verify: dict[int, list[float]] = {b: [] for b in sizes}
    draft_ms: list[float] = []
    passes = tqdm(range(repeats + 1), desc="microbench", unit="pass", disable=not progress)
    for r in passes:
        order = sizes if r % 2 else sizes[::-1]
        for b in order:
            ms = _timed_extend_ms(target, probe[:b])
            if r > 0:  # pass 0 is the warm-up
                verify[b].append(ms)
        if draft is not None:
            ms = _timed_extend_ms(draft, probe[:1])
            if r > 0:
                draft_ms.append(ms)
    for m in models:
        m.reset()
    return verify, draft_ms


def build_artifact(
    verify: dict[int, list[float]],
    draft_ms: list[float],
    models: Mapping[str, Model | None],
    prefix: int,
    repeats: int,
    acceptance: Acceptance | None,
) -> MicrobenchArtifact:
    """The `specdec.microbench/1` artifact from raw timings (the glossary above)."""
    medians = {b: statistics.median(ms) for b, ms in sorted(verify.items())}
    step = medians[1]
    v = [medians[b] / step for b in sorted(medians)]  # [B_max] v[b-1] = v(b)
    draft_step = statistics.median(draft_ms) if draft_ms else None
    c = draft_step / step if draft_step is not None else None
    # Without a draft model the prediction is for a model-free drafter (prompt lookup): c = 0.
    c_used = c if c is not None else 0.0
    p = acceptance.p_at_least if acceptance else None
    k_max = min(len(v) - 1, len(p)) if p is not None else len(v) - 1
    prediction = tuple(
        Prediction(
            k=k,
            expected_tokens_per_round=expected_tokens_per_round(p, k) if p is not None else None,
            cost_in_target_steps=round_cost(v, c_used, k),
            predicted_speedup=predicted_speedup(v, c_used, p, k) if p is not None else None,
        )
        for k in range(1, k_max + 1)
    )
    return MicrobenchArtifact(
        meta=meta_block(),
        models=models,
        prefix_tokens=prefix,
        repeats=repeats,
        max_batch=len(v),
        verify=tuple(
            VerifyPoint(b=b, median_ms=medians[b], ratio=v[b - 1], samples_ms=tuple(verify[b]))
            for b in sorted(medians)
        ),
        target_step_ms=step,
        step_spread=max(verify[1]) / min(verify[1]) - 1,
        draft_step_ms=draft_step,
        draft_samples_ms=tuple(draft_ms) or None,
        c=c,
        acceptance=acceptance,
        prediction_c=c_used,
        prediction=prediction,
        best_k=best_k(v, c_used, p, k_max) if p is not None else None,
    )


#: Tokens cached before each probe: the context a step and v(b) are measured on (--prefix).
PREFIX = 100


def run(
    target: SpecModel,
    draft: SpecModel | None,
    models: Mapping[str, Model | None],
    *,
    prefix: int = PREFIX,
    max_batch: int = 16,
    repeats: int = 7,
    acceptance: Acceptance | None = None,
    progress: bool = True,
) -> MicrobenchArtifact:
    """Measure `target` (and `draft`) and return the microbench artifact."""
    if prefix < 1 or max_batch < 1 or repeats < 1:
        raise ValueError("prefix, max_batch and repeats must all be >= 1")
    width = target.vocab_size
    if draft is not None:
        from specdec.core.pair import check_pair

        width = check_pair(draft, target)  # the probe ids must mean the same to both
    ids = probe_ids(target.tokenizer, width, prefix + max_batch)
    verify, draft_ms = measure(target, draft, ids, prefix, max_batch, repeats, progress)
    return build_artifact(verify, draft_ms, models, prefix, repeats, acceptance)


def format_table(art: MicrobenchArtifact) -> str:
    """A compact, human-readable summary of a microbench artifact."""
    target = art.target.name if art.target else "?"
    lines = [
        f"target {target}: one step {art.target_step_ms:.2f} ms "
        f"on a {art.prefix_tokens}-token prefix (median of {art.repeats})"
    ]
    lines.append("verify b  " + " ".join(f"{pt.b:>6d}" for pt in art.verify))
    lines.append("ms        " + " ".join(f"{pt.median_ms:>6.2f}" for pt in art.verify))
    lines.append("v(b)      " + " ".join(f"{pt.ratio:>6.2f}" for pt in art.verify))
    if art.draft_step_ms is not None and art.draft is not None:
        lines.append(
            f"draft {art.draft.name}: one step {art.draft_step_ms:.2f} ms, c = {art.c:.3f}"
        )
    else:
        lines.append("no draft model: predictions assume a free drafter (c = 0)")
    acc = art.acceptance
    if acc is None:
        lines.append("no acceptance profile (--acceptance): cost only; speedup = E / cost")
    else:
        pos = " ".join(f"{x:.2f}" for x in acc.p_at_least)
        lines.append(f"acceptance from {acc.source}: P(>= i accepted) = [{pos}]")
    lines.append(f"{'K':>3}  {'E[tok/round]':>12}  {'cost':>6}  {'speedup':>7}")
    for row in art.prediction:
        e = fmt.num(row.expected_tokens_per_round, ".2f", plain=True)
        sp = fmt.x(row.predicted_speedup, plain=True)
        lines.append(f"{row.k:>3}  {e:>12}  {row.cost_in_target_steps:>6.2f}  {sp:>7}")
    if art.best_k is not None:
        lines.append(f"best K = {art.best_k} (0 = speculation cannot pay)")
    for ch in art.checks:
        lines.append(
            f"check {ch.source}: K={ch.k} {ch.drafter} T={ch.temperature}: predicted "
            f"{fmt.x(ch.predicted_speedup, plain=True)}, measured "
            f"{fmt.x(ch.measured_decode_speedup, plain=True)} decode phase "
            f"({fmt.x(ch.measured_speedup, plain=True)} end to end), error "
            + fmt.num(ch.relative_error, "+.1%", plain=True)
        )
    return "\n".join(lines)


#: A single step that varies by more than this between passes means the machine was busy (one
#: other busy process turned an 18 ms llama.cpp step into 2,000 ms here): every v(b) is then
#: flattened, and the curve is not this machine's.
CONTENDED_SPREAD = 0.10


def artifact_path(out: Path, target_name: str, tag: str | None = None) -> Path:
    """<out>/microbench_<target-name>[_<tag>].json, the name made filesystem-safe."""
    return named_artifact(out, "microbench", target_name, tag)
