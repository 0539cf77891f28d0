#!/usr/bin/env python3
"""Issue 65's hostile check against both front doors, one `specdec serve` and `--replicas 2`
(each replica --threads 1), on loopback, written as a specdec.front_door_check/1 record:

    python scripts/front_door_check.py --out results/cpu/cluster/front_door.json

    slow_bodies  keyless connections from 127.0.0.2 that send a request's head and one byte of
                 its body, then nothing: 16 at --max-connections 16, 256 at the defaults; while
                 they hold their places, /health's latency and a keyed 8-token request's,
                 against the same request before them
    heads        a 20 KB header, a 9 KB URL, a 70 KB header, 200 times each: the status, and
                 the server processes' RSS before and after
    storm        64 requests naming a wrong model with a 70 KB prompt (16 at a time), then
                 another key's 4-token request: its latency, and the running gauges after
    fairness     --max-queue 2 --parallel 1: one key sends 8 64-token requests at once, the
                 other key one: its latency against one generation alone
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from loadtest_common import write_record

KEYS = ("key-alpha", "key-beta")
OPERATOR = "key-operator"
SLOW_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)


class Server:
    """`specdec serve` with two keys and an operator key, on a free loopback port."""

    def __init__(self, target: str, tmp: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (tmp / "keys").write_text("\n".join(KEYS) + "\n")
        (tmp / "operator").write_text(OPERATOR + "\n")
        self.target = target
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--target", target]
        cmd += ["--port", str(self.port), "--threads", "1", "--api-keys-file", str(tmp / "keys")]
        cmd += ["--metrics-key-file", str(tmp / "operator"), *extra]
        self.log = tmp / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while self.post(4, timeout=5)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() - t0 > 300:
                self.proc.kill()
                raise SystemExit(self.log.read_text()[-3000:])
            time.sleep(0.5)

    def post(
        self,
        max_tokens: int,
        key: str = KEYS[0],
        model: str | None = None,
        prompt: str = "def f(x):",
        timeout: float = 120,
    ) -> tuple[int, float]:
        body = {"model": model or self.target, "prompt": prompt, "max_tokens": max_tokens}
        body["temperature"] = 0
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status, time.monotonic() - t0
        except OSError:
            return 0, time.monotonic() - t0

    def get(self, path: str, key: str | None = None) -> tuple[int, float, bytes]:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, time.monotonic() - t0, raw

    def rss_mb(self) -> float:
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        ray = [p for p in psutil.process_iter() if _is_ray(p)]
        return sum(p.memory_info().rss for p in {*procs, *ray} if p.is_running()) / 2**20

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _is_ray(p: psutil.Process) -> bool:
    try:
        line = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(m in line for m in ("raylet", "gcs_server", "ray::", "default_worker.py"))


def slow_bodies(srv: Server, connections: int) -> dict[str, Any]:
    _, usual = srv.post(8)
    socks, refused = [], 0
    for _ in range(connections):
        try:
            c = socket.create_connection(
                ("127.0.0.1", srv.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            c.sendall(SLOW_BODY)
            socks.append(c)
        except OSError:
            refused += 1
    health, keyed = [], []
    try:
        for _ in range(5):
            status, took, _ = srv.get("/health")
            health.append(took if status == 200 else None)
            status, took = srv.post(8)
            keyed.append(took if status == 200 else None)
            time.sleep(0.5)
    finally:
        for c in socks:
            c.close()
    return {
        "connections": connections,
        "refused_at_connect": refused,
        "keyed_before_s": round(usual, 3),
        "health_s": [None if t is None else round(t, 4) for t in health],
        "keyed_s": [None if t is None else round(t, 3) for t in keyed],
    }


def heads(srv: Server) -> dict[str, Any]:
    cases = {
        "header_20kb": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000,
        "url_9kb": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1",
        "header_70kb": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000,
    }
    before = srv.rss_mb()
    out: dict[str, Any] = {}
    for name, head in cases.items():
        answers = set()
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:
                c.sendall(head + b"\r\n\r\n")
                first = c.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
                answers.add(first or "(closed)")
        out[name] = sorted(answers)
    out["rss_before_mb"], out["rss_after_mb"] = round(before), round(srv.rss_mb())
    return out


def storm(srv: Server) -> dict[str, Any]:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        asks = [pool.submit(srv.post, 4, KEYS[0], "nope", "x" * 70_000) for _ in range(64)]
        statuses = [a.result()[0] for a in asks]
    wall = time.monotonic() - t0
    status, took = srv.post(4, KEYS[1])
    _, _, text = srv.get("/metrics", OPERATOR)
    gauges = [
        ln
        for ln in text.decode().splitlines()
        if ln.startswith(("specdec:num_requests_running", "specdec_edge_slots_held"))
    ]
    return {
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "storm_s": round(wall, 2),
        "other_key": {"status": status, "s": round(took, 3)},
        "gauges_after": gauges,
    }


def fairness(srv: Server) -> dict[str, Any]:
    _, alone = srv.post(64)
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        flood = [pool.submit(srv.post, 64, KEYS[0]) for _ in range(8)]
        time.sleep(1.0)
        status, took = srv.post(64, KEYS[1])
        statuses = [f.result()[0] for f in flood]
    return {
        "one_generation_s": round(alone, 3),
        "other_key": {"status": status, "s": round(took, 3)},
        "flood_statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="llamacpp:qwen2.5-coder-0.5b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    record: dict[str, Any] = {"target": args.target, "modes": {}}
    for mode, extra in (("single", ()), ("cluster", ("--replicas", "2"))):
        got: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for connections in (16, 256):
                srv = Server(args.target, tmp, *extra, "--max-connections", str(connections))
                try:
                    got[f"slow_bodies_{connections}"] = slow_bodies(srv, connections)
                    if connections == 256:
                        got["heads"] = heads(srv)
                        got["storm"] = storm(srv)
                finally:
                    srv.stop()
            srv = Server(args.target, tmp, *extra, "--max-queue", "2")
            try:
                got["fairness"] = fairness(srv)
            finally:
                srv.stop()
        record["modes"][mode] = got
        print(mode, json.dumps(got, indent=1), file=sys.stderr)
    if args.out:
        write_record(args.out, "specdec.front_door_check/1", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
