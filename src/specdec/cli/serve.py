"""`specdec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from specdec.serve.config import API_KEY_ENV, ServeConfig, Setting, settings
from specdec.serve.launch import serve


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat + completions)")
    hints = get_type_hints(ServeConfig)
    for f, s in settings():
        if s.cli:
            _add_setting(p, f.name, hints[f.name], f.default, s)
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (str; default: --api-key-file, else "
        f"${API_KEY_ENV}, else none). On the command line the key shows in `ps`: prefer the "
        "file or the variable",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (its first line; path; default none)",
    )
    key.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="accept several API keys, one per line of this file (blank lines and lines "
        "starting with # skipped; path; default none). Each key is a tenant of its own: with "
        "--draft-pool key, its requests draft only from its own earlier requests; its k=auto "
        "statistics and its share of the queue are its own",
    )
    p.add_argument(
        "--metrics-key-file",
        default=None,
        metavar="PATH",
        help="the operator's key for GET /metrics, from this file's first line (path; default "
        "none: the API key of a server with one, and no one's on a server with several, since "
        "the metrics count every key's requests). An API key gets 403 there",
    )
    p.set_defaults(func=_cmd_serve)


def _add_setting(
    p: argparse.ArgumentParser, name: str, kind: Any, default: Any, s: Setting
) -> None:
    """One flag for a ServeConfig field, from its declaration: a bool is a switch, an optional
    bool a --x/--no-x pair, a tuple a repeatable flag; ServeConfig checks the value."""
    kw: dict[str, Any] = {"dest": name, "help": s.help, "metavar": s.metavar}
    if default is MISSING:
        kw["required"] = True
    else:
        kw["default"] = None if isinstance(default, tuple) else default
    if kind is bool:
        kw |= {"action": "store_true"}
        del kw["metavar"]
    elif kind == bool | None:
        kw |= {"action": argparse.BooleanOptionalAction}
        del kw["metavar"]
    elif get_origin(kind) is tuple:
        kw |= {"action": "append", "type": str}
    else:
        parse = s.parse or next(t for t in (int, float, str) if t is kind or t in get_args(kind))
        kw |= {"type": _argparse_type(parse), "choices": s.choices or None}
    p.add_argument(*(s.flags or ("--" + name.replace("_", "-"),)), **kw)


def _argparse_type(parse: Any) -> Any:
    """`parse` with its ValueError's message as argparse's error (argparse would say only
    "invalid value")."""
    if parse in (int, float, str):
        return parse

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = parse.__name__
    return typed


def _cmd_serve(args: argparse.Namespace) -> int:
    flags = {f.name: _field_value(getattr(args, f.name), f.default) for f, s in settings() if s.cli}
    cfg = ServeConfig(
        **flags,
        api_keys=resolve_api_keys(args.api_key, args.api_key_file, args.api_keys_file, os.environ),
        metrics_key=_metrics_key(args.metrics_key_file),
    )
    if cfg.replicas > 1 or cfg.ray_address:  # Ray Serve; one process never imports Ray
        from specdec.serve.cluster import serve_cluster

        return serve_cluster(cfg)
    return serve(cfg)


def _field_value(value: Any, default: Any) -> Any:
    """A flag's value as its field takes it: a repeatable flag's list (None: not given) as the
    tuple its field holds."""
    return tuple(value or ()) if isinstance(default, tuple) else value


def resolve_api_keys(
    flag: str | None, path: str | None, keys_path: str | None, environ: Mapping[str, str]
) -> tuple[str, ...]:
    """Every API key the server accepts: the lines of --api-keys-file, else `resolve_api_key`'s
    one key; () when none is set."""
    if keys_path is None:
        if path is not None and any(line.strip() for line in _lines("--api-key-file", path)[1:]):
            print(
                f"warning: --api-key-file {path} has more than one line and only its first is "
                "the key; for several keys use --api-keys-file",
                file=sys.stderr,
            )
        key = resolve_api_key(flag, path, environ)
        return () if key is None else (key,)
    lines = _lines("--api-keys-file", keys_path)
    keys = tuple(dict.fromkeys(k for k in map(str.strip, lines) if k and not k.startswith("#")))
    if not keys:
        raise ValueError(
            f"--api-keys-file {keys_path} holds no key; write one key per line (lines starting "
            "with # are comments)"
        )
    return keys


def _metrics_key(path: str | None) -> str | None:
    """The operator's key: the first line of --metrics-key-file; None without the flag."""
    if path is None:
        return None
    lines = _lines("--metrics-key-file", path)
    key = lines[0].strip() if lines else ""
    if not key:
        raise ValueError(f"--metrics-key-file {path}: its first line, the key, is empty")
    return key


def _lines(flag: str, path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e})") from None


def resolve_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key: --api-key, else the first line of --api-key-file, else $SPECDEC_API_KEY;
    None (no key required) when none is set. An empty key is refused, not taken as "none"."""
    if flag is not None:
        key, where = flag, "--api-key"
    elif path is not None:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        key, where = (lines[0].strip() if lines else ""), f"--api-key-file {path}"
    elif API_KEY_ENV in environ:
        key, where = environ[API_KEY_ENV].strip(), f"${API_KEY_ENV}"
    else:
        return None
    if not key:
        raise ValueError(f"the API key from {where} is empty")
    return key
