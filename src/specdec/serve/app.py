"""`specdec serve`: an OpenAI-compatible HTTP server over one speculative-decoding engine.

Endpoints
    POST /v1/chat/completions   messages -> the model's chat template -> token ids
    POST /v1/completions        prompt: a string (tokenized raw), or a list of token ids (the
                                only way to serve a tokenizer-free mock model); with `suffix`,
                                the middle between prompt and suffix (backends.fim)
    POST /infill                llama.cpp's code completion for editors (serve.infill)
    GET  /v1/models             the one model; its id is the target spec string, with the
                                drafters a request may ask for and the server's defaults
    GET  /health                {"status": "ok", ...} (no paths: it needs no API key); 503
                                {"status": "draining"} once shutdown began, so a router
                                sends the next request elsewhere
    GET  /metrics               Prometheus text format, each metric defined in its HELP line;
                                the operator's (serve.http_checks.check_operator): its
                                counters add up every tenant's requests
    GET  /                      the playground (serve.playground): a static page that calls the
                                API above, with the API key its user types in

Request fields honoured by both POST endpoints: model, max_tokens (chat also accepts
max_completion_tokens), temperature (default 1, in [0, 2]; below 1e-5 it is greedy), top_p,
top_k, min_p and typical_p (extensions), presence/frequency/repetition penalties, logit_bias,
stop (a string or a list of up to 16, each up to 256 characters), seed, n (up to 16: serve.answers),
response_format (json_object, json_schema: a grammar, backends.grammar), logprobs, stream,
stream_options.include_usage and return_token_ids (extension, after vLLM: each choice also
carries its generated token ids, so a client can check exactness token for token); chat adds
tools, tool_choice and parallel_tool_calls (serve.tools), completions echo. Each is exact
under speculation (core.processing; docs/requests.md). Fields that would change the output and
are not implemented (best_of, chat's suffix, functions, ...) are refused with 400
unsupported_parameter unless they ask for nothing (null, false, 0, {}); other unknown fields
are ignored. Extensions for
speculation (serve.wire; docs/api-extensions.md): `speculation` {"drafter", "k", "k_max"} per
request, over the server's start-up flags; `usage.speculation`, what it did (in a stream only
with stream_options.include_speculation, which also gives each chunk its tokens' origins:
serve.origins). Responses carry
`usage` and a `spec` object, GenerationStats' numbers for that request (core.metrics has the
definitions):

    drafted, accepted       draft tokens sent to verification; of those, kept by the accept rule
    acceptance_rate         accepted / drafted
    rounds, drafting_rounds target passes after the prefill; those that verified >= 1 draft
    tokens_per_round        generated / rounds (rounds that drafted nothing included)
    mean_acceptance_length  1 + accepted / drafting_rounds (vLLM's; the bonus token included)
    drafted_per_position, accepted_per_position, ttft_s, wall_s

`stop` strings: the text is cut at the first occurrence of any of them (the stop string is not
returned) and generation ends. Streaming holds back text that may be the start of a stop string,
or an incomplete UTF-8 character, until it is resolved, so the streamed deltas concatenate to
the non-streamed text (serve.text). `usage.completion_tokens` counts every token the engine
committed, which can include a few past a stop string: one round commits up to K+1 at once.

Concurrency, cancellation, shutdown: serve.engine. Parsing, validation, tokenization and chat
templating run in threads, off the event loop, and a request is admitted to the queue (its place
reserved: a Reservation) before any tokenizing. A client that goes away, or a deadline that passes,
frees the engine within one round or one prefill chunk. On shutdown waiting requests get 503 at
once, the running one is cancelled, and connections get GRACEFUL_SHUTDOWN_S seconds to close.

API keys and tenants: a server may accept several keys (serve.keys), and a request's key is its
tenant: what it may read server-side is scoped by it, its draft pool (serve.draft_pools: prompt
lookup drafts from the earlier requests of the same key, unless --draft-pool says otherwise)
and the prompt cache (the previous request's KV is kept for a request of the same scope only);
what it may steer is too: its k="auto" policies (serve.tenant_policies) and its share of the
queue (serve.job_queue: --max-queue-per-key places, and the keys take turns).

Browsers: POST bodies must be `Content-Type: application/json` (415 otherwise), which a web
page cannot send cross-origin without a CORS preflight this server never grants; and when bound
to loopback only loopback Host headers are served (DNS rebinding), unless --allowed-host says.

Errors: every error body is OpenAI's {"error": {"message", "type", "param", "code"}}, and the
server keeps serving.
    400 invalid_request_error   malformed or deeply nested JSON, lone surrogates, NaN and
                                out-of-range numbers, over-long lists, wrong types (serve.wire's
                                parse_json and check_shape, on the raw JSON), temperature
                                outside [0, 2], top_p outside (0, 1], max_tokens beyond the
                                context window, n > 16, unsupported parameters, a Host header
                                not allowed (invalid_host), ...
    401 invalid_api_key         API keys are set and the Bearer token is none of them (on /v1
                                and /metrics; /health needs none and says no more than ok)
    403 operator_key_required   /metrics with a tenant's key where the operator has one of
                                their own (--metrics-key-file), or the server has several keys
    404 model_not_found         (and unknown routes: not_found)
    408 request_timeout         the body did not arrive within --body-timeout (headers get
                                serve.connections.HEADER_TIMEOUT_S, then the connection is closed)
    413 request_too_large       body over --max-body-bytes
    415 unsupported_media_type  a POST body that is not application/json
    429 queue_full              with Retry-After (seconds); decided before tokenizing: the
                                queue, or the key's share of it, is full
    500 server_error            the engine raised (the type is named, its text only logged)
    503 shutting_down           with Retry-After: the server is stopping (engine_stopped: its
                                worker is not running); also past --max-connections open
                                connections (uvicorn's, without Retry-After), or
                                --max-connections-per-client from one address (serve.
                                connections, which also resets a connection whose client has
                                taken no bytes for --write-timeout seconds)
    504 timeout                 --request-timeout passed, counted from arrival (queue included)
Every response echoes the request's x-request-id (one is made when none, or a malformed one,
came) and, in a cluster, names its replica in x-specdec-replica (serve.cluster); all but an
unexpected 500, which Starlette's outermost middleware sends.

A streaming request that fails after its response started gets the error object as its last
SSE event (the openai client raises it as an APIError). A non-streaming request whose client
went away is counted as 499 (nginx's "client closed request") in specdec_requests_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from specdec.backends.cores import pace
from specdec.backends.weights import kernel_of
from specdec.core.model import SpecModel
from specdec.serve import answers, playground
from specdec.serve import infill as fim_route
from specdec.serve.answers import Reply
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine
from specdec.serve.errors import ApiError, bad
from specdec.serve.front_door import DEADLINE_HEADER
from specdec.serve.http_checks import HostCheck, ResponseHeaders, check_operator, read_body
from specdec.serve.keys import KeyRing
from specdec.serve.samples import make_samples
from specdec.serve.validation import MAX_N
from specdec.serve.wire import ChatRequest, CompletionRequest, parse_json, parse_request

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Context:
    """What the routes need, on app.state.specdec."""

    engine: Engine
    cfg: ServeConfig  # without its API keys: `keys` and `operator` hold their digests
    keys: KeyRing
    operator: KeyRing | None  # the --metrics-key-file key; None: none was given
    model_ids: frozenset[str]  # the names a request's `model` may use
    public_id: str  # the id responses carry: the target spec without directories
    replica: str | None = None  # this replica's name in a cluster (serve.cluster)

    def drain(self) -> None:
        """Shutting down (serve.connections.uvicorn_server): the engine fails what waits."""
        self.engine.drain()


def _ctx(request: Request) -> _Context:
    return request.app.state.specdec


# ------------------------------------------------------------------------------ errors
def _error_response(request: Request, e: ApiError) -> JSONResponse:
    _ctx(request).engine.metrics.count_request(request.url.path, e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _api_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, ApiError)
    return _error_response(request, e)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, HTTPException)
    code = "not_found" if e.status_code == 404 else None
    err = ApiError(e.status_code, str(e.detail), code=code, headers=dict(e.headers or {}))
    return _error_response(request, err)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    err = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
    return _error_response(request, err)


# ------------------------------------------------------------------------------ checks
def _tenant(request: Request) -> str:
    """The request's tenant (serve.keys.KeyRing.tenant): 401 without an accepted key."""
    return _ctx(request).keys.tenant(request.headers.get("authorization", ""))


def _check_model(ctx: _Context, model: str) -> None:
    if model not in ctx.model_ids:
        raise ApiError(
            404,
            f"the model {model[:200]!r} does not exist; this server serves {ctx.public_id!r}",
            param="model",
            code="model_not_found",
        )


def _parse(kind: type[ChatRequest] | type[CompletionRequest], body: bytes) -> Any:
    return parse_request(kind, parse_json(body))


async def _off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` in a thread, so that the event loop serves others meanwhile; a request
    nested deeper than Python's stack allows (a schema or a tool call's arguments, each under
    the body's own bound) is the client's 400, not a 500."""
    try:
        return await asyncio.to_thread(fn, *args)
    except RecursionError:
        raise bad("the request nests objects too deeply", code="too_deep") from None


# ------------------------------------------------------------------------------ routes
async def chat_completions(request: Request) -> Response:
    return await _completion(request, ChatRequest)


async def completions(request: Request) -> Response:
    return await _completion(request, CompletionRequest)


async def _completion(
    request: Request, kind: type[ChatRequest] | type[CompletionRequest]
) -> Response:
    """Both POST routes: read, parse, admit, tokenize, validate, generate, in that order."""
    arrived = time.perf_counter()
    ctx = _ctx(request)
    engine = ctx.engine
    tenant = _tenant(request)
    body = await read_body(request, ctx.cfg.max_body_bytes, ctx.cfg.body_timeout)
    # JSON and validation off the event loop; the bounds in parse_json keep both short.
    req = await _off_loop(_parse, kind, body)
    _check_model(ctx, req.model)
    with contextlib.ExitStack() as held:
        # 429 / 503 now, before any tokenizing: a place for each of the n samples
        reservations = [held.enter_context(engine.reserve(tenant)) for _ in range(_samples(req))]
        # Templating and tokenizing up to --max-body-bytes of text takes a while: in a thread.
        params, echo = await _off_loop(engine.models.prepare, req)
        reply = Reply(
            ctx.public_id,
            isinstance(req, ChatRequest),
            req,
            params.prompt_ids,
            params.speculation,
            logprobs=params.logprobs is not None,
            echo=echo,
            replica=ctx.replica,
        )
        loop = asyncio.get_running_loop()
        deadline = arrived + _time_left(request, ctx)
        samples = make_samples(params, loop, arrived, deadline, tenant)
        response = await answers.respond(request, engine, reply, params, samples, reservations)
        engine.metrics.count_request(request.url.path, 200)
        return response


def _time_left(request: Request, ctx: _Context) -> float:
    """Seconds this request may take: --request-timeout, or in a cluster's replica what the
    edge says is left of it (serve.edge: deadlines run from arrival at the edge, which alone
    reaches a replica and sets this header)."""
    left = request.headers.get(DEADLINE_HEADER.decode()) if ctx.replica is not None else None
    try:
        return min(ctx.cfg.request_timeout, max(0.0, float(left)))
    except (TypeError, ValueError):
        return ctx.cfg.request_timeout


async def infill(request: Request) -> Response:
    """llama.cpp's /infill (serve.infill): read, parse, admit, build the FIM prompt, generate."""
    arrived = time.perf_counter()
    ctx = _ctx(request)
    engine = ctx.engine
    tenant = _tenant(request)
    body = await read_body(request, ctx.cfg.max_body_bytes, ctx.cfg.body_timeout)
    req = await _off_loop(lambda: fim_route.parse_infill(parse_json(body)))
    with contextlib.ExitStack() as held:
        reservations = [held.enter_context(engine.reserve(tenant)) for _ in range(_samples(req))]
        params = await _off_loop(fim_route.prepare, engine.models, req, ctx.public_id)
        loop = asyncio.get_running_loop()
        deadline = arrived + _time_left(request, ctx)
        samples = make_samples(params, loop, arrived, deadline, tenant)
        response = await fim_route.answer(
            request, req, engine, params, samples, reservations, ctx.public_id
        )
        engine.metrics.count_request(request.url.path, 200)
        return response


def _samples(req: ChatRequest | CompletionRequest | fim_route.InfillRequest) -> int:
    """The samples a request asks for (validate_request checks the range; a place is held for
    at most MAX_N)."""
    return req.n if isinstance(req.n, int) and 1 <= req.n <= MAX_N else 1


async def models(request: Request) -> Any:
    ctx = _ctx(request)
    _tenant(request)
    ctx.engine.metrics.count_request(request.url.path, 200)
    card = {
        "id": ctx.public_id,
        "object": "model",
        "created": 0,
        "owned_by": "specdec",
        "draft": public_model_name(ctx.cfg.draft) if ctx.cfg.draft else None,
        "n_ctx": ctx.engine.models.n_ctx,
        "speculation": _speculation_card(ctx.engine),
        "weights": _weights_card(ctx.engine.models.target),
    }
    return {"object": "list", "data": [card]}


def _weights_card(target: SpecModel) -> dict[str, Any] | None:
    """A llama.cpp target's weight types, the kernel of each, and whether greedy speculation
    equals target-only output on it (backends.weights); None for other backends."""
    types = getattr(target, "weight_types", None)
    if types is None:
        return None
    isa = getattr(target, "sdmm", None)
    return {
        "types": {t: kernel_of(t, isa) for t in sorted(types)},
        "batch_invariant": target.batch_invariant,
    }


def _speculation_card(engine: Engine) -> dict[str, Any]:
    """What a request's `speculation` may ask of this server, what it gets by default, and whose
    earlier requests prompt lookup drafts from (serve.draft_pools)."""
    pool = engine.pools.cfg
    return {
        **engine.models.defaults.card(),
        "draft_pool": {"scope": pool.mode, "tokens": 0 if pool.mode == "off" else pool.tokens},
    }


async def health(request: Request) -> Response:
    ctx = _ctx(request)
    alive = ctx.engine.alive
    # unauthenticated: whether it serves and what, no directories and no load (how busy the
    # server is describes other tenants' traffic: /metrics, the operator's, says it)
    status = "engine_stopped" if not alive else "draining" if ctx.engine.draining else "ok"
    body = {"status": status, "model": ctx.public_id}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def prometheus(request: Request) -> Response:
    ctx = _ctx(request)
    check_operator(request)
    engine = ctx.engine
    gauges = {
        "specdec_queue_depth": engine.queue_depth,
        "specdec_busy": int(engine.busy),
        "specdec_running": engine.running,
        "specdec_slots": engine.parallel,
        "specdec_queue_capacity": engine.max_queue,
        "specdec:num_requests_waiting": engine.queue_depth,
        "specdec:num_requests_running": engine.running,
        "specdec:kv_cache_usage_perc": engine.models.kv_usage,
        **engine.cycle.store_gauges(),
        **engine.pools.gauges(),
        **pace().gauges(),
    }
    text = engine.metrics.render(gauges)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ------------------------------------------------------------------------------ the app
@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = app.state.specdec.engine
    if not engine.alive:
        engine.start()
    yield
    await asyncio.to_thread(engine.stop)  # joins the worker: not on the event loop


def create_app(engine: Engine, cfg: ServeConfig, replica: str | None = None) -> FastAPI:
    """The FastAPI app over a started-or-not `engine` (the lifespan starts and stops it);
    `replica` names it in a cluster (x-specdec-replica, usage.replica)."""
    # No /docs, /redoc or /openapi.json: this is an API for programs, and the schema would
    # describe FastAPI's view of routes that parse their own bodies.
    app = FastAPI(
        title="specdec", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    public_id = public_model_name(cfg.target)
    target = engine.models.target.name
    names = {cfg.target, target, target.split(":", 1)[-1], public_id}
    keys = KeyRing(cfg.keys())
    operator = KeyRing([cfg.metrics_key]) if cfg.metrics_key else None
    # The keys stay in the rings alone, as digests (serve.keys), not in the routes' config.
    bare = dataclasses.replace(cfg, api_key=None, api_keys=(), metrics_key=None)
    app.state.specdec = _Context(engine, bare, keys, operator, frozenset(names), public_id, replica)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/infill", infill, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    playground.add_routes(app)
    # a replica is reached only through the cluster's edge, which checks the Host (serve.edge)
    hosts = cfg.host_names() if replica is None else None
    if hosts is not None:
        app.add_middleware(HostCheck, names=hosts)
    app.add_middleware(ResponseHeaders, replica=replica)
    return app


# ------------------------------------------------------------------------------ names
def public_model_name(spec: str) -> str:
    """`spec` without the directories of a local path ("llamacpp:/home/u/m.gguf" ->
    "llamacpp:m.gguf"); registry names and hub ids ("hf:org/name") are kept."""
    backend, sep, name = spec.partition(":")  # the first colon: a path may hold more
    if not sep:
        backend, name = "", spec
    if os.path.isabs(name) or name.startswith(("~", ".")) or "\\" in name:
        name = os.path.basename(name.replace("\\", "/").rstrip("/")) or "model"
    return f"{backend}{sep}{name}"
