"""`specdec figures`: figures and report: PNGs and REPORT.md from the JSON artifacts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.cli.args import EXIT_FAILED
from specdec.study.present.figures import write_figures
from specdec.study.present.report import render_report
from specdec.study.present.scan import Study, scan


def _load(dir_: str) -> Study | None:
    """Scan DIR and print what was left out; None (after an error line) when nothing is usable."""
    study = scan(Path(dir_))
    for msg in study.skipped:
        print(f"note: skipping {msg}", file=sys.stderr)
    for msg in study.no_rows:
        print(f"note: nothing to show in {msg}", file=sys.stderr)
    for msg in study.malformed:
        print(f"warning: malformed artifact {msg}", file=sys.stderr)
    if not study.metas:
        print(f"error: no specdec artifacts under {dir_}", file=sys.stderr)
        return None
    return study


def _cmd_figures(args: argparse.Namespace) -> int:
    study = _load(args.dir)
    if study is None:
        return EXIT_FAILED
    written, notes = write_figures(study, Path(args.out or Path(args.dir) / "figures"))
    for p in written:
        print(p)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return EXIT_FAILED if study.malformed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    study = _load(args.dir)
    if study is None:
        return EXIT_FAILED
    out = Path(args.out or Path(args.dir) / "REPORT.md")
    figures = Path(args.figures or Path(args.dir) / "figures")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(study, figures, out), encoding="utf-8")
    print(out)
    return EXIT_FAILED if study.malformed else 0


def add(subparsers: argparse._SubParsersAction) -> None:
    exits = (
        "Exit status 0; 1 when DIR holds no specdec artifact, or when a file claims a specdec "
        "schema but is malformed: it is named on stderr and left out, and the rest is still "
        "written. JSON that is not a specdec artifact is skipped with a note."
    )
    f = subparsers.add_parser(
        "figures",
        help="regenerate the study's PNG figures from the JSON artifacts under DIR",
        description=f"Draw every figure whose artifacts exist under DIR (searched recursively); "
        f"a figure whose inputs are absent is skipped with a note. {exits}",
    )
    f.add_argument("dir", metavar="DIR", help="directory searched recursively for *.json (path)")
    f.add_argument("--out", default=None, help="output directory (path; default DIR/figures)")
    f.set_defaults(func=_cmd_figures)
    r = subparsers.add_parser(
        "report",
        help="write REPORT.md (tables in the shape of the paper's) from the JSON under DIR",
        description=f"Write a Markdown report in which every number cites its artifact. {exits}",
    )
    r.add_argument("dir", metavar="DIR", help="directory searched recursively for *.json (path)")
    r.add_argument("--out", default=None, help="report file (path; default DIR/REPORT.md)")
    r.add_argument(
        "--figures",
        default=None,
        help="directory whose PNGs the report links when present (path; default DIR/figures)",
    )
    r.set_defaults(func=_cmd_report)
