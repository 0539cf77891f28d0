"""Load test for `specdec serve` (a benchmark, not a test): N requests at concurrency C.

    specdec serve --target llamacpp:smollm2-135m --draft hf:smollm2-135m --threads 1 &
    .venv/bin/python scripts/loadtest.py --url http://127.0.0.1:8000 --out results/loadtest.json

Each request is a streamed chat completion of a prompt from the vendored prompt set (cycled), so
the client sees the time to first token as well as the whole latency. Prints and writes:

    latency_p50_s, _p95_s   request sent -> [DONE] received (queue wait included)
    ttft_p50_s, _p95_s      request sent -> first chunk with text
    tokens_per_s            completion tokens of successful requests / wall time of the run
    errors                  requests that failed (HTTP status, stream error or exception)
    acceptance_rate, tokens_per_round   pooled over the responses' `spec` objects

Standard library only (threads + http.client). Loopback URLs only: it is a load generator.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_PROMPTS = (
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "List three uses of binary search.",
    "Summarize the plot of Hamlet in one paragraph.",
)


def _prompts() -> list[str]:
    try:
        from specdec.study.prompts import load_prompts

        return [p.text for p in load_prompts()] or list(DEFAULT_PROMPTS)
    except ImportError:  # run without the package installed: a small built-in set
        return list(DEFAULT_PROMPTS)


def _percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _one(host: str, port: int, body: dict, headers: dict, timeout: float) -> dict[str, Any]:
    """One streamed request: latency, TTFT, completion tokens, spec, or the error."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ok": False, "latency_s": None, "ttft_s": None, "tokens": 0}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
            return out
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                out["ok"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"].get("message", "stream error")
                return out
            for c in event.get("choices", ()):
                if out["ttft_s"] is None and (c.get("delta") or {}).get("content"):
                    out["ttft_s"] = time.perf_counter() - t0
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
                out["spec"] = event.get("spec")
        if not out["ok"]:
            out["error"] = "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out["latency_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    ap.add_argument("-n", "--requests", type=int, default=200, help="requests (int; default 200)")
    ap.add_argument("-c", "--concurrency", type=int, default=8, help="clients (int; default 8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (int; default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="(float; default 0, greedy)")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, s (default 300)")
    ap.add_argument("--out", default=None, help="write the JSON result here (path)")
    args = ap.parse_args(argv)
    if not (1 <= args.requests <= 100_000 and 1 <= args.concurrency <= 256):
        ap.error("need 1 <= --requests <= 100000 and 1 <= --concurrency <= 256")

    url = urlsplit(args.url)
    host, port = url.hostname or "", url.port or 80
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if url.scheme != "http" or not loopback:
        ap.error(f"--url must be http:// on a loopback address, got {args.url!r}")

    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    model = args.model
    if model is None:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/v1/models", headers=headers)
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()

    prompts = _prompts()
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(args.requests)
    ]
    done = 0
    lock = threading.Lock()

    def run(body: dict) -> dict:
        nonlocal done
        r = _one(host, port, body, headers, args.timeout)
        with lock:
            done += 1
            if done % max(1, args.requests // 10) == 0:
                print(f"  {done}/{args.requests}", file=sys.stderr, flush=True)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        results = list(pool.map(run, bodies))
    wall = time.perf_counter() - t0

    ok = [r for r in results if r["ok"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    specs = [r["spec"] for r in ok if r.get("spec")]
    drafted = sum(s["drafted"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    rounds = sum(s["rounds"] for s in specs)
    errors = [r["error"] for r in results if not r["ok"]]
    result = {
        "url": args.url,
        "model": model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "wall_s": wall,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "latency_p50_s": _percentile(lat, 50),
        "latency_p95_s": _percentile(lat, 95),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": tokens / rounds if rounds else None,
    }

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    print(
        f"{len(ok)}/{args.requests} ok, {len(errors)} errors in {wall:.1f} s | latency p50 "
        f"{fmt(result['latency_p50_s'])} s, p95 {fmt(result['latency_p95_s'])} s | TTFT p50 "
        f"{fmt(result['ttft_p50_s'])} s, p95 {fmt(result['ttft_p95_s'])} s | "
        f"{result['tokens_per_s']:.1f} tokens/s | acceptance {fmt(result['acceptance_rate'])}, "
        f"{fmt(result['tokens_per_round'])} tokens/round"
    )
    for e in result["error_samples"]:
        print(f"  error: {e}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
