"""Level 3 of the exactness gate: speculative vs target-only decoding on real models (paper 6.1).

Two legs, one verdict:

sampled  For prompt i (chat-templated, stop ids honoured) generate up to `max_new_tokens` at
         T = 1.0 with the target alone (seed 1234 + i) and with the speculative pair (seed
         1234 + i + 100000). The seed streams differ so the two samples are independent draws;
         with equal seeds they would share random numbers and the test would be miscalibrated.
         All tokens of each method are pooled into frequency counts and compared with a
         two-sample chi-square over bins where every expected count is >= 5 (top tokens by
         combined count, the rest pooled: `specdec.stats.frequency_bins`). The verdict uses
         that statistic's permutation p-value (swapping the two methods' generations within
         prompts, `specdec.stats.paired_permutation_p`): tokens within a generation are
         correlated, which makes the asymptotic chi2(dof) p-value too small, so a correct engine
         would fail the asymptotic test more often than 1% of the time (stats.py has the
         measurement). Both p-values are recorded; pass at permutation p > 0.01.
         The smoothed symmetric KL is recorded for reference only (the paper explains why it is
         dominated by smoothing at this sample size).
greedy   A few prompts x up to 200 tokens at T = 0: the speculative tokens must equal the
         target-only tokens exactly. This presupposes batch-invariant target logits (fp32 HF;
         llama.cpp with flash attention); the first mismatch index is recorded if any.

The chi-square test bounds, rather than rules out, a deviation: with ~10^4 tokens per method it
detects gross errors (an always-accept rule, an off-by-one in the verify rows) but not tiny ones.
The analytic argument (paper 3.2) and levels 1-2 (tests/) carry the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import cli_args, decode
from .models.base import SpecModel
from .stats import (
    KL_SMOOTHING,
    MIN_EXPECTED,
    PERMUTATIONS,
    chi2_of_bins,
    frequency_bins,
    paired_permutation_p,
    smoothed_symmetric_kl,
)

SCHEMA = "specdec.gate/1"
#: Seeds: baseline run i uses SEED_BASE + i, speculative run i SEED_BASE + i + SPEC_SEED_OFFSET.
SEED_BASE = 1234
SPEC_SEED_OFFSET = 100_000
#: The sampled leg passes when p > P_MIN (paper, section 6.1).
P_MIN = 0.01
#: With fewer prompts the permutation test cannot reach p <= P_MIN (see paired_permutation_p).
MIN_PROMPTS = 8
_EXIT_FAILED = 1
_EXIT_INTERRUPTED = 130  # shell convention: 128 + SIGINT


@dataclass(frozen=True)
class GateSettings:
    """Sizes of the two legs. Defaults are the paper's protocol (section 5, "Protocol")."""

    prompts: int = 100
    max_new_tokens: int = 100
    temperature: float = 1.0
    k: int = 4
    greedy_prompts: int = 5
    greedy_tokens: int = 200


#: `--quick` (CI on `smoke`): 10 prompts x 40 tokens per method give ~10 bins with expected count
#: >= 5 on smollm2 (measured: 389 tokens, dof 10; 12 x 24 gave only dof 6-8), so the chi-square
#: keeps some power; about half a minute on 2 idle cores, most of it the HF draft.
QUICK = GateSettings(prompts=10, max_new_tokens=40, greedy_prompts=2, greedy_tokens=24)

#: A prompt as the gate sees it: (prompt id, token ids).
PromptIds = tuple[str, list[int]]


# ------------------------------------------------------------------------------ the two legs
@dataclass
class PairedSamples:
    """One generation per method per prompt; row i of each list belongs to prompt i."""

    baseline: list[list[int]]  # [n_prompts][<= max_new_tokens] token ids
    speculative: list[list[int]]
    seeds_baseline: list[int]
    seeds_speculative: list[int]
    drafted: int = 0
    accepted: int = 0


def sample_pairs(
    target: SpecModel,
    draft: SpecModel,
    prompts: Sequence[PromptIds],
    settings: GateSettings,
    *,
    stop_ids: Sequence[int] = (),
    progress: bool = True,
) -> PairedSamples:
    """Generate with the target alone and with the pair on every prompt, seeds kept apart."""
    from tqdm import tqdm

    out = PairedSamples([], [], [], [])
    kw = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
          "stop_ids": stop_ids}  # fmt: skip
    bar = tqdm(prompts, desc="gate: sampled", unit="prompt", disable=not progress)
    for i, (_, ids) in enumerate(bar):
        out.seeds_baseline.append(SEED_BASE + i)
        out.seeds_speculative.append(SEED_BASE + i + SPEC_SEED_OFFSET)
        base = decode.generate(target, ids, seed=out.seeds_baseline[-1], **kw)
        spec = decode.generate(target, ids, draft=draft, k=settings.k,
                               seed=out.seeds_speculative[-1], **kw)  # fmt: skip
        out.baseline.append(base.tokens)
        out.speculative.append(spec.tokens)
        out.drafted += spec.stats.drafted
        out.accepted += spec.stats.accepted
    return out


def compare(
    samples: PairedSamples, width: int, label: Callable[[int], str] = str
) -> dict[str, Any]:
    """The two-sample test on pooled token frequencies, with the bins as tested.

    width  the sampling width V: token ids are in [0, width)
    label  token id -> human-readable bin label (e.g. the decoded text)
    """
    counts_s = np.zeros(width, dtype=np.int64)  # [V] speculative token counts
    counts_b = np.zeros(width, dtype=np.int64)  # [V] baseline token counts
    for seq in samples.speculative:
        counts_s += np.bincount(seq, minlength=width)
    for seq in samples.baseline:
        counts_b += np.bincount(seq, minlength=width)
    bins = frequency_bins(counts_s, counts_b)
    chi2, dof, p_value = chi2_of_bins(bins)
    p_perm = paired_permutation_p(samples.speculative, samples.baseline)
    distinct = int(((counts_s + counts_b) > 0).sum())
    labels = [label(int(t)) for t in bins.index]
    token_ids: list[int | None] = [int(t) for t in bins.index]
    if bins.pooled:
        labels.append(f"<other: {distinct - len(bins.index)} tokens>")
        token_ids.append(None)
    return {
        "tokens_speculative": int(counts_s.sum()),
        "tokens_baseline": int(counts_b.sum()),
        "distinct_tokens": distinct,
        "min_expected": MIN_EXPECTED,
        "n_bins": len(labels),
        "chi2": chi2,
        "dof": dof,
        "p_value": p_value,
        "p_value_permutation": p_perm,
        "n_permutations": PERMUTATIONS,
        "p_min": P_MIN,
        "decided_by": "p_value_permutation",
        # dof 0 means a single bin: nothing was compared, which is not a pass.
        "passed": bool(dof >= 1 and p_perm > P_MIN),
        "smoothed_kl": smoothed_symmetric_kl(counts_s, counts_b),
        "kl_definition": f"KL(s||b) + KL(b||s), add-{KL_SMOOTHING} smoothing over the union "
        "support; reference only",
        "bins": [
            {"label": lab, "token_id": tid, "speculative": int(s), "baseline": int(b)}
            for lab, tid, s, b in zip(labels, token_ids, bins.a, bins.b, strict=True)
        ],
    }


def sampled_leg(
    target: SpecModel,
    draft: SpecModel,
    prompts: Sequence[PromptIds],
    settings: GateSettings,
    *,
    width: int,
    stop_ids: Sequence[int] = (),
    label: Callable[[int], str] = str,
    progress: bool = True,
) -> dict[str, Any]:
    """T > 0: sample both methods on every prompt, then compare the pooled token frequencies."""
    t0 = time.perf_counter()
    samples = sample_pairs(target, draft, prompts, settings, stop_ids=stop_ids,
                           progress=progress)  # fmt: skip
    n = samples.drafted
    return {
        "n_prompts": len(prompts),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "k": settings.k,
        "seeds": {
            "rule": f"baseline {SEED_BASE}+i, speculative {SEED_BASE}+i+{SPEC_SEED_OFFSET} "
            "(disjoint streams: the two samples are independent)",
            "baseline": samples.seeds_baseline,
            "speculative": samples.seeds_speculative,
        },
        "acceptance_rate": samples.accepted / n if n else 0.0,
        **compare(samples, width, label),
        "wall_s": time.perf_counter() - t0,
    }


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_leg(
    target: SpecModel,
    draft: SpecModel,
    prompts: Sequence[PromptIds],
    settings: GateSettings,
    *,
    stop_ids: Sequence[int] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """T = 0: speculative tokens must equal target-only tokens exactly, prompt by prompt."""
    from tqdm import tqdm

    rows = []
    kw = {"max_new_tokens": settings.greedy_tokens, "temperature": 0.0, "stop_ids": stop_ids}
    for pid, ids in tqdm(prompts, desc="gate: greedy", unit="prompt", disable=not progress):
        base = decode.generate(target, ids, **kw).tokens
        spec = decode.generate(target, ids, draft=draft, k=settings.k, **kw).tokens
        mismatch = first_mismatch(spec, base)
        rows.append({"prompt_id": pid, "match": mismatch is None, "n_baseline": len(base),
                     "n_speculative": len(spec), "first_mismatch": mismatch})  # fmt: skip
    return {
        "n_prompts": len(prompts),
        "max_new_tokens": settings.greedy_tokens,
        "k": settings.k,
        "rows": rows,
        "passed": all(r["match"] for r in rows),
    }


def run_gate(
    target: SpecModel,
    draft: SpecModel,
    prompts: Sequence[PromptIds],
    settings: GateSettings,
    *,
    stop_ids: Sequence[int] = (),
    label: Callable[[int], str] = str,
    progress: bool = True,
) -> dict[str, Any]:
    """Both legs on already-loaded models: {sampled, greedy, passed}. `prompts` must hold at
    least max(settings.prompts, settings.greedy_prompts) prompts; the first ones are used."""
    from .tokenizer import check_pair

    need = max(settings.prompts, settings.greedy_prompts)
    if len(prompts) < need:
        raise ValueError(f"the gate needs {need} prompts, got {len(prompts)}")
    if settings.prompts < MIN_PROMPTS:
        raise ValueError(f"the sampled leg needs >= {MIN_PROMPTS} prompts to be able to fail")
    width = check_pair(draft, target)
    sampled = sampled_leg(target, draft, prompts[: settings.prompts], settings, width=width,
                          stop_ids=stop_ids, label=label, progress=progress)  # fmt: skip
    greedy = greedy_leg(target, draft, prompts[: settings.greedy_prompts], settings,
                        stop_ids=stop_ids, progress=progress)  # fmt: skip
    return {"sampled": sampled, "greedy": greedy,
            "passed": bool(sampled["passed"] and greedy["passed"])}  # fmt: skip


def build_artifact(config: dict[str, Any], models: dict[str, Any], result: dict[str, Any]) -> dict:
    """The `specdec.gate/1` artifact (see schema.py)."""
    from .schema import meta_block

    return {"schema": SCHEMA, "meta": meta_block(), "config": config, "models": models, **result}


def _greedy_cell(row: dict[str, Any]) -> str:
    same = "identical" if row["match"] else f"differs at {row['first_mismatch']}"
    return f"{row['prompt_id']} {same} ({row['n_baseline']} tok)"


def format_summary(art: dict[str, Any]) -> str:
    s, g = art["sampled"], art["greedy"]
    verdict = "PASS" if s["passed"] else "FAIL"
    lines = [
        f"sampled ({s['n_prompts']} prompts x {s['max_new_tokens']} tokens, T={s['temperature']},"
        f" K={s['k']}): {s['tokens_speculative']} speculative vs {s['tokens_baseline']} baseline"
        f" tokens, acceptance {s['acceptance_rate']:.1%}",
        f"  chi2 = {s['chi2']:.1f}, dof = {s['dof']}, p = {s['p_value']:.3f} (chi2 reference), "
        f"p = {s['p_value_permutation']:.3f} (permutation; pass at > {s['p_min']}) -> {verdict}",
        f"  smoothed symmetric KL {s['smoothed_kl']:.3f} (reference only)",
        f"greedy ({g['n_prompts']} prompts x <= {g['max_new_tokens']} tokens, T=0): "
        + ", ".join(_greedy_cell(r) for r in g["rows"])
        + f" -> {'PASS' if g['passed'] else 'FAIL'}",
        f"gate {'PASSED' if art['passed'] else 'FAILED'}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def add_cli(subparsers: argparse._SubParsersAction) -> None:
    d = GateSettings()
    p = subparsers.add_parser(
        "gate", help="level-3 exactness gate: speculative vs target-only on real models"
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="NAME",
        help="named draft -> target configuration (str; e.g. smoke, all_gguf)",
    )
    cli_args.add_device_args(p)
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"sampled-leg prompts, {MIN_PROMPTS}..100 (int; default {d.prompts})",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"sampled-leg tokens per prompt, >= 1 (int; default {d.max_new_tokens})",
    )
    p.add_argument(
        "-t",
        "--temperature",
        type=float,
        default=None,
        help=f"sampled-leg temperature, > 0 (float; default {d.temperature})",
    )
    p.add_argument(
        "-k",
        "--k",
        type=int,
        default=None,
        help=f"draft tokens per round, >= 1 (int; default {d.k})",
    )
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=None,
        help=f"greedy-leg prompts, 0..100 (int; default {d.greedy_prompts})",
    )
    p.add_argument(
        "--greedy-tokens",
        type=int,
        default=None,
        help=f"greedy-leg max tokens, >= 1 (int; default {d.greedy_tokens})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"CI sizes: {QUICK.prompts} x {QUICK.max_new_tokens} sampled, "
        f"{QUICK.greedy_prompts} x {QUICK.greedy_tokens} greedy; explicit "
        "size flags still win (flag; default off)",
    )
    p.add_argument(
        "--out",
        default="results",
        metavar="DIR",
        help="directory for gate_<config>.json (path; default results/)",
    )
    cli_args.add_no_progress_arg(p, help="hide the progress bars (flag; default off)")
    p.set_defaults(func=_cmd_gate)


def _settings(args: argparse.Namespace) -> GateSettings:
    base = QUICK if args.quick else GateSettings()
    given = {name: getattr(args, name) for name in asdict(base)}  # None = flag not given
    s = GateSettings(**{**asdict(base), **{k: v for k, v in given.items() if v is not None}})
    if s.prompts < MIN_PROMPTS:
        raise ValueError(f"--prompts must be >= {MIN_PROMPTS}: with fewer, the permutation test "
                         "cannot reach p <= 0.01, so the gate could not fail")  # fmt: skip
    if s.max_new_tokens < 1 or s.greedy_tokens < 1 or s.greedy_prompts < 0 or s.k < 1:
        raise ValueError("--max-new-tokens, --greedy-tokens and -k must be >= 1, "
                         "--greedy-prompts >= 0")  # fmt: skip
    cli_args.check_threads(args.threads)
    if s.temperature <= 0:
        raise ValueError(f"the sampled leg needs a temperature > 0, got {s.temperature}")
    return s


def _token_label(tokenizer: Any, token_id: int) -> str:
    """The token's text, quoted so leading spaces and newlines stay visible (e.g. "' the'")."""
    if tokenizer is None:
        return str(token_id)
    return repr(tokenizer.decode([token_id], skip_special_tokens=False))


def _cmd_gate(args: argparse.Namespace) -> int:
    from . import prompting
    from .bench import model_block  # the MODEL block every artifact shares
    from .configs import resolve_config
    from .models import load_model

    settings = _settings(args)
    cfg = resolve_config(args.config)
    prompts = prompting.load_prompts()
    need = max(settings.prompts, settings.greedy_prompts)
    if need > len(prompts):
        raise ValueError(f"the gate needs {need} prompts; the vendored set has {len(prompts)}")
    try:
        target = load_model(cfg.target, device=args.device, n_threads=args.threads)
        draft = load_model(cfg.draft, device=args.device, n_threads=args.threads)
        tok = target.tokenizer
        ids = [(p.id, prompting.encode(tok, p.text)) for p in prompts[:need]]
        result = run_gate(target, draft, ids, settings, stop_ids=prompting.stop_ids(tok),
                          label=lambda t: _token_label(tok, t),
                          progress=not args.no_progress)  # fmt: skip
    except KeyboardInterrupt:
        # A partial sample is not the sample the test was sized for: write nothing.
        print("\ngate interrupted: no artifact written (rerun to completion for a verdict)",
              file=sys.stderr)  # fmt: skip
        return _EXIT_INTERRUPTED
    config = {"name": cfg.name, "draft": cfg.draft, "target": cfg.target, "quick": args.quick,
              "threads": args.threads, **asdict(settings)}  # fmt: skip
    models = {"draft": model_block(cfg.draft, draft), "target": model_block(cfg.target, target)}
    art = build_artifact(config, models, result)
    out = Path(args.out) / f"gate_{cfg.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(art, indent=1) + "\n")
    print(format_summary(art))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if art["passed"] else _EXIT_FAILED
