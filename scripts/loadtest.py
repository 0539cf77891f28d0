"""Load test for a running `specdec serve` (a benchmark, not a test), in three modes.

The load run (the default): N streamed chat completions at concurrency C, each of a prompt from
the vendored prompt set (cycled), so that the client sees the time to first token as well as the
whole latency:

    specdec serve --target llamacpp:smollm2-135m --drafter lookup -k auto --threads 2 &
    .venv/bin/python scripts/loadtest.py -n 200 -c 8 --max-tokens 32 --out results/cpu/loadtest.json

    latency_p50_s, _p95_s   request sent -> [DONE] received (queue wait included)
    ttft_p50_s, _p95_s      request sent -> first chunk with text
    tokens_per_s            completion tokens of successful requests / wall time of the run
    errors                  requests that failed (HTTP status, stream error or exception)
    acceptance_rate, tokens_per_round   pooled over the responses' `spec` objects

--soak, the mixed soak (issue 11): a deterministic mix of good requests (streamed and not, greedy
and sampled), malformed bodies (bad JSON, wrong types, deep nesting, lone surrogates,
text/plain), disconnects mid-stream, oversize stop lists, unsupported parameters and unknown
paths, then one greedy request compared with `generate()` run in this process on the same models:

    specdec serve --target llamacpp:smollm2-135m --draft hf:smollm2-135m --threads 1 &
    .venv/bin/python scripts/loadtest.py --soak --pid $! -n 500 -c 16 \\
        --target llamacpp:smollm2-135m --draft hf:smollm2-135m \\
        --out results/cpu/loadtest_soak.json

It reports crashes (the server gone or /health not ok), 5xx answers to good requests, answers
with another status than the kind's expected one, the server's RSS before and after (read from
/proc/PID/status after a warm-up; flat means within 10%), the number of Prometheus series before
and after, and whether the last greedy answer equals `generate()` token for token. Exit status 0
only if all of those hold.

--hostile, the hostile soak (issues 21, 33; `make soak-hostile`): what a hostile or broken
client sends, a burst past the queue, /health timed throughout, the RSS's course, and every
answer compared with `generate()`. scripts/loadtest_hostile.py says what it sends and checks.

Every mode prints one line and, with --out, writes its record as a specdec artifact
(`specdec.loadtest/1`, `specdec.loadtest_soak/1`, `specdec.loadtest_hostile/1`) whose `meta`
names the machine; the exit status is 0 only if the record is `ok`. Where the code is:
scripts/loadtest_common.py (what the modes share: the request sender, the server's readings,
the tally, generate(), the artifact), scripts/loadtest_hostile.py (the hostile mix), this file
(the command line, the load run and the mixed soak). The client side is the standard library;
specdec is imported for the prompt set, the reference generation and the artifact. Loopback
URLs only: it is a load generator.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loadtest_common import (
    SHORT_PROMPTS,
    WARMUP_OFFSET,
    Plan,
    Server,
    connect,
    crashes,
    growth,
    load_reference,
    percentile,
    regenerate,
    run_mix,
    send,
    server_errors,
    snapshot,
    tally,
    turn,
    write_record,
)
from loadtest_hostile import hostile_soak
from loadtest_hostile import report as report_hostile

#: The load run's prompts where the package is not installed: the first short prompts.
DEFAULT_PROMPTS = SHORT_PROMPTS[:4]


def _prompts() -> list[str]:
    try:
        from specdec.study.run.prompts import load_prompts

        return [p.text for p in load_prompts()] or list(DEFAULT_PROMPTS)
    except ImportError:  # run without the package installed: a small built-in set
        return list(DEFAULT_PROMPTS)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


# ------------------------------------------------------------------------------ the load run
def _stream_one(server: Server, body: dict, timeout: float) -> dict[str, Any]:
    """One streamed request: latency, TTFT, completion tokens, spec, or the error."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ok": False, "latency_s": None, "ttft_s": None, "tokens": 0}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), server.headers)
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


def load(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """The load run; returns its record (see the module docstring)."""
    prompts = _prompts()
    done = 0
    lock = threading.Lock()

    def run(i: int) -> dict[str, Any]:
        nonlocal done
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = _stream_one(server, body, args.timeout)
        with lock:
            done += 1
            if done % max(1, args.requests // 10) == 0:
                print(f"  {done}/{args.requests}", file=sys.stderr, flush=True)
        return r

    t0 = time.perf_counter()
    results = run_mix(run, range(args.requests), args.concurrency)
    return _load_record(args, server, results, time.perf_counter() - t0)


def _load_record(
    args: argparse.Namespace, server: Server, results: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    specs = [r["spec"] for r in ok if r.get("spec")]
    drafted = sum(s["drafted"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    rounds = sum(s["rounds"] for s in specs)
    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "url": args.url,
        "model": server.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "wall_s": wall,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "latency_p50_s": percentile(lat, 50),
        "latency_p95_s": percentile(lat, 95),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "ok": not errors,
    }


def _report_load(record: dict[str, Any]) -> None:
    print(
        f"{record['completed']}/{record['requests']} ok, {record['errors']} errors in "
        f"{record['wall_s']:.1f} s | latency p50 {_fmt(record['latency_p50_s'])} s, p95 "
        f"{_fmt(record['latency_p95_s'])} s | TTFT p50 {_fmt(record['ttft_p50_s'])} s, p95 "
        f"{_fmt(record['ttft_p95_s'])} s | {record['tokens_per_s']:.1f} tokens/s | acceptance "
        f"{_fmt(record['acceptance_rate'])}, {_fmt(record['tokens_per_round'])} tokens/round"
    )
    for e in record["error_samples"]:
        print(f"  error: {e}", file=sys.stderr)


# ------------------------------------------------------------------------------ the mixed soak
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
#: The statuses each kind may get (empty: any; a disconnect leaves during a 200 stream, and what
#: else it gets is not its point).
EXPECTED_STATUS: dict[str, tuple[Any, ...]] = {
    "good": (200,),
    "malformed": (400, 415),  # 415: the text/plain variant
    "disconnect": (),
    "oversize_stop": (400,),
    "unknown_path": (404,),
    "bad_field": (400,),
}
SOAK_MAX_TOKENS = 16
RSS_TOLERANCE = 0.10  # "flat": the RSS after within 10% of the RSS before
FINAL_PROMPT = "Name three colors."


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
    return variants[turn(i, SOAK_MIX) % len(variants)]


def _soak_plan(i: int, model: str, prompts: list[str]) -> Plan:
    """What soak request i sends, and how its client behaves."""
    kind, t = SOAK_MIX[i % len(SOAK_MIX)], turn(i, SOAK_MIX)
    if kind == "malformed":
        data, headers = _malformed(i, model)
        return Plan(kind, i, data=data, headers=headers)
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
        body["stop"] = [f"s{j}" for j in range(17)] if t % 2 else ["x" * 1000]
    elif kind == "bad_field":
        extra = ({"logprobs": True}, {"temperature": 2.5}, {"max_tokens": "8"}, {"n": 3})
        body.update(extra[t % len(extra)])
    path = f"/v1/soak-{i}/nothing-here" if kind == "unknown_path" else "/v1/chat/completions"
    leave = "first_line" if kind == "disconnect" else None
    return Plan.of(kind, i, body, path=path, leave=leave)


def _final_body(model: str) -> dict[str, Any]:
    """The greedy request sent before and after the soak, and regenerated here."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": FINAL_PROMPT}],
        "max_tokens": SOAK_MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


def _final_greedy(server: Server) -> list[int] | None:
    r = send(server, Plan.of("final", 0, _final_body(server.model)))
    return r.get("ids") if r["status"] == 200 and not r["error"] else None


def _final_reference(args: argparse.Namespace) -> list[int]:
    """`generate()` on the final request, its prompt encoded here with the chat template (so
    that the server's template is checked too)."""
    from specdec.backends.chat import encode_messages

    ref = load_reference(args)
    body = _final_body("")
    return regenerate(ref, encode_messages(ref.tokenizer, body["messages"]), body)


def soak(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """The mixed soak; returns its record (see the module docstring)."""
    prompts = _prompts()
    stop_at = time.perf_counter() + args.time_limit

    def run(i: int) -> dict[str, Any]:
        plan = _soak_plan(i, server.model, prompts)
        if time.perf_counter() > stop_at:  # bounded in time as well as in count
            return {"kind": plan.kind, "i": i, "status": None, "error": "skipped: --time-limit"}
        return send(server, plan, args.timeout)

    first = _final_greedy(server)
    # Warm-up: the same mix, so one-time allocations (thread pools, allocator arenas, caches)
    # happen before the RSS is first read.
    run_mix(run, range(WARMUP_OFFSET, WARMUP_OFFSET + 3 * args.concurrency), args.concurrency)
    before = snapshot(server, args.pid, None)
    t0 = time.perf_counter()
    results = run_mix(run, range(args.requests), args.concurrency)
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # let the engine finish what the disconnected clients left
    seen = {
        "wall_s": round(wall, 1),
        "before": before,
        "after": snapshot(server, args.pid, None),
        "crashes": crashes(server, args.pid),
        "first": first,
        "last": _final_greedy(server),
    }
    want = _final_reference(args) if args.target else None
    return _soak_record(args, results, seen, want)


def _soak_record(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    seen: dict[str, Any],
    want: list[int] | None,
) -> dict[str, Any]:
    by_kind, unexpected = tally(results, lambda r: EXPECTED_STATUS[r["kind"]])
    good_5xx = server_errors(results, ["good"])
    before, after = seen["before"]["rss_mb"], seen["after"]["rss_mb"]
    rss_growth = growth(before, after)
    record = {
        "target": args.target,
        "draft": args.draft,
        "drafter": args.drafter,
        "server_threads": args.threads,
        "requests": len(results),
        "concurrency": args.concurrency,
        "max_tokens": SOAK_MAX_TOKENS,
        "wall_s": seen["wall_s"],
        "by_kind": by_kind,
        "crashes": seen["crashes"],
        "good_5xx": good_5xx,
        "unexpected": len(unexpected),
        "unexpected_samples": unexpected[:5],
        "rss_mb_before": before,
        "rss_mb_after": after,
        "rss_growth": rss_growth,
        "rss_flat": rss_growth is not None and abs(rss_growth) <= RSS_TOLERANCE,
        "metrics_series_before": seen["before"]["series"],
        "metrics_series_after": seen["after"]["series"],
        "first_greedy_equals_last": seen["first"] is not None and seen["first"] == seen["last"],
        "final_greedy_equals_generate": want is not None and seen["last"] == want,
        "final_greedy_tokens": seen["last"],
    }
    record["ok"] = (
        record["crashes"] == 0
        and good_5xx == 0
        and not unexpected
        and record["rss_flat"]
        and record["final_greedy_equals_generate"]
    )
    return record


def _report_soak(record: dict[str, Any]) -> None:
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


# ------------------------------------------------------------------------------ the command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    ap.add_argument("-n", "--requests", type=int, default=200, help="requests (int; default 200)")
    ap.add_argument("-c", "--concurrency", type=int, default=8, help="clients (int; default 8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (int; default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="(float; default 0, greedy)")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    key = ap.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    key.add_argument("--api-key-file", default=None, help="read the key from this file (path)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, s (default 300)")
    ap.add_argument("--out", default=None, help="write the JSON record here (path)")
    soak_args = ap.add_argument_group("--soak and --hostile: the robustness runs")
    soak_args.add_argument("--soak", action="store_true", help="run the mixed soak instead")
    soak_args.add_argument(
        "--hostile", action="store_true", help="run the hostile soak instead (implies --soak)"
    )
    soak_args.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS")
    soak_args.add_argument("--target", default=None, help="the server's --target, for generate()")
    soak_args.add_argument("--draft", default=None, help="the server's --draft (default none)")
    soak_args.add_argument("--drafter", default=None, help="the server's --drafter")
    soak_args.add_argument("-k", default=None, help="the server's -k (default: the engine's)")
    soak_args.add_argument("--threads", type=int, default=1, help="threads per model (default 1)")
    soak_args.add_argument(
        "--parallel", type=int, default=1, help="the server's --parallel, recorded (default 1)"
    )
    soak_args.add_argument(
        "--deterministic", action="store_true", help="the server runs --deterministic"
    )
    soak_args.add_argument(
        "--time-limit", type=float, default=1800.0, help="--soak: stop sending after this many s"
    )
    soak_args.add_argument("--server-log", default=None, help="--hostile: the server's stderr")
    soak_args.add_argument(
        "--max-queue", type=int, default=8, help="--hostile: the server's --max-queue (burst)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not (1 <= args.requests <= 100_000 and 1 <= args.concurrency <= 256):
        ap.error("need 1 <= --requests <= 100000 and 1 <= --concurrency <= 256")
    if not args.time_limit > 0:
        ap.error("--time-limit must be > 0")
    if args.k is not None and args.k.isdigit():
        args.k = int(args.k)
    key = args.api_key
    if args.api_key_file:  # its first line, as `specdec serve --api-key-file` reads it
        key = Path(args.api_key_file).read_text().splitlines()[0].strip()
    try:
        server = connect(args.url, key, args.model)
    except ValueError as e:
        ap.error(str(e))
    if args.hostile:
        record, schema = hostile_soak(args, server), "specdec.loadtest_hostile/1"
        report_hostile(record)
    elif args.soak:
        record, schema = soak(args, server), "specdec.loadtest_soak/1"
        _report_soak(record)
    else:
        record, schema = load(args, server), "specdec.loadtest/1"
        _report_load(record)
    write_record(args.out, schema, record)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
