#!/usr/bin/env python3
"""Both CPU classes on one host, in one run: stock llama.cpp's kernels and specdec's, as this
host's native build runs them and as a CPU without AVX-512 runs them (the AVX2 class: ggml-cpu
rebuilt portable, GGML_NATIVE=OFF, by llamacpp_build.build_cpu_backend, and specdec's AVX2 path
forced; built once and cached). On an AVX2-only host both classes are the same build.

Per configuration, one fresh process per round (configurations interleaved, their order
reversed every other round): the prompt prefill (no logits, as a request's prompt runs), then at
that many cached tokens the single step and the 16-token pass (every row's logits, as a verify
runs). Medians per round; the artifact keeps every round.

    .venv/bin/python scripts/kernel_classes.py --target llamacpp:qwen2.5-coder-1.5b \
        --out results/cpu/kernel-classes/zen4.json

Run it on an idle machine, one benchmark at a time (llama.cpp's threads spin at barriers).
`--package LABEL=DIR` adds a configuration: another build's llama_cpp package (a copy of an
earlier install, say), run with specdec's kernels as it picks them and with the AVX2 path forced.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec.backends import llamacpp_build
from specdec.backends.llamacpp_lib import package_with_cpu_backend
from specdec.study.artifacts import write_json
from specdec.study.artifacts.provenance import meta_block

_WORKER = r"""
import json, statistics, sys, time
from specdec.backends import load_model
from specdec.backends.llamacpp_kernels import kernels
target, threads, prompt, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = load_model(target, n_threads=threads, n_ctx=prompt + 64)
ids = [(1000 + 7 * i) % 30000 + 200 for i in range(prompt + 16)]

def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

m.prefill(ids[:32]); m.reset()  # warm: first-touch pages, thread pool
prefill = []
for _ in range(reps):
    m.reset()
    prefill.append(timed(lambda: m.prefill(ids[:prompt])))
step, pass16 = [], []
for _ in range(reps * 2):
    step.append(timed(lambda: m.extend(ids[prompt:prompt + 1])))
    m.truncate(prompt)
for _ in range(reps):
    pass16.append(timed(lambda: m.extend(ids[prompt:prompt + 16])))
    m.truncate(prompt)
k = kernels()
print(json.dumps({"prefill_s": prefill, "step_s": step, "pass16_s": pass16,
                  "sdmm": k.get("sdmm"), "sdfa": k.get("sdfa"), "features": k.get("features")}))
"""


_TIMES = ("prefill_s", "step_s", "pass16_s")


def host_class() -> str:
    """The class of this CPU as sdmm sees it: its best int8 instructions."""
    flags = set(llamacpp_build.cpu_flags())
    for flag, name in (("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "no AVX2"


def _run(target: str, threads: int, prompt: int, reps: int, path: Path | None, env: dict) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_MM")}
    e.pop("SPECDEC_FA", None)
    e.update(env)
    if path is not None:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), e.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", _WORKER, target, str(threads), str(prompt), str(reps)]
    res = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"worker failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timings per round (steps: twice)")
    ap.add_argument("--package", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        configs: list[tuple[str, Path | None, dict]] = [
            ("native stock", None, {"SPECDEC_MM": "0"}),
            ("native specdec", None, {}),
        ]
        if "avx512f" in llamacpp_build.cpu_flags():
            portable = package_with_cpu_backend("portable", Path(tmp) / "portable")
            configs += [
                ("avx2 stock", portable, {"SPECDEC_MM": "0"}),
                ("avx2 specdec", portable, {"SPECDEC_MM_ISA": "avx2"}),
            ]
        for spec in args.package:
            label, _, d = spec.partition("=")
            configs += [(f"{label} specdec", Path(d), {})]
            configs += [(f"{label} avx2-forced", Path(d), {"SPECDEC_MM_ISA": "avx2"})]
        rounds: list[dict[str, dict]] = []
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            got = {}
            for label, path, env in order:
                got[label] = _run(args.target, args.threads, args.prompt, args.reps, path, env)
                med = {k: statistics.median(v) for k, v in got[label].items() if k in _TIMES}
                print(
                    f"round {r} {label:24s} prefill {med['prefill_s']:.2f} s  step "
                    f"{1e3 * med['step_s']:.1f} ms  pass16 {1e3 * med['pass16_s']:.0f} ms",
                    flush=True,
                )
            rounds.append(got)

    summary = {}
    for label, *_ in configs:
        per = {k: [statistics.median(r[label][k]) for r in rounds] for k in _TIMES}
        summary[label] = {k: statistics.median(v) for k, v in per.items()}
        summary[label]["prefill_tok_s"] = args.prompt / summary[label]["prefill_s"]
    print(f"\n{'':24s} {'prefill tok/s':>14s} {'step ms':>8s} {'pass16 ms':>10s}")
    for label, s in summary.items():
        print(
            f"{label:24s} {s['prefill_tok_s']:14.1f} {1e3 * s['step_s']:8.1f} "
            f"{1e3 * s['pass16_s']:10.0f}"
        )
    for cls in ("native", "avx2"):
        if f"{cls} stock" in summary:
            st, sd = summary[f"{cls} stock"], summary[f"{cls} specdec"]
            print(
                f"{cls}: specdec/stock prefill speed {st['prefill_s'] / sd['prefill_s']:.2f}x, "
                f"step {sd['step_s'] / st['step_s']:.2f}, pass16 "
                f"{sd['pass16_s'] / st['pass16_s']:.2f}"
            )
    record = {
        "schema": "specdec.kernel_classes/1",
        "meta": meta_block(),
        "host_class": host_class(),
        "target": args.target,
        "threads": args.threads,
        "prompt": args.prompt,
        "configs": {
            label: {"env": env, "package": str(path) if path else None}
            for label, path, env in configs
        },
        "rounds": rounds,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
