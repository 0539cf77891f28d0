"""`specdec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from specdec.cli import args as cli_args
from specdec.serve.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    ServeConfig,
)
from specdec.serve.connections import DEFAULT_WRITE_TIMEOUT_S
from specdec.serve.draft_pools import (
    DEFAULT_POOL_SCOPES,
    DEFAULT_POOL_TOKENS,
    MAX_POOL_TOKENS,
    MIN_POOL_TOKENS,
    POOL_MODES,
    pool_memory_bytes,
)
from specdec.serve.job_queue import DEFAULT_MAX_QUEUE
from specdec.serve.launch import serve
from specdec.serve.prompt_store import DEFAULT_CACHE_RAM_MIB
from specdec.serve.scheduler import PREFILL_SHARE

#: The environment variable read for the API key when neither flag gives one.
API_KEY_ENV = "SPECDEC_API_KEY"


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat + completions)")
    cli_args.add_model_args(
        p,
        target_help="target model, BACKEND:NAME_OR_PATH (str; e.g. llamacpp:smollm2-135m); "
        "also the model id clients send",
        draft_default=None,
        draft_help="draft model SPEC, or none (str; default none: target-only unless --drafter "
        "lookup)",
    )
    cli_args.add_spec_args(
        p,
        k_default=None,  # None: serve.speculation.DEFAULT_K
        k_help="default draft tokens per round: an int >= 1, 'auto' (K in 0..--k-max from "
        "measured costs; 0 where drafting cannot pay) or 'schedule' (default auto; a request's "
        "speculation.k overrides it)",
        k_max_default=None,
        k_max_help="default largest K for -k auto|schedule (int >= 1; default 8 with a draft "
        "model, 64 for lookup and prediction; a request's speculation.k_max overrides it)",
        drafter_help="default drafter: model (needs --draft), lookup (prompt lookup), composite "
        "(lookup, else the draft model; needs --draft) or prediction (a request's `prediction`, "
        "else lookup) (default: model when --draft is given; else a request's `prediction` "
        "when it has one, and none otherwise). A request's speculation.drafter overrides it "
        "(none, lookup, prediction; model and composite with --draft); a request's "
        "`prediction` is drafted from first with any drafter but none",
        p_min_help="stop drafting below this draft top probability, in [0, 1) (float; default off)",
    )
    cli_args.add_device_args(p)
    cli_args.add_deterministic_arg(p)
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--prompt-cache",
        dest="prompt_cache",
        action="store_true",
        default=None,
        help="keep the KV of the prefix shared with the previous request, in whole blocks of "
        "16 tokens, as llama-server's cache_prompt (flag; default: on only where the output "
        "cannot depend on it: a batch-invariant target, as the default models are with specdec's "
        "kernels; see docs/serving.md)",
    )
    cache.add_argument(
        "--no-prompt-cache",
        dest="prompt_cache",
        action="store_false",
        help="prefill every prompt from scratch (flag)",
    )
    p.add_argument(
        "--cache-ram",
        type=int,
        default=DEFAULT_CACHE_RAM_MIB,
        metavar="MiB",
        help="keep slots' caches in RAM, up to this many MiB, and restore the one that shares "
        "the longest prefix with a later request of its API key, as llama-server's --cache-ram "
        f"(int >= 0, 0: off; default {DEFAULT_CACHE_RAM_MIB}, llama-server's)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (str; default 127.0.0.1, loopback only)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (int; default 8000)")
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
    p.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host header name to serve, repeatable; '*' for any (str; default: localhost, "
        "127.0.0.1 and ::1 when bound to loopback, else any). Guards against DNS rebinding",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting for the engine before 429 (int >= 1; default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--parallel",
        "-np",
        type=int,
        default=1,
        metavar="N",
        help="requests generated at once, each in a slot with a KV cache of its own, one target "
        "pass a round for all of them (llama-server's -np; int >= 1; default 1; llamacpp: and "
        "mock: models)",
    )
    p.add_argument(
        "--ctx-size",
        "-c",
        type=int,
        default=None,
        metavar="N",
        help="tokens of context per request (llama-server's -c per slot; int >= 16; default: "
        "the backend's, 4096 for llama.cpp): a prompt plus max_tokens must fit; each --parallel "
        "slot holds a KV cache this long",
    )
    p.add_argument(
        "--prefill-share",
        type=float,
        default=PREFILL_SHARE,
        metavar="S",
        help="with --parallel: a cycle's prompt prefill may cost S times its round of the "
        "running requests; lower keeps their streams smoother, higher starts new prompts "
        f"sooner (float > 0; default {PREFILL_SHARE:g}: a stream waits about two rounds)",
    )
    p.add_argument(
        "--max-running-per-key",
        type=int,
        default=None,
        metavar="N",
        help="requests of one API key generated at once, of the --parallel slots (int >= 1; "
        "default: every slot with one key, half of them with several)",
    )
    p.add_argument(
        "--max-queue-per-key",
        type=int,
        default=None,
        metavar="N",
        help="requests of one API key waiting before 429; the keys' requests then take turns "
        "(int >= 1; default: --max-queue with one key, half of it with several)",
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
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client may take to send a request's body, else 408 (float > 0; "
        f"default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"connections open at once, else 503 (int >= 1; default {DEFAULT_MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        metavar="N",
        help="connections open at once from one client address, else 503 (int >= 1; default "
        "half of --max-connections). Behind a reverse proxy every client has its address: set "
        "it to --max-connections there",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=DEFAULT_WRITE_TIMEOUT_S,
        help="seconds a response may wait for its client to read any of it before the "
        f"connection is reset (float > 0; default {DEFAULT_WRITE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="engines serving at once, each a Ray Serve replica with its own slots, prompt "
        "cache and draft pools (--threads each); a request goes to the replica that served its "
        "API key and prompt prefix last (int >= 1; default 1: one process, no Ray; needs "
        "specdec[cluster]; docs/serving.md)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (ray start --head's address) instead of starting one on "
        "this machine; its replicas may run on any of its nodes",
    )
    _add_pool_args(p)
    p.set_defaults(func=_cmd_serve)


def _add_pool_args(p: argparse.ArgumentParser) -> None:
    mib = pool_memory_bytes(DEFAULT_POOL_TOKENS) / (1 << 20)
    p.add_argument(
        "--draft-pool",
        choices=POOL_MODES,
        default="key",
        help="prompt lookup also drafts from earlier requests' prompts and outputs, kept in a "
        "bounded pool: key, one pool per API key (requests without a key, on a server without "
        "keys, share one); shared, one pool for all (a client can then learn through speed "
        "whether its text matches another key's); off (default key; docs/api-extensions.md)",
    )
    p.add_argument(
        "--draft-pool-tokens",
        type=int,
        default=DEFAULT_POOL_TOKENS,
        metavar="N",
        help=f"tokens each pool holds, the oldest evicted first (int in [{MIN_POOL_TOKENS}, "
        f"{MAX_POOL_TOKENS}]; default {DEFAULT_POOL_TOKENS}). A pool allocates 36 bytes a "
        f"token at a power of two, up to 68 just above one: {mib:g} MiB at the default, all "
        "of it when its key sends its first request",
    )
    p.add_argument(
        "--draft-pool-scopes",
        type=int,
        default=DEFAULT_POOL_SCOPES,
        metavar="N",
        help="pools held at once with --draft-pool key, the least recently used dropped "
        f"first (int in [1, 65536]; default {DEFAULT_POOL_SCOPES}, and never more than the API "
        f"keys): at most N x a pool's memory, {DEFAULT_POOL_SCOPES * mib:g} MiB with the defaults",
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    lows = (("max_queue", 1), ("parallel", 1), ("max_body_bytes", 1), ("threads", 1), ("port", 0),
            ("ctx_size", 16), ("replicas", 1))  # fmt: skip
    per = (("max_queue_per_key", 1), ("max_running_per_key", 1), ("max_connections_per_client", 1))
    for name, low in (*lows, ("max_connections", 1), *per):
        v = getattr(args, name)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    for name in ("request_timeout", "body_timeout", "write_timeout", "prefill_share"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    cfg = ServeConfig(
        target=args.target,
        draft=cli_args.draft_spec(args.draft),
        **cli_args.spec_options(args),
        device=args.device,
        threads=args.threads,
        host=args.host,
        port=args.port,
        api_keys=resolve_api_keys(args.api_key, args.api_key_file, args.api_keys_file, os.environ),
        metrics_key=_metrics_key(args.metrics_key_file),
        allowed_hosts=tuple(args.allowed_host or ()),
        max_queue=args.max_queue,
        parallel=args.parallel,
        max_running_per_key=args.max_running_per_key,
        max_queue_per_key=args.max_queue_per_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        deterministic=args.deterministic,
        prompt_cache=args.prompt_cache,
        cache_ram=args.cache_ram,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        write_timeout=args.write_timeout,
        prefill_share=args.prefill_share,
        ctx_size=args.ctx_size,
        draft_pool=args.draft_pool,
        draft_pool_tokens=args.draft_pool_tokens,
        draft_pool_scopes=args.draft_pool_scopes,
        replicas=args.replicas,
        ray_address=args.ray_address,
    )
    if cfg.replicas > 1 or cfg.ray_address:  # Ray Serve; one process never imports Ray
        from specdec.serve.cluster import serve_cluster

        return serve_cluster(cfg)
    return serve(cfg)


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
