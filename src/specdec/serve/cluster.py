"""`specdec serve --replicas N`: the server as a Ray Serve application, one engine per replica,
each request routed to the replica that served its API key and prompt prefix last.

Ray Serve (an optional extra, `specdec[cluster]`, pinned) runs the replicas as processes across
the machines of a cluster, restarts one that dies and streams through its HTTP proxy; specdec
writes neither a cluster manager nor a balancer. Two deployments, as Ray's own prefix-aware LLM
router has them, because Ray's proxy picks a replica before it reads a request's body:
    specdec-http    (`Ingress`, one replica, no CPU) reads the body whole, hashes the API key
                    and the prompt's first block (`affinity_key`), and relays the answer;
    specdec-engine  (`Replica`, N of them) one engine each (serve.launch.build_engine: its own
                    slots, prompt cache and draft pools) behind the same app as `specdec serve`
                    (serve.app.create_app, called in-process: `Replica.http`).
`AffinityRouter` sends a request to the replica that answered its (key, prefix) last while that
replica has a free slot (max_ongoing_requests = --parallel), else to the least loaded one: the
prompt cache and the key's draft pool live in one replica, and a round-robin balancer would
land the next edit of the same file cold elsewhere.

A replica that dies mid-answer ends a stream with an error event, or answers 503 with
Retry-After if nothing was sent yet; Ray restarts it; the others serve on. SIGINT/SIGTERM drain:
running answers finish (up to DRAIN_S), then the replicas stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from specdec.serve.config import ServeConfig
from specdec.serve.errors import ApiError, unavailable_error

#: The Ray release this module is written against (pyproject's cluster extra pins it).
RAY_VERSION = "2.60.0"
#: The prompt's first characters that, with the API key, name where its cache is: about one
#: prompt-cache block (serve.engine.PROMPT_CACHE_BLOCK tokens) of code.
AFFINITY_CHARS = 1024
#: (key, prefix) pairs remembered by the router, the least recently routed forgotten first.
AFFINITY_MEMORY = 4096
#: Seconds running answers get to finish when the cluster is stopped.
DRAIN_S = 30.0
APP_NAME = "specdec"


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request, read whole by the ingress, for a replica's app."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    affinity: str | None  # affinity_key; None: any replica will do
    replica: str | None = None  # this replica only (the ingress's /metrics asks each)


def affinity_key(authorization: str, body: bytes) -> str | None:
    """A digest of the API key and the first AFFINITY_CHARS characters of the prompt (a chat's
    messages' text in order, or a completion's prompt); None for a body that names no prompt,
    which the replica's app will refuse anyway."""
    try:  # the replica's app bounds the JSON and says what is wrong with it; here, no key
        obj = json.loads(body)
        text = _prompt_text(obj.get("messages", obj.get("prompt"))) if isinstance(obj, dict) else ""
    except (ValueError, RecursionError):
        return None
    if not text:
        return None
    digest = hashlib.sha256(f"{authorization}\0{text[:AFFINITY_CHARS]}".encode())
    return digest.hexdigest()[:32]


def _prompt_text(x: Any) -> str:
    """The text of a prompt, messages or content parts, in order (token ids as numbers)."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return _prompt_text(x.get("content", x.get("text", "")))
    if isinstance(x, list):
        return "\n".join(_prompt_text(v) if not isinstance(v, int) else str(v) for v in x)
    return ""


def merge_metrics(texts: dict[str, str]) -> str:
    """The Prometheus text of several replicas as one: each family once, its samples from every
    replica with a `replica` label."""
    families: OrderedDict[str, tuple[list[str], list[str]]] = OrderedDict()
    for replica, text in texts.items():
        label = f'replica="{replica}"'
        for line in text.splitlines():
            if line.startswith("#"):
                name = line.split(" ", 3)[2] if line.count(" ") >= 2 else ""
                head, _ = families.setdefault(name, ([], []))
                if line not in head:
                    head.append(line)
                continue
            if not line.strip():
                continue
            series, _, value = line.rpartition(" ")
            name, brace, labels = series.partition("{")
            family = next((f for f in (name, *_histogram_family(name)) if f in families), name)
            labelled = f"{name}{{{label},{labels}" if brace else f"{name}{{{label}}}"
            families.setdefault(family, ([], []))[1].append(f"{labelled} {value}")
    return "".join("\n".join(h + s) + "\n" for h, s in families.values())


def _histogram_family(sample: str) -> list[str]:
    """The histogram a sample may belong to: specdec_x_bucket -> specdec_x."""
    return [sample.removesuffix(s) for s in ("_bucket", "_sum", "_count") if sample.endswith(s)]


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
        """Run `req` through the app; yield (status, headers), then the body's chunks. Closed
        early (the client went away), the app sees its client disconnect."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body = [req.body]

        async def receive() -> dict[str, Any]:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "root_path": "",
            "query_string": req.query,
            "headers": req.headers,
            "client": None,
            "server": None,
        }

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await out.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    yield message["status"], list(message.get("headers", ()))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine's worker stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(timeout=5.0)


class Ingress:
    """Ray Serve's HTTP entry: reads a request, routes it with its affinity, relays the
    answer (streams as they come)."""

    def __init__(self, engines: Any, replicas: int, max_body_bytes: int) -> None:
        self.engines = engines.options(stream=True)
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes
        self.seen: set[str] = set()  # replicas that answered, by name (for /metrics)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        try:
            body = await self._body(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        headers = list(request.scope["headers"])
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return await self._metrics(request, headers)
        affinity = None
        if request.method == "POST":
            affinity = affinity_key(request.headers.get("authorization", ""), body)
        fwd = Forwarded(
            request.method, path, request.scope.get("query_string", b""), headers, body, affinity
        )
        answer = self.engines.http.remote(fwd)
        try:
            status, head = await answer.__anext__()
        except Exception as e:  # the replica died or could not be reached: nothing was sent
            err = _replica_error(e)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        self._saw(head)
        # the relay frames the body anew, and Ray's proxy echoes x-request-id itself
        dropped = (b"content-length", b"transfer-encoding", b"x-request-id")
        kept = [(k, v) for k, v in head if k.lower() not in dropped]
        media = dict((k.lower(), v) for k, v in head).get(b"content-type", b"")
        if not media.startswith(b"text/event-stream"):
            chunks = [c async for c in answer]
            return _raw(Response(b"".join(chunks), status_code=status), kept)
        return _raw(StreamingResponse(_relay(answer), status_code=status), kept)

    async def _body(self, request: Any) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
        return body

    async def _metrics(self, request: Any, headers: list[tuple[bytes, bytes]]) -> Any:
        """Every replica's /metrics, each sample labelled with its replica."""
        from starlette.responses import JSONResponse, Response

        if len(self.seen) < self.replicas:  # find the replicas no answer has named yet
            probe = Forwarded("GET", "/health", b"", headers, b"", None)
            calls = [_collect(self.engines.http.remote(probe)) for _ in range(2 * self.replicas)]
            for got in await asyncio.gather(*calls, return_exceptions=True):
                if not isinstance(got, BaseException):
                    self._saw(got[1])
        texts: dict[str, str] = {}
        for name in sorted(self.seen):
            fwd = Forwarded("GET", "/metrics", b"", headers, b"", None, replica=name)
            try:
                status, head, text = await asyncio.wait_for(
                    _collect(self.engines.http.remote(fwd)), 10.0
                )
            except Exception:  # gone since (Ray restarts it under another name)
                self.seen.discard(name)
                continue
            if status != 200:  # 401/403: the same answer for every replica
                return _raw(Response(text, status_code=status), head)
            texts[name] = text.decode()
        if not texts:
            err = unavailable_error("no replica answered", "no_replica")
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    def _saw(self, head: list[tuple[bytes, bytes]]) -> None:
        name = dict(head).get(b"x-specdec-replica")
        if name:
            self.seen.add(name.decode())


async def _collect(answer: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, head = await answer.__anext__()
    return status, head, b"".join([c async for c in answer])


async def _relay(answer: Any) -> AsyncIterator[bytes]:
    """The rest of a stream; a replica that dies mid-answer ends it with an error event."""
    try:
        async for chunk in answer:
            yield chunk
    except Exception as e:
        yield f"data: {json.dumps(_replica_error(e).body())}\n\n".encode()


def _raw(response: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """`response` with the replica's headers (its own length and type kept)."""
    own = {k for k, _ in response.raw_headers}
    response.raw_headers += [(k, v) for k, v in headers if k.lower() not in own]
    return response


def _replica_error(e: Exception) -> ApiError:
    from ray.serve.exceptions import BackPressureError

    if isinstance(e, BackPressureError):
        return ApiError(
            429,
            "every replica's slots and queue are full; retry later",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return unavailable_error(
        f"the replica answering failed ({type(e).__name__}); retry: the others serve on",
        "replica_failed",
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes", code="request_too_large")


# ------------------------------------------------------------------------------ the process
def build_app(cfg: ServeConfig) -> Any:
    """The Ray Serve application: the ingress bound to cfg.replicas engine replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engines = serve.deployment(
        Replica,
        name="specdec-engine",
        num_replicas=cfg.replicas,
        max_ongoing_requests=cfg.parallel,  # a slot each: more wait at the router (affinity)
        max_queued_requests=cfg.max_queue * cfg.replicas,  # past it: 429 (_replica_error)
        ray_actor_options={"num_cpus": cfg.threads or 1},
        request_router_config=RequestRouterConfig(
            request_router_class="specdec.serve.cluster_router.AffinityRouter",
            request_router_kwargs={"slots": cfg.parallel},
        ),
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=DRAIN_S,
    )
    ingress = serve.deployment(
        Ingress,
        name="specdec-http",
        num_replicas=1,
        max_ongoing_requests=cfg.max_connections,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engines.bind(cfg), cfg.replicas, cfg.max_body_bytes)


def serve_cluster(cfg: ServeConfig) -> int:
    """Start (or join, with cfg.ray_address) Ray, run the application until SIGINT/SIGTERM,
    then drain it and shut down what this process started."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("specdec serve --replicas needs Ray: pip install 'specdec[cluster]'", file=sys.stderr)
        return 2
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

        need = cfg.replicas * (cfg.threads or 1)
        if need > usable_cores():
            print(
                f"warning: {cfg.replicas} replicas x {cfg.threads or 1} thread(s) on "
                f"{usable_cores()} cores: they will slow each other",
                file=sys.stderr,
            )
        ray.init(
            num_cpus=max(need, usable_cores()),
            include_dashboard=False,
            object_store_memory=128 << 20,  # requests and answers, never weights
        )
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    print(
        f"specdec: serving {cfg.target} on {cfg.replicas} replica(s) at "
        f"http://{cfg.host}:{cfg.port}/v1 (ready in {time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    print("specdec: draining the replicas", file=sys.stderr)
    serve.shutdown()
    if not cfg.ray_address:
        ray.shutdown()
    return 0
