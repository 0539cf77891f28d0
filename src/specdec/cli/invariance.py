"""`specdec invariance`: does a b-token verify pass compute what b single steps do, op by op."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from specdec.cli import args as cli_args
from specdec.study.artifacts import InvarianceArtifact, write_json
from specdec.study.artifacts.provenance import meta_block
from specdec.study.run.invariance import SETTINGS, format_table, run_setting

DEFAULT_CONTEXTS = (40, 600, 1100)  # below and above 512 and 1,024 positions


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"every value must be an integer >= 1, got {text!r}")
    return out


def _settings(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown setting(s) {bad or text!r}; choose from {', '.join(SETTINGS)}"
        )
    return names


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "invariance",
        help="batch invariance op by op: a b-token pass vs b single steps, per llama.cpp setting",
    )
    p.add_argument(
        "--target",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="llamacpp: model specs to probe (str, one or more)",
    )
    p.add_argument(
        "--settings",
        type=_settings,
        default=list(SETTINGS),
        help=f"comma-separated, of {', '.join(SETTINGS)} (default: all)",
    )
    p.add_argument(
        "--contexts",
        type=_ints,
        default=list(DEFAULT_CONTEXTS),
        help="cached tokens before the probe, comma-separated ints >= 1 (default 40,600,1100)",
    )
    p.add_argument(
        "--batch", type=int, default=8, help="tokens b in the pass (int >= 1; default 8)"
    )
    cli_args.add_device_args(p)
    cli_args.add_out_arg(p, "invariance.json")
    p.set_defaults(func=_cmd_invariance)


def _cmd_invariance(args: argparse.Namespace) -> int:
    cli_args.check_threads(args.threads)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    bad = [s for s in args.target if not s.startswith("llamacpp:")]
    if bad:
        raise ValueError(f"the op-level probe reads llama.cpp's graph; {bad} are not llamacpp:")
    probes = []
    for setting in args.settings:
        for spec in args.target:
            job = {
                "spec": spec,
                "setting": setting,
                "contexts": args.contexts,
                "batch": args.batch,
                "threads": args.threads,
            }
            probes += _in_child(job)
            print(f"{spec} {setting}: done", file=sys.stderr)
    art = InvarianceArtifact(
        meta=meta_block(),  # the parent's: the children run the same build on the same CPU
        settings={s: SETTINGS[s] for s in args.settings},
        batch=args.batch,
        contexts=args.contexts,
        threads=args.threads,
        probes=probes,  # the children's JSON, validated into records here
    )
    out = Path(args.out) / "invariance.json"
    write_json(out, art)
    print(format_table(art))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _in_child(job: dict) -> list[dict]:
    """Run one setting in a fresh process: llama.cpp reads GGML_CPU_TILED_MM, and sdmm
    SPECDEC_MM, once per process."""
    _, tiled, sdmm = SETTINGS[job["setting"]]
    env = {**os.environ, "GGML_CPU_TILED_MM": tiled, "SPECDEC_MM": sdmm}
    code = "from specdec.cli.invariance import _child; _child()"
    res = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(job), env=env, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise ValueError(f"probe of {job['spec']} ({job['setting']}) failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def _child() -> None:
    job = json.loads(sys.stdin.read())
    probes = run_setting(job["spec"], job["setting"], job["contexts"], job["batch"], job["threads"])
    print(json.dumps(probes))
