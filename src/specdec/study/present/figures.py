"""The study's figures, drawn from the artifacts under one directory (`scan.scan`) and nothing else.

Each figure function takes the `Study` and a path, and returns the path, or None when its inputs
are absent (a figure is skipped with a note, never drawn empty). Every figure's footnote names the
files its numbers came from. Names follow the paper: K is the speculation length, v(b) the cost of
a b-token verify pass in single-token target steps, c the draft-step / target-step latency ratio.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.study.artifacts import PHASES, BenchArtifact, GateArtifact, variant_method
from specdec.study.present import fmt, scan
from specdec.study.present.scan import Study

_DPI = 120
_FOOTNOTE_CHARS = 160  # footnote wraps at this width
_FOOTNOTE_LINE_IN = 0.13  # height of one 7-pt footnote line, inches
_TOP_BINS = 200  # the paper's Figure 2 overlays the top-200 tokens by combined count
_TOP_LABELLED = 15  # bins whose token labels are readable in the right-hand panel
_LABEL_CHARS = 14  # token labels are truncated to this many characters
_COLORS = {"baseline": "#8c8c8c", "speculative": "#1f77b4", "hf_assisted": "#ff7f0e"}
_PHASE_COLORS = {"draft": "#9ecae1", "verify": "#3182bd", "sampling": "#e6550d", "other": "#d9d9d9"}


def _token(label: str) -> str:
    """A token label on one line: spaces made visible (␣), control characters escaped, cut."""
    t = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in label).replace(" ", "␣")
    return t if len(t) <= _LABEL_CHARS else t[: _LABEL_CHARS - 1] + "…"


def _pyplot() -> Any:  # matplotlib is imported only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig: Any, path: Path, sources: Iterable[str]) -> Path:
    """Add the sources footnote, lay out, save, close. A title wider than the figure leaves
    (a legend beside the axes takes their width) is wrapped until it fits: tight_layout
    centres it over the axes and cuts what reaches past the edge."""
    note = textwrap.fill("source: " + ", ".join(sorted(set(sources))), _FOOTNOTE_CHARS)
    fig.text(0.005, 0.005, note, fontsize=7, color="#555555", va="bottom")
    footnote_in = _FOOTNOTE_LINE_IN * (note.count("\n") + 1) + 0.05
    rect = (0, footnote_in / fig.get_figheight(), 1, 1)
    fig.tight_layout(rect=rect)
    for _ in range(4):
        cut = clipped(fig)
        titles = [ax.title for ax in fig.axes if ax.title.get_text() in cut]
        if not titles:
            break
        for title in titles:
            title.set_text(_narrower(title.get_text()))
        fig.tight_layout(rect=rect)
    CLIPPED.extend((path.name, t) for t in clipped(fig))
    fig.savefig(path, dpi=_DPI, metadata={"Software": None})  # no version stamp: stable bytes
    _pyplot().close(fig)
    return path


#: (figure file, text) of every text a saved figure cut at its edge (tests/study/test_figures.py
#: checks that none is).
CLIPPED: list[tuple[str, str]] = []


def clipped(fig: Any) -> list[str]:
    """The visible texts of `fig` that reach past its edges (cut off in the image): titles,
    legends, notes; texts that their axes clip on purpose are not counted."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox
    # tick labels are placed by tight_layout itself, and those of ticks outside the view exist
    # undrawn: not counted
    ticks = {
        id(label)
        for ax in fig.axes
        for axis in (ax.xaxis, ax.yaxis)
        for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks())
        for label in (tick.label1, tick.label2)
    }
    out = []
    for t in fig.findobj(Text):
        clips = t.get_clip_on() and t.get_clip_box() is not None  # cut to its axes on purpose
        if not t.get_visible() or not t.get_text().strip() or clips or id(t) in ticks:
            continue
        box = t.get_window_extent(renderer)
        if (
            box.x0 < edge.x0 - 1
            or box.x1 > edge.x1 + 1
            or box.y0 < edge.y0 - 1
            or box.y1 > edge.y1 + 1
        ):
            out.append(t.get_text())
    return out


def _narrower(text: str) -> str:
    """`text` with its longest line wrapped at three quarters of its length."""
    lines = text.split("\n")
    longest = max(lines, key=len)
    width = max(20, 3 * len(longest) // 4)
    return "\n".join(textwrap.fill(ln, width) if ln is longest else ln for ln in lines)


def _box(ax: Any, text: str, x: float, y: float, ha: str, va: str, size: float = 9) -> None:
    ax.text(
        x,
        y,
        text,
        transform=ax.transAxes,
        fontsize=size,
        ha=ha,
        va=va,
        bbox={"boxstyle": "round", "fc": "white", "ec": "#999999", "alpha": 0.9},
    )


def _gate_lines(g: GateArtifact) -> list[str]:
    s, rows = g.sampled, g.greedy.rows
    rule = f" (threshold p > {s.p_min:g})" if s.p_min is not None else ""
    lines = [
        f"χ² = {s.chi2:.1f}, dof = {s.dof}, {scan.gate_p_text(g)} "
        f"→ {'pass' if s.passed else 'FAIL'}{rule}"
    ]
    if s.tokens_speculative is not None and s.tokens_baseline is not None:
        lines.append(f"tokens: {s.tokens_speculative} spec / {s.tokens_baseline} target-only")
    pooled = s.pooled_bin
    if pooled is not None:
        lines.append(
            f"pooled bin {pooled.text}: {pooled.speculative:.0f} / {pooled.baseline:.0f} "
            "(tested, not plotted)"
        )
    if s.smoothed_kl is not None:
        lines.append(f"smoothed KL = {s.smoothed_kl:.3f} (reference only)")
    if rows:
        n_ok = sum(r.match for r in rows)
        ok = "pass" if g.greedy.passed else "FAIL"
        lines.append(f"greedy leg: {n_ok}/{len(rows)} prompts identical → {ok}")
    return lines


def fig_token_frequency(study: Study, path: Path) -> Path | None:
    """Figure 2: per gate, counts of the top bins, speculative vs target-only, with the test."""
    gates = [g for g in study.gates if g.sampled.token_bins]
    if not gates:
        return None
    plt = _pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(
        len(gates),
        2,
        figsize=(13, 4.8 * len(gates)),
        squeeze=False,
        gridspec_kw={"width_ratios": (2.2, 1)},
    )
    for (ax, bx), g in zip(axes, gates, strict=True):
        s = g.sampled
        bins = sorted(s.token_bins, key=lambda b: (-(b.speculative + b.baseline), b.text))
        bins = bins[:_TOP_BINS]
        ranks = range(1, len(bins) + 1)
        for side in ("speculative", "baseline"):
            ax.plot(
                ranks,
                [getattr(b, side) for b in bins],
                marker="o",
                ms=2.5,
                lw=1,
                alpha=0.85,
                color=_COLORS[side],
                label=scan.SIDE_NAMES[side],
            )
        ax.set_yscale("log")
        # Plain numbers ("4", "10", "200"), not 4×10⁰; minor ticks labelled only on short ranges.
        ax.yaxis.set_major_formatter(ticker.LogFormatter())
        ax.yaxis.set_minor_formatter(
            ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5))
        )
        ax.set_xlabel(
            f"token rank by combined count ({len(bins)} of {len(s.token_bins)} token bins shown)"
        )
        ax.set_ylabel("count (log)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left")  # counts fall with rank, so the lower left stays empty
        _box(ax, "\n".join(_gate_lines(g)), 0.985, 0.97, "right", "top")
        pair = f"{g.draft.name} → {g.target.short}" if g.draft and g.target else ""
        setup = fmt.join(
            f"{s.n_prompts} prompts × {s.max_new_tokens} tokens" if s.n_prompts else "",
            f"T={s.temperature:g}" if s.temperature is not None else "",
            "--quick" if g.quick else "",
        )
        ax.set_title(f"{g.name}: {pair}\n{setup} ({g.src})", fontsize=10)

        top = bins[:_TOP_LABELLED][::-1]  # barh draws bottom-up: most frequent on top
        y = range(len(top))
        h = 0.4
        bx.barh(
            [v + h / 2 for v in y], [b.speculative for b in top], h, color=_COLORS["speculative"]
        )
        bx.barh([v - h / 2 for v in y], [b.baseline for b in top], h, color=_COLORS["baseline"])
        bx.set_yticks(list(y), [_token(b.text) for b in top], fontsize=8, family="monospace")
        bx.set_xlabel("count")
        bx.set_title(f"top {len(top)} tokens (␣ = space)", fontsize=10)
        bx.grid(True, axis="x", alpha=0.3)
    fig.suptitle("Token-frequency overlay: speculative vs target-only sampling (level-3 gate)")
    return _finish(fig, path, (g.src for g in gates))


def _bench_tick(b: BenchArtifact) -> str:
    """'all_gguf' over 'llamacpp→llamacpp · cpu'; the model names are in the report. A label
    with settings ('all_gguf (composite, K=auto, T=0)') puts them on a line of their own."""
    name, sep, rest = b.label.partition(" (")
    lines = [name, f"({rest}"] if sep else [b.label]
    if b.draft and b.target:
        lines.append(f"{b.draft.backend}→{b.target.backend} · {b.target.device}")
    if not b.complete:
        lines.append("(incomplete)")
    return "\n".join(textwrap.fill(line, _TICK_CHARS) for line in lines)


_TICK_CHARS = 30  # a config's tick label wraps at this width
_VARIANT_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#d62728")


@dataclass(frozen=True)
class _Bar:
    """One method's bar in a config's group: tok/s mean ± std, speedup over the same run's
    baseline (None for the baseline itself)."""

    key: str  # legend entry / colour: a _COLORS side or a variant name
    method: str  # the text in the bar, e.g. "target-only", "lookup K=auto"
    mean: float
    std: float
    speedup: float | None


def _bars(b: BenchArtifact) -> list[_Bar]:
    """The methods measured in one bench run, in the order they are drawn."""
    agg, out = b.aggregates, []
    for side, sp in (
        ("baseline", None),
        ("speculative", agg.speedup),
        ("hf_assisted", agg.speedup_hf_assisted),
    ):
        a = agg.of(side)
        if a is None or a.tok_s_mean is None:
            continue
        method = {"baseline": "target-only", "speculative": b.method}.get(side, "HF assisted")
        out.append(_Bar(side, method, a.tok_s_mean, a.tok_s_std or 0.0, sp))
    for name, v in agg.variants.items():
        if v.tok_s_mean is not None:
            out.append(
                _Bar(name, variant_method(name), v.tok_s_mean, v.tok_s_std or 0.0, v.speedup)
            )
    return out


def _bar_colors(groups: Sequence[Sequence[_Bar]]) -> dict[str, str]:
    colors = dict(_COLORS)
    for bars in groups:
        for bar in bars:
            if bar.key not in colors:
                n = len(colors) - len(_COLORS)
                colors[bar.key] = _VARIANT_COLORS[n % len(_VARIANT_COLORS)]
    return colors


def _legend_name(bar: _Bar) -> str:
    if bar.key == "speculative":
        return "speculative (the run's main method)"
    return scan.SIDE_NAMES.get(bar.key, f"variant {bar.method}")


def fig_throughput(study: Study, path: Path) -> Path | None:
    """Figure 3a: tok/s per config of target-only, the speculative method, HF-assisted and any
    variants measured in the same run (`aggregates.variants`); each bar names its method and is
    labelled with its speedup over the same run's target-only baseline."""
    benches = study.benches
    if not benches:
        return None
    plt = _pyplot()
    groups = [_bars(b) for b in benches]
    colors = _bar_colors(groups)
    width, gap = 0.8, 0.9  # a bar, and the space between two configs' groups
    n_bars = sum(len(g) for g in groups)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.62 * n_bars + 0.9 * len(benches) + 1.5), 5.5))
    top = max(bar.mean + bar.std for g in groups for bar in g)
    labelled: set[str] = set()
    ticks, x = [], 0.0
    for bars in groups:
        xs = [x + j * width for j in range(len(bars))]
        ticks.append(sum(xs) / len(xs))
        for xi, bar in zip(xs, bars, strict=True):
            ax.bar(
                xi,
                bar.mean,
                width * 0.92,
                yerr=bar.std,
                capsize=3,
                color=colors[bar.key],
                label=None if bar.key in labelled else _legend_name(bar),
            )
            labelled.add(bar.key)
            ax.text(  # the method, inside the bar's foot
                xi,
                0.012 * top,
                bar.method,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7.5,
                color="white" if bar.key != "baseline" else "black",
                clip_on=True,
            )
            if bar.speedup is not None:
                ax.text(
                    xi,
                    bar.mean + bar.std + 0.015 * top,
                    f"{bar.speedup:.2f}×",
                    ha="center",
                    va="bottom",
                    fontsize=8.5 if len(bars) > 3 else 9,
                    fontweight="bold",
                )
        x = xs[-1] + width + gap
    ax.set_xticks(ticks, [_bench_tick(b) for b in benches], fontsize=8.5)
    ax.set_xlim(-width, x - gap)
    ax.set_ylabel("tokens / s (mean ± std over prompts)")
    ax.set_ylim(0, top * 1.15)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8.5)
    settings = scan.shared_settings(benches)
    ax.set_title(
        "Throughput per method; label = speedup over the same run's target-only"
        + (f"\n({settings})" if settings else ""),
        fontsize=11,
    )
    return _finish(fig, path, (b.src for b in benches))


def fig_speedup_vs_k(study: Study, path: Path) -> Path | None:
    """Figure 3b: measured speedup vs K per sweep; matching microbench predictions dashed."""
    sweeps = [s for s in study.sweeps if s.points]
    if not sweeps:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    sources, ks, top = [], set(), 1.0
    for i, s in enumerate(sweeps):
        color, label = f"C{i % 10}", scan.sweep_label(s, sweeps)
        ks.update(p.k for p in s.points)
        top = max(top, *(p.speedup for p in s.points))
        ax.plot(
            [p.k for p in s.points],
            [p.speedup for p in s.points],
            marker="o",
            color=color,
            label=f"{label} measured",
        )
        best = max(s.points, key=lambda p: p.speedup)
        ax.annotate(
            f"best {best.speedup:.2f}× at K={best.k}",
            (best.k, best.speedup),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8.5,
            color=color,
            fontweight="bold",
        )
        sources.append(s.src)
        for m in study.micros:
            preds = [(p.k, p.predicted_speedup) for p in m.prediction if p.predicted_speedup]
            if preds and scan.same_pair(s.draft_spec, s.target_spec, s.device, m):
                ax.plot(
                    [k for k, _ in preds],
                    [sp for _, sp in preds],
                    ls="--",
                    marker="x",
                    color=color,
                    label=f"{label} predicted ({m.src})",
                )
                ks.update(k for k, _ in preds)
                top = max(top, *(sp for _, sp in preds))
                sources.append(m.src)
    ax.axhline(1.0, color="black", lw=1, ls=":", label="break-even (1.0×)")
    ax.set_xticks(sorted(ks))
    ax.set_xlim(min(ks) - 0.5, max(ks) + 0.5)  # room for the best-K label at either end
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("speedup over target-only (×)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Speedup vs K, each K normalised by its own interleaved baseline", fontsize=11)
    return _finish(fig, path, sources)


def fig_acceptance_by_position(study: Study, path: Path) -> Path | None:
    """Figure 4: speculative acceptance rate at draft position 1..K, per config."""
    benches = [b for b in study.benches if b.aggregates.speculative.positional]
    if not benches:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, b in enumerate(benches):
        speculative = b.aggregates.speculative
        ax.plot(
            range(1, len(speculative.positional) + 1),
            [100 * a for a in speculative.positional],
            marker="o",
            color=f"C{i % 10}",
            label=f"{b.label} (pooled {fmt.pct(speculative.acceptance_rate)})",
        )
    ax.set_xticks(range(1, max(len(b.aggregates.speculative.positional) for b in benches) + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance rate at position i (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    settings = scan.shared_settings(benches)
    ax.set_title(
        "Acceptance by draft position" + (f" ({settings})" if settings else ""), fontsize=11
    )
    return _finish(fig, path, (b.src for b in benches))


def fig_latency_split(study: Study, path: Path) -> Path | None:
    """Figure 5: stacked ms per generated token, draft/verify/sampling/other, per config."""
    benches = [b for b in study.benches if scan.timed(b)]
    if not benches:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 * len(benches) + 2), 5))
    stacks = []  # [(x, [ms per PHASES])]: a config's two bars at x = 2.6 i and 2.6 i + 1
    for i, b in enumerate(benches):
        for j, ms in enumerate(scan.timed(b)):
            stacks.append((i * 2.6 + j, [ms[p] for p in PHASES]))
    for n, phase in enumerate(PHASES):
        ax.bar(
            [x for x, _ in stacks],
            [v[n] for _, v in stacks],
            0.8,
            bottom=[sum(v[:n]) for _, v in stacks],
            color=_PHASE_COLORS[phase],
            edgecolor="white",
            label=phase,
        )
    top = max(sum(v) for _, v in stacks)
    for x, v in stacks:
        ax.text(x, sum(v) + 0.01 * top, f"{sum(v):.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([x for x, _ in stacks], ["target-only", "spec"] * len(benches), fontsize=8)
    for i, b in enumerate(benches):  # the config under its pair of bars
        ax.annotate(
            _bench_tick(b),
            (i * 2.6 + 0.5, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -18),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
        )
    ax.set_ylabel("ms per generated token")
    ax.set_ylim(0, top * 1.12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="phase", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(
        "Per-token latency split, target-only vs speculative (bar label = total ms)", fontsize=11
    )
    return _finish(fig, path, (b.src for b in benches))


def fig_verify_scaling(study: Study, path: Path) -> Path | None:
    """Verify-batch scaling: v(b), the cost of a b-token pass in single-token target steps."""
    micros = [m for m in study.micros if m.verify]
    if not micros:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    bmax = max(v.b for m in micros for v in m.verify)
    bs = list(range(1, bmax + 1))
    ax.plot(bs, bs, color="#999999", ls=":", label="serial, v(b) = b")
    ax.plot(bs, [1] * len(bs), color="#999999", ls="--", label="ideal parallel, v(b) = 1")
    for i, m in enumerate(micros):
        step = f"target step {m.target_step_ms:.1f} ms"
        if m.prefix_tokens is not None:
            step = f"context {m.prefix_tokens}, {step}"
        # the file names the target and the run's --tag (e.g. _deterministic, _tiled-on)
        step = f"{Path(m.src).stem.removeprefix('microbench_')}: {step}"
        if m.draft_step_ms is not None:
            step += f", draft step {m.draft_step_ms:.1f} ms"
        c = f"c = {m.c:.3f}" if m.c is not None else "no draft: c not measured"
        ax.plot(
            [v.b for v in m.verify],
            [v.ratio for v in m.verify],
            marker="o",
            markersize=2 if bmax > 32 else 5,
            color=f"C{i % 10}",
            label=f"{step}; {c}",  # the file stem names the target (m.label is the long form)
        )
    step_b = 16 if bmax > 64 else 8 if bmax > 32 else 1
    ax.set_xticks([b for b in bs if b == 1 or b % step_b == 0])
    ax.set_xlabel("b (tokens in one verify pass)")
    ax.set_ylabel("v(b) = median ms(b) / median ms(1)")
    ax.set_ylim(0, max(bmax, *(v.ratio for m in micros for v in m.verify)) * 1.05)
    ax.grid(True, alpha=0.3)
    # beside the axes: with several curves to b = 128 a legend inside covers them
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title("Verify-batch scaling of the target: is verification parallel?", fontsize=11)
    return _finish(fig, path, (m.src for m in micros))


#: file name -> (function, what it needs when skipped)
_FIGURES: dict[str, tuple[Callable[[Study, Path], Path | None], str]] = {
    "token_frequency.png": (fig_token_frequency, "a gate artifact with bins"),
    "throughput.png": (fig_throughput, "a stand-alone bench artifact (outside a sweep)"),
    "speedup_vs_k.png": (fig_speedup_vs_k, "a sweep summary with points"),
    "acceptance_by_position.png": (fig_acceptance_by_position, "a bench with speculative rounds"),
    "latency_split.png": (fig_latency_split, "a bench artifact with ms_per_token"),
    "verify_scaling.png": (fig_verify_scaling, "a microbench artifact"),
}
FIGURES = tuple(_FIGURES)


def write_figures(study: Study, out: Path) -> tuple[list[Path], list[str]]:
    """Draw every figure whose inputs exist into `out`; return (paths written, skip notes)."""
    out.mkdir(parents=True, exist_ok=True)
    written, notes = [], []
    for name, (func, needs) in _FIGURES.items():
        p = func(study, out / name)
        if p is None:
            notes.append(f"{name}: skipped, needs {needs}")
        else:
            written.append(p)
    return written, notes
