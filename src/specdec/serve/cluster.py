"""`specdec serve --replicas N`: one engine per Ray Serve replica, behind specdec's own front door.

Ray Serve (an optional extra, `specdec[cluster]`, pinned) runs the replicas as processes across
the machines of a cluster and restarts one that dies; specdec writes neither a cluster manager
nor a process supervisor. Its HTTP proxy is not started: the edge (serve.edge, in this
process) is the single server's hardened HTTP server, and calls the replicas through a
deployment handle (`RayReplicas`), so no client byte reaches Ray before the single server's
checks, and no client header reaches Ray's request options.
    specdec-engine  (`Replica`, N of them) one engine each (serve.launch.build_engine: its own
                    slots, prompt cache and draft pools) behind the same app as `specdec serve`
                    (serve.app.create_app, called in-process: `Replica.http`).
The edge decides where each request runs (serve.front_door: slots, per-key queues, prompt
affinity); Ray's request router only carries the choice out (serve.cluster_router).

A replica that dies mid-answer ends a stream with an error event, or answers 503 with
Retry-After if nothing was sent yet; Ray restarts it; the others serve on. SIGINT/SIGTERM drain:
the edge refuses new requests, running answers finish (up to DRAIN_S), then the replicas stop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from specdec.serve.config import ServeConfig
from specdec.serve.edge import call_app
from specdec.serve.front_door import LIGHT_PER_REPLICA, Forwarded

#: The Ray release this module is written against (pyproject's cluster extra pins it).
RAY_VERSION = "2.60.0"
#: Seconds running answers get to finish when the cluster is stopped.
DRAIN_S = 30.0
#: Requests a replica takes beyond its slots: the edge's light requests, its probes, /metrics.
BEYOND_SLOTS = LIGHT_PER_REPLICA + 4
APP_NAME = "specdec"
ENGINE = "specdec-engine"


# ------------------------------------------------------------------------------ Ray's side
class Replica:
    """One engine and its app, in a Ray Serve replica."""

    def __init__(self, cfg: ServeConfig) -> None:
        from ray import serve

        from specdec.serve.app import create_app
        from specdec.serve.launch import build_engine

        self.name = serve.get_replica_context().replica_id.unique_id
        self.engine = build_engine(cfg)
        self.engine.start()  # a thread of its own: Ray's threads hold this process's main one
        self.app = create_app(self.engine, cfg, replica=self.name)

    async def http(self, req: Forwarded) -> AsyncIterator[Any]:
        """Run `req` through the app (serve.edge.call_app): (status, headers), then the body's
        chunks."""
        async for message in call_app(self.app, req):
            yield message

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine's worker stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(timeout=5.0)


class RayReplicas:
    """The edge's transport (serve.front_door.Replicas): the engine deployment's handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True)

    def call(self, fwd: Forwarded) -> Any:
        return self.handle.http.remote(fwd)


# ------------------------------------------------------------------------------ the process
def replica_threads(cfg: ServeConfig, cores: int) -> int:
    """Threads (and Ray CPUs) per replica: --threads, else this machine's cores shared out, so
    that replicas without --threads do not each start a pool of every core."""
    return cfg.threads or max(1, cores // cfg.replicas)


def build_app(cfg: ServeConfig) -> Any:
    """The Ray Serve application: cfg.replicas engine replicas (no ingress: serve.edge is)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specdec.backends.cores import usable_cores

    cfg = dataclasses.replace(cfg, threads=replica_threads(cfg, usable_cores()))

    engines = serve.deployment(
        Replica,
        name=ENGINE,
        num_replicas=cfg.replicas,
        # its slots (the edge counts them: serve.front_door) and the edge's other requests
        max_ongoing_requests=cfg.parallel + BEYOND_SLOTS,
        max_queued_requests=-1,  # requests wait at the edge (serve.front_door), not here
        ray_actor_options={"num_cpus": cfg.threads},
        request_router_config=RequestRouterConfig(
            request_router_class="specdec.serve.cluster_router.EdgeChoice",
            max_backoff_s=0.1,
        ),
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=DRAIN_S,
        logging_config={"enable_access_log": False},  # the edge probes each replica every 2 s
    )
    return engines.bind(cfg)


def serve_cluster(cfg: ServeConfig) -> int:
    """Start (or join, with cfg.ray_address) Ray, run the replicas and the edge until
    SIGINT/SIGTERM, then drain them and shut down what this process started."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("specdec serve --replicas needs Ray: pip install 'specdec[cluster]'", file=sys.stderr)
        return 2
    from specdec.serve.connections import uvicorn_server
    from specdec.serve.edge import create_edge_app
    from specdec.serve.launch import start_warnings

    for warning in start_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if ray.__version__ != RAY_VERSION:
        print(
            f"warning: Ray {ray.__version__}; specdec is tested with {RAY_VERSION}", file=sys.stderr
        )
    started = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine unasked
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=True)
    else:
        from specdec.backends.cores import usable_cores

        cores = usable_cores()
        threads = replica_threads(cfg, cores)
        need = cfg.replicas * threads
        if need > cores:
            print(
                f"warning: {cfg.replicas} replicas x {threads} thread(s) on "
                f"{cores} cores: they will slow each other",
                file=sys.stderr,
            )
        ray.init(
            num_cpus=max(need, cores),
            include_dashboard=False,
            object_store_memory=128 << 20,  # requests and answers, never weights
        )
    serve.start(proxy_location="Disabled")  # the edge below is the one HTTP entry
    serve.run(build_app(cfg), name=APP_NAME, route_prefix=None, blocking=False)
    replicas = RayReplicas(serve.get_deployment_handle(ENGINE, app_name=APP_NAME))
    edge = uvicorn_server(
        create_edge_app(replicas, cfg),
        host=cfg.host,
        port=cfg.port,
        timeout_graceful_shutdown=DRAIN_S,  # running answers finish; new requests get 503
        log_level="warning",
    )
    print(
        f"specdec: serving {cfg.target} on {cfg.replicas} replica(s) at "
        f"http://{cfg.host}:{cfg.port}/v1 (Ray ready in {time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    # uvicorn takes SIGINT/SIGTERM while it runs and raises them again after its shutdown:
    # to these handlers, which leave the stopping to this function (not KeyboardInterrupt)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        edge.run()  # until SIGINT/SIGTERM: uvicorn drains the edge (serve.connections)
    finally:
        print("specdec: stopping the replicas", file=sys.stderr)
        serve.delete(APP_NAME)
        if not cfg.ray_address:  # what this process started; a cluster joined keeps its Serve
            serve.shutdown()
            ray.shutdown()
    return 0 if edge.started else 1
