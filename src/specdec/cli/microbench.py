"""`specdec microbench`: verify-cost curves, the draft/target step ratio, predicted speedup."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.backends.costs import CurveFiles
from specdec.cli import args as cli_args
from specdec.core.checks import check_int
from specdec.core.cost import VerifyCurve
from specdec.study.run.microbench import (
    CONTENDED_SPREAD,
    acceptance_profile,
    artifact_path,
    check_prediction,
    format_table,
    run,
)


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "microbench",
        help="verify-batch scaling curve, draft/target step ratio and predicted speedup per K",
    )
    cli_args.add_model_args(
        p, draft_help="draft model SPEC for the step ratio c, or 'none' (str; default none)"
    )
    cli_args.add_device_args(p)
    cli_args.add_prefix_arg(p)
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
    cli_args.add_out_arg(p, "microbench_<target>.json")
    cli_args.add_tag_arg(
        p, help="suffix for the artifact name, e.g. the context (str; default none)"
    )
    cli_args.add_deterministic_arg(p)
    cli_args.add_no_progress_arg(p)
    p.set_defaults(func=_cmd_microbench)


def _cmd_microbench(args: argparse.Namespace) -> int:
    from specdec.study.artifacts import write_json

    cli_args.check_threads(args.threads)  # load_pair checks it too, but after the reading below
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
        k = bench.get("config", {}).get("k")  # checked before the minutes of measuring
        check_int(f"{path}: --check needs fixed-K bench artifacts; its config.k", k, 1)
        acceptance_profile(bench, source=str(path))  # validates the schema and the rows
        benches.append((str(path), bench))
    target, draft = cli_args.load_pair(args, args.target, args.draft)
    art = run(
        target,
        draft,
        cli_args.model_blocks(args, target, draft),
        prefix=args.prefix,
        max_batch=args.max_batch,
        repeats=args.repeats,
        acceptance=acceptance,
        progress=not args.no_progress,
    )
    v = [pt.ratio for pt in art.verify]
    checks = tuple(check_prediction(v, art.c, b, src) for src, b in benches)
    update = {"threads": args.threads, "checks": checks, "deterministic": args.deterministic}
    art = art.model_copy(update=update)
    out = artifact_path(Path(args.out), target.name, args.tag)
    write_json(out, art)
    # k="auto" starts from this curve in later processes
    measured = VerifyCurve.of({pt.b: pt.median_ms / 1e3 for pt in art.verify})
    CurveFiles().save(target, measured, replace=True)
    print(format_table(art))
    if art.step_spread is not None and art.step_spread > CONTENDED_SPREAD:
        print(
            f"warning: the single step varied by {art.step_spread:.0%} between passes: the "
            "machine was busy, and every v(b) is flattened; rerun on an idle machine",
            file=sys.stderr,
        )
    print(f"wrote {out}", file=sys.stderr)
    return 0
