"""REPORT.md, rendered from the artifacts under one directory (`scan.scan`) and nothing else.

Tables in the shape of the paper's (Table 3 for the main results, Table 4 for the K-sweeps), then
acceptance by position, the latency split, the microbenchmarks and the gate. Every number cites
the file it came from; a section whose inputs are absent says "No artifact" instead of a table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from specdec.core.metrics import PREDICTION_SOURCE
from specdec.study.artifacts import (
    PHASES,
    Agg,
    BenchArtifact,
    GateArtifact,
    MicrobenchArtifact,
    SweepPoint,
    variant_method,
)
from specdec.study.present import fmt, scan
from specdec.study.present.scan import Study


def _cite(src: str) -> str:
    return f"`{src}`"


def _figure(name: str, figures: Path, report: Path) -> list[str]:
    if not (figures / name).is_file():
        return []
    rel = Path(os.path.relpath(figures / name, report.parent)).as_posix()
    return [f"![{name}]({rel})", ""]


def _section_hosts(s: Study) -> list[str]:
    """One table of the hosts the artifacts were made on; each section below names its own."""
    return [
        "## Hosts",
        "",
        "From each artifact's `meta.machine` (the CPU, the instruction sets ggml was built with, "
        "cores, memory) and `meta.versions`; every section below names its artifact's host, day "
        "and run tag, and the kernels it ran. Compare numbers made on one host and day.",
        "",
        *s.hosts.table(),
        "",
    ]


def _section_main(s: Study) -> list[str]:
    if not s.benches:
        return []
    benches = sorted(s.benches, key=lambda b: (-(b.aggregates.speedup or 0.0), b.label))
    hf = any(b.aggregates.hf_assisted for b in benches)
    vram = any(b.aggregates.peak_vram_mb is not None for b in benches)
    settings = scan.shared_settings(benches)
    out = [
        (f"Settings shared by every run: {settings}. " if settings else "")
        + "Throughput is the mean ± std over the recorded prompts of per-prompt tok/s; Speedup "
        "is spec mean / baseline mean (`aggregates.speedup`); Pooled is the ratio of total "
        "tokens / total wall time (`aggregates.speedup_pooled`). Accept. is the pooled "
        "acceptance rate. Peak RSS is a process-wide high-water mark, an upper bound; 1 GB = "
        "1024 MB as recorded."
        + (
            " HF-assisted is transformers' `generate(assistant_model=...)` on the same prompts "
            "and pair (`aggregates.hf_assisted`, `aggregates.speedup_hf_assisted`)."
            if hf
            else ""
        ),
        "",
    ]
    header = [
        "Config",
        "Base tok/s",
        "Spec tok/s",
        "Speedup",
        "Pooled",
        "Accept.",
        "TTFT_b (s)",
        "TTFT_s (s)",
        "Peak RSS (GB)",
    ]
    header += ["Peak VRAM (GB)"] * vram + ["HF-assisted tok/s", "HF-assisted speedup"] * hf
    header += ["K / T / tokens / prompts"] * (not settings) + ["Host", "Source"]
    best = benches[0].aggregates.speedup
    best = best if len(benches) > 1 else None
    rows = [
        [*_main_row(b, best, vram, hf, settings), s.hosts.where(b.src), _cite(b.src)]
        for b in benches
    ]
    out += fmt.md_table(header, rows)
    out += ["", "Models:", ""]
    out += fmt.md_table(
        ["Config", "Draft", "Target", "Source"],
        [
            [
                b.label,
                b.draft.short if b.draft else b.draft_spec,
                b.target.short if b.target else b.target_spec,
                _cite(b.src),
            ]
            for b in benches
        ],
    )
    for b in benches:
        out += _methods_table(b, s.hosts.where(b.src))
    return out


def _main_row(
    b: BenchArtifact, best: float | None, vram: bool, hf: bool, settings: str
) -> list[str]:
    """One run's line of the main table; its speedup in bold when it is the `best`."""
    agg = b.aggregates
    sp = fmt.x(agg.speedup)
    row = [
        b.label + ("" if b.complete else " (incomplete)"),
        fmt.pm(agg.baseline.tok_s_mean, agg.baseline.tok_s_std),
        fmt.pm(agg.speculative.tok_s_mean, agg.speculative.tok_s_std),
        f"**{sp}**" if best is not None and agg.speedup == best else sp,
        fmt.x(agg.speedup_pooled),
        fmt.pct(agg.speculative.acceptance_rate),
        fmt.num(agg.baseline.ttft_s_mean),
        fmt.num(agg.speculative.ttft_s_mean),
        fmt.gb(agg.peak_rss_mb),
    ]
    if vram:
        row.append(fmt.gb(agg.peak_vram_mb))
    if hf:
        h = agg.hf_assisted
        row += (
            ["not run", "—"]
            if h is None
            else [fmt.pm(h.tok_s_mean, h.tok_s_std), fmt.x(agg.speedup_hf_assisted)]
        )
    if not settings:
        t = "—" if b.temperature is None else f"{b.temperature:g}"
        row.append(f"{b.k} / {t} / {b.max_new_tokens} / {b.n_prompts}")
    return row


def _method_row(method: str, a: Agg, speedup: float | None, decode: float | None) -> list[str]:
    return [
        method,
        fmt.pm(a.tok_s_mean, a.tok_s_std),
        fmt.x(speedup),
        fmt.x(decode),
        fmt.pct(a.acceptance_rate),
        fmt.num(a.tokens_per_round, ".2f"),
        fmt.num(a.mean_acceptance_length, ".2f"),
    ]


def _methods_table(b: BenchArtifact, where: str) -> list[str]:
    """Every method of one run (main + variants) and its speedup by prompt category."""
    agg = b.aggregates
    variants = {n: v for n, v in agg.variants.items() if v.tok_s_mean is not None}
    if not variants and not agg.by_category:
        return []
    out = [
        "",
        f"Methods measured in one run, {b.label} ({_cite(b.src)}; {where}): Decode is the "
        "speedup with the prompt prefills (paid once by every method) left out "
        "(`decode_speedup`). Tokens/round counts every target pass; Mean acc. length is "
        "vLLM's mean acceptance length, over the rounds that drafted (`mean_acceptance_length`).",
        "",
    ]
    base = agg.baseline
    rows = [["target-only", fmt.pm(base.tok_s_mean, base.tok_s_std), "1.00x", *["—"] * 4]]
    rows.append(_method_row(b.method, agg.speculative, agg.speedup, agg.decode_speedup))
    for name, v in variants.items():
        rows.append(_method_row(variant_method(name), v, v.speedup, v.decode_speedup))
    header = ["Method", "tok/s", "Speedup", "Decode", "Accept.", "Tokens/round"]
    out += fmt.md_table([*header, "Mean acc. length"], rows)
    if agg.by_category:
        methods = [m for m in next(iter(agg.by_category.values())) if m != "baseline"]
        names = {"speculative": b.method, **{n: variant_method(n) for n in variants}}
        out += [
            "",
            "Speedup by prompt category (vs the same prompts' target-only mean; n "
            "prompts per category):",
            "",
        ]
        crow = []
        for cat, per in sorted(agg.by_category.items()):
            n = per["baseline"].n if "baseline" in per else None
            cells = [fmt.x(per[m].speedup if m in per else None) for m in methods]
            crow.append([f"{cat} ({n})", *cells])
        out += fmt.md_table(["Category", *(names.get(m, m) for m in methods)], crow)
    return out


def _sweep_row(p: SweepPoint, best: bool) -> list[str]:
    m = p.member
    b = "**" if best else ""
    base = fmt.pm(p.baseline_tok_s, p.baseline_tok_s_std)
    speculative = fmt.pm(p.speculative_tok_s, p.speculative_tok_s_std)
    where = _cite(m.src) if m else (f"`{p.artifact}` (not under DIR)" if p.artifact else "—")
    return [
        f"{b}{p.k}{b}",
        base,
        f"{b}{speculative}{b}",
        fmt.pct(p.acceptance_rate),
        fmt.num(p.tokens_per_round, ".2f"),
        fmt.num(p.mean_acceptance_length, ".2f"),
        f"{b}{fmt.x(p.speedup)}{b}",
        where,
    ]


def _section_sweeps(s: Study) -> list[str]:
    out: list[str] = []
    for sw in s.sweeps:
        setup = fmt.join(
            f"{sw.max_new_tokens} new tokens" if sw.max_new_tokens else "",
            f"{sw.recorded_prompts} recorded prompts" if sw.recorded_prompts else "",
            f"T={sw.temperature:g}" if sw.temperature is not None else "",
        )
        what = f"{scan.sweep_label(sw, s.sweeps)}: {sw.draft_spec} → {sw.target_spec}"
        out += [s.hosts.heading(what, sw.src), "", s.hosts.provenance(sw.src), ""]
        out += [
            f"From {_cite(sw.src)}"
            + (f" ({setup})" if setup else "")
            + ("" if sw.complete else "; **incomplete** (interrupted)")
            + ". Every K reruns its own interleaved target-only baseline.",
            "",
        ]
        if not sw.points:
            out += ["No K finished a recorded prompt.", ""]
            continue
        best = max(p.speedup or 0.0 for p in sw.points)
        rows = [_sweep_row(p, p.speedup == best and len(sw.points) > 1) for p in sw.points]
        header = ["K", "Base tok/s", "Spec tok/s", "Acceptance", "Tokens/round"]
        out += fmt.md_table([*header, "Mean acc. length", "Speedup", "Per-K artifact"], rows)
        pos = [
            [str(p.k), " · ".join(fmt.pct(a) for a in p.positional)]
            for p in sw.points
            if p.positional
        ]
        if pos:
            out += ["", f"Positional acceptance at each K (from {_cite(sw.src)}):", ""]
            out += fmt.md_table(["K", "Position 1 … K"], pos)
        out.append("")
    return out


def _section_positional(s: Study) -> list[str]:
    benches = [b for b in s.benches if b.aggregates.speculative.positional]
    if not benches:
        return []
    kmax = max(len(b.aggregates.speculative.positional) for b in benches)
    rows = []
    for b in benches:
        pos = [fmt.pct(a) for a in b.aggregates.speculative.positional]
        rows.append(
            [
                b.label,
                *pos,
                *["—"] * (kmax - len(pos)),
                fmt.pct(b.aggregates.speculative.acceptance_rate),
                fmt.num(b.aggregates.speculative.tokens_per_round, ".2f"),
                fmt.num(b.aggregates.speculative.mean_acceptance_length, ".2f"),
                _cite(b.src),
            ]
        )
    out = [
        "Acceptance at position i = rounds whose i-th draft was accepted / rounds that "
        "drafted an i-th token; tokens per round includes the bonus or recovered token.",
        "Mean acc. length = 1 + accepted / rounds that drafted (vLLM's mean acceptance length); "
        "tokens per round divides by every round, K = 0 rounds included.",
        "",
    ]
    cols = ["Config", *(f"Pos {i}" for i in range(1, kmax + 1)), "Pooled", "Tokens/round"]
    return out + fmt.md_table([*cols, "Mean acc. length", "Source"], rows)


def _section_latency(s: Study) -> list[str]:
    benches = [b for b in s.benches if scan.timed(b)]
    if not benches:
        return []
    out = [
        "Milliseconds per generated token (`aggregates.*.ms_per_token`); verify includes the "
        "prefill, other is wall time outside the three timed phases.",
        "",
    ]
    rows = []
    for b in benches:
        for side, ms in zip(("baseline", "speculative"), scan.timed(b), strict=True):
            total = sum(ms.values())
            rows.append(
                [
                    b.label,
                    scan.SIDE_NAMES[side],
                    *(f"{ms[p]:.2f}" for p in PHASES),
                    f"{total:.2f}",
                    fmt.pct(ms["sampling"] / total if total else None),
                    _cite(b.src),
                ]
            )
    header = ["Config", "Path", *(f"{p} (ms)" for p in PHASES), "Total (ms)", "Sampling share"]
    return out + fmt.md_table([*header, "Source"], rows)


def _measured(s: Study, m: MicrobenchArtifact, k: int) -> tuple[float, str] | None:
    """The measured speedup at K for the microbench's pair: a sweep point, else a bench run."""
    for sw in s.sweeps:
        if scan.same_pair(sw.draft_spec, sw.target_spec, sw.device, m):
            for p in sw.points:
                if p.k == k and p.speedup is not None:
                    return p.speedup, sw.src
    for b in s.benches:
        device = b.target.device if b.target else None
        if (
            b.k == k
            and b.aggregates.speedup
            and scan.same_pair(b.draft_spec, b.target_spec, device, m)
        ):
            return b.aggregates.speedup, b.src
    return None


def _section_micro(s: Study) -> list[str]:
    out: list[str] = []
    for m in s.micros:
        what = fmt.join(
            f"cached prefix of {m.prefix_tokens} tokens" if m.prefix_tokens is not None else "",
            f"median of {m.repeats} repeats" if m.repeats is not None else "",
        )
        out += [s.hosts.heading(_micro_what(m), m.src), "", s.hosts.provenance(m.src), ""]
        out += [f"From {_cite(m.src)}" + (f" ({what})" if what else "") + ":"]
        out += ["", f"- target step: {m.target_step_ms:.2f} ms"]
        if m.draft_step_ms is not None:
            out.append(f"- draft step: {m.draft_step_ms:.2f} ms")
        c = fmt.num(m.c) if m.c is not None else "no draft"
        out.append(f"- c = draft step / target step: {c}")
        verify = [[str(v.b), f"{v.median_ms:.2f}", f"{v.ratio:.2f}"] for v in m.verify]
        out += ["", *fmt.md_table(["b", "median ms", "v(b)"], verify)]
        if m.predicts:
            out += _micro_predictions(s, m)
        if m.checks:
            out += _micro_checks(m)
        elif m.prediction:
            out += [
                "",
                "No acceptance profile in this artifact, so no predicted speedup; the "
                "break-even tokens per round at each K (= cost in target steps):",
                "",
            ]
            out += fmt.md_table(
                ["K", "Break-even tokens/round"],
                [[str(p.k), f"{p.cost_in_target_steps:.2f}"] for p in m.prediction],
            )
        out.append("")
    return out


def _micro_what(m: MicrobenchArtifact) -> str:
    """'Verify curve: TARGET' ('… and draft cost: DRAFT → TARGET' with a draft)."""
    target = m.target.name if m.target else "?"
    if m.draft is None:
        return f"Verify curve: {target}"
    return f"Verify curve and draft cost: {m.draft.name} → {target}"


def _micro_predictions(s: Study, m: MicrobenchArtifact) -> list[str]:
    """Predicted speedup per K beside the measured one for the same pair, and the best K."""
    acc = m.acceptance
    src = f"acceptance profile from `{acc.source}`" if acc else ""
    c = f"c = {m.prediction_c:.3f}" if m.prediction_c is not None else ""
    out = [
        "",
        f"Predicted speedup = E[tokens/round] / (v(K+1) + K·c) ({fmt.join(c, src)}), "
        "against the measured one for the same pair:",
        "",
    ]
    rows = []
    for p in m.prediction:
        got = _measured(s, m, p.k)
        rows.append(
            [
                str(p.k),
                fmt.num(p.expected_tokens_per_round, ".2f"),
                f"{p.cost_in_target_steps:.2f}",
                fmt.x(p.predicted_speedup),
                fmt.x(got[0]) if got else "not measured",
                _cite(got[1]) if got else "—",
            ]
        )
    header = ["K", "E[tokens/round]", "Cost (target steps)", "Predicted", "Measured"]
    out += fmt.md_table([*header, "Measured in"], rows)
    if m.best_k is not None:
        best = "0 (speculation cannot pay)" if m.best_k == 0 else str(m.best_k)
        out += ["", f"Predicted best K: {best} (`best_k`)."]
    return out


def _micro_checks(m: MicrobenchArtifact) -> list[str]:
    """`microbench --check`: predicted against measured, bench by bench."""
    out = [
        "",
        "Prediction checked against fixed-K benches (`microbench --check`), each "
        "with its own acceptance profile; measured on the decode phase (prompt "
        "prefills left out), end to end beside it:",
        "",
    ]
    rows = [
        [
            str(ch.k),
            str(ch.drafter),
            fmt.num(ch.temperature, ".2f"),
            fmt.x(ch.predicted_speedup),
            fmt.x(ch.measured_decode_speedup),
            fmt.x(ch.measured_speedup),
            fmt.num(ch.relative_error, "+.1%"),
            _cite(str(ch.source)),
        ]
        for ch in m.checks
    ]
    header = ["K", "Drafter", "T", "Predicted", "Measured (decode)", "Measured (end to end)"]
    return out + fmt.md_table([*header, "Error", "Bench"], rows)


def _section_gate(s: Study) -> list[str]:
    out: list[str] = []
    for g in s.gates:
        pair = f"{g.draft.short} → {g.target.short}" if g.draft and g.target else "?"
        ep, ref = g.config.get("endpoint"), g.config.get("endpoint_baseline")
        if isinstance(ep, dict) and isinstance(ref, dict):  # a gate between two servers
            pair = f"endpoint {ep.get('label')} against {ref.get('label')}"
        verdict = "PASS" if g.passed else "FAIL"
        quick = " (`--quick`: CI-sized, low power)" if g.quick else ""
        out += [s.hosts.heading(f"{g.name}: {pair}", g.src), "", s.hosts.provenance(g.src), ""]
        out += [f"From {_cite(g.src)}: **{verdict}**{quick}.", ""]
        out += [_sampled_line(g), *_greedy_lines(g), ""]
    return out


def _sampled_line(g: GateArtifact) -> str:
    sm = g.sampled
    setup = fmt.join(
        f"{sm.n_prompts} prompts × {sm.max_new_tokens} tokens per method" if sm.n_prompts else "",
        f"T = {sm.temperature:g}" if sm.temperature is not None else "",
        f"{sm.tokens_speculative} speculative and {sm.tokens_baseline} target-only tokens"
        if sm.tokens_speculative is not None
        else "",
    )
    rule = f" (threshold p > {sm.p_min:g})" if sm.p_min is not None else ""
    pooled = " (top tokens + one pooled bin)" if sm.pooled_bin else ""
    binning = f"{len(sm.bins)} bins{pooled}"
    if sm.min_expected is not None:
        binning += f", every expected count ≥ {sm.min_expected:g}"
    line = (
        f"- Sampled leg ({setup}): χ² = {sm.chi2:.2f}, dof = {sm.dof}, "
        f"{scan.gate_p_text(g)} → {'pass' if sm.passed else 'FAIL'}{rule}; {binning}."
    )
    if sm.acceptance_rate is not None:
        line += f"\n- Acceptance rate during the sampled leg: {fmt.pct(sm.acceptance_rate)}"
        line += "." if sm.drafted is None else f" ({sm.accepted} of {sm.drafted} drafted tokens)."
    if sm.smoothed_kl is not None:
        line += f"\n- Smoothed symmetric KL (reference only, not the test): {sm.smoothed_kl:.4f}."
    return line


def _greedy_lines(g: GateArtifact) -> list[str]:
    rows = g.greedy.rows
    if not rows:
        return ["- Greedy leg: no rows in the artifact."]
    n_ok = sum(r.match for r in rows)
    cap = f", up to {g.greedy.max_new_tokens} tokens" if g.greedy.max_new_tokens else ""
    lens = ", ".join(str(r.n_speculative) for r in rows)
    out = [
        f"- Greedy leg (T = 0{cap}): {n_ok}/{len(rows)} prompts "
        f"identical ({lens} tokens) → {'pass' if g.greedy.passed else 'FAIL'}."
    ]
    bad = [
        [str(r.prompt_id), str(r.n_baseline), str(r.n_speculative), str(r.first_mismatch)]
        for r in rows
        if not r.match
    ]
    if bad:
        header = ["Prompt", "n baseline", "n speculative", "First mismatch"]
        out += ["", *fmt.md_table(header, bad)]
    return out


def _section_files(s: Study) -> list[str]:
    out = ["## Artifacts", ""]
    rows = []
    for src in sorted(s.metas):
        meta = s.metas[src]
        cmd = str(meta.get("command") or "—").replace("|", "\\|")
        row = [_cite(src), s.schemas[src], s.hosts.name(src), str(meta.get("created", "—"))]
        rows.append([*row, f"`{cmd}`"])
    out += fmt.md_table(["File", "Schema", "Host", "Created", "Command"], rows)
    members = sorted(p.member.src for sw in s.sweeps for p in sw.points if p.member)
    if members:
        out += [
            "",
            "Per-K sweep artifacts (in the K-sweep tables, not the main results): "
            + ", ".join(map(_cite, members))
            + ".",
        ]
    for title, items in (
        ("Valid but empty (not used)", s.no_rows),
        ("Malformed (not used)", s.malformed),
        ("Skipped (not specdec artifacts)", s.skipped),
    ):
        if items:
            out += ["", f"{title}:", "", *(f"- {m}" for m in items)]
    return [*out, ""]


def _k_hist(run: Mapping[str, Any]) -> str:
    """'0:12 1:3 15:4': rounds per drafted K (core.metrics k_histogram), K ascending."""
    hist = run.get("k_histogram") or {}
    return " ".join(f"{k}:{n}" for k, n in sorted(hist.items(), key=lambda kv: int(kv[0])))


def _section_predictions(s: Study) -> list[str]:
    """Per task, for every method of a run that drafted from a prediction: the speedup over
    target-only on that prompt, accepted / rejected prediction tokens, and the chosen K's."""
    out: list[str] = []
    for b in s.benches:
        methods = [
            m
            for m in ("speculative", *b.variants)
            if any(
                s.startswith(PREDICTION_SOURCE)
                for r in b.rows
                for s in r.run(m).get("drafted_by_source") or {}
            )
        ]
        if not methods:
            continue
        if not out:
            out = [
                "## Per task: drafting from a prediction",
                "",
                "Speedup = target-only wall time / the method's, on the same prompt (end to "
                "end; decode phase in brackets). Accepted / rejected prediction tokens as "
                "OpenAI's usage fields (core.metrics). K histogram: rounds per drafted K.",
                "",
            ]
        rows = []
        for r in b.rows:
            base = r.baseline
            for m in methods:
                run = r.run(m)
                e2e = fmt.x(base["wall_s"] / run["wall_s"] if run["wall_s"] else None)
                dec = fmt.x(_decode_ratio(base, run))
                rows.append(
                    [
                        r.prompt_id,
                        m,
                        str(run["generated"]),
                        f"{e2e} ({dec})",
                        str(run.get("accepted_prediction_tokens", "—")),
                        str(run.get("rejected_prediction_tokens", "—")),
                        _k_hist(run),
                    ]
                )
        header = ["Prompt", "Method", "Tokens", "Speedup", "Accepted", "Rejected", "K histogram"]
        out += [
            f"From {_cite(b.src)} ({s.hosts.where(b.src)}):",
            "",
            *fmt.md_table(header, rows),
            "",
        ]
    return out


def _decode_ratio(base: Mapping[str, Any], run: Mapping[str, Any]) -> float | None:
    """Decode-phase speedup of one run over its baseline (core.metrics decode_tokens_per_s)."""
    b, r = base.get("decode_tokens_per_s"), run.get("decode_tokens_per_s")
    return r / b if b and r else None


#: REPORT.md's sections between the hosts' and the predictions': heading, body (empty when its
#: inputs are absent), the figure linked below it, and what "No artifact:" then names as absent.
_SECTIONS: tuple[tuple[str, Callable[[Study], list[str]], str, str], ...] = (
    (
        "Main results (Table 3 shape)",
        _section_main,
        "throughput.png",
        "no stand-alone `specdec bench` run under this directory",
    ),
    (
        "K-sweeps (Table 4 shape)",
        _section_sweeps,
        "speedup_vs_k.png",
        "no `specdec sweep` summary under this directory",
    ),
    (
        "Acceptance by draft position",
        _section_positional,
        "acceptance_by_position.png",
        "no stand-alone bench run with speculative rounds",
    ),
    (
        "Per-token latency split",
        _section_latency,
        "latency_split.png",
        "no stand-alone bench run with phase timings",
    ),
    (
        "Microbenchmarks: verify scaling and draft cost",
        _section_micro,
        "verify_scaling.png",
        "no `specdec microbench` run under this directory",
    ),
    (
        "Correctness gate (level 3)",
        _section_gate,
        "token_frequency.png",
        "no `specdec gate` run under this directory",
    ),
)


def render_report(study: Study, figures: Path, report: Path) -> str:
    """REPORT.md's text; figures under `figures` are linked relative to `report` when present."""
    n = len(study.metas)
    out = [
        "# specdec study report",
        "",
        f"Generated by `specdec report` from the {n} JSON artifact{'s' * (n != 1)} under this "
        "directory and nothing else; every number names the file it came from.",
        "",
        *_section_hosts(study),
    ]
    for heading, section, figure, missing in _SECTIONS:
        body = section(study)
        if body:  # a blank line too many is harmless: runs of blank lines are folded below
            out += [f"## {heading}", "", *body, "", *_figure(figure, figures, report)]
        else:
            out += [f"## {heading}", "", f"No artifact: {missing}.", ""]
    out += _section_predictions(study)
    out += _section_files(study)
    text = "\n".join(out)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip() + "\n"
