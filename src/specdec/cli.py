"""`specdec` command line.

Each subcommand is a pair: `_add_<name>(subparsers)` declares it and sets `func=_cmd_<name>`;
`_cmd_<name>(args) -> int` runs it. Add new ones to `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from specdec import bench, cli_args, figures, gate, microbench, registry, server
from specdec.cli_args import k_value  # noqa: F401  (re-exported: `specdec.cli.k_value`)

_SHA_PREFIX = 12
_EXIT_ERROR = 2
_EXIT_NOT_FETCHED = 1
_EXIT_INTERRUPTED = 130  # shell convention: 128 + SIGINT


def _error(msg: str, code: int = _EXIT_ERROR) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return code


def _add_models(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list, fetch and locate the registry's GGUF models")
    p.set_defaults(func=_cmd_models, models_parser=p)
    sub = p.add_subparsers(dest="models_cmd", metavar="{list,fetch,path}")
    sub.add_parser("list", help="table of known models and whether each is in the cache")
    f = sub.add_parser("fetch", help="download, assemble and verify models into the cache")
    f.add_argument("names", nargs="*", metavar="NAME", help="model names (str, repeatable)")
    f.add_argument("--all", action="store_true", help="fetch every known model (flag; default off)")
    f.add_argument(
        "--force", action="store_true", help="re-download even if cached (flag; default off)"
    )
    f.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar (flag; default off)"
    )
    pp = sub.add_parser("path", help="print the cached file of a fetched model")
    pp.add_argument("name", metavar="NAME", help="model name (str)")


def _cmd_models(args: argparse.Namespace) -> int:
    if args.models_cmd == "list":
        rows = [("NAME", "FETCHED", "SIZE", "SHA256", "DESCRIPTION")]
        for e in registry.MODELS.values():
            fetched = "yes" if registry.is_fetched(e.name) else "no"
            size = f"{e.size_hint_mb} MiB"
            rows.append((e.name, fetched, size, e.sha256[:_SHA_PREFIX], e.description))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        print(f"cache: {registry.specdec_home() / 'models'}")
        return 0
    if args.models_cmd == "fetch":
        if args.all == bool(args.names):
            return _error("give model NAMEs or --all (not both)")
        for name in list(registry.MODELS) if args.all else args.names:
            path = registry.fetch(name, progress=not args.no_progress, force=args.force)
            print(f"{name}: {path}")
        return 0
    if args.models_cmd == "path":
        if not registry.is_fetched(args.name):  # raises ModelFetchError for unknown names
            return _error(
                f"model {args.name!r} is not fetched; run `specdec models fetch {args.name}`",
                _EXIT_NOT_FETCHED,
            )
        print(registry.cached_path(args.name))
        return 0
    args.models_parser.print_help(sys.stderr)
    return _EXIT_ERROR


# ------------------------------------------------------------------------------ generate
def _add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument(
        "--target",
        required=True,
        metavar="SPEC",
        help="target model, BACKEND:NAME_OR_PATH (str; e.g. llamacpp:qwen2.5-coder-1.5b)",
    )
    if draft:
        p.add_argument(
            "--draft",
            default="none",
            metavar="SPEC",
            help="draft model SPEC, or 'none' for target-only decoding (str; default none)",
        )
    cli_args.add_device_args(p, threads=False)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    cli_args.add_spec_args(p)
    cli_args.add_sampling_args(p)


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text, streaming it, then print stats")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="feed PROMPT raw instead of as a chat user turn (flag; default off)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (tokens, text, stats) instead of streaming (flag)",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the user message (str)")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import json
    import time

    from specdec import prompting
    from specdec.decode import stream
    from specdec.models import load_model

    target = load_model(args.target, device=args.device)
    draft = None if args.draft.lower() == "none" else load_model(args.draft, device=args.device)
    tok = target.tokenizer if target.tokenizer is not None else getattr(draft, "tokenizer", None)
    prompt_ids = prompting.encode(tok, args.prompt, chat=not args.no_chat)
    t0 = time.perf_counter()
    s = stream(target, prompt_ids, draft=draft, drafter=args.drafter, k=args.k, k_max=args.k_max,
               p_min=args.p_min, max_new_tokens=args.max_new_tokens,
               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
               seed=args.seed, stop_ids=prompting.stop_ids(tok))  # fmt: skip
    out: list[int] = []
    shown = ""
    for chunk in s:
        out += chunk
        if not args.json:
            text = prompting.decode(tok, out)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[len(shown) :], end="", flush=True)
                shown = text
    wall = time.perf_counter() - t0
    assert s.result is not None
    st = s.result.stats
    if args.json:
        print(json.dumps({
            "prompt_tokens": len(prompt_ids), "tokens": out,
            "text": prompting.decode(tok, out), "stop_reason": s.result.stop_reason,
            "wall_s": wall, "stats": st.to_dict(),
        }))  # fmt: skip
        return 0
    print(prompting.decode(tok, out)[len(shown) :])
    pos = " ".join(f"{a:.0%}" for a in st.positional_acceptance)
    spec = (f" | accepted {st.accepted}/{st.drafted} ({st.acceptance_rate:.1%}), by position "
            f"[{pos}], {st.tokens_per_round:.2f} tokens/round") if st.drafted else ""  # fmt: skip
    print(f"-- {st.generated} tokens in {st.wall_s:.2f} s ({st.tokens_per_s:.1f} tok/s), "
          f"TTFT {st.ttft_s:.3f} s{spec}", file=sys.stderr)  # fmt: skip
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_models, _add_generate]


#: Harness modules that declare their own subcommands with `add_cli(subparsers)`; each sets
#: `func` on its parser, like the pairs above.
_HARNESS_MODULES = (bench, microbench, gate, figures, server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec", description="Lossless speculative decoding and its measurement harness."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    for mod in _HARNESS_MODULES:
        mod.add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and usage errors; callers want a code
        return e.code if isinstance(e.code, int) else _EXIT_ERROR
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return _EXIT_ERROR
    try:
        return args.func(args)
    except (registry.ModelFetchError, ValueError) as e:  # bad input: name it, no traceback
        return _error(str(e))
    except KeyboardInterrupt:
        return _error("interrupted", _EXIT_INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(main())
