"""`specdec serve --replicas 2 --threads 1` on loopback (serve.cluster): a local Ray with two
engine replicas of qwen2.5-coder-0.5b, driven over HTTP as a client would, beside the same model
served by one plain `specdec serve`.

    kinds      stream, prediction, tools and logprobs answer with the single server's text (T=0)
    affinity   2 keys x 2 files: each pair on one replica every time, its later requests served
               from that replica's prompt cache (cached_tokens >= 80% of the prompt)
    worker     x-request-id echoed, /health, /metrics merged with a replica label and the
               edge's gauges (serve.edge.merge_metrics is unit-tested in test_router_surface.py)
    front door no Ray proxy runs, Ray's request headers do nothing; 256 keyless slow bodies
               leave /health and a keyed user alone; a storm of fast 404s with 70 KB prompts
               leaves nothing running or counted (test_hostile.py runs these and more
               against the edge without Ray)
    failure    a replica killed (SIGKILL) during a burst of 8: none hangs, each completes or
               names the failure; the next burst completes
    disconnect a client that goes away mid-stream frees its replica's slot
    shutdown   SIGINT while a stream runs: the stream finishes, then no Ray process is left

One cluster for the module (~20 s to start on a 2-core machine); `slow`, so `make test-fast`
leaves it out.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.slow

KEYS = ("key-alpha", "key-beta")
OPERATOR = "key-operator"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


class Proc:
    """A `specdec serve` subprocess on a free loopback port."""

    def __init__(self, target: str, keys_file: Path, *extra: str) -> None:
        self.target = target
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--target", target]
        cmd += ["--port", str(self.port), "--threads", "1", "--api-keys-file", str(keys_file)]
        cmd += ["--metrics-key-file", str(keys_file.parent / "operator")]
        self.log = keys_file.parent / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [*cmd, *extra],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
        self.started = time.monotonic()

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start to the first answer."""
        deadline = self.started + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            try:
                status, _, r = self.request("POST", "/v1/completions", _completion("x", 1), 0)
                assert status in (200, 404, 503), r  # 404: Ray has no route yet
                if status == 200:
                    return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.5)

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        key: int | str = 0,
        extra: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {**_headers(key), **(extra or {})}
        if body is not None and body.get("model") == "m":  # the name this server answers to
            body = {**body, "model": self.target}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        head = {k.lower(): v for k, v in resp.getheaders()}
        is_json = head.get("content-type", "").startswith("application/json")
        return resp.status, head, json.loads(raw) if is_json else raw.decode()

    def stream(self, body: dict, key: int = 0) -> tuple[str, list[dict], str | None]:
        """(the text, the events, the error message of an error event, if any)."""
        status, _, raw = self.request("POST", "/v1/chat/completions", {**body, "stream": True}, key)
        assert status == 200, raw
        events, error = [], None
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                else:
                    events.append(event)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        return text, events, error

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(90)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)


def _headers(key: int | str) -> dict[str, str]:
    token = KEYS[key] if isinstance(key, int) else key
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    return {**auth, "X-Request-Id": "trace-42"}


def _completion(prompt: str, max_tokens: int) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _chat(content: str, **kw: Any) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **kw,
    }


FILE = "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n"
KINDS: dict[str, dict] = {
    "plain": _chat("Write a Python function that reverses a string.", max_tokens=24),
    "prediction": _chat(
        f"Rename the function to sum_all:\n{FILE}",
        max_tokens=40,
        prediction={"type": "content", "content": FILE.replace("total", "sum_all")},
    ),
    "tools": _chat("What is the weather in Paris?", tools=TOOLS, tool_choice="required"),
    "logprobs": _chat("Say hello.", max_tokens=8, logprobs=True, top_logprobs=2),
}


def _answer(r: dict) -> Any:
    msg = r["choices"][0]["message"]
    logprobs = r["choices"][0].get("logprobs")
    tokens = [t["token"] for t in logprobs["content"]] if logprobs else None
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []
    ]
    return msg.get("content"), calls, tokens


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "keys"
    path.write_text("\n".join(KEYS) + "\n")
    (path.parent / "operator").write_text(OPERATOR + "\n")
    return path


@pytest.fixture(scope="module")
def single(qwen05_path: Path, keys_file: Path) -> dict[str, Any]:
    """The answers of one plain `specdec serve` (no Ray) to KINDS."""
    srv = Proc(f"llamacpp:{qwen05_path}", keys_file)
    try:
        srv.wait_ready(120)
        out = {}
        for name, body in KINDS.items():
            status, _, r = srv.request("POST", "/v1/chat/completions", body)
            assert status == 200, r
            out[name] = _answer(r)
        out["stream"] = srv.stream(KINDS["plain"])[0]
        return out
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def cluster(qwen05_path: Path, keys_file: Path, single: dict) -> Iterator[Proc]:
    before = _ray_processes()
    srv = Proc(f"llamacpp:{qwen05_path}", keys_file, "--replicas", "2")
    try:
        srv.ready_s = srv.wait_ready(180)
        yield srv
    finally:
        srv.stop()
    assert _ray_processes() <= before, "Ray processes left behind"


def _processes(*marks: str) -> list[int]:
    """The processes whose command line holds any of `marks`."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if any(m in line for m in marks):
            found.append(p.info["pid"])
    return found


def _ray_processes() -> set[int]:
    return set(_processes("raylet", "gcs_server", "ray::", "ray/dashboard", "default_worker.py"))


def test_every_kind_answers_as_the_single_server(cluster: Proc, single: dict) -> None:
    assert cluster.ready_s < 90, f"first answer after {cluster.ready_s:.0f} s"
    for name, body in KINDS.items():
        status, head, r = cluster.request("POST", "/v1/chat/completions", body)
        assert status == 200, (name, r)
        assert _answer(r) == single[name], name
        assert r["usage"]["replica"] == head["x-specdec-replica"]
        if name == "tools":
            assert r["choices"][0]["finish_reason"] == "tool_calls"
        if name == "prediction":
            assert r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    text, events, error = cluster.stream(KINDS["plain"])
    assert error is None and text == single["stream"] and len(events) > 2


def test_a_key_and_file_stay_on_one_replica_and_hit_its_prompt_cache(cluster: Proc) -> None:
    # 586 prompt tokens each: the cache keeps whole 16-token blocks (97% of it), and a first
    # request prefills half what 60 functions took
    files = [
        "".join(f"def f{i}_{j}(x):\n    return x * {i} + {j}\n\n" for j in range(30))
        for i in range(2)
    ]
    home: dict[tuple[int, int], str] = {}
    # Each pair's two requests in a row: a replica's one slot (--parallel 1) keeps one prompt,
    # so pairs interleaved on one replica would evict each other (docs/serving.md).
    for key, f in ((0, 0), (1, 1), (0, 1), (1, 0)):
        for n in range(2):
            body = _chat(f"Add type hints to this file:\n{files[f]}", max_tokens=4)
            status, head, r = cluster.request("POST", "/v1/chat/completions", body, key)
            assert status == 200, r
            where = head["x-specdec-replica"]
            assert home.setdefault((key, f), where) == where, (key, f, n)
            if n == 1:
                usage = r["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 0.8 * usage["prompt_tokens"], (key, f, usage)
    # new pairs go where the fewest pairs live (the earlier tests' prompts count too)
    assert len(set(home.values())) == 2, f"all pairs on one replica: {home}"


def test_worker_surface_through_the_cluster(cluster: Proc) -> None:
    status, head, body = cluster.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert head["x-request-id"] == "trace-42"
    status, head, r = cluster.request(
        "POST", "/v1/chat/completions", {**KINDS["plain"], "max_tokens": 2, "no_such_field": 1}
    )
    assert status == 200 and head["x-request-id"] == "trace-42"
    status, _, r = cluster.request("GET", "/metrics", key=0)
    assert status == 403 and r["error"]["code"] == "operator_key_required"
    status, _, text = cluster.request("GET", "/metrics", key=OPERATOR)
    assert status == 200
    names = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}
    assert {"specdec:num_requests_waiting", "specdec:kv_cache_usage_perc"} <= names
    replicas = {
        ln.split('replica="')[1].split('"')[0] for ln in text.splitlines() if "replica=" in ln
    }
    assert len(replicas) == 2, replicas
    status, _, r = cluster.request("POST", "/v1/chat/completions", {"model": "m"})
    assert status == 400 and r["error"]["param"] == "messages"


def test_no_ray_proxy_and_no_client_header_reaches_ray(cluster: Proc) -> None:
    assert not _processes("ProxyActor"), "Ray's HTTP proxy runs"
    # Ray's proxy took these from any client: the first turned its timeout off
    headers = {"x-request-timeout-seconds": "0", "x-request-disconnect-disabled": "1"}
    headers.update({"x-specdec-deadline-s": "0"})  # the edge's own, to a replica: dropped
    status, _, r = cluster.request("POST", "/v1/completions", _completion("x", 2), 0, headers)
    assert status == 200, r


def test_slow_bodies_and_a_storm_of_4xx_leave_the_cluster_serving(cluster: Proc) -> None:
    t0 = time.monotonic()
    status, _, _ = cluster.request("POST", "/v1/completions", _completion("def f(x):", 8))
    usual = time.monotonic() - t0
    assert status == 200
    slow = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    socks = []
    try:
        for _ in range(256):  # from another address: half of them get places, the rest 503
            c = socket.create_connection(
                ("127.0.0.1", cluster.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            c.sendall(slow)
            socks.append(c)
        for _ in range(3):
            t0 = time.monotonic()
            status, _, health = cluster.request("GET", "/health")
            assert status == 200 and time.monotonic() - t0 < 1.0, health
            t0 = time.monotonic()
            status, _, r = cluster.request("POST", "/v1/completions", _completion("def f(x):", 8))
            assert status == 200 and time.monotonic() - t0 < usual + 2.0, r
    finally:
        for c in socks:
            c.close()
    wrong = {**_completion("x" * 70_000, 4), "model": "nope"}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        asks = [pool.submit(cluster.request, "POST", "/v1/completions", wrong) for _ in range(64)]
        statuses = [a.result()[0] for a in asks]
    assert set(statuses) <= {404, 429} and statuses.count(404) >= 16, statuses
    t0 = time.monotonic()
    status, _, r = cluster.request("POST", "/v1/completions", _completion("def g(y):", 4), 1)
    assert status == 200 and time.monotonic() - t0 < usual + 2.0, r
    status, _, text = cluster.request("GET", "/metrics", key=OPERATOR)
    running = [ln for ln in text.splitlines() if ln.startswith("specdec:num_requests_running{")]
    held = [ln for ln in text.splitlines() if ln.startswith("specdec_edge_slots_held{")]
    assert len(running) == 2 and len(held) == 2, text[-2000:]
    assert all(ln.endswith(" 0") for ln in running + held), running + held


def test_a_client_that_goes_away_frees_its_replicas_slot(cluster: Proc) -> None:
    body = {**_chat("Count from 1 to 500, one number a line."), "max_tokens": 1500, "stream": True}
    body["model"] = cluster.target
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), _headers(0))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")

    def running() -> float:
        status, _, text = cluster.request("GET", "/metrics", key=OPERATOR)
        assert status == 200, text
        lines = [ln for ln in text.splitlines() if ln.startswith("specdec:num_requests_running")]
        return sum(float(ln.split()[-1]) for ln in lines)

    assert running() == 1
    conn.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 20
    while running() != 0:  # the generation was withdrawn, not run to its 1,500 tokens
        assert time.monotonic() < deadline, "the replica still generates for a gone client"
        time.sleep(0.5)


def test_a_killed_replica_fails_its_requests_by_name_and_the_next_burst_completes(
    cluster: Proc,
) -> None:
    bodies = [_chat(f"Count from {i} to {i + 30}.", max_tokens=24) for i in range(8)]

    def one(body: dict) -> tuple[str, str | None]:
        try:
            text, _, error = cluster.stream(body)
            return text, error
        except AssertionError as e:  # 503 before any byte: the failure is named in the body
            return "", str(e)

    victim = _replicas()[0]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, b) for b in bodies]
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=150) for f in futures]  # none hangs
    for text, error in results:
        assert error is None or "replica" in error, error
        assert text or error
    assert sum(error is None for _, error in results) >= 4
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        after = list(pool.map(one, bodies, timeout=300))
    assert all(error is None and text for text, error in after), after


def _replicas() -> list[int]:
    return _processes("specdec-engine")


def test_sigint_lets_a_running_stream_finish_then_leaves_nothing(cluster: Proc) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ask = _chat("Write a long story about a lighthouse keeper.", max_tokens=300)
        running = pool.submit(cluster.stream, ask)
        time.sleep(1.0)
        cluster.proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _, events, error = running.result(timeout=120)
        after = time.monotonic() - signalled
    # the whole answer, generated for seconds past the signal (a 0.5B, one thread)
    assert error is None and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert after > 2.0, f"the answer ended {after:.1f} s after the signal: nothing was drained"
    assert cluster.proc.wait(90) == 0
