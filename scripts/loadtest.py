"""Robustness soaks of a running `specdec serve` (benchmarks, not tests), in two modes.

The load test that was this script's default mode (N streamed chat completions at concurrency C:
latency, TTFT, tokens/s, errors, acceptance) is `specdec bench --concurrency C --endpoint URL`
(study/run/together.py), which reports those per method:

    specdec serve --target llamacpp:smollm2-135m --drafter lookup -k auto --threads 2 --parallel 8 &
    specdec bench --config all_gguf --endpoint http://127.0.0.1:8000 --concurrency 8 \\
        --prompts 32 --max-new-tokens 32

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

Each mode prints one line and, with --out, writes its record as a specdec artifact
(`specdec.loadtest_soak/1`, `specdec.loadtest_hostile/1`) whose `meta` names the machine; the
exit status is 0 only if the record is `ok`. Where the code is: scripts/loadtest_common.py (what
the modes share: the request sender, the server's readings, the tally, generate(), the
artifact), scripts/loadtest_hostile.py (the hostile mix), this file (the command line and the
mixed soak). Requests go out over the standard library's http.client; a streamed answer is read
by specdec's one reader of streams (specdec.study.engines.stream), and specdec is imported for
the prompt set, the reference generation and the artifact too. Loopback URLs only: it is a load
generator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from loadtest_common import (
    WARMUP_OFFSET,
    Plan,
    Server,
    add_server_args,
    connect_from_args,
    crashes,
    growth,
    load_reference,
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

from specdec.study.run.prompts import load_prompts

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
    prompts = [p.text for p in load_prompts()]
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
    add_server_args(ap, requests=200, timeout=300.0)
    soak_args = ap.add_argument_group("--soak and --hostile: the robustness runs (one of them)")
    soak_args.add_argument("--soak", action="store_true", help="run the mixed soak")
    soak_args.add_argument(
        "--hostile", action="store_true", help="run the hostile soak (overrides --soak)"
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
        "--keys-file",
        default=None,
        help="--hostile: more keys of the server's --api-keys-file, one per line: the "
        "structured requests take them in turn (default: the one key)",
    )
    soak_args.add_argument(
        "--max-queue", type=int, default=8, help="--hostile: the server's --max-queue (burst)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not (args.soak or args.hostile):
        ap.error(
            "pass --soak or --hostile; the load test that was the default mode is "
            "`specdec bench --concurrency C --endpoint URL`"
        )
    if not args.time_limit > 0:
        ap.error("--time-limit must be > 0")
    if args.k is not None and args.k.isdigit():
        args.k = int(args.k)
    server = connect_from_args(ap, args)
    if args.hostile:
        record, schema = hostile_soak(args, server), "specdec.loadtest_hostile/1"
        report_hostile(record)
    else:
        record, schema = soak(args, server), "specdec.loadtest_soak/1"
        _report_soak(record)
    write_record(args.out, schema, record)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
