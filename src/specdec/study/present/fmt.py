"""Number formatting for the harness's tables: one definition of each cell format.

Two audiences, one set of functions: the Markdown report (the default: "—" for a missing value,
"×" for a ratio, "12.34±0.56") and the terminal tables that `specdec bench`, `sweep` and
`microbench` print (`plain=True`: ASCII "-" and "x", "12.34 ± 0.56", a missing std shown as 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MB_PER_GB = 1024  # peak_*_mb are MiB (ru_maxrss / 1024); GB in the tables means GiB


def _none(plain: bool) -> str:
    return "-" if plain else "—"


def num(v: float | None, spec: str = ".3f", suffix: str = "", *, plain: bool = False) -> str:
    """`v` in the format `spec` (e.g. ".2f", ".1%"), then `suffix`; a dash when missing."""
    return _none(plain) if v is None else f"{v:{spec}}{suffix}"


def x(v: float | None, *, plain: bool = False) -> str:
    """A ratio such as a speedup: '1.23×' ('1.23x' plain)."""
    return num(v, ".2f", "x" if plain else "×", plain=plain)


def pct(v: float | None, *, plain: bool = False) -> str:
    """A rate in [0, 1] as a percentage with one decimal: '61.5%'."""
    return num(v, ".1%", plain=plain)


def pm(mean: float | None, std: float | None, *, plain: bool = False) -> str:
    """'mean±std' to two decimals; the mean alone when std is missing ('mean ± 0.00' plain)."""
    if mean is None:
        return _none(plain)
    if plain:
        return f"{mean:.2f} ± {std or 0:.2f}"
    return f"{mean:.2f}" if std is None else f"{mean:.2f}±{std:.2f}"


def gb(mb: float | None) -> str:
    """MiB as GiB, two decimals."""
    return num(None if mb is None else mb / MB_PER_GB, ".2f")


def p_value(v: float) -> str:
    """Three significant digits, scientific below 1e-3."""
    return f"{v:.3g}" if v >= 1e-3 else f"{v:.2e}"


def join(*parts: str) -> str:
    """The non-empty parts, comma-separated."""
    return ", ".join(p for p in parts if p)


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table, one line per list item."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )
