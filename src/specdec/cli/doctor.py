"""`specdec doctor`: will speculative decoding pay on this machine? (study.run.doctor)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec.backends.configs import CONFIGS
from specdec.cli import args as cli_args

#: The default pair (`all_gguf`): what `specdec doctor` judges when given no model.
DEFAULT = CONFIGS["all_gguf"]


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return out


def add(subparsers: argparse._SubParsersAction) -> None:
    from specdec.study.run.doctor import BATCHES, SECONDS

    p = subparsers.add_parser(
        "doctor",
        help="will speculation pay here? target step, verify curve v(b), draft ratio c, "
        "ceilings, break-even acceptance and a verdict (~1 min); seeds k=auto's cost store",
    )
    cli_args.add_model_args(
        p,
        target_default=DEFAULT.target,
        target_help=f"target model, BACKEND:NAME_OR_PATH (str; default {DEFAULT.target})",
        draft_default=DEFAULT.draft,
        draft_help=f"draft model SPEC for its step ratio c, or none (str; default {DEFAULT.draft})",
    )
    cli_args.add_device_args(p)
    cli_args.add_prefix_arg(
        p, help="tokens cached before each probe, >= 1 (int; default 100, as specdec microbench)"
    )
    p.add_argument(
        "--batches",
        type=_batches,
        default=BATCHES,
        metavar="B,B,...",
        help="verify batch sizes b to time, each >= 1; 1 is always timed (ints; default "
        + ",".join(map(str, BATCHES))
        + ")",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=SECONDS,
        help=f"time for the timed passes, > 0; at least 3 passes run whatever it is (float; "
        f"default {SECONDS:g}; loading the models comes on top)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table (flag)"
    )
    p.add_argument(
        "--out", default=None, metavar="FILE", help="also write the JSON report here (path)"
    )
    p.add_argument(
        "--reset-costs",
        action="store_true",
        help="forget k=auto's stored verify curve for this target, build and settings, and "
        "measure nothing (flag); the next k=auto run starts from the prior",
    )
    p.add_argument(
        "--no-seed",
        action="store_true",
        help="do not write the measured curve to k=auto's cost store (flag; default: write it)",
    )
    cli_args.add_deterministic_arg(p)
    cli_args.add_no_progress_arg(p)
    p.set_defaults(func=_cmd_doctor)


def _weights(target: Any) -> Any:
    """A llama.cpp target's weights report (backends.weights), None for other backends."""
    if getattr(target, "weight_types", None) is None or getattr(target, "path", None) is None:
        return None
    from specdec.backends.weights import inspect_weights

    return inspect_weights(target.path, target.sdmm)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from specdec.backends.costs import CurveFiles
    from specdec.cli.main import version_line
    from specdec.study.artifacts import to_json, write_json
    from specdec.study.run.doctor import format_report, format_stored, run

    if args.prefix < 1:
        raise ValueError(f"--prefix must be >= 1, got {args.prefix}")
    if not args.seconds > 0:
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    if args.reset_costs:
        target, _ = cli_args.load_pair(args, args.target, None)
        gone = CurveFiles().reset(target)
        print(f"removed {gone}" if gone else "no stored k=auto curve for this target and settings")
        return 0
    target, draft = cli_args.load_pair(args, args.target, args.draft)
    stored = CurveFiles().load(target)
    rep = run(
        target,
        draft,
        cli_args.model_blocks(args, target, draft),
        prefix=args.prefix,
        batches=args.batches,
        seconds=args.seconds,
        curves=None if args.no_seed else CurveFiles(),
        progress=not args.no_progress and not args.json,
    )
    if args.out is not None:
        write_json(Path(args.out), rep)
    weights = _weights(target)
    if args.json:
        out = to_json(rep)
        if weights is not None:
            out["weights"] = weights.record()
        print(json.dumps(out, indent=1))
    else:
        print(version_line())
        print(format_report(rep))
        print()
        print(format_stored(stored, rep.verify_ms))
        if weights is not None:
            print()
            print("\n".join(weights.lines()))
    if rep.contended:
        print(
            f"warning: the single step varied by {rep.step_spread:.0%} between passes: the "
            "machine was busy; rerun on an idle machine",
            file=sys.stderr,
        )
    return 0
