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

With --soak it is a robustness check instead (issue 11): a deterministic mix of good requests
(streamed and not, greedy and sampled), malformed bodies (bad JSON, wrong types, deep nesting,
lone surrogates, text/plain), disconnects mid-stream, oversize stop lists, unsupported
parameters and unknown paths, then one greedy request compared with `generate()` run in this
process on the same models:

    specdec serve --target llamacpp:smollm2-135m --draft hf:smollm2-135m --threads 1 &
    .venv/bin/python scripts/loadtest.py --soak --pid $! -n 500 -c 16 \\
        --target llamacpp:smollm2-135m --draft hf:smollm2-135m \\
        --out results/cpu/loadtest_soak.json

It reports crashes (the server gone or /health not ok), 5xx answers to good requests, answers
with another status than the kind's expected one, the server's RSS before and after (read from
/proc/PID/status after a warm-up; flat means within 10%), the number of Prometheus series before
and after, and whether the last greedy answer equals `generate()` token for token. Exit status 0
only if all of those hold. The client side is the standard library; the reference generation
imports specdec (and loads the models) after the soak.

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
        from specdec.study.run.prompts import load_prompts

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
    soak_args = ap.add_argument_group("--soak: the mixed robustness run")
    soak_args.add_argument("--soak", action="store_true", help="run the mixed soak instead")
    soak_args.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS")
    soak_args.add_argument("--target", default=None, help="the server's --target, for generate()")
    soak_args.add_argument("--draft", default=None, help="the server's --draft (default none)")
    soak_args.add_argument("--drafter", default=None, help="the server's --drafter")
    soak_args.add_argument("-k", default=None, help="the server's -k (default: the engine's)")
    soak_args.add_argument("--threads", type=int, default=1, help="threads per model (default 1)")
    soak_args.add_argument(
        "--time-limit", type=float, default=1800.0, help="stop sending after this many s"
    )
    soak_args.add_argument(
        "--hostile", action="store_true", help="the hostile soak (scripts/hostile_soak.py)"
    )
    soak_args.add_argument("--server-log", default=None, help="the server's stderr (hostile)")
    soak_args.add_argument(
        "--deterministic", action="store_true", help="the server runs --deterministic"
    )
    soak_args.add_argument(
        "--max-queue", type=int, default=8, help="the server's --max-queue (hostile burst)"
    )
    args = ap.parse_args(argv)
    if not (1 <= args.requests <= 100_000 and 1 <= args.concurrency <= 256):
        ap.error("need 1 <= --requests <= 100000 and 1 <= --concurrency <= 256")
    if not args.time_limit > 0:
        ap.error("--time-limit must be > 0")

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

    if args.soak:
        if args.k is not None and args.k.isdigit():
            args.k = int(args.k)
        if args.hostile:
            from hostile_soak import hostile_soak

            return _finish_hostile(args, hostile_soak(args, host, port, headers, model))
        return _finish_soak(args, soak(args, host, port, headers, model))

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


# ------------------------------------------------------------------------------ the soak
#: Kinds of soak request, by i % 10: half are good, each other kind is a tenth.
SOAK_MIX = (
    "good",
    "malformed",
    "good",
    "disconnect",
    "good",
    "oversize_stop",
    "good",
    "unknown_path",
    "good",
    "bad_field",
)
#: The statuses each kind may get (empty: a disconnect does not wait for its answer).
EXPECTED_STATUS: dict[str, tuple[int, ...]] = {
    "good": (200,),
    "malformed": (400, 415),  # 415: the text/plain variant
    "disconnect": (),
    "oversize_stop": (400,),
    "unknown_path": (404,),
    "bad_field": (400,),
}
SOAK_MAX_TOKENS = 16
WARMUP_OFFSET = 1_000_000  # warm-up requests' indices: other prompts and seeds than the soak's
RSS_TOLERANCE = 0.10  # "flat": the RSS after within 10% of the RSS before
FINAL_PROMPT = "Name three colors."


def _turn(i: int) -> int:
    """How many requests of request i's kind came before it: the index that rotates a kind's
    variants (i itself would not: every i of one kind has the same residue mod 10)."""
    return i // len(SOAK_MIX)


def _malformed(i: int, model: str) -> tuple[bytes, dict[str, str]]:
    """A broken body (or header), rotating through the failure modes the server must survive."""
    json_ct = {"Content-Type": "application/json"}
    variants: list[tuple[bytes, dict[str, str]]] = [
        (b'{"model": "' + model.encode() + b'", "messages": [', json_ct),
        (b"[" * 5000, json_ct),  # nested past the parser's recursion limit
        (json.dumps({"model": model, "messages": "hi"}).encode(), json_ct),
        (
            json.dumps(
                {"model": model, "messages": [{"role": "user", "content": "\ud800"}]}
            ).encode(),
            json_ct,
        ),
        (json.dumps({"model": model, "messages": []}).encode(), {"Content-Type": "text/plain"}),
        (b'{"model": "\xff"}', json_ct),
    ]
    return variants[_turn(i) % len(variants)]


def _soak_body(kind: str, i: int, model: str, prompts: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
        "max_tokens": SOAK_MAX_TOKENS,
        "temperature": 0.0 if i % 4 < 2 else 0.8,
        "seed": i,
        "stream": i % 3 != 0,
    }
    if kind == "disconnect":
        body.update(stream=True, max_tokens=64)
    elif kind == "oversize_stop":
        body["stop"] = [f"s{j}" for j in range(17)] if _turn(i) % 2 else ["x" * 1000]
    elif kind == "bad_field":
        extra = ({"logprobs": True}, {"temperature": 2.5}, {"max_tokens": "8"}, {"n": 3})
        body.update(extra[_turn(i) % len(extra)])
    return body


def _soak_one(
    host: str,
    port: int,
    kind: str,
    i: int,
    model: str,
    prompts: list[str],
    headers: dict[str, str],
    timeout: float,
) -> dict[str, Any]:
    """One soak request: its kind, the status it got (None for a disconnect), any error."""
    path, hdrs = "/v1/chat/completions", dict(headers)
    if kind == "malformed":
        data, extra = _malformed(i, model)
        hdrs.update(extra)
    else:
        data = json.dumps(_soak_body(kind, i, model, prompts)).encode()
    if kind == "unknown_path":
        path = f"/v1/soak-{i}/nothing-here"
    out: dict[str, Any] = {"kind": kind, "status": None, "error": None}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, data, hdrs)
        resp = conn.getresponse()
        out["status"] = resp.status
        if kind == "disconnect" and resp.status == 200:
            resp.readline()  # the first event, then the client goes away mid-stream
            out["status"] = None
            return out
        raw = resp.read()
        if resp.status == 200 and b"data: " in raw and b'"error"' in raw:
            out["error"] = "stream error: " + raw[raw.find(b'"error"') :][:160].decode(
                errors="replace"
            )
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _get(host: str, port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


def _series(host: str, port: int) -> int:
    """Prometheus samples on /metrics (lines that are not comments)."""
    status, text = _get(host, port, "/metrics", {})
    lines = text.decode(errors="replace").splitlines()
    return sum(1 for x in lines if x and not x.startswith("#")) if status == 200 else -1


def _greedy(host: str, port: int, model: str, headers: dict[str, str]) -> list[int] | None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": FINAL_PROMPT}],
        "max_tokens": SOAK_MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        data = json.loads(resp.read())
        return data["choices"][0]["token_ids"] if resp.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None
    finally:
        conn.close()


def _reference(args: argparse.Namespace) -> list[int]:
    """`generate()` on the server's models, loaded here with the same settings."""
    from specdec.backends import load_model
    from specdec.backends.chat import encode_messages, stop_ids
    from specdec.core.config import SpecConfig, Warp
    from specdec.core.decode import generate

    kw = {"n_threads": args.threads} if args.threads else {}
    target = load_model(args.target, **kw)
    draft = load_model(args.draft, **kw) if args.draft else None
    spec_kw = {"drafter": args.drafter, "k": args.k}
    spec = SpecConfig(**{key: v for key, v in spec_kw.items() if v is not None})
    tok = target.tokenizer or getattr(draft, "tokenizer", None)
    prompt = encode_messages(tok, [{"role": "user", "content": FINAL_PROMPT}])
    result = generate(
        target,
        prompt,
        draft=draft,
        spec=spec,
        warp=Warp(0.0),
        max_new_tokens=SOAK_MAX_TOKENS,
        stop_ids=stop_ids(tok),
    )
    return result.tokens


def soak(
    args: argparse.Namespace, host: str, port: int, headers: dict[str, str], model: str
) -> dict[str, Any]:
    """The mixed soak; returns its record (see the module docstring)."""
    prompts = _prompts()
    stop_at = time.perf_counter() + args.time_limit

    def run(i: int) -> dict[str, Any]:
        kind = SOAK_MIX[i % len(SOAK_MIX)]
        if time.perf_counter() > stop_at:  # bounded in time as well as in count
            return {"kind": kind, "status": None, "error": "skipped: --time-limit"}
        return _soak_one(host, port, kind, i, model, prompts, headers, args.timeout)

    def mix(indices: range) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            return list(pool.map(run, indices))

    first = _greedy(host, port, model, headers)
    # Warm-up: the same mix, so one-time allocations (thread pools, allocator arenas, caches)
    # happen before the RSS is first read.
    mix(range(WARMUP_OFFSET, WARMUP_OFFSET + 3 * args.concurrency))
    rss_before, series_before = _rss_mb(args.pid), _series(host, port)
    t0 = time.perf_counter()
    results = mix(range(args.requests))
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # let the engine finish what the disconnected clients left
    rss_after, series_after = _rss_mb(args.pid), _series(host, port)
    health, _ = _get(host, port, "/health", {})
    last = _greedy(host, port, model, headers)
    want = _reference(args) if args.target else None
    return _soak_record(
        args,
        results,
        wall,
        (rss_before, rss_after),
        (series_before, series_after),
        health,
        first,
        last,
        want,
    )


def _soak_record(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    wall: float,
    rss: tuple[float | None, float | None],
    series: tuple[int, int],
    health: int,
    first: list[int] | None,
    last: list[int] | None,
    want: list[int] | None,
) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    unexpected = []
    for r in results:
        counts = by_kind.setdefault(r["kind"], {})
        key = "disconnected" if r["status"] is None and not r["error"] else str(r["status"])
        counts[key] = counts.get(key, 0) + 1
        allowed = EXPECTED_STATUS[r["kind"]]
        if r["error"] or (allowed and r["status"] not in allowed):
            unexpected.append(f"{r['kind']}: {r['status']} {r['error'] or ''}".strip())
    good_5xx = sum(1 for r in results if r["kind"] == "good" and (r["status"] or 0) >= 500)
    before, after = rss
    growth = (after - before) / before if before and after else None
    alive = args.pid is None or Path(f"/proc/{args.pid}").exists()
    crashes = 0 if alive and health == 200 else 1
    record = {
        "target": args.target,
        "draft": args.draft,
        "drafter": args.drafter,
        "server_threads": args.threads,
        "requests": len(results),
        "concurrency": args.concurrency,
        "max_tokens": SOAK_MAX_TOKENS,
        "wall_s": round(wall, 1),
        "by_kind": by_kind,
        "crashes": crashes,
        "good_5xx": good_5xx,
        "unexpected": len(unexpected),
        "unexpected_samples": sorted(set(unexpected))[:5],
        "rss_mb_before": before,
        "rss_mb_after": after,
        "rss_growth": growth,
        "rss_flat": growth is not None and abs(growth) <= RSS_TOLERANCE,
        "metrics_series_before": series[0],
        "metrics_series_after": series[1],
        "first_greedy_equals_last": first is not None and first == last,
        "final_greedy_equals_generate": want is not None and last == want,
        "final_greedy_tokens": last,
    }
    record["ok"] = (
        crashes == 0
        and good_5xx == 0
        and not unexpected
        and record["rss_flat"]
        and record["final_greedy_equals_generate"]
    )
    return record


def _finish_soak(args: argparse.Namespace, record: dict[str, Any]) -> int:
    def mb(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f} MB"

    print(
        f"soak: {record['requests']} requests in {record['wall_s']} s | crashes "
        f"{record['crashes']}, 5xx on good {record['good_5xx']}, unexpected "
        f"{record['unexpected']} | RSS {mb(record['rss_mb_before'])} -> "
        f"{mb(record['rss_mb_after'])} | series {record['metrics_series_before']} -> "
        f"{record['metrics_series_after']} | final greedy == generate(): "
        f"{record['final_greedy_equals_generate']}"
    )
    for e in record["unexpected_samples"]:
        print(f"  unexpected: {e}", file=sys.stderr)
    _write(args.out, record)
    return 0 if record["ok"] else 1


def _finish_hostile(args: argparse.Namespace, record: dict[str, Any]) -> int:
    h, ref, course = record["health"], record["reference"] or {}, record["rss_course"]
    same = ref.get("compared", 0) - ref.get("mismatches", 0)
    print(
        f"hostile soak: {record['requests']} requests in {record['wall_s']} s | crashes "
        f"{record['crashes']}, 5xx on well-formed {record['well_formed_5xx']}, unexpected "
        f"{record['unexpected']} | /health p99 {h['p99_ms']} ms (max {h['max_ms']}, "
        f"{h['samples']} samples) | RSS {record['before']['rss_mb']} -> "
        f"{record['after']['rss_mb']} MB (second half: drift {_pct(course['drift'])}, span "
        f"{_pct(course['span'])}) | fds {record['before']['fds']} -> "
        f"{record['after']['fds']} | new 504s {record['new_504']}, tracebacks "
        f"{record['new_tracebacks']} | answers == generate(): {same}/{ref.get('compared', 0)}"
        f" ({ref.get('not_comparable', 0)} sampled with a draft pool: not comparable)"
        f" | ok {record['ok']}"
    )
    for e in record["unexpected_samples"]:
        print(f"  unexpected: {e}", file=sys.stderr)
    _write(args.out, record)
    return 0 if record["ok"] else 1


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"


def _write(path: str | None, record: dict[str, Any]) -> None:
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
