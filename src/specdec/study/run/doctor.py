"""`specdec doctor`: will speculative decoding pay on this machine? About a minute to find out.

It measures what the paper asks every implementation to report, with the microbench's probe and
protocol (study.run.microbench.measure, at a few b instead of every one):

    step       the target's single step, in ms, on a `prefix`-token context
    v(b)       a target pass over b tokens, in single steps, at b = 1, 2, 4, ..., 64 (a round at K
               verifies b = K + 1, and k=auto's depth cap doubles K through 1, 3, 7, 15, 31, 63)
    c          the draft model's step / the target's step

and turns them into answers with core.cost's formulas (nothing re-derived here), in target steps:

    ceiling        max over b of b / v(b): a drafter that costs nothing and is always right emits
                   b tokens per pass of b, so no lossless method beats this (speedup(K) with every
                   draft accepted and c = 0)
    draft ceiling  the same with the draft model's K steps paid: max over K of
                   (K + 1) / (v(K + 1) + K c)
    break-even     per K: the tokens a round must emit to pay for itself, cost(K) = v(K + 1) + K c,
                   and the acceptance alpha it takes, the same at every draft position (each given
                   the earlier ones accepted), so that E(K) = 1 + alpha + ... + alpha^K reaches it
                   (none: not even alpha = 1 does); for the model-free drafters (c = 0) and for
                   the draft model

v between the measured b is k=auto's own interpolation (core.policy.CostModelK.v), so the doctor
reads the curve as k=auto will; the measured v(b), in seconds, is written where k=auto's curves
are kept (backends.costs.CurveFiles, as `specdec microbench` does), so the first request of a
later process starts from this curve instead of the prior.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from specdec.backends.cores import WAIT_DROP, WINDOW_S, Mark, pace
from specdec.core.cost import (
    ROW_SLACK,
    VerifyCurve,
    expected_tokens_per_round,
    p_at_least_from_conditional,
    predicted_speedup,
    round_cost,
)
from specdec.core.model import SpecModel
from specdec.core.policy import CostModelK, CurveStore
from specdec.study.artifacts import BreakEven, Diagnosis, DoctorArtifact, Model
from specdec.study.artifacts.provenance import meta_block
from specdec.study.run import microbench

#: The b timed: powers of two, where k=auto's doubling depth cap puts K + 1, up to the
#: model-free drafters' default k_max (core.config.K_MAX_FREE).
BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Seconds for the timed passes (the models' loading comes on top): with the default pair here a
#: pass over every b takes ~1.7 s, so MAX_REPEATS fit in well under this.
SECONDS = 45.0
MIN_REPEATS, MAX_REPEATS = 3, 7  # the microbench's default is 7
#: A ceiling below this: under 5% gained even if every draft were accepted, which the rounds'
#: bookkeeping (sampling, cache truncation) eats.
PAYS_ABOVE = 1.05


# ------------------------------------------------------------------------------ the diagnosis
def dense_curve(v: Mapping[int, float]) -> list[float]:
    """[v(1), ..., v(max b)]: the measured points, and between them k=auto's interpolation."""
    policy = CostModelK(k_max=max(v), verify_s=v)  # without a measurement count: trusted as is
    return [policy.v(b) for b in range(1, max(v) + 1)]


def break_even_acceptance(v: Sequence[float], c: float, k: int) -> float | None:
    """The alpha at which E(k) = cost(k) (core.cost), by bisection (E grows with alpha);
    None when even alpha = 1 falls short (cost(k) >= k + 1)."""
    need = round_cost(v, c, k)

    def tokens(alpha: float) -> float:
        return expected_tokens_per_round(p_at_least_from_conditional([alpha] * k), k)

    if tokens(1.0) <= need:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):  # 2**-50: far below any digit printed
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens(mid) < need else (lo, mid)
    return hi


def diagnose(v: Mapping[int, float], c: float | None) -> Diagnosis:
    """The ceilings, the break-even table and the verdict for a curve `v` {b: v(b)} (b = 1
    included, v(1) = 1) and a draft step ratio `c` (None: no draft model)."""
    if 1 not in v:
        raise ValueError("the verify curve needs b = 1 (its unit)")
    dense = dense_curve(v)
    ks = [b - 1 for b in sorted(v) if b > 1]
    always = [1.0] * max(ks, default=0)  # P(>= i accepted) = 1: every draft accepted

    def best(cost: float) -> tuple[float, int]:
        return max((predicted_speedup(dense, cost, always, k), k) for k in [0, *ks])

    ceiling, k_free = best(0.0)
    draft_ceiling, k_draft = best(c) if c is not None else (None, None)
    rows = tuple(
        BreakEven(
            k=k,
            v=dense[k],
            free_cost=round_cost(dense, 0.0, k),
            free_acceptance=break_even_acceptance(dense, 0.0, k),
            model_cost=round_cost(dense, c, k) if c is not None else None,
            model_acceptance=break_even_acceptance(dense, c, k) if c is not None else None,
        )
        for k in ks
    )
    verdict = _verdict(ceiling, k_free + 1, c, draft_ceiling, rows)
    return Diagnosis(
        v=dict(sorted(v.items())),
        c=c,
        ceiling=ceiling,
        ceiling_b=k_free + 1,
        draft_ceiling=draft_ceiling,
        draft_ceiling_k=k_draft,
        break_even=rows,
        verdict=verdict,
    )


def _verdict(
    ceiling: float,
    ceiling_b: int,
    c: float | None,
    draft_ceiling: float | None,
    rows: Sequence[BreakEven],
) -> tuple[str, ...]:
    out = []
    if ceiling < PAYS_ABOVE:
        out.append(
            "no lossless method can pay here: a pass over b tokens costs about b single steps "
            f"(best b / v(b) = {ceiling:.2f}x); decode with the target alone (k=auto does so "
            "by itself)"
        )
    else:
        first = rows[0] if rows else None
        if first is None:
            prose = ""
        elif first.free_acceptance is None:
            prose = (
                f"; one draft per round cannot pay (a pass over 2 tokens costs {first.v:.2f} steps)"
            )
        else:
            prose = (
                f"; on new text they need {first.free_acceptance:.0%} of drafts accepted at K = 1 "
                "to break even"
            )
        out.append(
            f"prompt lookup and predictions pay on edits up to ~{ceiling:.1f}x (copies accepted "
            f"{ceiling_b - 1} tokens at a time){prose}"
        )
    if c is None or draft_ceiling is None:
        out.append("no draft model measured: give --draft SPEC to judge one")
    elif draft_ceiling < PAYS_ABOVE:
        out.append(
            f"a draft model cannot pay here: c = {c:.2f} (even with every draft accepted the "
            f"best is {draft_ceiling:.2f}x)"
        )
    else:
        k, alpha = min(
            ((r.k, r.model_acceptance) for r in rows if r.model_acceptance is not None),
            key=lambda x: x[1],
        )
        out.append(
            f"a draft model pays where more than {alpha:.0%} of its drafts are accepted "
            f"(at K = {k}; c = {c:.2f}), up to ~{draft_ceiling:.1f}x if all are"
        )
    return tuple(out)


# ------------------------------------------------------------------------------ measuring
def plan_repeats(pass_s: float, seconds: float) -> int:
    """Timed passes that fit `seconds`, given one pass's seconds (within MIN/MAX_REPEATS)."""
    fit = math.floor(seconds / pass_s) if pass_s > 0 else MAX_REPEATS
    return max(MIN_REPEATS, min(MAX_REPEATS, fit))


def measure(
    target: SpecModel,
    draft: SpecModel | None,
    *,
    prefix: int = microbench.PREFIX,
    batches: Sequence[int] = BATCHES,
    seconds: float = SECONDS,
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[int, list[float]], list[float], float]:
    """Timings {b: [ms]}, [draft ms] and the seconds they took: a first pass (after the
    microbench's warm-up) says how long a pass takes, then as many more as fit in `seconds`."""
    width = target.vocab_size
    if draft is not None:
        from specdec.core.pair import check_pair

        width = check_pair(draft, target)  # the probe ids must mean the same to both
    top = max(batches)
    ids = microbench.probe_ids(target.tokenizer, width, prefix + top)
    t0 = clock()
    verify, draft_ms = microbench.measure(target, draft, ids, prefix, top, 1, False, batches)
    first_s = clock() - t0  # the warm-up pass and one timed pass
    repeats = plan_repeats(first_s / 2, seconds - first_s) - 1
    if repeats > 0:
        more, more_draft = microbench.measure(
            target, draft, ids, prefix, top, repeats, progress, batches
        )
        for b, ms in more.items():
            verify[b] += ms
        draft_ms += more_draft
    return verify, draft_ms, clock() - t0


def run(
    target: SpecModel,
    draft: SpecModel | None,
    models: Mapping[str, Model | None],
    *,
    prefix: int = microbench.PREFIX,
    batches: Sequence[int] = BATCHES,
    seconds: float = SECONDS,
    curves: CurveStore | None = None,
    progress: bool = True,
) -> DoctorArtifact:
    """Measure, diagnose, and write the curve to `curves` (the CLI's: backends.costs.CurveFiles),
    where k=auto starts from it."""
    if prefix < 1 or seconds <= 0:
        raise ValueError("prefix must be >= 1 and seconds > 0")
    batches = tuple(sorted(set(batches) | {1}))
    if batches[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batches[0]}")
    mark = Mark()
    verify, draft_ms, took = measure(
        target, draft, prefix=prefix, batches=batches, seconds=seconds, progress=progress
    )
    others, waited, _ = mark.since()
    if took < WINDOW_S:  # a wait over a few milliseconds says nothing of the machine
        others = waited = None
    medians = {b: statistics.median(ms) for b, ms in sorted(verify.items())}
    step = medians[1]
    spread = max(verify[1]) / min(verify[1]) - 1
    draft_step = statistics.median(draft_ms) if draft_ms else None
    c = draft_step / step if draft_step is not None else None
    diagnosis = diagnose({b: ms / step for b, ms in medians.items()}, c)
    store = None
    if curves is not None:
        passes = VerifyCurve()  # every timed pass a sample: the store keeps their median
        for b, ms in sorted(verify.items()):
            for x in ms:
                passes.add(b, x / 1e3)
        written = curves.save(target, passes, replace=True)
        store = str(written) if written else None
    return DoctorArtifact(
        meta=meta_block(),
        cpu_flags=vector_flags(),
        target=models["target"],
        draft=models.get("draft"),
        prefix_tokens=prefix,
        repeats=len(verify[1]),
        batches=batches,
        target_step_ms=step,
        step_spread=spread,
        verify_ms=medians,
        draft_step_ms=draft_step,
        diagnosis=diagnosis,
        contended=spread > microbench.CONTENDED_SPREAD or (waited or 0.0) >= WAIT_DROP,
        cost_store=store,
        measure_s=took,
        other_cores=others,
        thread_wait=waited,
        # a llama.cpp target (it has GGUF weight types) ran the passes the pace recorded
        threads=(pace().threads or None) if hasattr(target, "weight_types") else None,
    )


def vector_flags() -> tuple[str, ...]:
    """The CPU's vector instruction sets (/proc/cpuinfo flags of the families ggml has kernels
    for): beside the kernels' compiled-in set, they show a build that leaves some unused."""
    from specdec.backends.llamacpp_build import cpu_flags

    return tuple(f for f in cpu_flags() if f.startswith(VECTOR_FLAG_PREFIXES))


#: /proc/cpuinfo flag families of vector units llama.cpp's CPU kernels use
VECTOR_FLAG_PREFIXES = ("sse4", "ssse3", "avx", "fma", "f16c", "amx", "bmi2")


# ------------------------------------------------------------------------------ the table
def _pct(x: float | None) -> str:
    return "never" if x is None else f"{x:.0%}"


def format_report(rep: DoctorArtifact) -> str:
    """The human-readable report: machine, curve, ceilings, break-even table, verdict (the
    kernels line is `specdec --version`'s, which the CLI prints above it)."""
    d, machine = rep.diagnosis, rep.meta.get("machine", {})
    load = machine.get("load_avg")
    lines = [
        f"machine   {machine.get('cpu_model', '?')}, {machine.get('cpu_count', '?')} cores"
        + (f", load {load[0]:.2f}" if load else ""),
        f"cpu flags {' '.join(rep.cpu_flags) or '(not reported by this OS)'}",
    ]
    lines.append(
        f"target    {rep.target.name}: one step {rep.target_step_ms:.1f} ms on "
        f"{rep.prefix_tokens} cached tokens (median of {rep.repeats})"
    )
    bs = list(d.v)
    lines.append("b         " + "".join(f"{b:>8d}" for b in bs))
    lines.append("ms        " + "".join(f"{rep.verify_ms[b]:>8.1f}" for b in bs))
    lines.append("v(b)      " + "".join(f"{d.v[b]:>8.2f}" for b in bs))
    lines.append("b / v(b)  " + "".join(f"{b / d.v[b]:>8.2f}" for b in bs))
    if rep.draft is not None and d.c is not None:
        lines.append(
            f"draft     {rep.draft.name}: one step {rep.draft_step_ms:.1f} ms, c = {d.c:.2f}"
        )
    lines.append(
        f"ceiling   {d.ceiling:.2f}x for any lossless method (b = {d.ceiling_b}, every draft "
        "accepted, drafting free)"
    )
    if d.draft_ceiling is not None and d.draft_ceiling_k:
        lines.append(
            f"          {d.draft_ceiling:.2f}x with the draft model (K = {d.draft_ceiling_k}, "
            "every draft accepted)"
        )
    elif d.draft_ceiling is not None:
        lines.append("          no K pays with the draft model, even with every draft accepted")
    lines += [
        "",
        "break-even: the tokens a round must emit (its cost in steps), and the acceptance",
    ]
    lines.append("of each draft that gets there (the same at every position)")
    lines.append(
        f"{'':>4}  {'':>7}  {'lookup, prediction':>20}"
        + (f"  {'draft model':>20}" if d.c is not None else "")
    )
    cols = f"{'tokens':>9} {'accepted':>10}"
    lines.append(f"{'K':>4}  {'v(K+1)':>7}  {cols}" + (f"  {cols}" if d.c is not None else ""))
    for r in d.break_even:
        row = f"{r.k:>4}  {r.v:>7.2f}  {r.free_cost:>9.2f} {_pct(r.free_acceptance):>10}"
        if r.model_cost is not None:
            row += f"  {r.model_cost:>9.2f} {_pct(r.model_acceptance):>10}"
        lines.append(row)
    lines += ["", "verdict"] + [f"  - {v}" for v in d.verdict]
    if rep.contended:
        lines.append(
            f"  ! the single step varied by {rep.step_spread:.0%} between passes"
            + (f", its threads waited {rep.thread_wait:.2f} s a second" if rep.thread_wait else "")
            + ": the machine was busy, and every number above is flattened; rerun on an idle "
            "machine"
        )
    if rep.other_cores is not None:
        lines.append(
            f"other work on this process's cores while it measured: {rep.other_cores:.2f} cores"
            + (
                f"; its threads waited for a core {rep.thread_wait:.2f} s a second"
                if rep.thread_wait is not None
                else ""
            )
            + (f"; llama.cpp ran {rep.threads} thread(s)" if rep.threads else "")
        )
    if rep.cost_store:
        lines.append(f"k=auto's cost store seeded: {rep.cost_store}")
    lines.append(f"measured in {rep.measure_s:.0f} s")
    return "\n".join(lines)


#: A stored point this far from what the doctor just measured (either way) looks wrong: it was
#: measured under another load, or on another day's host behind the same machine type.
STORED_OFF = 1.5


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def format_stored(
    curve: VerifyCurve, measured_ms: Mapping[int, float] | None = None, now: float | None = None
) -> str:
    """k=auto's stored curve for this target (backends.costs): each point's time, the samples
    behind it and their age, whether k=auto uses it, and where it looks wrong (beyond the
    physical bounds, or STORED_OFF from `measured_ms`, this run's medians)."""
    points = curve.points()
    if not points:
        return "stored    no k=auto curve for this target, build and settings (the prior until one)"
    now = time.time() if now is None else now
    step = curve.summary().get(1)
    lines = [
        "stored    k=auto's curve before this run",
        f"  {'b':>5} {'ms':>9}{'steps':>8} {'n':>4}  {'newest':>11}  used",
    ]
    wrong = []
    for p in points:
        steps = f"{p.seconds / step:8.2f}" if step else f"{'':>8}"
        note = "" if p.used else f"  dropped: over {ROW_SLACK:g} x b x the cheapest point"
        ms = (measured_ms or {}).get(p.b)
        if p.used and ms and not 1 / STORED_OFF <= p.seconds * 1e3 / ms <= STORED_OFF:
            note = f"  {p.seconds * 1e3 / ms:.2f}x this run's {ms:.1f} ms"
        wrong += [p.b] * bool(note)
        lines.append(
            f"  {p.b:>5d} {p.seconds * 1e3:9.1f}{steps} {p.n:>4d}  {_age(now - p.newest):>7} ago"
            f"  {'yes' if p.used else 'no':>3}{note}"
        )
    if wrong:
        lines.append(
            f"  looks wrong at b = {', '.join(map(str, wrong))}: measured under another load or "
            "a hiccup; this run's curve replaces it (unless --no-seed), or clear it with "
            "`specdec doctor --reset-costs`"
        )
    return "\n".join(lines)
