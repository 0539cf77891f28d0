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
replica has a free slot (of --parallel), else to the least loaded one with a free slot, else
keeps it waiting: the prompt cache and the key's draft pool live in one replica, and a
round-robin balancer would land the next edit of the same file cold elsewhere.

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
from dataclasses import dataclass, field
from typing import Any

from specdec.serve.config import ServeConfig
from specdec.serve.errors import ApiError, unavailable_error

#: The Ray release this module is written against (pyproject's cluster extra pins it).
RAY_VERSION = "2.60.0"
#: The prompt's first characters that, with the API key, name where its cache is: about one
#: prompt-cache block (serve.cycle.PROMPT_CACHE_BLOCK tokens) of code.
AFFINITY_CHARS = 1024
#: (key, prefix) pairs remembered by the router, the least recently routed forgotten first.
AFFINITY_MEMORY = 4096
#: Seconds running answers get to finish when the cluster is stopped.
DRAIN_S = 30.0
#: Seconds the ingress waits for one replica's /metrics, and for any other's /health.
ASK_S, PROBE_S = 10.0, 2.0
#: Requests a replica takes beyond its slots and queue: /health, /metrics, /v1/models.
LIGHT_REQUESTS = 8
APP_NAME = "specdec"


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request, read whole by the ingress, for a replica's app."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]] = field(repr=False)  # the API key among them
    body: bytes = field(repr=False)
    affinity: str | None  # affinity_key; None: any replica will do
    replica: str | None = None  # this replica only (the ingress's /metrics asks each)
    avoid: tuple[str, ...] = ()  # any replica but these (how /metrics finds the others)


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

    def __init__(self, engines: Any, cfg: ServeConfig) -> None:
        from specdec.serve.keys import KeyRing

        self.engines = engines.options(stream=True)
        self.replicas = cfg.replicas
        self.max_body_bytes = cfg.max_body_bytes
        # a request without a valid key gets its 401 from a replica, and no affinity: a flood
        # of them must not push the paying keys' pairs out of the router's memory
        self.keys = KeyRing(cfg.keys()) if cfg.keys() else None
        self.seen: set[str] = set()  # replicas that answered, by name (for /metrics)

    async def __call__(self, request: Any) -> Any:
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response, StreamingResponse

        from specdec.serve.app import read_at_most

        try:
            body = await read_at_most(request, self.max_body_bytes)
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        headers = list(request.scope["headers"])
        if request.url.path == "/metrics" and request.method == "GET":
            return await self._metrics(headers)
        fwd = Forwarded(
            request.method,
            request.url.path,
            request.scope.get("query_string", b""),
            headers,
            body,
            await self._affinity(request, body),
        )
        answer = self.engines.http.remote(fwd)
        try:
            status, head = await answer.__anext__()
            self._saw(head)
            media = dict((k.lower(), v) for k, v in head).get(b"content-type", b"")
            if not media.startswith(b"text/event-stream"):
                whole = Response(b"".join([c async for c in answer]), status_code=status)
                return _raw(whole, head)
        except Exception as e:  # the replica died or could not be reached: nothing was sent
            answer.cancel()
            return _error(_replica_error(e))
        except BaseException:  # cancelled: the client went away; so does its generation
            answer.cancel()
            raise
        return _raw(StreamingResponse(_relay(answer), status_code=status), head)

    async def _affinity(self, request: Any, body: bytes) -> str | None:
        auth = request.headers.get("authorization", "")
        if request.method != "POST" or (self.keys is not None and not self.keys.matches(auth)):
            return None
        if len(body) < 1 << 16:
            return affinity_key(auth, body)
        # parsing up to --max-body-bytes of JSON would hold up every stream this loop relays
        return await asyncio.to_thread(affinity_key, auth, body)

    async def _metrics(self, headers: list[tuple[bytes, bytes]]) -> Any:
        """Every replica's /metrics, each sample labelled with its replica."""
        from starlette.responses import Response

        while len(self.seen) < self.replicas:  # find the replicas no answer has named yet
            probe = Forwarded("GET", "/health", b"", headers, b"", None, avoid=tuple(self.seen))
            try:
                self._saw((await self._ask(probe, PROBE_S))[1])
            except Exception:  # none answered: one is starting, or gone
                break
        texts: dict[str, str] = {}
        # One at a time: calls made while one HTTP request is handled share Ray's request id,
        # and Ray hands a replica found for one to the first pending call with that id.
        for name in sorted(self.seen):
            fwd = Forwarded("GET", "/metrics", b"", headers, b"", None, replica=name)
            try:
                status, head, text = await self._ask(fwd)
            except Exception:  # gone since (Ray restarts it under another name)
                self.seen.discard(name)
                continue
            if status != 200:  # 401/403: the same answer for every replica
                return _raw(Response(text, status_code=status), head)
            texts[name] = text.decode()
        if not texts:
            return _error(unavailable_error("no replica answered", "no_replica"))
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    async def _ask(
        self, fwd: Forwarded, timeout: float = ASK_S
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A whole answer to `fwd`, within `timeout` seconds (cancelled past them)."""
        answer = self.engines.http.remote(fwd)
        try:
            async with asyncio.timeout(timeout):
                status, head = await answer.__anext__()
                return status, head, b"".join([c async for c in answer])
        except BaseException:
            answer.cancel()
            raise

    def _saw(self, head: list[tuple[bytes, bytes]]) -> None:
        name = dict(head).get(b"x-specdec-replica")
        if name:
            self.seen.add(name.decode())


async def _relay(answer: Any) -> AsyncIterator[bytes]:
    """The rest of a stream; a replica that dies mid-answer ends it with an error event, and a
    client that goes away cancels the replica's generation."""
    ended = False
    try:
        async for chunk in answer:
            yield chunk
        ended = True
    except Exception as e:
        ended = True
        yield f"data: {json.dumps(_replica_error(e).body())}\n\n".encode()
    finally:
        if not ended:
            answer.cancel()


def _error(e: ApiError) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


#: What the relay sets itself: the body's framing, and x-request-id (Ray's proxy echoes it).
_RELAY_SETS = (b"content-length", b"transfer-encoding", b"x-request-id")


def _raw(response: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """`response` with the replica's headers (its own framing and type kept)."""
    own = {k for k, _ in response.raw_headers} | set(_RELAY_SETS)
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


# ------------------------------------------------------------------------------ the process
def build_app(cfg: ServeConfig) -> Any:
    """The Ray Serve application: the ingress bound to cfg.replicas engine replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engines = serve.deployment(
        Replica,
        name="specdec-engine",
        num_replicas=cfg.replicas,
        # its slots (the router counts them: cluster_router) and the light requests
        max_ongoing_requests=cfg.parallel + LIGHT_REQUESTS,
        max_queued_requests=cfg.max_queue * cfg.replicas,  # waiting at the router; then 429
        ray_actor_options={"num_cpus": cfg.threads or 1},
        request_router_config=RequestRouterConfig(
            request_router_class="specdec.serve.cluster_router.AffinityRouter",
            request_router_kwargs={"slots": cfg.parallel},
            max_backoff_s=0.1,  # a request waiting for a slot starts within 0.1 s of one freeing
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
        graceful_shutdown_timeout_s=DRAIN_S + 5,  # it relays the engines' last answers
    )
    return ingress.bind(engines.bind(cfg), cfg)


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

        need, cores = cfg.replicas * (cfg.threads or 1), usable_cores()
        if need > cores:
            print(
                f"warning: {cfg.replicas} replicas x {cfg.threads or 1} thread(s) on "
                f"{cores} cores: they will slow each other",
                file=sys.stderr,
            )
        ray.init(
            num_cpus=max(need, cores),
            include_dashboard=False,
            object_store_memory=128 << 20,  # requests and answers, never weights
        )
    # the proxy's own bound on a request, queue included: the engine's 504 comes first
    timeout = cfg.request_timeout + DRAIN_S
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": timeout})
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
    # The app first, while Ray's proxy still relays: its replicas finish their answers (up to
    # DRAIN_S). serve.shutdown would stop the proxy at once, cutting every stream.
    serve.delete(APP_NAME)
    if not cfg.ray_address:  # what this process started; a cluster joined keeps its Serve
        serve.shutdown()
        ray.shutdown()
    return 0
