"""`specdec bench`: bench and sweep: throughput of target-only vs speculative decoding."""

from __future__ import annotations

import argparse

from specdec.cli import args as cli_args
from specdec.core.checks import check_int
from specdec.core.config import SpecConfig, Warp
from specdec.study.engines import anchors, endpoint
from specdec.study.present.tables import format_table
from specdec.study.run import prompts as prompt_set
from specdec.study.run.bench import run_bench
from specdec.study.run.bench_settings import (
    CATEGORIES,
    COMPARES,
    CONFIGS,
    BenchConfig,
    Peers,
    bench_config,
    parse_categories,
    select_prompts,
    tag_suffix,
)
from specdec.study.run.sweep import format_sweep_table, run_sweep

#: The K values of `specdec sweep` when -k is not given (the paper's Table 4).
DEFAULT_SWEEP_KS = (1, 2, 4, 6, 8, 10, 12)


def _k_list(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"every K must be an integer >= 1, got {text!r}")
    return ks


def _add_common(p: argparse.ArgumentParser, prompts: int, max_new: int, out: str) -> None:
    n = len(prompt_set.load_prompts())
    p.add_argument(
        "--config",
        metavar="NAME",
        default=None,
        help=f"named pair: {', '.join(CONFIGS)} (str; required unless --draft and --target)",
    )
    p.add_argument(
        "--draft",
        metavar="SPEC",
        default=None,
        help="draft model BACKEND:NAME_OR_PATH for a custom pair (str; default off)",
    )
    p.add_argument(
        "--target",
        metavar="SPEC",
        default=None,
        help="target model BACKEND:NAME_OR_PATH for a custom pair (str; default off)",
    )
    cli_args.add_sampling_args(p, seed=False, max_new_tokens=False)
    p.add_argument(
        "--category",
        default=None,
        metavar="NAME[,NAME...]",
        help=f"run only the prompts of these categories: {', '.join(CATEGORIES)} "
        "(comma-separated str; default: all)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"prompts to run, the first N of the set (of the --category prompts, in file "
        f"order, when given), 1..{n} (int; default {prompts}, or all the --category prompts "
        "when fewer)",
    )
    p.set_defaults(default_prompts=prompts)
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="leading prompts run but not recorded, 0 <= W < prompts (int; default 2)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new,
        help=f"tokens generated per prompt, >= 1 (int; default {max_new})",
    )
    p.add_argument(
        "--out",
        default=out,
        metavar="DIR",
        help=f"directory for the JSON artifacts (path; default {out})",
    )
    cli_args.add_device_args(
        p, threads=False, device_help="cpu, cuda or mps (str; default: best available)"
    )
    cli_args.add_tag_arg(
        p, "suffix for the artifact file names, [A-Za-z0-9_.-] (str; default none)"
    )
    cli_args.add_deterministic_arg(p)
    cli_args.add_no_progress_arg(p)


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="baseline vs speculative throughput on the prompt set (paper, Table 3)"
    )
    _add_common(p, prompts=30, max_new=128, out="results/")
    cli_args.add_spec_args(
        p,
        k_help="draft tokens per round: an int >= 1, 'auto' or 'schedule' (default 4)",
        drafter_default="model",
        drafter_help="the speculative method's drafter: model, lookup (prompt lookup, no draft "
        "model), composite or prediction (each prompt's prediction, e.g. the file a rewrite "
        "task re-emits; prompts without one use lookup) (str; default model)",
        p_min_help="draft confidence cutoff in [0, 1) (float; default off)",
    )
    p.add_argument(
        "--variants",
        default="",
        metavar="DRAFTER:K,...",
        help="more speculative methods on the same prompts, e.g. model:auto,lookup:auto; "
        "DRAFTER may also be wrong-prediction (the prediction drafter given another task's "
        "file) (comma-separated; default none)",
    )
    p.add_argument(
        "--compare",
        choices=COMPARES,
        default=None,
        help="also run, on the same prompts: hf-assisted (transformers' assisted generation; hf "
        "models on both sides) or llama-server (llama.cpp's own server, built by `specdec "
        "anchors build`, in the --llama-server-modes) (str; default off)",
    )
    p.add_argument(
        "--llama-server-modes",
        default=",".join(anchors.DEFAULT_MODES),
        metavar="MODE,...",
        help=f"with --compare llama-server: {', '.join(anchors.SERVER_MODES)}, or lookup "
        f"(llama-lookup, one process per prompt); twin-<mode> runs a mode on the 'same "
        f"kernels' twin (specdec anchors build --twin), ik-<mode> on ik_llama.cpp (specdec "
        f"anchors build --peer ik) (comma-separated; default "
        f"{','.join(anchors.DEFAULT_MODES)}; settings are llama.cpp's defaults)",
    )
    _add_endpoint_args(p)
    p.set_defaults(func=_cmd_bench)

    s = subparsers.add_parser(
        "sweep", help="bench at several K, each against its own baseline (paper, Table 4)"
    )
    _add_common(s, prompts=10, max_new=96, out="results/sweep")
    default_ks = ",".join(map(str, DEFAULT_SWEEP_KS))
    s.add_argument(
        "-k",
        "--k",
        type=_k_list,
        default=list(DEFAULT_SWEEP_KS),
        metavar="K,K,...",
        help=f"speculation lengths, each >= 1 (comma-separated ints; default {default_ks})",
    )
    s.set_defaults(func=_cmd_sweep)


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    """bench's servers: --endpoint and its kin, --serve, and --concurrency (the load test)."""
    e = p.add_argument_group(
        "endpoints",
        "measure an OpenAI-compatible server (vLLM, SGLang, llama-server, specdec "
        f"serve) instead of the in-process methods; API key from ${endpoint.API_KEY_ENV}",
    )
    e.add_argument(
        "--endpoint",
        metavar="URL",
        default=None,
        help="the speculative method is this server, e.g. http://127.0.0.1:8000 (str; default off)",
    )
    e.add_argument(
        "--endpoint-baseline",
        metavar="URL",
        default=None,
        help="the baseline is this server (default: target-only in-process on --target) (str)",
    )
    e.add_argument(
        "--endpoint-model",
        metavar="NAME",
        default=None,
        help="the requests' model field (str; default: the first of the server's /v1/models)",
    )
    e.add_argument(
        "--endpoint-api",
        choices=endpoint.APIS,
        default="chat",
        help="chat: /v1/chat/completions with the prompt as the user turn; completions: "
        "/v1/completions with the raw prompt (str; default chat)",
    )
    e.add_argument(
        "--serve",
        action="store_true",
        help="run the baseline and the speculative method through `specdec serve` processes "
        "the bench starts on loopback (target-only, and the run's drafter and K; prompt cache "
        "off), warm like the --compare llama-server servers beside them (flag; default off)",
    )
    e.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="C",
        help="with --serve: send the prompts C at a time, each method on a fresh server that "
        "serves them at once (specdec serve --parallel C, llama-server -np C) and, for specdec, "
        "one that serves them in turn (--parallel 1); with --endpoint: C at a time to that "
        "running server (a load test). Reports each method's tokens/s, latency and time to "
        "first token p50/p95, errors and acceptance; --prompts a multiple of C "
        "(study/run/together.py; int >= 2; default 1: the per-prompt protocol)",
    )
    e.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --concurrency: runs of every method, the order reversed on every other "
        "(int >= 1; default 1)",
    )


def _config_from(args: argparse.Namespace, k: int | str, compare: str | None) -> BenchConfig:
    categories = parse_categories(args.category)
    n_prompts = args.prompts
    if n_prompts is None:  # the default, capped at what the categories hold
        n_prompts = min(args.default_prompts, len(select_prompts(categories)))
    spec, variants, peers = SpecConfig("model", k), (), Peers()  # the sweep's
    if hasattr(args, "drafter"):  # bench only; the sweep is the draft model at fixed K
        spec = SpecConfig(**{**cli_args.spec_options(args), "k": k})
        variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        modes: tuple[str, ...] = ()
        if compare == "llama-server":
            modes = tuple(m.strip() for m in args.llama_server_modes.split(",") if m.strip())
        peers = Peers(
            compare=compare,
            endpoint=args.endpoint,
            endpoint_baseline=args.endpoint_baseline,
            endpoint_model=args.endpoint_model,
            endpoint_api=args.endpoint_api,
            llama_server=modes,
            served=getattr(args, "serve", False),
        )
    return bench_config(
        args.config,
        args.draft,
        args.target,
        spec=spec,
        warp=Warp(**cli_args.warp_options(args)),
        n_prompts=n_prompts,
        warmup=args.warmup,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        deterministic=args.deterministic,
        variants=variants,
        categories=categories,
        peers=peers,
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    cfg = _config_from(args, args.k, args.compare)
    tag_suffix(args.tag)  # validate before loading models
    if args.concurrency != 1:
        from specdec.study.run import together

        check_int("--repeats", args.repeats, 1)
        record = together.run_together(
            cfg, args.concurrency, args.out, args.repeats, args.tag, not args.no_progress
        )
        print(together.format_table(record))
        print(f"wrote {record['path']}")
        return 0
    art = run_bench(cfg, args.out, progress=not args.no_progress, tag=args.tag)
    print(format_table(art))
    print(f"wrote {art.path}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    cfg = _config_from(args, args.k[0], None)
    tag_suffix(args.tag)
    summary = run_sweep(cfg, args.k, args.out, progress=not args.no_progress, tag=args.tag)
    print(format_sweep_table(summary))
    print(f"wrote {summary.path}")
    return 0
