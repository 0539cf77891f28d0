"""Level 3 of the exactness gate: speculative vs target-only decoding on real models (paper 6.1).

Two legs, one verdict:

sampled  For prompt i (chat-templated, stop ids honoured) generate up to `max_new_tokens` at
         T = 1.0 with the target alone (seed 1234 + i) and with the speculative pair (seed
         1234 + i + 100000). The seed streams differ so the two samples are independent draws;
         with equal seeds they would share random numbers and the test would be miscalibrated.
         All tokens of each method are pooled into frequency counts and compared with a
         two-sample chi-square over bins where every expected count is >= 5 (top tokens by
         combined count, the rest pooled: `significance.frequency_bins`). The verdict uses
         that statistic's permutation p-value (swapping the two methods' generations within
         prompts, `significance.paired_permutation_p`): tokens within a generation are
         correlated, which makes the asymptotic chi2(dof) p-value too small, so a correct engine
         would fail the asymptotic test more often than 1% of the time (significance.py has
         the measurement). Both p-values are recorded; pass at permutation p > 0.01.
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

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.core.model import SpecModel
from specdec.study.artifacts import (
    GateArtifact,
    GateBin,
    GreedyLeg,
    GreedyRow,
    Model,
    SampledLeg,
)
from specdec.study.artifacts.provenance import meta_block
from specdec.study.run.significance import (
    KL_SMOOTHING,
    MIN_EXPECTED,
    PERMUTATIONS,
    chi2_of_bins,
    frequency_bins,
    paired_permutation_p,
    smoothed_symmetric_kl,
)

SCHEMA = GateArtifact.SCHEMA
#: Seeds: baseline run i uses SEED_BASE + i, speculative run i SEED_BASE + i + SPEC_SEED_OFFSET.
SEED_BASE = 1234
SPEC_SEED_OFFSET = 100_000
#: The sampled leg passes when p > P_MIN (paper, section 6.1).
P_MIN = 0.01
#: With fewer prompts the permutation test cannot reach p <= P_MIN (see paired_permutation_p).
MIN_PROMPTS = 8


@dataclass(frozen=True)
class GateSettings:
    """Sizes of the two legs. Defaults are the paper's protocol (section 5, "Protocol")."""

    prompts: int = 100
    max_new_tokens: int = 100
    temperature: float = 1.0
    k: int = 4
    greedy_prompts: int = 5
    greedy_tokens: int = 200


#: `--quick` (CI on `smoke`): 16 prompts x 40 tokens per method give ~10+ bins with expected
#: count >= 5 on smollm2 (measured with 10 prompts: 389 tokens, dof 10; 12 x 24 gave only dof
#: 6-8), so the chi-square keeps some power, and 16 pairs let the permutation p-value go below
#: 0.001 (smallest attainable ~2/2^n), the level the CI test holds it to; about a minute on 2
#: idle cores, most of it the HF draft.
QUICK = GateSettings(prompts=16, max_new_tokens=40, greedy_prompts=2, greedy_tokens=24)

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
    # prompts left out because a method failed on them (an endpoint's error), as
    # {prompt_id, method, leg, error}
    failed: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Methods:
    """The two methods a gate compares, behind one call, and what the legs must know of them.
    `local_methods` runs the in-process pair; `endpoint_methods` sends to two servers.

    run       (method "baseline" | "speculative", prompt, seed, temperature, max_new_tokens)
              -> Sample; a prompt is (prompt id, whatever the methods take: token ids
              in-process, the text for an endpoint)
    width     token ids lie in [0, width): the sampling width V the tokens are counted over
    failures  what `run` raises to say "this prompt failed" (recorded, the gate goes on)
    """

    run: Callable[[str, tuple[str, Any], int, float, int], Sample]
    width: int
    failures: tuple[type[Exception], ...] = ()


def local_methods(
    target: SpecModel, draft: SpecModel, k: int, stop_ids: Sequence[int] = ()
) -> Methods:
    """Target-only vs the speculative pair at fixed K, in-process (the pair checked first)."""
    from specdec.core.pair import check_pair

    def run(method: str, prompt: tuple[str, Any], seed: int, t: float, n: int) -> Sample:
        kw = {"max_new_tokens": n, "warp": Warp(t), "stop_ids": stop_ids, "seed": seed}
        if method == "baseline":
            r = generate(target, prompt[1], **kw)
        else:
            r = generate(target, prompt[1], draft=draft, spec=SpecConfig(k=k), **kw)
        return Sample(r.tokens, r.stats.drafted, r.stats.accepted)

    return Methods(run, check_pair(draft, target))


def endpoint_methods(speculative: Any, baseline: Any, tokenizer: Any) -> Methods:
    """The same two methods sent to two OpenAI-compatible servers (engines.endpoint.Client each);
    a prompt is (id, text) and the answer's text is tokenized with the target's `tokenizer`.
    Drafted/accepted come from llama-server's `timings` where the server sends them. An
    endpoint's error fails that prompt only (see sample_pairs)."""
    from specdec.study.engines import endpoint

    def run(method: str, prompt: tuple[str, Any], seed: int, t: float, n: int) -> Sample:
        client = speculative if method == "speculative" else baseline
        reply = client.stream(endpoint.Request(prompt[1], n, Warp(t), seed))
        timings = reply.timings or {}
        return Sample(
            endpoint.tokenize(tokenizer, reply.text),
            endpoint.count(timings.get("draft_n")) or 0,
            endpoint.count(timings.get("draft_n_accepted")) or 0,
        )

    return Methods(run, _width(tokenizer), (endpoint.EndpointError,))


def run_endpoint_gate(
    speculative: Any,
    baseline: Any,
    prompts: Sequence[tuple[str, str]],
    settings: GateSettings,
    *,
    tokenizer: Any,
    label: Callable[[int], str] = str,
    progress: bool = True,
    greedy_prompts: Sequence[tuple[str, str]] | None = None,
) -> GateResult:
    """Both legs against two endpoints (engines.endpoint.Client each): `speculative` is the
    server under test, `baseline` the reference (e.g. the same engine without speculation).
    An endpoint error on a prompt is recorded and the gate goes on (see sample_pairs)."""
    methods = endpoint_methods(speculative, baseline, tokenizer)
    return both_legs(
        methods, prompts, settings, label=label, progress=progress, greedy_prompts=greedy_prompts
    )


def _width(tokenizer: Any) -> int:
    """Token ids lie in [0, width): the tokenizer's size with its added tokens."""
    try:
        return len(tokenizer)
    except TypeError:  # a tokenizer-like object without __len__: its vocabulary
        return max(tokenizer.get_vocab().values()) + 1


def sample_pairs(
    methods: Methods,
    prompts: Sequence[tuple[str, Any]],
    settings: GateSettings,
    *,
    progress: bool = True,
) -> PairedSamples:
    """Generate with both methods on every prompt, seeds kept apart. A prompt on which a
    method raises one of `methods.failures` is left out of both samples and recorded."""
    from tqdm import tqdm

    out = PairedSamples([], [], [], [])
    t, n = settings.temperature, settings.max_new_tokens
    bar = tqdm(prompts, desc="gate: sampled", unit="prompt", disable=not progress)
    for i, prompt in enumerate(bar):
        seeds = SEED_BASE + i, SEED_BASE + i + SPEC_SEED_OFFSET
        try:
            base = methods.run("baseline", prompt, seeds[0], t, n)
            speculative = methods.run("speculative", prompt, seeds[1], t, n)
        except methods.failures as e:
            out.failed.append({"prompt_id": prompt[0], "leg": "sampled", "error": str(e)})
            continue
        out.seeds_baseline.append(seeds[0])
        out.seeds_speculative.append(seeds[1])
        out.baseline.append(base.tokens)
        out.speculative.append(speculative.tokens)
        out.drafted += speculative.drafted
        out.accepted += speculative.accepted
    return out


def compare(
    samples: PairedSamples, width: int, label: Callable[[int], str] = str
) -> dict[str, Any]:
    """The two-sample test on pooled token frequencies, with the bins as tested: the test's
    fields of `SampledLeg`.

    width  the sampling width V: token ids are in [0, width)
    label  token id -> human-readable bin label (e.g. the decoded text)
    """
    seqs = [*samples.speculative, *samples.baseline]
    width = max(width, 1 + max((max(q) for q in seqs if q), default=-1))
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
        "bins": tuple(
            GateBin(label=lab, token_id=tid, speculative=int(s), baseline=int(b))
            for lab, tid, s, b in zip(labels, token_ids, bins.a, bins.b, strict=True)
        ),
    }


def sampled_leg(
    methods: Methods,
    prompts: Sequence[tuple[str, Any]],
    settings: GateSettings,
    *,
    label: Callable[[int], str] = str,
    progress: bool = True,
) -> SampledLeg:
    """T > 0: sample both methods on every prompt, then compare the pooled token frequencies.
    Fewer than MIN_PROMPTS answered prompts (failures) cannot pass: the test could not fail."""
    t0 = time.perf_counter()
    samples = sample_pairs(methods, prompts, settings, progress=progress)
    n = samples.drafted
    if any(samples.baseline) and any(samples.speculative):
        tested = compare(samples, methods.width, label)
    else:  # every prompt failed (or answered nothing): nothing to compare, which is no pass
        tested = {"chi2": 0.0, "dof": 0, "p_value": 1.0, "p_value_permutation": 1.0}
        tested.update(p_min=P_MIN, decided_by="p_value_permutation", n_bins=0)
    if len(samples.baseline) < MIN_PROMPTS:
        tested["passed"] = False
    return SampledLeg(
        n_prompts=len(samples.baseline),
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        k=settings.k,
        seeds={
            "rule": f"baseline {SEED_BASE}+i, speculative {SEED_BASE}+i+{SPEC_SEED_OFFSET} "
            "(disjoint streams: the two samples are independent)",
            "baseline": samples.seeds_baseline,
            "speculative": samples.seeds_speculative,
        },
        acceptance_rate=samples.accepted / n if n else 0.0,
        drafted=samples.drafted,
        accepted=samples.accepted,
        **tested,
        wall_s=time.perf_counter() - t0,
        failed=tuple(samples.failed) or None,
    )


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_leg(
    methods: Methods,
    prompts: Sequence[tuple[str, Any]],
    settings: GateSettings,
    *,
    progress: bool = True,
) -> GreedyLeg:
    """T = 0: speculative tokens must equal target-only tokens exactly, prompt by prompt. A
    failed prompt is a row that does not match (with its error): the leg cannot pass on it."""
    from tqdm import tqdm

    rows = []
    n = settings.greedy_tokens
    for prompt in tqdm(prompts, desc="gate: greedy", unit="prompt", disable=not progress):
        try:
            base = methods.run("baseline", prompt, 0, 0.0, n).tokens
            spec = methods.run("speculative", prompt, 0, 0.0, n).tokens
        except methods.failures as e:
            rows.append(
                GreedyRow(
                    prompt_id=prompt[0],
                    match=False,
                    n_baseline=None,
                    n_speculative=None,
                    first_mismatch=None,
                    error=str(e),
                )
            )
            continue
        mismatch = first_mismatch(spec, base)
        rows.append(
            GreedyRow(
                prompt_id=prompt[0],
                match=mismatch is None,
                n_baseline=len(base),
                n_speculative=len(spec),
                first_mismatch=mismatch,
            )
        )
    return GreedyLeg(
        n_prompts=len(prompts),
        max_new_tokens=n,
        k=settings.k,
        rows=tuple(rows),
        passed=bool(rows) and all(r.match for r in rows),
    )


@dataclass(frozen=True)
class GateResult:
    """Both legs' outcomes, before the run's config and models make them an artifact."""

    sampled: SampledLeg
    greedy: GreedyLeg
    passed: bool  # sampled.passed and greedy.passed


def run_gate(
    target: SpecModel,
    draft: SpecModel,
    prompts: Sequence[PromptIds],
    settings: GateSettings,
    *,
    stop_ids: Sequence[int] = (),
    label: Callable[[int], str] = str,
    progress: bool = True,
    greedy_prompts: Sequence[PromptIds] | None = None,
) -> GateResult:
    """Both legs on already-loaded models. `prompts` must hold at
    least max(settings.prompts, settings.greedy_prompts) prompts; the first ones are used, by
    the greedy leg too unless `greedy_prompts` names its own."""
    need = max(settings.prompts, settings.greedy_prompts)
    if len(prompts) < need:
        raise ValueError(f"the gate needs {need} prompts, got {len(prompts)}")
    if settings.prompts < MIN_PROMPTS:
        raise ValueError(f"the sampled leg needs >= {MIN_PROMPTS} prompts to be able to fail")
    methods = local_methods(target, draft, settings.k, stop_ids)
    return both_legs(
        methods, prompts, settings, label=label, progress=progress, greedy_prompts=greedy_prompts
    )


def both_legs(
    methods: Methods,
    prompts: Sequence[tuple[str, Any]],
    settings: GateSettings,
    *,
    label: Callable[[int], str] = str,
    progress: bool = True,
    greedy_prompts: Sequence[tuple[str, Any]] | None = None,
) -> GateResult:
    """The sampled leg on the first settings.prompts prompts, the greedy leg on greedy_prompts
    (default: the first settings.greedy_prompts), one verdict."""
    sampled = sampled_leg(
        methods, prompts[: settings.prompts], settings, label=label, progress=progress
    )
    greedy = greedy_leg(
        methods,
        prompts[: settings.greedy_prompts] if greedy_prompts is None else greedy_prompts,
        settings,
        progress=progress,
    )
    return GateResult(sampled, greedy, bool(sampled.passed and greedy.passed))


def build_artifact(
    config: Mapping[str, Any], models: Mapping[str, Model | None], result: GateResult
) -> GateArtifact:
    """The `specdec.gate/1` artifact: the run's config ({name, draft, target, quick, threads} +
    asdict(GateSettings)), its models and both legs."""
    return GateArtifact(
        meta=meta_block(),
        config=config,
        models=models,
        sampled=result.sampled,
        greedy=result.greedy,
        passed=result.passed,
    )


def _greedy_cell(row: GreedyRow) -> str:
    if row.error is not None:
        return f"{row.prompt_id} failed: {row.error}"
    same = "identical" if row.match else f"differs at {row.first_mismatch}"
    return f"{row.prompt_id} {same} ({row.n_baseline} tok)"


def format_summary(art: GateArtifact) -> str:
    s, g = art.sampled, art.greedy
    verdict = "PASS" if s.passed else "FAIL"
    ep, ref = art.config.get("endpoint"), art.config.get("endpoint_baseline")
    how = f"K={s.k}" if ep is None else f"{ep['label']} vs {ref['label']}"
    lines = [
        f"sampled ({s.n_prompts} prompts x {s.max_new_tokens} tokens, T={s.temperature},"
        f" {how}): {s.tokens_speculative} speculative vs {s.tokens_baseline} baseline"
        f" tokens, acceptance {s.acceptance_rate:.1%}"
        + ("" if s.drafted is None else f" ({s.accepted}/{s.drafted} drafted)"),
        *(f"  prompt {f['prompt_id']} left out: {f['error']}" for f in s.failed or ()),
        f"  chi2 = {s.chi2:.1f}, dof = {s.dof}, p = {s.p_value:.3f} (chi2 reference), "
        f"p = {s.p_value_permutation:.3f} (permutation; pass at > {s.p_min}) -> {verdict}",
        f"  smoothed symmetric KL {s.smoothed_kl:.3f} (reference only)",
        f"greedy ({g.n_prompts} prompts x <= {g.max_new_tokens} tokens, T=0): "
        + ", ".join(_greedy_cell(r) for r in g.rows)
        + f" -> {'PASS' if g.passed else 'FAIL'}",
        f"gate {'PASSED' if art.passed else 'FAILED'}",
    ]
    return "\n".join(lines)
