"""`specdec serve`'s process: the models loaded and warmed up (`build_engine`), the operator warned
of risky flags, then the engine's worker in the main thread and uvicorn beside it until SIGINT or
SIGTERM (`serve`). The worker takes the main thread because llama.cpp's OpenMP barriers spin
only for the main thread's decode (serve.engine explains); the app itself is serve.app's.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from specdec.core.model import SpecModel
from specdec.serve.app import create_app
from specdec.serve.config import ServeConfig, is_loopback
from specdec.serve.connections import uvicorn_server
from specdec.serve.engine import Engine


def build_engine(cfg: ServeConfig) -> Engine:
    """Load the models named by `cfg`, check them with a warm-up generation, return the engine."""
    from specdec.backends import load_model, parse_spec

    load_kw: dict[str, Any] = {"n_threads": cfg.threads} if cfg.threads else {}
    load_kw["deterministic"] = cfg.deterministic
    if cfg.ctx_size is not None:
        load_kw["n_ctx"] = cfg.ctx_size

    def load(spec: str) -> SpecModel:
        # a llama.cpp context holds the slots' sequences: made for them at load
        llamacpp = parse_spec(spec)[0] == "llamacpp"
        slots = {"n_seq": cfg.parallel} if cfg.parallel > 1 and llamacpp else {}
        return load_model(spec, device=cfg.device, **load_kw, **slots)

    target = load(cfg.target)
    draft = load(cfg.draft) if cfg.draft else None
    engine = Engine(target, draft, cfg)
    engine.warm_up()
    return engine


def start_warnings(cfg: ServeConfig) -> list[str]:
    """What the operator should know about these flags before the server starts."""
    out = []
    if not is_loopback(cfg.host) and not cfg.keys():
        out.append(
            f"serving on {cfg.host} without an API key: anyone who can reach this port can use "
            "the model"
        )
    if cfg.draft_pool == "shared" and len(cfg.keys()) > 1:
        out.append(
            f"--draft-pool shared with {len(cfg.keys())} API keys: a client can learn whether its "
            "text matches another key's requests, through speed, and through "
            "usage.prompt_tokens_details.cached_tokens, which counts the prompt blocks the "
            "previous request of any key left in the prompt cache (--draft-pool key keeps each "
            "key's pool and cache apart)"
        )
    if len(cfg.keys()) > 1 and not cfg.metrics_key:
        out.append(
            f"{len(cfg.keys())} API keys and no --metrics-key-file: /metrics, which counts "
            "every key's requests, answers no one (403)"
        )
    return out


def serve(cfg: ServeConfig) -> int:
    """Load, warm up and serve until SIGINT/SIGTERM; the exit code (1: could not listen).
    (--replicas: serve.cluster.serve_cluster instead.)"""
    for warning in start_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    engine = build_engine(cfg)
    print(
        f"specdec: serving {cfg.target}"
        + (f" (draft {cfg.draft})" if cfg.draft else "")
        + f" at http://{cfg.host}:{cfg.port}/v1; {engine.pools.cfg.describe()}",
        file=sys.stderr,
    )
    models = (engine.models.target, engine.models.draft)
    kv = sum(getattr(m, "kv_bytes", 0) for m in models if m is not None)
    if kv:  # what --parallel costs, said once (the backend refused what would not fit)
        print(
            f"specdec: {cfg.parallel} slot(s), KV caches {kv / (1 << 20):.0f} MiB", file=sys.stderr
        )
    server = uvicorn_server(create_app(engine, cfg), host=cfg.host, port=cfg.port)
    # The engine's worker runs in this, the main thread, and uvicorn beside it: llama.cpp's
    # OpenMP barriers spin only for the main thread's decode (serve.engine explains).
    engine.runs_in_caller = True

    def serve_http() -> None:
        try:
            server.run()
        finally:  # also when uvicorn could not start (a port in use): end the worker too
            engine.stop(timeout=0)

    http = threading.Thread(target=serve_http, name="specdec-http")

    def shut_down(signum: int, _frame: Any) -> None:
        # uvicorn's own handlers need the main thread; this is what they do. Its shutdown
        # drains the engine, and the lifespan's engine.stop() ends `engine.run` below.
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shut_down)
    http.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        http.join()
    return 0 if server.started else 1
