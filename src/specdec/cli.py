"""`specdec` command line.

Each subcommand is a pair: `_add_<name>(subparsers)` declares it and sets `func=_cmd_<name>`;
`_cmd_<name>(args) -> int` runs it. Add new ones to `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from specdec import registry

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


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_models]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec", description="Lossless speculative decoding and its measurement harness."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
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
    except registry.ModelFetchError as e:
        return _error(str(e))
    except KeyboardInterrupt:
        return _error("interrupted", _EXIT_INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(main())
