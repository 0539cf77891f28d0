#!/usr/bin/env python3
"""llama.cpp's own benchmark on the builds `specdec anchors build` made, alternated round by round:
by default stock llama.cpp and the "same kernels" twin built for the AVX2 class (peers stock-avx2
and twin-avx2; the twin's processes run sdmm's AVX2 path, study/engines/peers.py; ik-avx2 adds
ik_llama.cpp, run with its run-time repack), so that the
prompt (pp512), a 16-token pass (pp16) and the single step (tg32) of stock's kernels and of
specdec's are measured in stock's own harness, with its defaults. Then the single step alone in
many short runs (`--step-rounds`, tg32 once each, the peers' order rotated every round): this
host's memory bandwidth moves within seconds (a step's rate 27 or 36 tok/s from one run to the
next), so a step is compared round by round, the median of the paired ratios with its quartiles.

    .venv/bin/python scripts/llama_bench_classes.py --target qwen2.5-coder-1.5b \
        --out results/cpu/kernel-classes/llama-bench-avx2.json

Run it on an idle machine, one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.backends.registry import resolve
from specdec.study.artifacts import write_json
from specdec.study.artifacts.provenance import meta_block
from specdec.study.engines import anchor_build
from specdec.study.engines.peers import PEERS

sys.path.insert(0, str(Path(__file__).parent))
from kernel_classes import host_class


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="a registry model name")
    ap.add_argument("--peers", default="stock-avx2,twin-avx2", help="builds, comma-separated")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--step-rounds", type=int, default=20, help="short tg32 runs per peer (0: none)"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    model = resolve(args.target, progress=False)
    peers = args.peers.split(",")
    tests = ["-p", "512,16", "-n", "32", "-r", "3", "-o", "json"]
    step = ["-p", "0", "-n", "32", "-r", "1", "-o", "json"]
    rows: dict[str, list] = {p: [] for p in peers}
    for r in range(args.rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            rows[peer].append(_bench(peer, model, args.threads, tests))
            line = ", ".join(f"{_name(x)} {x['avg_ts']:.1f} tok/s" for x in rows[peer][-1])
            print(f"round {r} {peer:12s} {line}", flush=True)
    steps: dict[str, list[float]] = {p: [] for p in peers}
    for r in range(args.step_rounds):
        for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
            steps[peer].append(_bench(peer, model, args.threads, step)[0]["avg_ts"])
        print(f"step round {r}: " + ", ".join(f"{p} {v[-1]:.1f}" for p, v in steps.items()))
    record = {
        "schema": "specdec.llama_bench/1",
        "meta": meta_block(),
        "host_class": host_class(),
        "target": args.target,
        "command": ["llama-bench", "-m", model.name, "-t", str(args.threads), *tests],
        "peers": {p: {"env": dict(PEERS[p].env), "build": anchor_build.manifest(p)} for p in peers},
        "rounds": rows,
        "steps": {
            "command": ["llama-bench", "-m", model.name, "-t", str(args.threads), *step],
            "rounds": steps,
        },
    }
    write_json(args.out, record)
    print(f"wrote {args.out}\n")
    print(table(record))
    return 0


def _bench(peer: str, model: Path, threads: int, tests: list[str]) -> list[dict]:
    """One llama-bench run of `peer`'s build: its rows, as its JSON output gives them."""
    exe = anchor_build.binary("llama-bench", peer)
    env = {**os.environ, **dict(PEERS[peer].env)}
    cmd = [str(exe), "-m", str(model), "-t", str(threads), *tests]
    # ik_llama.cpp at its best on a CPU, as its servers run (--run-time-repack)
    cmd += ["-rtr", "1"] if PEERS[peer].ik else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{peer}: llama-bench failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def _name(x: dict) -> str:
    return f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}"


def table(record: dict) -> str:
    """docs/kernels.md's table of a run: tok/s per peer and test, round by round, then each
    other peer's time against the twin's (the twin twin-avx2 on the AVX2 class), per round."""
    rounds = record["rounds"]
    tests = [_name(x) for x in next(iter(rounds.values()))[0]]
    rate = {
        p: {t: [next(x["avg_ts"] for x in r if _name(x) == t) for r in rs] for t in tests}
        for p, rs in rounds.items()
    }
    lines = [f"| {record['host_class']} host, llama-bench, tok/s | {' | '.join(tests)} |"]
    lines.append("|---|" + "---|" * len(tests))
    for p in rounds:
        lines.append(
            f"| {p} | "
            + " | ".join(" / ".join(f"{v:.1f}" for v in rate[p][t]) for t in tests)
            + " |"
        )
    twin = next((p for p in rounds if p.startswith("twin")), None)
    for p in rounds:
        if twin is None or p == twin:
            continue
        pairs = {t: zip(rate[twin][t], rate[p][t], strict=True) for t in tests}
        ratios = [" / ".join(f"{b / a:.2f}" for a, b in pairs[t]) for t in tests]
        lines.append(f"| the twin's time / {p}'s | " + " | ".join(ratios) + " |")
    steps = record.get("steps", {}).get("rounds", {})
    if twin is None or not steps or not steps[twin]:
        return "\n".join(lines)
    n = len(steps[twin])
    lines += [
        "",
        f"| tg32, {n} short runs rotated | median tok/s (quartiles) | the twin's time / its, "
        "per round: median (quartiles) | rounds the twin was faster |",
        "|---|---|---|---|",
    ]
    for p, v in steps.items():
        if p == twin:
            lines.append(f"| {p} | {_quartiles(v, 1)} | | |")
            continue
        pairs = list(zip(steps[twin], v, strict=True))  # (the twin's rate, p's) per round
        ratio = _quartiles([b / a for a, b in pairs])
        won = sum(a > b for a, b in pairs)
        lines.append(f"| {p} | {_quartiles(v, 1)} | {ratio} | {won} of {n} |")
    return "\n".join(lines)


def _quartiles(v: list[float], digits: int = 2) -> str:
    """`median (q1-q3)` of v"""
    if len(v) < 2:
        return f"{v[0]:.{digits}f}"
    q1, q2, q3 = statistics.quantiles(v, n=4)
    return f"{q2:.{digits}f} ({q1:.{digits}f}-{q3:.{digits}f})"


if __name__ == "__main__":
    sys.exit(main())
