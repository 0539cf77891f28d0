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
the draft's catch-up extend of the tokens committed last round; issue 5's `k="auto"` controller
reuses the pure functions below with online estimates of v, c and p_at_least.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import cli_args
from .device import synchronize
from .models.base import SpecModel

SCHEMA = "specdec.microbench/1"


# ------------------------------------------------------------------------------ cost model
def expected_tokens_per_round(p_at_least: Sequence[float], k: int) -> float:
    """E[tokens per round] at speculation length k: 1 + sum_{i<=k} P(>= i accepted).

    p_at_least  [K_max] float  p_at_least[i-1] = P(at least i drafts accepted); needs k <= K_max
    """
    if not 0 <= k <= len(p_at_least):
        raise ValueError(f"k must be in [0, {len(p_at_least)}] for this profile, got {k}")
    return 1.0 + float(sum(p_at_least[:k]))


def cost_in_target_steps(v: Sequence[float], c: float, k: int) -> float:
    """Cost of one round at speculation length k, in target steps: v(k+1) + k c.

    v  [B_max] float  v[b-1] = v(b), the verify cost of b tokens in target steps (v[0] = 1)
    c  draft step / target step
    """
    if not 0 <= k < len(v):
        raise ValueError(f"k must be in [0, {len(v) - 1}] for a curve of {len(v)} points, got {k}")
    return float(v[k]) + k * c


def predicted_speedup(v: Sequence[float], c: float, p_at_least: Sequence[float], k: int) -> float:
    """Predicted speedup over target-only decoding at speculation length k: E(k) / cost(k).

    k = 0 is a plain target step (E = 1, cost = v(1) = 1): speedup 1. The arithmetic is
    unit-agnostic: with v in seconds and c a draft step in seconds this is tokens per second,
    whose argmax over k is the same.
    """
    return expected_tokens_per_round(p_at_least, k) / cost_in_target_steps(v, c, k)


def best_k(v: Sequence[float], c: float, p_at_least: Sequence[float], k_max: int) -> int:
    """The k in 0..k_max with the highest predicted speedup (0: speculation cannot pay)."""
    return max(range(k_max + 1), key=lambda k: (predicted_speedup(v, c, p_at_least, k), -k))


# ------------------------------------------------------------------------------ acceptance
def acceptance_profile(bench: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Pooled P(>= i accepted) from the speculative runs of a `specdec.bench/1` artifact.

    p_at_least[i] = sum over rows of accepted_per_pos[i] / sum of drafted_per_pos[i]. The
    denominator is the rounds that drafted position i+1, not all rounds: the last round of a
    generation drafts fewer (or no) tokens when the token budget runs out, and counting it would
    bias every position down.
    """
    from .schema import validate

    if validate(bench) != "specdec.bench/1":
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
    return {
        "source": source,
        "config": cfg.get("name"),
        "k": cfg.get("k"),
        "temperature": cfg.get("temperature"),
        "n_rows": len(bench["rows"]),
        "drafted_per_pos": drafted[:k_max],
        "accepted_per_pos": accepted[:k_max],
        # positional acceptance (accepted / drafted at position i) IS P(>= i accepted): both kept
        # under their own names so neither reader has to know that.
        "positional_acceptance": p,
        "p_at_least": p,
    }


def check_prediction(art: dict[str, Any], bench: dict[str, Any], source: str = "") -> dict:
    """Predicted vs measured speedup for one fixed-K bench artifact, from this microbench's
    cost curve and the bench's own acceptance profile (the paper's claim that acceptance plus
    v(b) and c predict speed, tested).

    Measured is compared on the decode phase (bench `decode_speedup`: prompt prefills, paid
    once per request by every method, left out), which is what the per-round model describes;
    the end-to-end `speedup` is recorded beside it.
    """
    cfg = bench.get("config", {})
    k = cfg.get("k")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"{source}: the prediction check needs a fixed-K bench, got k={k!r}")
    prof = acceptance_profile(bench, source)
    v = [pt["ratio"] for pt in art["verify"]]
    model_free = cfg.get("drafter") == "lookup"
    c = 0.0 if model_free else art["c"]
    if c is None:
        raise ValueError(f"{source}: drafts with a model but this microbench measured no draft")
    k_eff = min(k, len(prof["p_at_least"]), len(v) - 1)
    pred = predicted_speedup(v, c, prof["p_at_least"], k_eff)
    agg = bench["aggregates"]
    measured = agg.get("decode_speedup")
    return {
        "source": source,
        "config": cfg.get("name"),
        "drafter": cfg.get("drafter"),
        "k": k,
        "temperature": cfg.get("temperature"),
        "c": c,
        "p_at_least": prof["p_at_least"],
        "predicted_speedup": pred,
        "measured_decode_speedup": measured,
        "measured_speedup": agg.get("speedup"),
        "relative_error": (pred - measured) / measured if measured else None,
    }


# ------------------------------------------------------------------------------ measurement
def probe_ids(tokenizer: Any, vocab_size: int, n: int) -> list[int]:
    """n token ids of real text: the vendored prompts, chat-templated, concatenated.

    Without a tokenizer (mock models) a fixed pseudo-random id sequence stands in.
    """
    if tokenizer is None:
        return [(7 * i + 3) % vocab_size for i in range(n)]
    from .prompting import encode, load_prompts

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
) -> tuple[dict[int, list[float]], list[float]]:
    """Time target extend(b) for b = 1..max_batch and draft extend(1), both on ids[:prefix].

    ids  [prefix + max_batch] token ids: the cached prefix, then the tokens each probe appends
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
    verify: dict[int, list[float]] = {b: [] for b in range(1, max_batch + 1)}
    draft_ms: list[float] = []
    passes = tqdm(range(repeats + 1), desc="microbench", unit="pass", disable=not progress)
    for r in passes:
        order = range(1, max_batch + 1) if r % 2 else range(max_batch, 0, -1)
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
    models: dict[str, Any],
    prefix: int,
    repeats: int,
    acceptance: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `specdec.microbench/1` artifact (see schema.py) from raw timings."""
    from .schema import meta_block

    medians = {b: statistics.median(ms) for b, ms in sorted(verify.items())}
    step = medians[1]
    v = [medians[b] / step for b in sorted(medians)]  # [B_max] v[b-1] = v(b)
    draft_step = statistics.median(draft_ms) if draft_ms else None
    c = draft_step / step if draft_step is not None else None
    # Without a draft model the prediction is for a model-free drafter (prompt lookup): c = 0.
    c_used = c if c is not None else 0.0
    p = acceptance["p_at_least"] if acceptance else None
    k_max = min(len(v) - 1, len(p)) if p is not None else len(v) - 1
    prediction = []
    for k in range(1, k_max + 1):
        e = expected_tokens_per_round(p, k) if p is not None else None
        cost = cost_in_target_steps(v, c_used, k)
        prediction.append({
            "k": k, "expected_tokens_per_round": e, "cost_in_target_steps": cost,
            "predicted_speedup": predicted_speedup(v, c_used, p, k) if p is not None else None,
        })  # fmt: skip
    return {
        "schema": SCHEMA,
        "meta": meta_block(),
        "models": models,
        "prefix_tokens": prefix,
        "repeats": repeats,
        "max_batch": len(v),
        "verify": [
            {"b": b, "median_ms": medians[b], "ratio": v[b - 1], "samples_ms": verify[b]}
            for b in sorted(medians)
        ],
        "target_step_ms": step,
        "draft_step_ms": draft_step,
        "draft_samples_ms": draft_ms or None,
        "c": c,
        "acceptance": acceptance,
        "prediction_c": c_used,
        "prediction": prediction,
        "best_k": best_k(v, c_used, p, k_max) if p is not None else None,
    }


def run(
    target: SpecModel,
    draft: SpecModel | None,
    models: dict[str, Any],
    *,
    prefix: int = 100,
    max_batch: int = 16,
    repeats: int = 7,
    acceptance: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure `target` (and `draft`) and return the microbench artifact."""
    if prefix < 1 or max_batch < 1 or repeats < 1:
        raise ValueError("prefix, max_batch and repeats must all be >= 1")
    width = target.vocab_size
    if draft is not None:
        from .tokenizer import check_pair

        width = check_pair(draft, target)  # the probe ids must mean the same to both
    ids = probe_ids(target.tokenizer, width, prefix + max_batch)
    verify, draft_ms = measure(target, draft, ids, prefix, max_batch, repeats, progress)
    return build_artifact(verify, draft_ms, models, prefix, repeats, acceptance)


def format_table(art: dict[str, Any]) -> str:
    """A compact, human-readable summary of a microbench artifact."""
    lines = [f"target {art['models']['target']['name']}: one step {art['target_step_ms']:.2f} ms "
             f"on a {art['prefix_tokens']}-token prefix (median of {art['repeats']})"]  # fmt: skip
    bs = [pt["b"] for pt in art["verify"]]
    lines.append("verify b  " + " ".join(f"{b:>6d}" for b in bs))
    lines.append("ms        " + " ".join(f"{pt['median_ms']:>6.2f}" for pt in art["verify"]))
    lines.append("v(b)      " + " ".join(f"{pt['ratio']:>6.2f}" for pt in art["verify"]))
    if art["draft_step_ms"] is not None:
        lines.append(f"draft {art['models']['draft']['name']}: one step "
                     f"{art['draft_step_ms']:.2f} ms, c = {art['c']:.3f}")  # fmt: skip
    else:
        lines.append("no draft model: predictions assume a free drafter (c = 0)")
    acc = art["acceptance"]
    if acc is None:
        lines.append("no acceptance profile (--acceptance): cost only; speedup = E / cost")
    else:
        pos = " ".join(f"{x:.2f}" for x in acc["p_at_least"])
        lines.append(f"acceptance from {acc['source']}: P(>= i accepted) = [{pos}]")
    lines.append(f"{'K':>3}  {'E[tok/round]':>12}  {'cost':>6}  {'speedup':>7}")
    for row in art["prediction"]:
        e, s = row["expected_tokens_per_round"], row["predicted_speedup"]
        e_txt = "-" if e is None else f"{e:.2f}"
        s_txt = "-" if s is None else f"{s:.2f}x"
        lines.append(f"{row['k']:>3}  {e_txt:>12}  {row['cost_in_target_steps']:>6.2f}  {s_txt:>7}")
    if art["best_k"] is not None:
        lines.append(f"best K = {art['best_k']} (0 = speculation cannot pay)")
    for ch in art.get("checks") or []:
        err = ch["relative_error"]
        lines.append(
            f"check {ch['source']}: K={ch['k']} {ch['drafter']} T={ch['temperature']}: predicted "
            f"{ch['predicted_speedup']:.2f}x, measured {_x(ch['measured_decode_speedup'])} "
            f"decode phase ({_x(ch['measured_speedup'])} end to end), error "
            + ("-" if err is None else f"{err:+.1%}")
        )
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def artifact_path(out: Path, target_name: str) -> Path:
    """<out>/microbench_<target-name>.json, the name made filesystem-safe."""
    return Path(out) / f"microbench_{re.sub(r'[^A-Za-z0-9._-]+', '-', target_name)}.json"


# ------------------------------------------------------------------------------ CLI
def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "microbench",
        help="verify-batch scaling curve, draft/target step ratio and predicted speedup per K",
    )
    p.add_argument(
        "--target",
        required=True,
        metavar="SPEC",
        help="target model, BACKEND:NAME_OR_PATH (str; required)",
    )
    p.add_argument(
        "--draft",
        default="none",
        metavar="SPEC",
        help="draft model SPEC for the step ratio c, or 'none' (str; default none)",
    )
    cli_args.add_device_args(p)
    p.add_argument(
        "--prefix",
        type=int,
        default=100,
        help="tokens cached before each probe, >= 1 (int; default 100)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="largest verify batch b timed, >= 1 (int; default 16)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timed passes per b; the median is kept, >= 1 (int; default 7)",
    )
    p.add_argument(
        "--acceptance",
        default=None,
        metavar="BENCH_JSON",
        help="bench artifact whose speculative rows give P(>= i accepted) "
        "(path; default none: cost only)",
    )
    p.add_argument(
        "--check",
        nargs="+",
        default=None,
        metavar="BENCH_JSON",
        help="fixed-K bench artifacts (e.g. a sweep's) whose measured decode-phase speedup is "
        "compared with this curve's prediction from their own acceptance (paths; default none)",
    )
    p.add_argument(
        "--out",
        default="results",
        metavar="DIR",
        help="directory for microbench_<target>.json (path; default results/)",
    )
    cli_args.add_no_progress_arg(p)
    p.set_defaults(func=_cmd_microbench)


def _cmd_microbench(args: argparse.Namespace) -> int:
    from .bench import model_block  # the MODEL block every artifact shares
    from .models import load_model

    cli_args.check_threads(args.threads)
    acceptance = None
    if args.acceptance is not None:  # read it first: a bad path should not cost a model load
        path = Path(args.acceptance)
        try:
            bench = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the acceptance artifact {path}: {e}") from e
        acceptance = acceptance_profile(bench, source=str(path))
    benches = []
    for path in map(Path, args.check or []):
        try:
            bench = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the bench artifact {path}: {e}") from e
        k = bench.get("config", {}).get("k")
        if isinstance(k, bool) or not isinstance(k, int):  # before the minutes of measuring
            raise ValueError(f"{path}: --check needs fixed-K bench artifacts, this one has k={k!r}")
        acceptance_profile(bench, source=str(path))  # validates the schema and the rows
        benches.append((str(path), bench))
    kw = {"device": args.device, "n_threads": args.threads}
    target = load_model(args.target, **kw)
    draft = None if args.draft.lower() == "none" else load_model(args.draft, **kw)
    models = {"target": model_block(args.target, target),
              "draft": model_block(args.draft, draft) if draft is not None else None}  # fmt: skip
    art = run(target, draft, models, prefix=args.prefix, max_batch=args.max_batch,
              repeats=args.repeats, acceptance=acceptance,
              progress=not args.no_progress)  # fmt: skip
    art["threads"] = args.threads  # None: the backends' default, all cores
    art["checks"] = [check_prediction(art, b, src) for src, b in benches]
    out = artifact_path(Path(args.out), target.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(art, indent=1) + "\n")
    print(format_table(art))
    print(f"wrote {out}", file=sys.stderr)
    return 0
