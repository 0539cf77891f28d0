"""`specdec anchors`: build llama.cpp's own tools from the llama.cpp our backend runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.cli.args import error


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "anchors", help="build stock llama.cpp's llama-server, llama-lookup and llama-bench"
    )
    p.set_defaults(func=_cmd_anchors, anchors_parser=p)
    sub = p.add_subparsers(dest="anchors_cmd", metavar="{build,path}")
    b = sub.add_parser(
        "build",
        help="build the llama.cpp that specdec's wheel is built from, with CMake's defaults "
        "(native kernels) and only upstream fixes, into $SPECDEC_HOME/anchors (once)",
    )
    b.add_argument(
        "--sdist",
        type=Path,
        default=None,
        help="use this llama-cpp-python sdist .tar.gz, sha256-checked (path; default download)",
    )
    b.add_argument("--jobs", type=int, default=None, help="parallel jobs (int; default all cores)")
    b.add_argument("--force", action="store_true", help="rebuild even if built (flag; default off)")
    b.add_argument(
        "--twin",
        action="store_true",
        help="build the 'same kernels' twin instead: every specdec patch and sdmm, run as the "
        "llama-server modes twin-<mode> (flag; default off)",
    )
    sub.add_parser("path", help="print the built llama-server and how it was built")


def _cmd_anchors(args: argparse.Namespace) -> int:
    from specdec.study.engines import anchors

    try:
        if args.anchors_cmd == "build":
            if args.jobs is not None and args.jobs < 1:
                return error(f"--jobs must be >= 1, got {args.jobs}")
            bin_dir = anchors.build(
                sdist=args.sdist, jobs=args.jobs, force=args.force, twin=args.twin
            )
            print(bin_dir)
            return 0
        if args.anchors_cmd == "path":
            print(anchors.binary())
            print(json.dumps(anchors.manifest(), indent=2))
            return 0
    except anchors.AnchorError as e:
        return error(str(e))
    args.anchors_parser.print_help()
    return 2
