"""`specdec profile`: where a verify pass over b tokens spends its time, op by op (llama.cpp)."""

from __future__ import annotations

import argparse
import sys

from specdec.cli import args as cli_args
from specdec.cli.invariance import _ints
from specdec.study.artifacts import ProfileArtifact, named_artifact, write_json
from specdec.study.artifacts.provenance import meta_block
from specdec.study.run.profile import format_kernel_rates, format_table, run_profile

#: --type-k names -> ggml_type
TYPE_K = {"q8_0": 8, "f16": 1}


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="per-op time of a llama.cpp verify pass over b tokens, by op and weight type",
    )
    p.add_argument("--target", required=True, metavar="SPEC", help="a llamacpp: model spec (str)")
    p.add_argument(
        "--contexts",
        type=_ints,
        default=[128, 1024],
        help="cached tokens before the pass, comma-separated ints >= 1 (default 128,1024)",
    )
    p.add_argument(
        "--batch",
        type=_ints,
        default=[1, 16, 64],
        help="tokens b per pass, comma-separated ints >= 1 (default 1,16,64)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="passes per probe; medians kept (int; default 3)"
    )
    p.add_argument(
        "--type-k",
        choices=sorted(TYPE_K),
        default="q8_0",
        help="K cache type (default q8_0, specdec's; f16 is llama.cpp's default)",
    )
    cli_args.add_device_args(p)
    cli_args.add_out_arg(p, "the profile artifact")
    cli_args.add_tag_arg(p)
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    from specdec.backends.cores import usable_cores
    from specdec.backends.llamacpp_kernels import peak_int8_gops

    cli_args.check_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    probes = run_profile(
        args.target,
        args.contexts,
        args.batch,
        repeats=args.repeats,
        n_threads=args.threads,
        type_k=TYPE_K[args.type_k],
    )
    art = ProfileArtifact(
        meta=meta_block(),
        target=args.target,
        threads=args.threads,
        type_k=args.type_k,
        repeats=args.repeats,
        peak_int8_gops=peak_int8_gops(args.threads or usable_cores()),
        probes=probes,
    )
    out = named_artifact(args.out, "profile", args.target.split(":", 1)[1], args.tag)
    write_json(out, art)
    print(format_table(probes))
    print(format_kernel_rates(probes, art.peak_int8_gops))
    print(f"wrote {out}", file=sys.stderr)
    return 0
