"""The cluster's front door (`specdec serve --replicas N`): the single server's HTTP server and
checks, in front of N engine replicas reached through a `Replicas` transport (serve.cluster's
Ray Serve deployment handles; `LocalReplicas` in this process, for tests).

Everything a client sends meets the single server's edge first (serve.connections: header,
body and write deadlines, connections per client and in all, the framing check; serve.http_checks:
the Host check, the API key and Content-Type before a body is read, the body's bound). No
client header reaches Ray: its HTTP proxy is not started, and a replica sees the client's
headers without the edge's own names (`x-specdec-*`). Where a generation runs and how long it
waits is serve.front_door's.

Deadlines run from arrival: a request still waiting at its deadline gets the JSON 504; the
replica gets what is left of it (front_door.DEADLINE_HEADER); an answer that overruns it by
DEADLINE_GRACE_S is cut, a stream with an error event, as is a stream whose replica fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from specdec.serve.errors import ApiError, timeout_error, unavailable_error
from specdec.serve.front_door import (
    DEADLINE_HEADER,
    Answer,
    Forwarded,
    FrontDoor,
    Replicas,
    Sent,
    affinity_of,
    parse_json,
    replica_of,
    samples_of,
)
from specdec.serve.http_checks import (
    HostCheck,
    ResponseHeaders,
    check_operator,
    read_at_most,
    read_body,
    read_within,
)
from specdec.serve.keys import KeyRing

#: Seconds an answer may run past its deadline (the replica ends it at the deadline) before the
#: edge cuts it.
DEADLINE_GRACE_S = 5.0
#: Seconds the edge waits for a replica's /metrics, or any answer that is not a generation.
ASK_S = 10.0
#: The generation routes: each request takes slots and waits in the edge's queue.
GENERATIONS = ("/v1/chat/completions", "/v1/completions", "/infill")


# ------------------------------------------------------------------------------ the app
@dataclass
class _EdgeContext:
    """What the edge's routes need, on app.state.specdec (the names serve.http_checks reads)."""

    door: FrontDoor
    cfg: Any  # ServeConfig without its API keys
    keys: KeyRing
    operator: KeyRing | None

    def drain(self) -> None:
        if self.door is not None:  # None: shut down before it started (a port in use)
            self.door.drain()


def _door_ctx(request: Request) -> _EdgeContext:
    return request.app.state.specdec


def create_edge_app(replicas: Replicas, cfg: Any) -> Any:
    """The cluster's HTTP app: serve.http_checks' checks, then the replicas through `replicas`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        ctx = app.state.specdec
        # its queue and events belong to this loop; its shares count the keys (not in ctx.cfg)
        ctx.door = FrontDoor(replicas, cfg)
        watcher = asyncio.create_task(ctx.door.watch())
        yield
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher

    app = FastAPI(
        title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    keys = KeyRing(cfg.keys())
    operator = KeyRing([cfg.metrics_key]) if cfg.metrics_key else None
    bare = dataclasses.replace(cfg, api_key=None, api_keys=(), metrics_key=None)
    app.state.specdec = _EdgeContext(None, bare, keys, operator)  # type: ignore[arg-type]

    async def api_error(request: Any, e: Exception) -> Any:
        assert isinstance(e, ApiError)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def http_error(request: Any, e: Exception) -> Any:
        assert isinstance(e, HTTPException)
        code = "not_found" if e.status_code == 404 else None
        err = ApiError(e.status_code, str(e.detail), code=code, headers=dict(e.headers or {}))
        return await api_error(request, err)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    for path in GENERATIONS:
        app.add_api_route(path, _generation, methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/{path:path}", _light, methods=["GET", "HEAD", "POST", "PUT", "DELETE"])
    hosts = cfg.host_names()
    if hosts is not None:
        app.add_middleware(HostCheck, names=hosts)
    app.add_middleware(ResponseHeaders, replica=None)
    return app


def _inner_headers(request: Request, deadline: float | None = None) -> list[tuple[bytes, bytes]]:
    """The client's headers for a replica: none of the edge's own names; the time left."""
    out = [(k, v) for k, v in request.scope["headers"] if not k.startswith(b"x-specdec-")]
    if deadline is not None:
        out.append((DEADLINE_HEADER, f"{max(0.0, deadline - time.perf_counter()):.3f}".encode()))
    return out


async def _generation(request: Request) -> Any:
    """A chat or completion: the single server's checks, a place in the queue, slots, then
    the replica's answer relayed."""
    arrived = time.perf_counter()
    ctx = _door_ctx(request)
    door, cfg = ctx.door, ctx.cfg
    auth = request.headers.get("authorization", "")
    tenant = ctx.keys.tenant(auth)  # 401 before the body is read
    body = await read_body(request, cfg.max_body_bytes, cfg.body_timeout)  # 415, 413, 408
    obj = parse_json(body) if len(body) < 1 << 16 else await asyncio.to_thread(parse_json, body)
    deadline = arrived + cfg.request_timeout
    sent = await door.admit(tenant, samples_of(obj), affinity_of(auth, obj), deadline)
    fwd = Forwarded(
        request.method,
        request.url.path,
        request.scope.get("query_string", b""),
        _inner_headers(request, deadline),
        body,
        replica=sent.replica,
    )
    return await _relay(door, fwd, deadline + DEADLINE_GRACE_S, sent)


async def _light(request: Request) -> Any:
    """Any other request (the models list, the playground, a 404): the key checked on /v1
    before a body is read, then any replica's answer."""
    ctx = _door_ctx(request)
    if request.url.path.startswith("/v1"):
        ctx.keys.tenant(request.headers.get("authorization", ""))
    async with ctx.door.light():
        read = read_at_most(request, ctx.cfg.max_body_bytes)
        body = await read_within(read, ctx.cfg.body_timeout)
        fwd = Forwarded(
            request.method,
            request.url.path,
            request.scope.get("query_string", b""),
            _inner_headers(request),
            body,
        )
        return await _relay(ctx.door, fwd, time.perf_counter() + ASK_S, None)


async def _relay(door: FrontDoor, fwd: Forwarded, cut_at: float, sent: Sent | None) -> Any:
    """Send `fwd`; its answer whole, or a stream relayed as it comes. The slots in `sent` are
    freed when the answer ends, however it ends."""
    from starlette.responses import Response

    answer: Answer | None = None
    try:
        answer = door.replicas.call(fwd)
        async with asyncio.timeout(max(0.0, cut_at - time.perf_counter())):
            status, head = await answer.__anext__()
            replica = replica_of(head)
            if sent is not None and replica is not None:
                sent.moved(replica)
                if status == 200:
                    door.answered(sent.waiter.tenant, sent.waiter.affinity, replica)
            media = dict((k.lower(), v) for k, v in head).get(b"content-type", b"")
            if not media.startswith(b"text/event-stream"):
                whole = b"".join([c async for c in answer])
                if sent is not None:
                    sent.free()
                return _raw(Response(whole, status_code=status), head)
    except BaseException as e:
        if answer is not None:  # the client went away, or the answer failed: end it there
            answer.cancel()
        if sent is not None:
            sent.free()
        if isinstance(e, TimeoutError):
            return _error(timeout_error())
        if isinstance(e, Exception):  # the replica died or could not be reached
            door.suspect()
            return _error(replica_error(e))
        raise
    return _raw(_Stream(answer, status, cut_at, door, sent), head)


class _Stream(StreamingResponse):
    """A relayed stream: its chunks as they come; a replica that fails, or an answer past its
    deadline, ends it with an error event; the client going away cancels the replica's
    generation; the slots are freed when it ends, whichever way."""

    def __init__(
        self, answer: Answer, status: int, cut_at: float, door: FrontDoor, sent: Sent | None
    ) -> None:
        self.answer, self.cut_at, self.door, self.sent = answer, cut_at, door, sent
        self.ended = False  # the answer was read to its end, or ended in an error event
        super().__init__(self._chunks(), status_code=status)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.ended:  # the client went away (Starlette stops the body quietly)
                self.answer.cancel()
            if self.sent is not None:
                self.sent.free()

    async def _chunks(self) -> AsyncIterator[bytes]:
        error: ApiError | None = None
        chunks = self.answer.__aiter__()
        while True:
            left = max(0.0, self.cut_at - time.perf_counter())
            try:  # the deadline bounds each wait for a chunk, never the client's reading
                chunk = await asyncio.wait_for(chunks.__anext__(), left)
            except StopAsyncIteration:
                break
            except TimeoutError:
                self.answer.cancel()
                error = timeout_error()
                break
            except Exception as e:
                error = replica_error(e)
                self.door.suspect()
                break
            yield chunk
        self.ended = True
        if error is not None:
            yield f"data: {json.dumps(error.body())}\n\n".encode()


def _error(e: ApiError) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


#: What the relay sets itself: the body's framing, and x-request-id (the edge echoes it).
_RELAY_SETS = (b"content-length", b"transfer-encoding", b"x-request-id")


def _raw(response: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """`response` with the replica's headers (its own framing and type kept)."""
    own = {k for k, _ in response.raw_headers} | set(_RELAY_SETS)
    response.raw_headers += [(k, v) for k, v in headers if k.lower() not in own]
    return response


def replica_error(e: Exception) -> ApiError:
    """What a client is told when the replica answering it failed or could not be reached."""
    return unavailable_error(
        f"the replica answering failed ({type(e).__name__}); retry: the others serve on",
        "replica_failed",
    )


# ------------------------------------------------------------------------------ the edge's own
async def _health(request: Request) -> Any:
    """The cluster serves while the edge reaches a replica; answered by the edge alone, so a
    busy or stalled replica never slows it."""
    from starlette.responses import JSONResponse

    door = _door_ctx(request).door
    status = "draining" if door.draining else "ok" if door.known else "no_replica"
    body = {"status": status, "replicas": len(door.known)}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def _metrics(request: Request) -> Any:
    """Every replica's /metrics, each sample labelled with its replica, and the edge's own."""
    from starlette.responses import Response

    ctx = _door_ctx(request)
    check_operator(request)
    door = ctx.door
    headers = _inner_headers(request)

    async def one(name: str) -> tuple[str, str | None]:
        fwd = Forwarded("GET", "/metrics", b"", headers, b"", replica=name, strict=True)
        try:
            status, _, text = await door.ask(fwd, ASK_S)
        except Exception:
            return name, None
        return name, text.decode() if status == 200 else None

    answers = await asyncio.gather(*(one(name) for name in list(door.known)))
    texts = {name: text for name, text in answers if text is not None}
    merged = merge_metrics(texts) if texts else ""
    return Response(merged + door.gauges(), media_type="text/plain; version=0.0.4")


# ------------------------------------------------------------------------------ in process
async def call_app(app: Any, req: Forwarded) -> AsyncIterator[Any]:
    """Run `req` through the ASGI `app` in this process; yield (status, headers), then the
    body's chunks. Closed early (the client went away), the app sees its client disconnect."""
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
            await app(scope, receive, send)
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


class LocalReplicas:
    """Replicas in this process, each a serve.app over a started engine, called as
    serve.cluster.Replica calls its own (`call_app`): the edge's transport in tests.
    `kill(name)` makes a replica unreachable, as a dead Ray replica is."""

    def __init__(self, apps: dict[str, Any]) -> None:
        self.apps = apps
        self.dead: set[str] = set()

    def call(self, fwd: Forwarded) -> Answer:
        alive = [n for n in self.apps if n not in self.dead]
        if fwd.replica is not None and (fwd.replica in alive or fwd.strict):
            name = fwd.replica
        else:
            rest = [n for n in alive if n not in fwd.avoid]
            name = rest[0] if rest else None
        app = None if name is None or name in self.dead else self.apps[name]
        return _LocalAnswer(None if app is None else call_app(app, fwd))

    def kill(self, name: str) -> None:
        self.dead.add(name)


class _LocalAnswer:
    def __init__(self, gen: AsyncIterator[Any] | None) -> None:
        self.gen = gen

    def __aiter__(self) -> _LocalAnswer:
        return self

    async def __anext__(self) -> Any:
        if self.gen is None:
            raise ConnectionError("no such replica")
        return await self.gen.__anext__()

    def cancel(self) -> None:
        if self.gen is not None:
            gen, self.gen = self.gen, None
            task = asyncio.get_running_loop().create_task(_close(gen))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)


_PENDING: set[asyncio.Task] = set()


async def _close(gen: Any) -> None:
    with contextlib.suppress(BaseException):
        await gen.aclose()


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
