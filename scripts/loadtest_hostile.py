"""The hostile soak (issues 21, 33): `scripts/loadtest.py --hostile`, against a running server.

    specdec serve --target llamacpp:smollm2-135m --drafter lookup -k 4 --deterministic \\
        --threads 1 --draft-pool off --api-key-file KEYFILE --body-timeout 2 --max-queue 16 \\
        --request-timeout 60 2> serve.log &
    .venv/bin/python scripts/loadtest.py --hostile --pid $! --server-log serve.log \\
        --api-key-file KEYFILE -n 500 -c 16 --target llamacpp:smollm2-135m --drafter lookup \\
        -k 4 --deterministic --max-queue 16 --out results/cpu/loadtest_hostile.json

A deterministic mix, half of it good requests (chat, streamed and not, greedy and sampled, each
with its prompt's token ids returned) and the rest what a hostile or broken client sends:
missing and wrong keys on every route; 1 MiB wrong-typed lists; 5,001-digit integers, NaN,
1e999; bodies that stall; headers sent a byte a second; streams never read; clients gone while
queued or tokenizing; predictions that are empty, wrong, repeated or larger than the context;
prompt-cache interleavings (a long shared prefix, a cancel during its prefill, a 400 after it is
tokenized, stop-string hits), in the mix and, one at a time so that each follows the last, in a
phase of their own. Then a burst of 4 x max_queue requests at once (429s must carry
Retry-After). Throughout, /health is timed every 0.2 s; the server's RSS and open descriptors,
its 504 count (with a short --request-timeout, a client left waiting shows up there) and its
stderr log (bytes, tracebacks) are read before and after.

Every answer to a good, prediction, cache or stop request is compared token for token with
`generate()` on the same models, run here after the soak (a stop string's answer must be a
prefix of it). With --deterministic the server's prompt cache is on (batch-invariant target),
so this also checks the cache against fresh prefills. A sampled answer is comparable only where
the server has no draft pool (`--draft-pool off`): with one, prompt lookup also drafts from the
earlier requests of the key, in whatever order they arrived, and other drafts consume the
sampler's random numbers otherwise (the distribution is the target's, the sample is not
generate()'s); those are counted as not comparable, and greedy answers are compared either way.

RSS is also read after every RSS_EVERY requests of the mix, so that its course shows: a plateau
is RSS within PLATEAU of its level at the mix's half over the whole second half. `make
soak-hostile` runs 500 requests; the run that settles a plateau (issue 33) is 2,000
(`make soak-hostile SOAK_N=2000`), whose second half is the last 1,000.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

from loadtest_common import (
    SHORT_PROMPTS,
    WARMUP_OFFSET,
    Plan,
    Server,
    crashes,
    get,
    growth,
    load_reference,
    regenerate,
    rss_mb,
    run_mix,
    send,
    server_errors,
    snapshot,
    tally,
    turn,
)
from loadtest_structured import HOSTILE_STRUCTURED, STRUCTURED, WEATHER_TOOL

from specdec.study.engines.endpoint import percentile

HOSTILE_MIX = (
    "good",
    "bad_key",
    "good",
    "wrong_typed",
    "good",
    "numbers",
    "good",
    "never_read",
    "good",
    "queued_leave",
    "good",
    "prediction",
    "good",
    "slow_body",
    "good",
    "cache",
    "good",
    "slow_headers",
    "good",
    "stop_hit",
    "good",
    "structured",
    "good",
    "hostile_structured",
)
#: The outcomes each kind may get: HTTP statuses, "left" (the client went away on purpose) or
#: "closed" (the server cut the connection).
EXPECTED: dict[str, tuple[Any, ...]] = {
    "good": (200,),
    "bad_key": (401,),
    "wrong_typed": (400,),
    "numbers": (400,),
    "never_read": ("left",),
    "queued_leave": ("left",),
    "prediction": (200, 400),  # 400: the room-sized variant, and only it
    "slow_body": (408,),
    "cache": (200, 400, "left"),
    "cache_seq": (200, 400, "left"),
    "slow_headers": ("closed",),
    "stop_hit": (200,),
    "structured": (200,),
    "hostile_structured": (200, 400),  # which, per variant: HOSTILE_STRUCTURED
}
#: Kinds whose requests are well-formed: a 5xx to any of them is the server's fault.
WELL_FORMED = ("good", "stop_hit", "prediction", "cache", "cache_seq", "structured")
MAX_TOKENS = 16
#: ~700 tokens shared by every "cache" request: the prompt cache keeps its whole blocks.
SHARED = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer in plain words, and say when you are unsure." for i in range(30)
)
QUESTIONS = ("What is 2 + 2?", "Name a prime number.", "What colour is the sky?", "Say hi.")
BAD_KEY_ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
)
HEALTH_EVERY_S = 0.2
#: Requests of the mix between two readings of the server's RSS.
RSS_EVERY = 100
#: A plateau: every RSS reading of the mix's second half within this fraction of the reading at
#: its half (issue 33's target: flat within 2% over the last 1,000 of 2,000 requests).
PLATEAU = 0.02
#: The whole RSS growth allowed from before the mix to after it.
RSS_GROWTH_MAX = 0.05
HEALTH_P99_MAX_MS = 200


class RssTrack:
    """The server's RSS after every RSS_EVERY completed requests of the mix."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.done = 0
        self.samples: list[tuple[int, float]] = []  # (requests completed, RSS in MB)
        self._lock = threading.Lock()

    def completed(self) -> None:
        with self._lock:
            self.done += 1
            if self.done % RSS_EVERY == 0 and (rss := rss_mb(self.pid)) is not None:
                self.samples.append((self.done, round(rss, 1)))

    def summary(self) -> dict[str, Any]:
        """The readings, and the drift over the second half: (last - half) / half, and the
        span of the second half's readings around the one at the half."""
        out: dict[str, Any] = {"every": RSS_EVERY, "samples": self.samples}
        if len(self.samples) < 2:
            return {**out, "drift": None, "span": None, "plateau": None}
        half_n = self.samples[-1][0] // 2
        mid = min(self.samples, key=lambda s: abs(s[0] - half_n))
        second = [rss for n, rss in self.samples if n >= mid[0]]
        span = (max(second) - min(second)) / mid[1]
        worst = max(abs(rss - mid[1]) / mid[1] for rss in second)
        return {
            **out,
            "mid": mid,
            "end": self.samples[-1],
            "drift": (self.samples[-1][1] - mid[1]) / mid[1],
            "span": span,
            "plateau": worst <= PLATEAU,
        }


class Monitor:
    """Times GET /health every HEALTH_EVERY_S seconds in a thread until stopped."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            t0 = time.perf_counter()
            status, _ = get(self.server, "/health")
            if status == 200:
                self.ms.append(1000 * (time.perf_counter() - t0))
            else:
                self.failures += 1

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        ms = lambda v: None if v is None else round(v, 1)  # noqa: E731
        return {
            "samples": len(self.ms),
            "failures": self.failures,
            "p50_ms": ms(percentile(self.ms, 50)),
            "p99_ms": ms(percentile(self.ms, 99)),
            "max_ms": ms(max(self.ms, default=None)),
        }


def _structured_variant(i: int) -> int:
    return turn(i, HOSTILE_MIX) % len(HOSTILE_STRUCTURED)


# ------------------------------------------------------------------------------ the requests
def _chat(model: str, content: str, i: int, **kw: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0 if i % 4 < 2 else 0.8,
        "seed": i,
        "stream": i % 3 != 0,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    body.update(kw)
    return body


def _plan(i: int, model: str, keys: tuple[str, ...] = (), tools: bool = True) -> Plan:
    """What request i of the mix sends, and how its client behaves (`keys`: the structured
    requests' API keys, taken in turn; none: the server's own. `tools`: whether the model's
    chat template has a tool format; without one, a tools request is a 400 naming `tools`,
    and the well-formed structured requests leave them out)."""
    kind, t = HOSTILE_MIX[i % len(HOSTILE_MIX)], turn(i, HOSTILE_MIX)
    p = SHORT_PROMPTS[i % len(SHORT_PROMPTS)]
    if kind in ("structured", "hostile_structured"):
        key = {"Authorization": f"Bearer {keys[t % len(keys)]}"} if keys else {}
        if kind == "structured":
            variants = [v for v in STRUCTURED if tools or "tools" not in v]
            body = _chat(model, p, i, **variants[t % len(variants)])
        else:
            body = _chat(model, p, i, stream=False, **HOSTILE_STRUCTURED[_structured_variant(i)][1])
        return Plan.of(kind, i, body, headers=key)
    if kind == "bad_key":
        method, path = BAD_KEY_ROUTES[t % len(BAD_KEY_ROUTES)]
        key = {"Authorization": "Bearer wrong"} if t % 2 else {"Authorization": ""}
        if method == "GET":
            return Plan(kind, i, method=method, path=path, headers=key)
        return Plan.of(kind, i, _chat(model, p, i), path=path, headers=key)
    if kind == "wrong_typed":
        n = 250_000  # ~1 MB: under the default 1 MiB body limit
        variants = (
            {"model": model, "messages": [{}] * n},
            {"model": model, "prompt": [{}] * n},
            {"model": model, "prompt": [1] * (n // 3) + ["x"]},
            {"model": model, "messages": [{"role": "user", "content": [{"type": 1}] * 4000}]},
        )
        body = variants[t % len(variants)]
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        return Plan.of(kind, i, body, path=path)
    if kind == "numbers":
        raw = (
            b'{"model": "m", "messages": [], "max_tokens": ' + b"9" * 5001 + b"}",
            b'{"model": "m", "messages": [], "temperature": NaN}',
            b'{"model": "m", "messages": [], "temperature": 1e999}',
            b'{"model": "m", "messages": [], "seed": -' + b"9" * 400 + b"}",
        )
        return Plan(kind, i, data=raw[t % len(raw)])
    if kind in ("never_read", "queued_leave"):
        leave = "unread" if kind == "never_read" else "sent"
        return Plan.of(kind, i, _chat(model, p, i, stream=True, max_tokens=64), leave=leave)
    if kind == "prediction":
        preds = ("", SHORT_PROMPTS[(i + 1) % len(SHORT_PROMPTS)], p * 3, "word " * 5000)
        pred = {"type": "content", "content": preds[t % len(preds)]}
        body = _chat(model, p, i, temperature=0.0, prediction=pred)
        return Plan.of(kind, i, body, room_sized=t % len(preds) == 3)
    if kind == "cache":
        variant = ("reuse", "cancel", "too_long", "reuse")[t % 4]
        body = _chat(model, f"{SHARED}\n\n{QUESTIONS[t % len(QUESTIONS)]}", i)
        if variant == "too_long":
            body["max_tokens"] = 10**6  # a 400, after the prompt was tokenized
        return Plan.of(kind, i, body, leave="cancel" if variant == "cancel" else None)
    if kind == "stop_hit":
        return Plan.of(kind, i, _chat(model, p, i, stop=[" ", "e"][t % 2]))
    if kind in ("slow_body", "slow_headers"):
        return Plan(kind, i)  # sent on a bare socket (_send)
    return Plan.of(kind, i, _chat(model, p, i))  # good


def _send(server: Server, plan: Plan) -> dict[str, Any]:
    """send(), but for the two kinds that need a bare socket: a body that stalls after its
    first byte, and headers sent a byte a second."""
    if plan.kind in ("slow_body", "slow_headers"):
        out: dict[str, Any] = {"kind": plan.kind, "i": plan.i, "status": None, "error": None}
        try:
            if plan.kind == "slow_headers":
                out["status"], out["s"] = _trickle_headers(server)
            else:
                out["status"], out["s"] = _stall_body(server)
        except (OSError, ValueError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
    else:
        out = send(server, plan)
    out["room_sized"] = plan.room_sized
    return out


def _stall_body(server: Server) -> tuple[Any, float]:
    """Announce a 2,000-byte body, send one byte; the status the server answers, or "closed"."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nAuthorization: "
        + server.headers.get("Authorization", "").encode()
        + b"\r\nContent-Length: 2000\r\n\r\n{"
    )
    t0 = time.perf_counter()
    with socket.create_connection((server.host, server.port), timeout=60) as c:
        try:
            c.sendall(head)
            answer = c.recv(256)
        except OSError:
            return "closed", time.perf_counter() - t0
    if not answer:
        return "closed", time.perf_counter() - t0
    return int(answer.split()[1]), time.perf_counter() - t0


def _trickle_headers(server: Server) -> tuple[Any, float]:
    """A header byte a second until the server hangs up (or 60 s pass)."""
    t0 = time.perf_counter()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    with socket.create_connection((server.host, server.port), timeout=5) as c:
        c.settimeout(1.0)
        for b in head:
            try:
                c.sendall(bytes([b]))
                if c.recv(256) == b"":
                    return "closed", time.perf_counter() - t0
            except TimeoutError:
                continue
            except OSError:
                return "closed", time.perf_counter() - t0
    return "open", time.perf_counter() - t0


def _cache_phase(server: Server) -> list[dict[str, Any]]:
    """Prompt-cache interleavings, one request at a time so each follows the last: a shared
    ~700-token prefix reused, a cancel during a prefill, a 400 after tokenizing, a stop-string
    hit, a sampled stream; each compared with generate() afterwards."""
    steps = (
        (0, {"temperature": 0.0, "stream": False}, None),
        (1, {"temperature": 0.0, "stream": True}, None),  # reuses the prefix's whole blocks
        (2, {"temperature": 0.0, "stream": True}, "cancel"),
        (3, {"temperature": 0.0, "stream": False}, None),
        (0, {"max_tokens": 10**6}, None),  # 400 after the prompt was tokenized
        (0, {"temperature": 0.0, "stream": True, "stop": [" "]}, None),
        (1, {"temperature": 0.8, "stream": True}, None),
        (1, {"temperature": 0.8, "stream": False, "seed": 7}, None),
    )
    out = []
    for n, (q, extra, leave) in enumerate(steps):
        body = _chat(server.model, f"{SHARED}\n\n{QUESTIONS[q]}", 10_000 + n, **extra)
        out.append(_send(server, Plan.of("cache_seq", 10_000 + n, body, leave=leave)))
        time.sleep(0.3)  # let a cancelled prefill end before the next request
    return out


def _burst(server: Server, n: int) -> dict[str, Any]:
    """n good requests at once: past max_queue they must get 429 with Retry-After."""
    body = _chat(server.model, "Count to three.", 0, stream=False, max_tokens=8)
    plan = Plan.of("burst", 0, body)
    got = run_mix(lambda _: send(server, plan), range(n), n)
    return {
        "sent": n,
        "statuses": dict(Counter(str(r["status"]) for r in got)),
        "429_without_retry_after": sum(
            1 for r in got if r["status"] == 429 and not r.get("retry_after")
        ),
    }


# ------------------------------------------------------------------------------ the soak
def hostile_soak(args: Any, server: Server) -> dict[str, Any]:
    """The hostile soak; returns its record (see the module docstring)."""
    track = RssTrack(args.pid)

    keys = _keys(args)
    tools = _tools_served(server)

    def run(i: int) -> dict[str, Any]:
        r = _send(server, _plan(i, server.model, keys, tools))
        if i < WARMUP_OFFSET:
            track.completed()
        return r

    # Warm-up: three rounds of the mix at full concurrency, so that one-time allocations (every
    # worker thread's malloc arena meeting a 1 MiB body, caches, pools) come before the RSS is
    # first read; other indices, so other prompts and seeds.
    run_mix(run, range(WARMUP_OFFSET, WARMUP_OFFSET + 3 * len(HOSTILE_MIX)), args.concurrency)
    # and every structured variant once, each kind's first use of the grammar engine included
    cycles = max(len(STRUCTURED), len(HOSTILE_STRUCTURED))
    at = [j for j, kind in enumerate(HOSTILE_MIX) if kind.endswith("structured")]
    first = WARMUP_OFFSET + 3 * len(HOSTILE_MIX)
    run_mix(run, [first + c * len(HOSTILE_MIX) + j for c in range(cycles) for j in at], 4)
    before = snapshot(server, args.pid, args.server_log)
    monitor = Monitor(server)
    t0 = time.perf_counter()
    results = run_mix(run, range(args.requests), args.concurrency)
    results += _cache_phase(server)
    burst = _burst(server, 4 * args.max_queue)
    wall = time.perf_counter() - t0
    time.sleep(2.0)  # let the engine finish what departed clients left
    seen = {
        "wall_s": round(wall, 1),
        "health": monitor.stop(),
        "after": snapshot(server, args.pid, args.server_log),
        "crashes": crashes(server, args.pid),
        "before": before,
        "burst": burst,
        "rss_course": track.summary(),
    }
    refs = _references(args, results, _pooled(server)) if args.target else None
    seen["solo"] = _solo(server, results, keys, tools)
    seen["tools_served"] = tools
    return _record(args, results, refs, seen)


def _keys(args: Any) -> tuple[str, ...]:
    if not args.keys_file:
        return ()
    with open(args.keys_file) as f:
        return tuple(line.strip() for line in f if line.strip())


def _tools_served(server: Server) -> bool:
    """Whether the model's chat template has a tool format: a tools request answered 200."""
    body = _chat(server.model, "Hi.", 0, stream=False, max_tokens=1, tools=[WEATHER_TOOL])
    return send(server, Plan.of("probe", 0, body))["status"] == 200


def _solo(
    server: Server, results: list[dict[str, Any]], keys: tuple[str, ...], tools: bool
) -> dict:
    """Every structured answer of the soak against the same request sent alone, now: the
    requests beside it (hostile ones among them) must not have changed a token."""
    compared, mismatches = 0, []
    for r in results:
        if r["kind"] != "structured" or "ids" not in r or r["error"]:
            continue
        again = _send(server, _plan(r["i"], server.model, keys, tools))
        compared += 1
        if again.get("ids") != r["ids"]:
            mismatches.append({"i": r["i"], "soak": r["ids"], "alone": again.get("ids"),
                               "status": again["status"]})  # fmt: skip
    return {"compared": compared, "mismatches": len(mismatches), "samples": mismatches[:3]}


def _latency(results: list[dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, Any]:
    s = [r["s"] for r in results if r["kind"] in kinds and r["status"] == 200 and "s" in r]
    return {"n": len(s), "p50_s": percentile(s, 50), "p99_s": percentile(s, 99),
            "max_s": max(s, default=None)}  # fmt: skip


def _allowed(r: dict[str, Any]) -> tuple[Any, ...]:
    if r["kind"] == "prediction":
        return (400,) if r["room_sized"] else (200,)
    if r["kind"] == "hostile_structured":
        _, _, statuses, field = HOSTILE_STRUCTURED[_structured_variant(r["i"])]
        named = (r.get("param") or "").startswith(field or "")
        if r["status"] == 400 and not named:
            return ()  # a 400 that does not name the field it refused
        return statuses
    return EXPECTED[r["kind"]]


def _record(
    args: Any, results: list[dict[str, Any]], refs: dict | None, seen: dict[str, Any]
) -> dict[str, Any]:
    by_kind, unexpected = tally(results, _allowed)
    wrong_typed_s = sorted(r["s"] for r in results if r["kind"] == "wrong_typed" and "s" in r)
    before, after = seen["before"], seen["after"]
    record = {
        "target": args.target,
        "drafter": args.drafter,
        "deterministic": args.deterministic,
        "parallel": args.parallel,
        "requests": len(results),
        "concurrency": args.concurrency,
        "wall_s": seen["wall_s"],
        "by_kind": by_kind,
        "crashes": seen["crashes"],
        "well_formed_5xx": server_errors(results, WELL_FORMED),
        "unexpected": len(unexpected),
        "unexpected_samples": unexpected[:8],
        "health": seen["health"],
        "wrong_typed_1mib_s": {
            "median": wrong_typed_s[len(wrong_typed_s) // 2] if wrong_typed_s else None,
            "max": wrong_typed_s[-1] if wrong_typed_s else None,
        },
        "burst": seen["burst"],
        "before": before,
        "after": after,
        "rss_growth": growth(before["rss_mb"], after["rss_mb"]),
        "rss_course": seen["rss_course"],
        "new_504": after["504"] - before["504"],
        "new_tracebacks": (after["log"]["tracebacks"] or 0) - (before["log"]["tracebacks"] or 0),
        "log_bytes_added": (after["log"]["bytes"] or 0) - (before["log"]["bytes"] or 0),
        "reference": refs,
        "solo": seen["solo"],
        "tools_served": seen["tools_served"],
        # what a well-formed request waited, hostile neighbours and all
        "latency": {k: _latency(results, (k,)) for k in ("good", "structured")},
        "hostile_structured": {
            name: dict(
                Counter(
                    str(r["status"])
                    for r in results
                    if r["kind"] == "hostile_structured"
                    and HOSTILE_STRUCTURED[_structured_variant(r["i"])][0] == name
                )
            )
            for name, *_ in HOSTILE_STRUCTURED
        },
    }
    record["ok"] = _ok(record, args.deterministic)
    return record


def _ok(record: dict[str, Any], deterministic: bool) -> bool:
    health, refs, rss = record["health"], record["reference"], record["rss_growth"]
    return bool(
        record["crashes"] == 0
        and record["well_formed_5xx"] == 0
        and record["unexpected"] == 0
        and health["p99_ms"] is not None
        and health["p99_ms"] < HEALTH_P99_MAX_MS
        and health["failures"] == 0
        and rss is not None
        and rss <= RSS_GROWTH_MAX
        and record["rss_course"]["plateau"] is not False
        and record["before"]["504"] >= 0  # /metrics was read: the 504 count means something
        and record["new_504"] == 0
        and record["new_tracebacks"] == 0
        and record["burst"]["429_without_retry_after"] == 0
        and refs is not None
        and refs["mismatches"] == 0
        and (refs["with_cached_prefix"] > 0 or not deterministic)  # the cache was exercised
        and record["solo"]["mismatches"] == 0
    )


# ------------------------------------------------------------------------------ generate()
def _pooled(server: Server) -> bool:
    """Whether the server drafts from a cross-request draft pool (its /v1/models card)."""
    status, raw = get(server, "/v1/models")
    card = json.loads(raw)["data"][0] if status == 200 else {}
    return card.get("speculation", {}).get("draft_pool", {}).get("scope", "key") != "off"


def _references(args: Any, results: list[dict[str, Any]], pooled: bool) -> dict[str, Any]:
    """Regenerate every recorded answer with generate() on the same models, here; with a draft
    pool on the server (`pooled`), the greedy ones only (the module docstring says why)."""
    ref = load_reference(args)
    compared, mismatches, not_comparable = 0, [], 0
    for r in results:
        if "ids" not in r or r.get("prompt_ids") is None or r["error"]:
            continue  # no complete answer to compare (a stream that failed is unexpected)
        if r["kind"] in ("structured", "hostile_structured"):
            continue  # generate() has no grammar, penalties or n: `_solo` compares these
        body = r["body"]
        if pooled and body["temperature"] > 0:
            not_comparable += 1
            continue
        out = regenerate(ref, r["prompt_ids"], body)
        compared += 1
        ok = out[: len(r["ids"])] == r["ids"] if body.get("stop") else out == r["ids"]
        if not ok:
            mismatches.append(_mismatch(r, out))
    cached = sum(1 for r in results if (r.get("cached") or 0) > 0 and not r["error"])
    return {
        "compared": compared,
        "not_comparable": not_comparable,
        "with_cached_prefix": cached,
        "mismatches": len(mismatches),
        "samples": mismatches[:5],
    }


def _mismatch(r: dict[str, Any], out: list[int]) -> dict[str, Any]:
    first = next((j for j, (a, b) in enumerate(zip(out, r["ids"], strict=False)) if a != b), None)
    return {
        "kind": r["kind"],
        "i": r["i"],
        "temperature": r["body"]["temperature"],
        "prompt_tokens": len(r["prompt_ids"]),
        "cached_tokens": r.get("cached"),
        "first_difference": first,
        "server": r["ids"],
        "generate": out,
    }


def report(record: dict[str, Any]) -> None:
    """The record in one line (and its unexpected answers on stderr)."""
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
        f" | structured == alone: {record['solo']['compared'] - record['solo']['mismatches']}"
        f"/{record['solo']['compared']} | ok {record['ok']}"
    )
    for e in record["unexpected_samples"]:
        print(f"  unexpected: {e}", file=sys.stderr)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"
