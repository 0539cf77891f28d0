"""`specdec gate`: the level-3 exactness gate on real models."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.cli import args as cli_args
from specdec.cli.args import EXIT_FAILED, EXIT_INTERRUPTED
from specdec.study.engines.endpoint import API_KEY_ENV, APIS
from specdec.study.run.gate import (
    MIN_PROMPTS,
    QUICK,
    GateSettings,
    build_artifact,
    format_summary,
    run_endpoint_gate,
    run_gate,
)


def add(subparsers: argparse._SubParsersAction) -> None:
    d = GateSettings()
    p = subparsers.add_parser(
        "gate", help="level-3 exactness gate: speculative vs target-only on real models"
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="NAME",
        help="named draft -> target configuration (str; e.g. smoke, all_gguf; required unless "
        "--endpoint, where it names the tokenizer: its target's)",
    )
    e = p.add_argument_group(
        "endpoints",
        "gate an OpenAI-compatible server against another (e.g. the same engine without "
        "speculation): answers are tokenized with the target's tokenizer; API key from "
        f"${API_KEY_ENV}",
    )
    e.add_argument("--endpoint", metavar="URL", default=None, help="the server under test (str)")
    e.add_argument(
        "--endpoint-baseline", metavar="URL", default=None, help="the reference server (str)"
    )
    e.add_argument(
        "--endpoint-model",
        metavar="NAME",
        default=None,
        help="the requests' model field (str; default: each server's first /v1/models id)",
    )
    e.add_argument(
        "--endpoint-api",
        choices=APIS,
        default="chat",
        help="chat or completions (str; default chat)",
    )
    e.add_argument(
        "--tokenizer",
        metavar="SPEC",
        default=None,
        help="model spec whose tokenizer reads the answers (str; default the --config target)",
    )
    e.add_argument(
        "--llama-server",
        metavar="MODE",
        default=None,
        help="gate llama.cpp's own server: llama-server in MODE (ngram-mod, draft, ...: "
        "study.engines.anchors.SERVER_MODES; twin-<mode>, ik-<mode> on those builds) against "
        "the same build without speculation, both started here on the --config pair (built by "
        "`specdec anchors build`) (str; default off)",
    )
    e.add_argument(
        "--category",
        default=None,
        metavar="NAME[,NAME...]",
        help="draw the prompts from these categories only, e.g. code_editing (str; default all)",
    )
    cli_args.add_tag_arg(
        e, help="artifact name gate_endpoint_<tag>.json, [A-Za-z0-9_.-] (str; default 'endpoint')"
    )
    cli_args.add_device_args(p)
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"sampled-leg prompts, {MIN_PROMPTS}..100 (int; default {d.prompts})",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"sampled-leg tokens per prompt, >= 1 (int; default {d.max_new_tokens})",
    )
    p.add_argument(
        "-t",
        "--temperature",
        type=float,
        default=None,
        help=f"sampled-leg temperature, > 0 (float; default {d.temperature})",
    )
    p.add_argument(
        "-k",
        "--k",
        type=int,
        default=None,
        help=f"draft tokens per round, >= 1 (int; default {d.k})",
    )
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=None,
        help=f"greedy-leg prompts, 0..100 (int; default {d.greedy_prompts})",
    )
    p.add_argument(
        "--greedy-tokens",
        type=int,
        default=None,
        help=f"greedy-leg max tokens, >= 1 (int; default {d.greedy_tokens})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"CI sizes: {QUICK.prompts} x {QUICK.max_new_tokens} sampled, "
        f"{QUICK.greedy_prompts} x {QUICK.greedy_tokens} greedy; explicit "
        "size flags still win (flag; default off)",
    )
    cli_args.add_out_arg(p, "gate_<config>.json")
    cli_args.add_deterministic_arg(p)
    cli_args.add_no_progress_arg(p, help="hide the progress bars (flag; default off)")
    p.set_defaults(func=_cmd_gate)


def _settings(args: argparse.Namespace) -> GateSettings:
    base = QUICK if args.quick else GateSettings()
    given = {name: getattr(args, name) for name in asdict(base)}  # None = flag not given
    s = GateSettings(**{**asdict(base), **{k: v for k, v in given.items() if v is not None}})
    if s.prompts < MIN_PROMPTS:
        raise ValueError(
            f"--prompts must be >= {MIN_PROMPTS}: with fewer, the permutation test "
            "cannot reach p <= 0.01, so the gate could not fail"
        )
    if s.max_new_tokens < 1 or s.greedy_tokens < 1 or s.greedy_prompts < 0 or s.k < 1:
        raise ValueError(
            "--max-new-tokens, --greedy-tokens and -k must be >= 1, --greedy-prompts >= 0"
        )
    cli_args.check_threads(args.threads)
    if s.temperature <= 0:
        raise ValueError(f"the sampled leg needs a temperature > 0, got {s.temperature}")
    return s


def _token_label(tokenizer: Any, token_id: int) -> str:
    """The token's text, quoted so leading spaces and newlines stay visible (e.g. "' the'")."""
    if tokenizer is None:
        return str(token_id)
    return repr(tokenizer.decode([token_id], skip_special_tokens=False))


def _cmd_gate(args: argparse.Namespace) -> int:
    from specdec.backends import chat as prompting
    from specdec.backends.configs import resolve_config
    from specdec.study.artifacts import write_json
    from specdec.study.artifacts.provenance import model_block
    from specdec.study.run import prompts as prompt_set

    settings = _settings(args)
    if args.llama_server is not None:
        return _cmd_llama_server_gate(args, settings)
    if args.endpoint is not None or args.endpoint_baseline is not None:
        return _cmd_endpoint_gate(args, settings)
    if args.category is not None:
        raise ValueError("--category applies to endpoint gates (--endpoint, --llama-server)")
    if args.config is None:
        raise ValueError("give --config NAME (or --endpoint URL --endpoint-baseline URL)")
    cfg = resolve_config(args.config)
    prompts = prompt_set.load_prompts()
    need = max(settings.prompts, settings.greedy_prompts)
    if need > len(prompts):
        raise ValueError(f"the gate needs {need} prompts; the vendored set has {len(prompts)}")
    try:
        target, draft = cli_args.load_pair(args, cfg.target, cfg.draft)
        tok = target.tokenizer
        ids = [(p.id, prompting.encode(tok, p.text)) for p in prompts[:need]]
        greedy = [(p.id, prompting.encode(tok, p.text)) for p in _greedy_prompts(prompts, settings)]
        result = run_gate(
            target,
            draft,
            ids,
            settings,
            stop_ids=prompting.stop_ids(tok),
            label=lambda t: _token_label(tok, t),
            progress=not args.no_progress,
            greedy_prompts=greedy,
        )
    except KeyboardInterrupt:
        # A partial sample is not the sample the test was sized for: write nothing.
        print(
            "\ngate interrupted: no artifact written (rerun to completion for a verdict)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    config = {
        "name": cfg.name,
        "draft": cfg.draft,
        "target": cfg.target,
        "quick": args.quick,
        "threads": args.threads,
        "deterministic": args.deterministic,
        "greedy_prompt_ids": [pid for pid, _ in greedy],
        **asdict(settings),
    }
    models = {"draft": model_block(cfg.draft, draft), "target": model_block(cfg.target, target)}
    art = build_artifact(config, models, result)
    mode = "_deterministic" if args.deterministic else ""
    out = Path(args.out) / f"gate_{cfg.name}{mode}.json"
    write_json(out, art)
    print(format_summary(art))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if art.passed else EXIT_FAILED


def _greedy_prompts(prompts: list, settings: GateSettings) -> list:
    """The greedy leg's prompts: the first greedy_prompts - 1 of the set plus the longest
    whole-file rewrite (r028, 3.1k characters of YAML), so the leg covers long cache lengths,
    where attention and matmul kernels change path. A leg of one prompt, or a set
    without rewrite tasks, takes the first prompts."""
    n = settings.greedy_prompts
    rewrites = [p for p in prompts if p.category == "rewrite"]
    long = max(rewrites, key=lambda p: len(p.text), default=None)
    if n < 2 or long is None:
        return prompts[:n]
    return [*prompts[: n - 1], long]


def _cmd_llama_server_gate(args: argparse.Namespace, settings: GateSettings) -> int:
    """llama-server in a speculative mode against the same build without speculation, on the
    --config pair."""
    from specdec.backends.configs import resolve_config
    from specdec.study.engines import anchors

    if args.endpoint is not None or args.endpoint_baseline is not None:
        raise ValueError("--llama-server starts both servers itself: drop --endpoint*")
    if args.config is None:
        raise ValueError("--llama-server needs --config NAME (the pair llama-server runs)")
    cfg = resolve_config(args.config)
    mode = args.llama_server
    servers = anchors.servers_for([mode, anchors.plain_mode(mode)], cfg.target, cfg.draft)
    with anchors.servers(servers):
        eps = [s.endpoint() for s in servers]
        extra = {"llama_server": mode, "servers": [s.describe() for s in servers]}
        return _endpoint_gate(args, settings, eps, cfg.target, tag=args.tag or mode, extra=extra)


def _cmd_endpoint_gate(args: argparse.Namespace, settings: GateSettings) -> int:
    """The gate between two servers: the same legs, prompts and test as the in-process gate."""
    from specdec.backends.configs import resolve_config
    from specdec.study.engines import endpoint

    if args.endpoint is None or args.endpoint_baseline is None:
        raise ValueError("an endpoint gate needs both --endpoint and --endpoint-baseline")
    spec = args.tokenizer or (resolve_config(args.config).target if args.config else None)
    if spec is None:
        raise ValueError("give --tokenizer SPEC (or --config NAME) to read the answers with")
    key = endpoint.api_key_from_env()
    eps = [
        endpoint.Endpoint(url, args.endpoint_model, args.endpoint_api, key)
        for url in (args.endpoint, args.endpoint_baseline)
    ]
    return _endpoint_gate(args, settings, eps, spec, tag=args.tag or "endpoint")


def _endpoint_gate(
    args: argparse.Namespace,
    settings: GateSettings,
    eps: list[Any],
    tokenizer_spec: str,
    *,
    tag: str,
    extra: dict[str, Any] | None = None,
) -> int:
    """Run both legs between eps[0] (under test) and eps[1] (reference); write the artifact."""
    from specdec.backends import load_tokenizer_of
    from specdec.study.artifacts import write_json
    from specdec.study.engines import endpoint
    from specdec.study.run.bench_settings import parse_categories, select_prompts, tag_suffix

    tag_suffix(tag)  # a name safe in a file name, before any work
    tok = load_tokenizer_of(tokenizer_spec)
    if tok is None:
        raise ValueError(
            f"{tokenizer_spec} has no tokenizer; give --tokenizer a llamacpp: or hf: model"
        )
    prompts = select_prompts(parse_categories(args.category))
    need = max(settings.prompts, settings.greedy_prompts)
    if need > len(prompts):
        raise ValueError(f"the gate needs {need} prompts; the selection has {len(prompts)}")
    texts = [(p.id, p.text) for p in prompts[:need]]
    greedy = [(p.id, p.text) for p in _greedy_prompts(prompts, settings)]
    with endpoint.Client(eps[0]) as under_test, endpoint.Client(eps[1]) as reference:
        try:
            result = run_endpoint_gate(
                under_test,
                reference,
                texts,
                settings,
                tokenizer=tok,
                label=lambda t: _token_label(tok, t),
                progress=not args.no_progress,
                greedy_prompts=greedy,
            )
        except KeyboardInterrupt:
            print("\ngate interrupted: no artifact written", file=sys.stderr)
            return EXIT_INTERRUPTED
    config = {
        "name": tag,
        "endpoint": eps[0].describe(),
        "endpoint_baseline": eps[1].describe(),
        "tokenizer": tokenizer_spec,
        "category": args.category,
        "quick": args.quick,
        "greedy_prompt_ids": [pid for pid, _ in greedy],
        **(extra or {}),
        **asdict(settings),
    }
    art = build_artifact(config, {"draft": None, "target": None}, result)
    out = Path(args.out) / f"gate_endpoint{tag_suffix(tag)}.json"
    write_json(out, art)
    print(format_summary(art))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if art.passed else EXIT_FAILED
