"""`specdec anchors`: build llama.cpp's own tools from the llama.cpp our backend runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.cli.args import error
from specdec.study.engines.peers import PEERS


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "anchors",
        help="build stock llama.cpp's llama-server, llama-lookup and llama-bench (or a peer's)",
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
        help="use this sdist .tar.gz (llama-cpp-python's, or ik-llama-cpp-python's for --peer "
        "ik), sha256-checked (path; default download)",
    )
    b.add_argument(
        "--src",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --peer ik: build ik_llama.cpp from this upstream source tree (a checkout of "
        "github.com/ikawrakow/ik_llama.cpp) instead of the sdist; the ik modes then run on "
        "it until the next `anchors build --peer ik` (path; default the sdist)",
    )
    b.add_argument(
        "--commit",
        default=None,
        help="with --src: the tree's git commit, where DIR has no .git (hex; default read "
        "from DIR/.git, else the tree is named by its files' names and sizes)",
    )
    b.add_argument("--jobs", type=int, default=None, help="parallel jobs (int; default all cores)")
    b.add_argument("--force", action="store_true", help="rebuild even if built (flag; default off)")
    b.add_argument(
        "--peer",
        choices=tuple(PEERS),
        default=None,
        help="which build: stock llama.cpp; the 'same kernels' twin (every specdec patch and "
        "sdmm, modes twin-<mode>); ik_llama.cpp from the ik-llama-cpp-python sdist (modes "
        "ik-<mode>, run with --run-time-repack; --src: from its upstream source); or stock and "
        "the twin as a CPU without AVX-512 runs them (stock-avx2, twin-avx2: modes avx2-<mode>, "
        "twin-avx2-<mode>) (default stock)",
    )
    b.add_argument(
        "--twin", action="store_true", help="the same as --peer twin (flag; default off)"
    )
    pp = sub.add_parser("path", help="print the built llama-server and how it was built")
    pp.add_argument(
        "--peer",
        choices=tuple(PEERS),
        default="stock",
        help="which build (ik: the one the ik modes run on) (default stock)",
    )


def _cmd_anchors(args: argparse.Namespace) -> int:
    from specdec.study.engines import anchor_build

    try:
        if args.anchors_cmd == "build":
            if args.jobs is not None and args.jobs < 1:
                return error(f"--jobs must be >= 1, got {args.jobs}")
            if args.twin and args.peer not in (None, "twin"):
                return error(f"--twin and --peer {args.peer} name two builds; pass one")
            peer = "twin" if args.twin else args.peer or "stock"
            if args.src is not None and not PEERS[peer].ik:
                return error(
                    "--src builds ik_llama.cpp from its source: pass --peer ik or ik-avx2 with it"
                )
            if args.commit is not None and args.src is None:
                return error("--commit names the commit of a --src tree: pass --src DIR with it")
            bin_dir = anchor_build.build(
                sdist=args.sdist,
                src=args.src,
                commit=args.commit,
                jobs=args.jobs,
                force=args.force,
                peer=peer,
            )
            print(bin_dir)
            return 0
        if args.anchors_cmd == "path":
            print(anchor_build.binary(peer=args.peer))
            print(json.dumps(anchor_build.manifest(args.peer), indent=2))
            return 0
    except anchor_build.AnchorError as e:
        return error(str(e))
    args.anchors_parser.print_help()
    return 2
