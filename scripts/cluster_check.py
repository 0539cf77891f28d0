#!/usr/bin/env python3
"""`specdec serve --replicas 2 --threads 1` on loopback against one plain `specdec serve`
(issue 54's held-out check), written as a specdec.cluster_check/1 record:

    python scripts/cluster_check.py --out results/cpu/cluster/loopback.json

    start        seconds from the command to its first answer; each process's RSS (Ray's own
                 processes, each engine replica, the single server)
    kinds        chat, stream, prediction, tools and logprobs at T=0: the cluster's text equals
                 the single server's
    affinity     2 API keys x 2 files, 8 requests, each pair's two in a row: the replica of each
                 pair, and cached_tokens / prompt_tokens of its second request; then the same 8
                 interleaved (pair by pair, round by round), where one slot per replica keeps one
                 prompt
    burst        8 different requests at once, three times: wall time on the cluster and on the
                 single server (--threads 2 --parallel 2: the same two cores as one engine)
    kill         a replica SIGKILLed 1.5 s into a burst of 8 streams: how each ended (answer,
                 error naming the failure, hung), then a second burst, and when Ray's replacement
                 answered
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
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
from loadtest_common import rss_mb, write_record

KEYS = ("key-alpha", "key-beta")
FILE = "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def chat(content: str, **kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


KINDS = {
    "plain": chat("Write a Python function that reverses a string.", max_tokens=48),
    "prediction": chat(
        f"Rename the function to sum_all:\n{FILE}",
        max_tokens=48,
        prediction={"type": "content", "content": FILE.replace("total", "sum_all")},
    ),
    "tools": chat("What is the weather in Paris?", tools=TOOLS, tool_choice="required"),
    "logprobs": chat("Say hello.", max_tokens=8, logprobs=True, top_logprobs=2),
}
FILES = [
    "".join(f"def f{i}_{j}(x):\n    return x * {i} + {j}\n\n" for j in range(60)) for i in range(2)
]


#: 2 keys x 2 files, round by round: a replica with one slot keeps only its last prompt
INTERLEAVED = [(0, 0), (1, 1), (0, 1), (1, 0)] * 2


class Server:
    def __init__(self, target: str, keys: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.target = target
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--target", target]
        cmd += ["--port", str(self.port), "--api-keys-file", str(keys), *extra]
        self.log = keys.parent / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None or time.monotonic() - t0 > 300:
                self.proc.kill()
                raise SystemExit(self.log.read_text()[-3000:])
            try:
                status, _, _ = self.post(chat("x", max_tokens=1))
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        self.ready_s = time.monotonic() - t0

    def post(self, body: dict, key: int = 0) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        headers = {"Authorization": f"Bearer {KEYS[key]}", "Content-Type": "application/json"}
        body = {"model": self.target, **body}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
        head = {k.lower(): v for k, v in resp.getheaders()}
        if head.get("content-type", "").startswith("application/json"):
            return resp.status, head, json.loads(raw)
        return resp.status, head, raw  # a stream, or Ray's 404 before the app is up

    def stream(self, body: dict) -> dict[str, Any]:
        try:
            status, _, raw = self.post({**body, "stream": True})
        except OSError as e:
            return {"outcome": "connection_error", "error": repr(e)}
        if status != 200:
            return {"outcome": f"http_{status}", "error": raw["error"]["message"]}
        text, error = "", None
        for line in raw.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                for c in event.get("choices", ()):
                    text += c["delta"].get("content") or ""
        return {"outcome": "error_event" if error else "answered", "error": error, "text": text}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def answer(r: dict) -> list:
    c = r["choices"][0]
    calls = [
        [t["function"]["name"], t["function"]["arguments"]]
        for t in c["message"].get("tool_calls", [])
    ]
    lp = [t["token"] for t in c["logprobs"]["content"]] if c.get("logprobs") else None
    return [c["message"].get("content"), calls, lp]


def kinds(srv: Server) -> dict[str, Any]:
    out = {name: answer(srv.post(body)[2]) for name, body in KINDS.items()}
    out["stream"] = srv.stream(KINDS["plain"])["text"]
    return out


def burst(srv: Server, n: int = 8) -> float:
    bodies = [
        chat(f"Count from {i} to {i + 30}, one number a line.", max_tokens=64) for i in range(n)
    ]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        got = list(pool.map(srv.stream, bodies))
    assert all(g["outcome"] == "answered" for g in got), got
    return time.perf_counter() - t0


def affinity(srv: Server, order: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    for key, f in order:
        status, head, r = srv.post(
            chat(f"Add type hints to this file:\n{FILES[f]}", max_tokens=4), key
        )
        assert status == 200, r
        u = r["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"] / u["prompt_tokens"]
        rows.append(
            {
                "key": key,
                "file": f,
                "replica": head["x-specdec-replica"],
                "cached": round(cached, 3),
            }
        )
    return rows


def total_rss_mb(pids: list[int]) -> float:
    return round(sum(rss_mb(p) or 0.0 for p in pids), 1)


def processes() -> dict[str, list[int]]:
    """Ray's processes by role, and the engine replicas."""
    out: dict[str, list[int]] = {"engine_replicas": [], "ray": []}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "specdec-engine" in line:
            out["engine_replicas"].append(p.info["pid"])
        elif any(
            m in line
            for m in (
                "raylet",
                "gcs_server",
                "ray::",
                "ray/_private",
                "ray/dashboard",
                "default_worker",
            )
        ):
            out["ray"].append(p.info["pid"])
    return out


def kill_during_burst(srv: Server) -> dict[str, Any]:
    victim = processes()["engine_replicas"][0]
    bodies = [
        chat(f"Count from {i} to {i + 30}, one number a line.", max_tokens=64) for i in range(8)
    ]
    replaced: list[float] = []

    def watch() -> None:  # until a new engine process stands beside the survivor
        while time.monotonic() - killed < 300:
            if len([p for p in processes()["engine_replicas"] if p != victim]) >= 2:
                replaced.append(time.monotonic() - killed)
                return
            time.sleep(0.2)

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(srv.stream, b) for b in bodies]
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        watcher = pool.submit(watch)
        done, hung = concurrent.futures.wait(futures, timeout=300)
    first = [f.result() for f in done]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        second = list(pool.map(srv.stream, bodies))
    second_s = time.perf_counter() - t0
    watcher.result()
    return {
        "first_burst": {
            o: sum(r["outcome"] == o for r in first) for o in {r["outcome"] for r in first}
        },
        "first_burst_errors": sorted({r["error"] for r in first if r["error"]}),
        "hung": len(hung),
        "second_burst_answered": sum(r["outcome"] == "answered" for r in second),
        "second_burst_s": round(second_s, 2),
        "replacement_process_after_s": round(replaced[0], 1) if replaced else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="specdec-cluster-"))
    servers: list[Server] = []
    try:
        return run(args, tmp, servers)
    finally:
        for srv in servers:
            if srv.proc.poll() is None:
                srv.stop()


def run(args: argparse.Namespace, tmp: Path, servers: list) -> int:
    keys = tmp / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    record: dict[str, Any] = {"target": args.target, "load": os.getloadavg()}

    single = Server(args.target, keys, "--threads", "1")
    servers.append(single)
    record["single_ready_s"] = round(single.ready_s, 1)
    record["single_rss_mb"] = total_rss_mb([single.proc.pid])
    want = kinds(single)
    single.stop()
    wide = Server(args.target, keys, "--threads", "2", "--parallel", "2")
    servers.append(wide)
    record["burst_single_2threads_s"] = [round(burst(wide), 2) for _ in range(3)]
    wide.stop()

    cl = Server(args.target, keys, "--threads", "1", "--replicas", "2")
    servers.append(cl)
    record["cluster_ready_s"] = round(cl.ready_s, 1)
    got = kinds(cl)
    record["kinds_equal"] = {k: got[k] == want[k] for k in want}
    record["affinity_consecutive"] = affinity(
        cl, [(0, 0), (0, 0), (1, 1), (1, 1), (0, 1), (0, 1), (1, 0), (1, 0)]
    )
    record["affinity_interleaved"] = affinity(cl, INTERLEAVED)
    procs = processes()
    record["rss_mb"] = {
        "ray_processes": total_rss_mb(procs["ray"]),
        "ray_process_count": len(procs["ray"]),
        "engine_replicas": [total_rss_mb([p]) for p in procs["engine_replicas"]],
    }
    record["burst_cluster_s"] = [round(burst(cl), 2) for _ in range(3)]
    record["kill"] = kill_during_burst(cl)
    cl.stop()
    # the same interleaving where each replica has a slot for each of its pairs
    wide_cl = Server(args.target, keys, "--threads", "1", "--replicas", "2", "--parallel", "2")
    servers.append(wide_cl)
    record["affinity_interleaved_parallel2"] = affinity(wide_cl, INTERLEAVED)
    wide_cl.stop()

    pairs = record["affinity_consecutive"]
    runs = [pairs, record["affinity_interleaved"], record["affinity_interleaved_parallel2"]]
    record["replicas_used"] = [len({r["replica"] for r in rows}) for rows in runs]
    record["targets"] = {
        "kinds_equal": all(record["kinds_equal"].values()),
        "pairs_on_one_replica": all(
            len({r["replica"] for r in rows if (r["key"], r["file"]) == kf}) == 1
            for rows in runs
            for kf in {(r["key"], r["file"]) for r in rows}
        ),
        "later_cached_ge_80pct": all(r["cached"] >= 0.8 for r in pairs[1::2]),
        "kill_none_hung": record["kill"]["hung"] == 0,
        "kill_next_burst_completes": record["kill"]["second_burst_answered"] == 8,
        "first_answer_le_60s": record["cluster_ready_s"] <= 60,
    }
    print(json.dumps(record, indent=1))
    write_record(args.out, "specdec.cluster_check/1", record)
    return 0 if all(record["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
