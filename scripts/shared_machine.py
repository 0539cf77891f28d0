#!/usr/bin/env python3
"""A machine shared with other work (issue 53): a greedy answer's time from `specdec serve`
alone, beside a niced compile loop on every core, and with a second server answering at the
same time; the thread pool that follows the free cores (the default) against a fixed pool of
every core (`--threads N`, what the default was), interleaved round by round.

    D=results/cpu/shared-machine
    python scripts/shared_machine.py --rounds 3 --session new --out $D/build-other-session.json
    python scripts/shared_machine.py --rounds 2 --session same --out $D/build-same-session.json
    python scripts/shared_machine.py --rounds 0 --idle 12 --out $D/idle.json

`--idle N` is the idle machine's check: a server of each pool answering alone in turn, N times.

The compile loop runs `gcc -O2` on a generated ~1.5 s C file, under `nice -n 19`, one loop per
core. `--session new` starts it in a session of its own (setsid), as a build in another terminal
or a service runs; there Linux's autogroups give each session an equal share of the CPU
whatever its nice value, so the build takes half the machine. `--session same` starts it in this
script's session, where nice applies. Two servers: each with its own 160-token answer, both
sent at once. Every answer must equal the server's first (greedy, the same request).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from loadtest_common import write_record

SPECDEC = str(Path(sys.executable).parent / "specdec")
PROMPT = "Write a Python module with a class that parses INI files, with docstrings."
PORTS = (8131, 8132)


def c_file(d: Path) -> Path:
    """A C file gcc -O2 takes ~1.5 s over (400 small loops)."""
    src = d / "load.c"
    src.write_text(
        "\n".join(
            f"int f{i}(int *a, int n) {{ int s = 0; for (int j = 0; j < n; j++) "
            f"{{ s += a[j] * {i} ^ (s >> 3); if (s > {i}) s -= a[(j*7)%n]; }} return s; }}"
            for i in range(400)
        )
        + "\n"
    )
    return src


def compile_loop(src: Path, session: str) -> list[subprocess.Popen]:
    loop = f"while :; do gcc -O2 -c {src} -o /dev/null; done"
    pre = ["setsid"] if session == "new" else []
    return [
        subprocess.Popen([*pre, "nice", "-n", "19", "sh", "-c", loop])
        for _ in range(os.cpu_count() or 1)
    ]


def stop(procs: list[subprocess.Popen], src: Path) -> None:
    for p in procs:
        p.kill()
    subprocess.run(["pkill", "-f", f"gcc -O2 -c {src}"], check=False)
    time.sleep(1.0)


def start(port: int, target: str, threads: int | None, log: Path) -> subprocess.Popen:
    cmd = [SPECDEC, "serve", "--target", target, "--port", str(port)]
    cmd += ["--threads", str(threads)] if threads else []
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("a"))
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return p
        except OSError:
            if p.poll() is not None:
                raise SystemExit(f"the server on {port} exited; its log: {log}") from None
            time.sleep(0.5)
    raise SystemExit(f"the server on {port} did not come up")


def stop_servers(servers: list[subprocess.Popen]) -> None:
    for p in servers:
        p.send_signal(signal.SIGINT)
    for p in servers:
        p.wait(60)


def ask(port: int, model: str, max_tokens: int) -> tuple[float, list[int]]:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}],
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req, timeout=1800).read())
    return time.perf_counter() - t0, out["choices"][0]["token_ids"]


def one_round(args: argparse.Namespace, threads: int | None, src: Path, log: Path) -> dict:
    servers = [start(port, args.target, threads, log) for port in PORTS]
    try:
        answers = []

        def timed(port: int) -> float:
            s, ids = ask(port, args.target, args.max_tokens)
            answers.append(ids)
            return round(s, 2)

        for port in PORTS:
            timed(port)  # warm: the first request's one-time costs
        alone = [timed(PORTS[0]) for _ in range(2)]
        load = compile_loop(src, args.session)
        time.sleep(2.0)
        try:
            beside = timed(PORTS[0])
        finally:
            stop(load, src)
        both: dict[int, float] = {}
        ts = [threading.Thread(target=lambda p=p: both.__setitem__(p, timed(p))) for p in PORTS]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        alone.append(timed(PORTS[0]))
    finally:
        stop_servers(servers)
    base = sorted(alone)[1]
    return {
        "threads": threads or "default",
        "alone_s": alone,
        "beside_compile_s": beside,
        "two_servers_s": [both[p] for p in PORTS],
        "beside_compile_x": round(beside / base, 2),
        "two_servers_x": [round(both[p] / base, 2) for p in PORTS],
        "same_answers": all(a == answers[0] for a in answers),
    }


def idle_ab(args: argparse.Namespace, n: int, log: Path) -> dict[str, Any]:
    """An idle machine: the default pool's server and the fixed pool's, each answering alone in
    turn, `n` times (one server started per pool, both warm; the order flips every turn)."""
    servers = [
        start(PORTS[0], args.target, None, log),
        start(PORTS[1], args.target, args.fixed, log),
    ]
    try:
        for port in PORTS:
            ask(port, args.target, args.max_tokens)
        times: dict[int, list[float]] = {p: [] for p in PORTS}
        for i in range(n):
            for port in PORTS if i % 2 == 0 else PORTS[::-1]:
                times[port].append(round(ask(port, args.target, args.max_tokens)[0], 3))
    finally:
        stop_servers(servers)
    a, b = sorted(times[PORTS[0]]), sorted(times[PORTS[1]])
    return {
        "default_s": times[PORTS[0]],
        "fixed_s": times[PORTS[1]],
        "default_over_fixed": round(a[len(a) // 2] / b[len(b) // 2], 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b", help="the servers' model")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both pools (default 2)")
    ap.add_argument("--max-tokens", type=int, default=160, help="the answer's length")
    ap.add_argument("--fixed", type=int, default=os.cpu_count(), help="the fixed pool's threads")
    ap.add_argument("--session", choices=("new", "same"), default="new", help="the build's session")
    ap.add_argument("--idle", type=int, default=0, help="idle answers per pool, alternated")
    ap.add_argument("--out", default=None, help="write the record here (path)")
    args = ap.parse_args()
    load_before = os.getloadavg()  # benchmarks want an idle machine: what it was
    with tempfile.TemporaryDirectory() as tmp:
        src, log = c_file(Path(tmp)), Path(tmp) / "serve.log"
        rows = []
        for r in range(args.rounds):
            for threads in (None, args.fixed):
                row = {"round": r, **one_round(args, threads, src, log)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        idle = idle_ab(args, args.idle, log) if args.idle else None
        if idle:
            print(json.dumps(idle), flush=True)
    ok = all(row["same_answers"] for row in rows)
    record = {
        "target": args.target,
        "max_tokens": args.max_tokens,
        "session": args.session,
        "cores": os.cpu_count(),
        "load_avg_before": load_before,
        "rounds": rows,
        "idle": idle,
        "same_answers": ok,
    }
    write_record(args.out, "specdec.shared_machine/1", record)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
