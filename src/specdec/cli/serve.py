"""`specdec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from specdec.cli import args as cli_args
from specdec.serve.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_REQUEST_TIMEOUT_S,
    ServeConfig,
    serve,
)


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat + completions)")
    p.add_argument(
        "--target",
        required=True,
        metavar="SPEC",
        help="target model, BACKEND:NAME_OR_PATH (str; e.g. llamacpp:smollm2-135m); "
        "also the model id clients send",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="SPEC",
        help="draft model SPEC, or none (str; default none: target-only unless --drafter lookup)",
    )
    cli_args.add_spec_args(
        p,
        k_default=None,  # None: the engine's defaults
        k_help="draft tokens per round: an int >= 1, 'auto' or 'schedule' "
        "(default: the engine's, 4)",
        k_max_default=None,
        k_max_help="largest K for -k auto|schedule (int >= 1; default: the engine's, 8)",
        drafter_help="model (needs --draft), lookup (prompt lookup, no draft model) or "
        "composite (default: model when --draft is given, else none)",
        p_min_help="stop drafting below this draft top probability, in [0, 1) (float; default off)",
    )
    cli_args.add_device_args(
        p,
        threads_help="CPU threads per model (int >= 1; default: all cores; on a shared "
        "machine fewer is much faster for llama.cpp)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (str; default 127.0.0.1, loopback only)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (int; default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (str; default none)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting for the engine before 429 (int >= 1; default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body, else 413 (int; default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds from arrival (queue wait included) before a request fails with "
        f"504 (float > 0; default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    for name, low in (("max_queue", 1), ("max_body_bytes", 1), ("threads", 1), ("port", 0)):
        v = getattr(args, name)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    draft = None if args.draft is None or args.draft.lower() == "none" else args.draft
    serve(
        ServeConfig(
            target=args.target,
            draft=draft,
            drafter=args.drafter,
            k=args.k,
            k_max=args.k_max,
            p_min=args.p_min,
            device=args.device,
            threads=args.threads,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            request_timeout=args.request_timeout,
        )
    )
    return 0
