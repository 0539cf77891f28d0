"""`specdec serve --replicas 2 --ray-address` on two real Ray nodes: a head and a worker, each in
a network namespace this test makes (a veth pair, addresses that exist only inside the two
namespaces), Ray's token authentication on, one replica per node (one CPU each).

    token      a client without the cluster's token is refused
    both       a burst of streams is served by both nodes' replicas
    cut        the worker's link goes down once every stream of a burst has text: the worker's
               streams end with an error event (Ray declares the node dead), none hangs, the
               head's complete
    after      the next burst completes, on the head's replica

Needs root and iproute2 (CI has both; elsewhere it says what is missing). ~1.5 minutes; `slow`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

HEAD_IP, WORKER_IP, PREFIX = "10.231.0.1", "10.231.0.2", 24
RAY_PORT, HTTP_PORT = 6390, 8000
BIN = Path(sys.executable).parent
#: Ray declares a node dead after 5 failed health checks, here a second apart and each given 2 s
#: (Ray's defaults: 3 s apart and 10 s each, ~55 s from the cut to the streams' error events)
FAST_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}

#: The client, run inside the head's namespace: streams a burst at the edge and prints each
#: stream's replica, text length, error event and seconds as one JSON line. Given a command
#: (argv 6, JSON), it runs it once every stream has its first text: the worker's link is cut
#: while its streams are running, however fast this host generates (each has max_tokens to go,
#: the streams' first texts come within one prefill of each other).
BURST = """
import concurrent.futures, http.client, json, subprocess, sys, threading, time
host, model = sys.argv[1], sys.argv[5]
port, n, max_tokens = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cut = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
lock, first = threading.Lock(), []
def has_text(i):
    with lock:
        first.append(i)
        if cut and len(first) == n:  # a thread of its own: every stream goes on reading
            threading.Thread(target=subprocess.run, args=(cut,), kwargs={"check": True}).start()
def one(i):
    t0 = time.monotonic()
    c = http.client.HTTPConnection(host, port, timeout=150)
    body = {"model": model, "prompt": f"# {i}\\ndef count(n):\\n", "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    out = {"status": r.status, "replica": r.getheader("x-specdec-replica"), "text": 0,
           "error": None, "done": False}
    for line in r:
        line = line.strip()
        if line == b"data: [DONE]":
            out["done"] = True
        elif line.startswith(b"data: "):
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
            else:
                out["text"] += len(event["choices"][0].get("text") or "")
                if out["text"] and "first" not in out:
                    out["first"] = time.monotonic() - t0
                    has_text(i)
    out["s"] = time.monotonic() - t0
    return out
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    print(json.dumps(list(pool.map(one, range(n)))))
"""


def _need_root_and_ip() -> None:
    missing = [] if shutil.which("ip") else ["iproute2 (apt-get install iproute2)"]
    if os.geteuid() != 0:
        missing.append("root (network namespaces)")
    if missing:
        message = "the two-node test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Nodes:
    """Two namespaces joined by a veth pair, and what runs in them."""

    def __init__(self, tmp: Path) -> None:
        tag = f"{os.getpid() % 100000}"
        self.head, self.worker = f"sdh{tag}", f"sdw{tag}"
        self.head_if, self.worker_if = f"vh{tag}", f"vw{tag}"
        self.tmp = tmp
        self.token = secrets.token_hex(16)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            **FAST_DEATH,
        }
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        _ip("netns", "add", self.head)
        _ip("netns", "add", self.worker)
        _ip("link", "add", self.head_if, "type", "veth", "peer", "name", self.worker_if)
        for ns, dev, addr in (
            (self.head, self.head_if, HEAD_IP),
            (self.worker, self.worker_if, WORKER_IP),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(
        self, ns: str, *cmd: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> Any:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *cmd],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start_ray(self) -> None:
        common = ["--num-cpus", "1", "--disable-usage-stats"]
        head = self.run(
            self.head,
            str(BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address",
            HEAD_IP,
            "--port",
            str(RAY_PORT),
            "--include-dashboard",
            "false",
            "--temp-dir",
            str(self.tmp / "rh"),
            *common,
        )
        assert head.returncode == 0, head.stderr[-2000:]
        worker = self.run(
            self.worker,
            str(BIN / "ray"),
            "start",
            "--address",
            f"{HEAD_IP}:{RAY_PORT}",
            "--node-ip-address",
            WORKER_IP,
            "--temp-dir",
            str(self.tmp / "rw"),
            *common,
        )
        assert worker.returncode == 0, worker.stderr[-2000:]

    def serve(self, target: str) -> subprocess.Popen:
        self.target = target
        cmd = [str(BIN / "specdec"), "serve", "--target", target, "--threads", "1"]
        cmd += ["--replicas", "2", "--ray-address", f"{HEAD_IP}:{RAY_PORT}"]
        cmd += ["--host", HEAD_IP, "--port", str(HTTP_PORT)]
        self.log = self.tmp / "serve.log"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.head, *cmd],
            env=self.env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def burst(
        self, n: int, max_tokens: int, cut: list[str] | None = None, timeout: float = 180
    ) -> list[dict[str, Any]]:
        script = self.tmp / "burst.py"
        script.write_text(BURST)
        args = [sys.executable, str(script), HEAD_IP, str(HTTP_PORT), str(n), str(max_tokens)]
        args += [self.target, *([json.dumps(cut)] if cut else [])]
        out = self.run(self.head, *args, timeout=timeout)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    def health(self) -> dict[str, Any] | None:
        code = (
            "import http.client, json\n"
            f"c = http.client.HTTPConnection('{HEAD_IP}', {HTTP_PORT}, timeout=5)\n"
            "c.request('GET', '/health'); print(c.getresponse().read().decode())\n"
        )
        out = self.run(self.head, sys.executable, "-c", code, timeout=20)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def down(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for ns in (self.worker, self.head):
            self.run(ns, str(BIN / "ray"), "stop", "--force", timeout=60)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    _need_root_and_ip()
    # a short path: Ray's sockets live under its temp dir (108 bytes at most)
    tmp = Path(f"/tmp/sd2n{os.getpid() % 100000}")
    tmp.mkdir(exist_ok=True)
    n = Nodes(tmp)
    try:
        n.up()
        n.start_ray()
        yield n
    finally:
        n.down()
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_nodes_with_token_auth_serve_and_survive_a_cut_link(
    nodes: Nodes, qwen05_path: Path
) -> None:
    # a client without the token is refused by the head
    stranger = {**nodes.env, "RAY_AUTH_TOKEN": "not-the-token"}
    status = nodes.run(
        nodes.worker, str(BIN / "ray"), "status", "--address", f"{HEAD_IP}:{RAY_PORT}", env=stranger
    )
    assert status.returncode != 0 and "Auth" in status.stderr + status.stdout, status.stdout

    serve = nodes.serve(f"llamacpp:{qwen05_path}")
    deadline = time.monotonic() + 240
    while (nodes.health() or {}).get("replicas") != 2:
        assert serve.poll() is None, nodes.log.read_text()[-3000:]
        assert time.monotonic() < deadline, nodes.log.read_text()[-3000:]
        time.sleep(1)

    both = nodes.burst(4, 16)
    assert all(s["status"] == 200 and s["done"] and s["text"] for s in both), both
    replicas = {s["replica"] for s in both}
    assert len(replicas) == 2, both  # one replica on each node

    # the link goes down once all four streams have text: the worker's two are mid-stream
    cut = ["ip", "-n", nodes.worker, "link", "set", nodes.worker_if, "down"]
    t0 = time.monotonic()
    during = nodes.burst(4, 128, cut=cut)
    assert time.monotonic() - t0 < 150  # none hung
    failed = [s for s in during if s["error"]]
    assert failed and all("replica" in s["error"] and not s["done"] for s in failed), during
    lost = {s["replica"] for s in failed}
    assert len(lost) == 1, during  # the worker's replica alone
    assert all(s["done"] for s in during if s["replica"] not in lost), during

    after = nodes.burst(4, 16)
    assert all(s["status"] == 200 and s["done"] and s["text"] for s in after), after
    assert {s["replica"] for s in after} == replicas - lost, after

    serve.send_signal(signal.SIGINT)
    assert serve.wait(90) == 0, nodes.log.read_text()[-3000:]
