"""What the server tests share: `specdec serve` in-process on loopback, the mock models and
tokenizer it serves, and the HTTP helpers the tests drive it with. Not a test module (pytest
collects test_*.py only); the HTTP tests under tests/serve/ import from it.

Each server runs in-process (uvicorn in a background thread, on a socket bound to 127.0.0.1:0)
so a test can compare its output with `specdec.generate` on the very same model objects
(`expected`, taking `engine.lock`, as the server's worker does).

    models     MockModel pairs (no tokenizer): /v1/completions with token-id prompts; the text
               is the ids joined by spaces. `SlowMock` sleeps in every forward pass to make
               requests overlap; `FakeTokenizer` (one character per id) lets a mock read text.
    servers    `Server` over any engine; `mock_server` builds the mock pair from keywords,
               `serve_models` serves the models a test built itself
    HTTP       `Server.request` for raw requests (what the openai client will not send),
               `Server.client` for the openai client; `bearer`, `open_stream` (a stream read
               by specdec.study.engines.stream, the one reader of streams), `metric`,
               `error_of`, `assert_good_request_exact`, `wait_for`
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

from specdec.backends.mock import MockModel
from specdec.core.config import Warp
from specdec.core.generate import generate
from specdec.serve.app import create_app
from specdec.serve.config import ServeConfig
from specdec.serve.connections import uvicorn_server
from specdec.serve.edge import LocalReplicas, create_edge_app
from specdec.serve.engine import Engine
from specdec.study.engines.stream import read_stream

V = 48
MOCK_SPEC = "mock:vocab=48,seed=0"
API_KEY = "test-key"
JSON = {"Content-Type": "application/json"}
#: A small greedy-able request every mock server answers (with AUTH where it has API_KEY).
GOOD = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 4}


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header for `key`; none for no key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


AUTH = bearer(API_KEY)


# ---------------------------------------------------------------------------- models
class SlowMock(MockModel):
    """A MockModel whose forward passes take `delay` seconds, like a real model's."""

    delay = 0.0

    def _extend(self, ids: list[int]) -> Any:
        time.sleep(self.delay)
        return super()._extend(ids)


class FakeTokenizer:
    """The slice of the HF tokenizer interface the server uses, over the mock's 48 ids: one
    character per token. Like the Rust tokenizers it refuses text with a lone surrogate, and a
    prompt starting with "slow" takes `delay` seconds to encode (a 1 MiB body's worth)."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None
    delay = 1.5

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate, as tokenizers raises
        if text.startswith("slow"):
            time.sleep(self.delay)
        return {"input_ids": [ord(c) % V for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if any(i < 0 for i in ids):  # as the Rust tokenizers refuse them
            raise OverflowError("can't convert negative int to unsigned")
        return "".join(chr(ord("0") + i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(ord("0") + i): i for i in range(V)}


# ---------------------------------------------------------------------------- servers
class Server:
    """uvicorn serving `create_app(engine, cfg)` on a fresh loopback port, in a thread."""

    def __init__(self, engine: Engine, cfg: ServeConfig, app: Any = None) -> None:
        self.engine = engine
        self.api_key = cfg.api_key
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = create_app(engine, cfg) if app is None else app
        self.uv = uvicorn_server(app, log_level="warning", lifespan="on")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """Raw HTTP (for what the openai client will not send): status, headers, parsed body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {**JSON, **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        ctype = resp.getheader("content-type", "")
        parsed = json.loads(raw) if ctype.startswith("application/json") else raw.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed

    def metrics(self) -> str:
        return self.request("GET", "/metrics", headers=bearer(self.api_key))[2]

    def wait_idle(self, timeout: float = 30) -> None:
        e = self.engine
        wait_for(lambda: not (e.busy or e.queue_depth), timeout, "engine still busy")

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


class EdgeServer(Server):
    """The cluster's front door (serve.edge) over `engines`, each a replica in this process
    (serve.edge.LocalReplicas, named r0, r1, ...): the cluster's HTTP path without Ray."""

    def __init__(self, engines: list[Engine], cfg: ServeConfig) -> None:
        self.engines = engines
        apps = {}
        for i, engine in enumerate(engines):
            engine.start()
            apps[f"r{i}"] = create_app(engine, cfg, replica=f"r{i}")
        self.replicas = LocalReplicas(apps)
        super().__init__(engines[0], cfg, create_edge_app(self.replicas, cfg))
        door = lambda: self.uv.config.app.state.specdec.door  # noqa: E731
        wait_for(lambda: door() is not None and len(door().known) == len(engines), 10, "replicas")

    def wait_idle(self, timeout: float = 30) -> None:
        for e in self.engines:
            wait_for(lambda e=e: not (e.busy or e.queue_depth), timeout, "engine still busy")

    def close(self) -> None:
        super().close()
        for engine in self.engines:
            engine.stop(timeout=5.0)


def mock_server(**cfg_kw: Any) -> Server:
    """A mock target (and, unless `with_draft=False`, a draft near it) behind a warmed-up
    engine. Besides ServeConfig's fields: `delay` per forward pass, the target's `n_ctx`,
    `engine_kwargs` for the engine's SpecConfig, and `edge=N`: N such engines behind the
    cluster's front door (`EdgeServer`) instead of one server."""
    replicas = cfg_kw.pop("edge", 0)
    if replicas:
        engines = [_mock_engine(dict(cfg_kw))[0] for _ in range(replicas)]
        return EdgeServer(engines, ServeConfig(target=MOCK_SPEC, replicas=replicas, **_cfg(cfg_kw)))
    engine, cfg = _mock_engine(cfg_kw)
    return Server(engine, cfg)


#: The two HTTP front ends every hostile test runs against: one `specdec serve`, and the
#: cluster's edge over two in-process replicas (`specdec serve --replicas 2` without Ray).
FRONTS = ("single", "edge")


def front_server(front: str, **cfg_kw: Any) -> Server:
    """mock_server behind the front end `front` (one of FRONTS)."""
    assert front in FRONTS, front
    return mock_server(**cfg_kw, edge=2 if front == "edge" else 0)


_MOCK_KW = ("delay", "n_ctx", "with_draft", "engine_kwargs", "tokenizer")


def _cfg(cfg_kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg_kw.items() if k not in _MOCK_KW}


def _mock_engine(cfg_kw: dict[str, Any]) -> tuple[Engine, ServeConfig]:
    delay = cfg_kw.pop("delay", 0.0)
    n_ctx = cfg_kw.pop("n_ctx", 4096)
    with_draft = cfg_kw.pop("with_draft", True)
    # K = 4 and no draft pools unless a test asks for them
    spec = {"k": 4, "draft_pool": "off"} | cfg_kw.pop("engine_kwargs", {})
    target = SlowMock(V, seed=0, n_ctx=n_ctx, name=MOCK_SPEC)
    target.tokenizer = cfg_kw.pop("tokenizer", None)
    target.delay = delay
    draft = None
    if with_draft:
        draft = SlowMock.near(target, noise=0.7, seed=1)
        draft.delay = delay
    cfg = ServeConfig(target=MOCK_SPEC, **spec | cfg_kw)
    engine = Engine(target, draft, cfg)
    engine.warm_up()
    return engine, cfg


def serve_models(target: MockModel, draft: MockModel | None = None, **cfg_kw: Any) -> Server:
    """A server over these models (the engine warmed up, as `specdec serve` does)."""
    cfg_kw = {"k": 4, "draft_pool": "off"} | cfg_kw
    cfg = ServeConfig(target=cfg_kw.pop("spec", MOCK_SPEC), **cfg_kw)
    engine = Engine(target, draft, cfg)
    engine.warm_up()
    return Server(engine, cfg)


def expected(
    srv: Server, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> Any:
    """What `specdec generate` gives for this request, on the server's own models."""
    e = srv.engine.models
    with srv.engine.lock:
        return generate(
            e.target,
            prompt_ids,
            draft=e.draft,
            spec=e.defaults.config,
            warp=Warp(temperature),
            max_new_tokens=max_tokens,
            seed=seed,
            stop_ids=e.stop_ids,
        )


# ---------------------------------------------------------------------------- HTTP helpers
def open_stream(srv: Server, body: dict) -> tuple[http.client.HTTPConnection, Any]:
    """A streaming request, read (by the library's stream reader) up to its first chunk with
    generated text; the rest of the stream is left unread in `resp`."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON)
    resp = conn.getresponse()
    assert resp.status == 200
    url = f"http://127.0.0.1:{srv.port}/v1/completions"
    # a line at a time, so that nothing past the first text chunk is taken from `resp`
    got = read_stream(iter(resp.readline, b""), url, until=lambda r: bool(r.pieces))
    assert got.pieces, "the stream ended before any text"
    return conn, resp


def stream_events(srv: Server, path: str, body: dict) -> list[dict[str, Any]]:
    """A streamed request's events, parsed by the library's stream reader, which checks the
    stream ends with [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), JSON)
    resp = conn.getresponse()
    try:
        assert resp.status == 200, resp.read()
        got = read_stream(resp, f"http://127.0.0.1:{srv.port}{path}", keep=True)
    finally:
        conn.close()
    assert got.done, "the stream ended without [DONE]"
    return got.chunks or []


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def error_of(status: int, body: Any, code: str | None = None) -> dict:
    """The `error` object of an OpenAI-shaped error body, its shape checked (and its code)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_good_request_exact(srv: Server, headers: dict[str, str] | None = None) -> None:
    """A greedy request after a bad one: still served, and still exactly `generate()`'s."""
    body = {**GOOD, "temperature": 0, "seed": 1, "return_token_ids": True}
    ok, _, good = srv.request("POST", "/v1/completions", body, headers)
    assert ok == 200, good
    want = expected(srv, GOOD["prompt"], GOOD["max_tokens"]).tokens
    assert good["choices"][0]["token_ids"] == want
    assert good["choices"][0]["text"] == " ".join(map(str, want))


def wait_for(cond: Callable[[], Any], timeout: float = 20, what: str = "timed out") -> None:
    """Poll `cond` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
