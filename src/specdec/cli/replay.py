"""`specdec replay`: core.decode's loop, drafters and K policies over recorded greedy outputs,
costed by a measured verify curve (study/run/replay.py). No model runs (the target answers from
the record) and no wall clock is read (the clock is the curve's)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.cli import args as cli_args
from specdec.core.checks import check_int
from specdec.study.artifacts import write_json
from specdec.study.run import replay as rp

DEFAULT_POLICIES = "oracle,oracle-plan,best-fixed,auto"


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay drafters and K policies over recorded greedy outputs with a verify curve",
        description=rp.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="FILE",
        help="bench artifacts (T = 0: their recorded outputs) or JSONL files of prompts and "
        "outputs (str, one or more)",
    )
    p.add_argument(
        "--curve",
        metavar="MICROBENCH_JSON",
        help="the verify curve: a `specdec microbench` artifact (str; required to replay)",
    )
    p.add_argument(
        "--method",
        default="baseline",
        help="whose output to replay in a bench artifact: baseline, speculative or a variant "
        "(str; default baseline, i.e. target-only's greedy output)",
    )
    p.add_argument(
        "--drafter",
        default="prediction",
        choices=rp.REPLAY_DRAFTERS,
        help="the drafter replayed (default prediction: the task's prediction, then lookup)",
    )
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        help="comma-separated K policies: oracle, oracle-plan, auto, schedule, N (fixed K), "
        "best-fixed, a name of core.policy.POLICIES, or module:attr "
        f"(str; default {DEFAULT_POLICIES})",
    )
    p.add_argument(
        "--k-max", type=int, default=64, help="largest K for every policy (int >= 1; default 64)"
    )
    p.add_argument(
        "--draft-cost",
        type=float,
        default=0.0,
        help="cost of one drafted token in target steps, c (float >= 0; default 0: the "
        "model-free drafters cost microseconds)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="a new policy object per task (flag; default: one kept across the tasks, in "
        "order, as one process keeps k=auto's estimates)",
    )
    p.add_argument(
        "--target",
        metavar="SPEC",
        default=None,
        help="the target whose tokenizer reads a JSONL's text (str; default: none, ids only)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also replay each recorded run whose artifact logged its rounds (its method, "
        "drafter and K, a fresh policy, its own times) and say where it parts from the record",
    )
    p.add_argument(
        "--json", metavar="OUT", default=None, help="write the specdec.replay/1 artifact here"
    )
    _add_record_args(p)
    p.set_defaults(func=run)


def _add_record_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recording outputs to replay (instead of replaying)")
    g.add_argument(
        "--record",
        metavar="OUT_JSONL",
        default=None,
        help="generate greedy outputs of --target for the vendored prompts and write them as "
        "replay JSONL (str; default off)",
    )
    g.add_argument(
        "--category",
        default="rewrite",
        help="prompt categories to record, comma-separated (str; default rewrite)",
    )
    g.add_argument(
        "--prompts", type=int, default=None, help="record the first N (int >= 1; default all)"
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=512, help="per output (int >= 1; default 512)"
    )
    g.add_argument("--threads", type=int, default=None, help=cli_args.THREADS_HELP)
    g.add_argument(
        "--target-only",
        action="store_true",
        help="record with target-only decoding (flag; default: the prediction drafter at "
        "k=auto, whose greedy output is target-only's on a batch-invariant backend)",
    )


def _tokenizer(args: argparse.Namespace) -> object:
    if args.target is None:
        return None
    from specdec.backends import load_tokenizer_of

    return load_tokenizer_of(args.target)


def _load(args: argparse.Namespace) -> list[rp.Recorded]:
    tokenizer = _tokenizer(args)
    tasks: list[rp.Recorded] = []
    for f in args.inputs:
        if not Path(f).is_file():
            raise ValueError(f"{f}: no such file")
        if f.endswith(".jsonl"):
            tasks += rp.from_jsonl(f, tokenizer)
        else:
            tasks += rp.from_bench(f, args.method, tokenizer)
    return tasks


def _check(inputs: list[str], curve: rp.Curve, tokenizer: object) -> list[str]:
    lines = []
    for f in (f for f in inputs if not f.endswith(".jsonl")):
        for rep in rp.reproduce_bench(f, curve, tokenizer):
            state = "reproduced" if rep.reproduced else f"parts at round {rep.same_rounds + 1}"
            lines.append(
                f"{rep.id} {rep.method}: {rep.same_rounds}/{rep.rounds} rounds the same "
                f"({state}); verify {rep.recorded_verify_s:.2f} s measured, "
                f"{rep.curve_verify_s:.2f} s by the curve ({rep.cost_error:+.1%})"
            )
    return lines or ["no bench artifact with logged rounds to check"]


def _record(args: argparse.Namespace) -> int:
    from specdec.backends import load_model
    from specdec.study.run.bench_settings import parse_categories, select_prompts

    if args.target is None:
        raise ValueError("--record needs --target SPEC (the model whose outputs to record)")
    check_int("--max-new-tokens", args.max_new_tokens, 1)
    if args.prompts is not None:
        check_int("--prompts", args.prompts, 1)
    cli_args.check_threads(args.threads)
    prompts = select_prompts(parse_categories(args.category), args.prompts)
    target = load_model(args.target, n_threads=args.threads)
    try:
        drafter = None if args.target_only else "prediction"
        rp.record(target, prompts, args.max_new_tokens, args.record, drafter)
    finally:
        target.close()
    print(f"wrote {args.record}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.record is not None:
        return _record(args)
    if not args.inputs or args.curve is None:
        raise ValueError("give the recorded outputs (FILE ...) and --curve MICROBENCH_JSON")
    check_int("--k-max", args.k_max, 1)
    if args.draft_cost < 0:
        raise ValueError(f"--draft-cost must be >= 0, got {args.draft_cost}")
    curve = rp.load_curve(args.curve)
    tasks = _load(args)
    if not tasks:
        raise ValueError("no recorded outputs in the inputs")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    results = rp.run_policies(
        tasks, args.drafter, policies, curve, args.k_max, args.draft_cost, args.fresh
    )
    print(f"drafter {args.drafter}, curve {curve.source}, {len(tasks)} outputs, decode phase:")
    print(rp.format_table(results, tasks))
    if args.check:
        print("\n".join(_check(args.inputs, curve, _tokenizer(args))))
    if args.json:
        config = {
            "inputs": args.inputs,
            "curve": args.curve,
            "method": args.method,
            "drafter": args.drafter,
            "policies": policies,
            "k_max": args.k_max,
            "draft_cost": args.draft_cost,
            "fresh": args.fresh,
        }
        write_json(args.json, rp.to_artifact(results, tasks, config))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
