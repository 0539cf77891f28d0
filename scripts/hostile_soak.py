"""The hostile soak (issue 21): `scripts/loadtest.py --soak --hostile`, against a running server.

    specdec serve --target llamacpp:smollm2-135m --drafter lookup -k 4 --deterministic \\
        --threads 1 --api-key-file KEYFILE --body-timeout 2 --max-queue 16 --request-timeout 60 \\
        2> serve.log &
    .venv/bin/python scripts/loadtest.py --soak --hostile --pid $! --server-log serve.log \\
        --api-key KEY -n 500 -c 16 --target llamacpp:smollm2-135m --drafter lookup -k 4 \\
        --deterministic --out results/cpu/loadtest_hostile.json

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
soak-hostile` runs 500 requests; the run that settles a plateau (issue 33) is 2,000, the same
command with -n 2000, whose second half is the last 1,000:

    .venv/bin/python scripts/loadtest.py --soak --hostile --pid $! --server-log serve.log \\
        --api-key KEY -n 2000 -c 16 --target llamacpp:smollm2-135m --drafter lookup -k 4 \\
        --deterministic --max-queue 16 --out results/cpu/loadtest_hostile_2000.json
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loadtest import _get  # the soak's helper; loadtest imports this module lazily

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
}
MAX_TOKENS = 16
#: ~700 tokens shared by every "cache" request: the prompt cache keeps its whole blocks.
SHARED = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer in plain words, and say when you are unsure." for i in range(30)
)
QUESTIONS = ("What is 2 + 2?", "Name a prime number.", "What colour is the sky?", "Say hi.")
#: The good requests' prompts: short, so that the engine keeps up with 16 clients on one thread
#: (long prompts queue past any deadline, and a 504 under overload says nothing of robustness).
SHORT_PROMPTS = (
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "List three uses of binary search.",
    "Summarize the plot of Hamlet in one paragraph.",
    "What does HTTP status 429 mean?",
    "Give a haiku about autumn.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Name the planets of the solar system.",
    "Write a SQL query that counts rows in a table named users.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a binary tree in one sentence.",
    "Suggest a name for a cat.",
)
HEALTH_EVERY_S = 0.2
WARMUP_OFFSET = 1_000_000
#: Requests of the mix between two readings of the server's RSS.
RSS_EVERY = 100
#: A plateau: every RSS reading of the mix's second half within this fraction of the reading at
#: its half (issue 33's target: flat within 2% over the last 1,000 of 2,000 requests).
PLATEAU = 0.02


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
            if self.done % RSS_EVERY == 0 and self.pid is not None:
                rss = _proc(self.pid)["rss_mb"]
                if rss is not None:
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

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            t0 = time.perf_counter()
            status, _ = _get(self.host, self.port, "/health", {})
            if status == 200:
                self.ms.append(1000 * (time.perf_counter() - t0))
            else:
                self.failures += 1

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        s = sorted(self.ms)
        pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 1) if s else None  # noqa: E731
        return {
            "samples": len(s),
            "failures": self.failures,
            "p50_ms": pick(0.5),
            "p99_ms": pick(0.99),
            "max_ms": round(s[-1], 1) if s else None,
        }


def _turn(i: int) -> int:
    return i // len(HOSTILE_MIX)


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


def _plan(kind: str, i: int, model: str, prompts: list[str]) -> dict[str, Any]:
    """What request i sends: method, path, body bytes, extra headers, and how to behave."""
    t = _turn(i)
    p = prompts[i % len(prompts)]
    plan: dict[str, Any] = {"method": "POST", "path": "/v1/chat/completions", "headers": {}}
    body: dict[str, Any] | None = None
    if kind == "good":
        body = _chat(model, p, i)
    elif kind == "bad_key":
        routes = (
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
        )
        plan["method"], plan["path"] = routes[t % 4]
        plan["headers"] = {"Authorization": "Bearer wrong"} if t % 2 else {"Authorization": ""}
        body = _chat(model, p, i) if plan["method"] == "POST" else None
    elif kind == "wrong_typed":
        n = 250_000  # ~1 MB: under the default 1 MiB body limit
        variants = (
            {"model": model, "messages": [{}] * n},
            {"model": model, "prompt": [{}] * n},
            {"model": model, "prompt": [1] * (n // 3) + ["x"]},
            {"model": model, "messages": [{"role": "user", "content": [{"type": 1}] * 4000}]},
        )
        body = variants[t % len(variants)]
        plan["path"] = "/v1/completions" if "prompt" in body else plan["path"]
    elif kind == "numbers":
        raw = (
            b'{"model": "m", "messages": [], "max_tokens": ' + b"9" * 5001 + b"}",
            b'{"model": "m", "messages": [], "temperature": NaN}',
            b'{"model": "m", "messages": [], "temperature": 1e999}',
            b'{"model": "m", "messages": [], "seed": -' + b"9" * 400 + b"}",
        )
        plan["data"] = raw[t % len(raw)]
    elif kind in ("never_read", "queued_leave"):
        body = _chat(model, p, i, stream=True, max_tokens=64)
    elif kind == "prediction":
        preds = ("", prompts[(i + 1) % len(prompts)], p * 3, "word " * 5000)
        body = _chat(model, p, i, temperature=0.0, prediction={"type": "content", "content": ""})
        body["prediction"]["content"] = preds[t % len(preds)]
        plan["room_sized"] = t % len(preds) == 3
    elif kind == "slow_body":
        plan["slow_body"] = True
    elif kind == "cache":
        q = QUESTIONS[t % len(QUESTIONS)]
        variant = ("reuse", "cancel", "too_long", "reuse")[t % 4]
        body = _chat(model, f"{SHARED}\n\n{q}", i)
        if variant == "too_long":
            body["max_tokens"] = 10**6  # a 400, after the prompt was tokenized
        plan["cancel"] = variant == "cancel"
    elif kind == "slow_headers":
        plan["slow_headers"] = True
    elif kind == "stop_hit":
        body = _chat(model, p, i, stop=[" ", "e"][t % 2])
    if body is not None:
        plan["data"] = json.dumps(body).encode()
        plan["body"] = body
    return plan


def _raw(host: str, port: int, data: bytes, timeout: float) -> tuple[Any, float]:
    """Send `data` on a fresh socket; the status the server answers, or "closed"."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout) as c:
        try:
            c.sendall(data)
            answer = c.recv(256)
        except OSError:
            return "closed", time.perf_counter() - t0
    if not answer:
        return "closed", time.perf_counter() - t0
    return int(answer.split()[1]), time.perf_counter() - t0


def _trickle_headers(host: str, port: int) -> tuple[Any, float]:
    """A header byte a second until the server hangs up (or 60 s pass)."""
    t0 = time.perf_counter()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    with socket.create_connection((host, port), timeout=5) as c:
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


def _ids_of(raw: bytes, streamed: bool) -> tuple[list[int] | None, list[int], int | None]:
    """(prompt ids, completion ids, cached prompt tokens) of a response with return_token_ids."""
    if not streamed:
        obj = json.loads(raw)
        cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
        return obj.get("prompt_token_ids"), obj["choices"][0].get("token_ids", []), cached
    prompt, ids, cached = None, [], None
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        prompt = chunk.get("prompt_token_ids", prompt)
        if chunk.get("choices"):
            ids += chunk["choices"][0].get("token_ids", [])
        if chunk.get("usage"):
            cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return prompt, ids, cached


def _one(host: str, port: int, kind: str, i: int, plan: dict, headers: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "i": i, "status": None, "error": None}
    hdrs = {**headers, **plan["headers"]}
    t0 = time.perf_counter()
    try:
        if plan.get("slow_headers"):
            out["status"], out["s"] = _trickle_headers(host, port)
            return out
        if plan.get("slow_body"):
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nAuthorization: "
                + hdrs.get("Authorization", "").encode()
                + b"\r\nContent-Length: 2000\r\n\r\n{"
            )
            out["status"], out["s"] = _raw(host, port, head, timeout=60)
            return out
        conn = http.client.HTTPConnection(host, port, timeout=300)
        try:
            conn.request(plan["method"], plan["path"], plan.get("data"), hdrs)
            if kind == "queued_leave" or plan.get("cancel"):
                time.sleep(0.05 if plan.get("cancel") else 0.0)
                conn.sock.shutdown(socket.SHUT_RDWR)
                out["status"] = "left"
                return out
            resp = conn.getresponse()
            out["status"] = resp.status
            if kind == "never_read":
                time.sleep(1.0)  # the stream's first bytes sit unread; then the client leaves
                out["status"] = "left"
                return out
            raw = resp.read()
            out["retry_after"] = resp.getheader("Retry-After")
            body = plan.get("body") or {}
            if resp.status == 200 and body.get("return_token_ids"):
                out["prompt_ids"], out["ids"], out["cached"] = _ids_of(
                    raw, bool(body.get("stream"))
                )
                out["done_at"] = time.perf_counter()
            elif resp.status >= 400:
                out["code"] = json.loads(raw).get("error", {}).get("code")
            if resp.status == 200 and b'"error"' in raw and body.get("stream"):
                out["error"] = "stream error"
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["s"] = time.perf_counter() - t0
    return out


def _proc(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"rss_mb": None, "fds": None}
    rss = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {"rss_mb": None, "fds": None}
    return {"rss_mb": rss, "fds": fds}


def _log(path: str | None) -> dict[str, Any]:
    if not path or not Path(path).is_file():
        return {"bytes": None, "tracebacks": None}
    text = Path(path).read_text(errors="replace")
    return {"bytes": len(text.encode()), "tracebacks": text.count("Traceback")}


def _count_504(host: str, port: int, headers: dict[str, str]) -> float:
    status, text = _get(host, port, "/metrics", headers)
    total = 0.0
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("specdec_requests_total{") and 'code="504"' in line:
            total += float(line.split()[-1])
    return total if status == 200 else -1.0


def _cache_phase(host: str, port: int, model: str, headers: dict) -> list[dict[str, Any]]:
    """Prompt-cache interleavings, one request at a time so each follows the last: a shared
    ~300-token prefix reused, a cancel during a prefill, a 400 after tokenizing, a stop-string
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
    for n, (q, extra, how) in enumerate(steps):
        body = _chat(model, f"{SHARED}\n\n{QUESTIONS[q]}", 10_000 + n, **extra)
        plan = {
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": {},
            "data": json.dumps(body).encode(),
            "body": body,
            "cancel": how == "cancel",
        }
        r = _one(host, port, "cache_seq", 10_000 + n, plan, headers)
        r["body"], r["room_sized"] = body, False
        out.append(r)
        time.sleep(0.3)  # let a cancelled prefill end before the next request
    return out


def _burst(host: str, port: int, model: str, headers: dict, n: int) -> dict[str, Any]:
    """n good requests at once: past max_queue they must get 429 with Retry-After."""
    body = json.dumps(_chat(model, "Count to three.", 0, stream=False, max_tokens=8)).encode()

    def one(_: int) -> tuple[int, str | None]:
        conn = http.client.HTTPConnection(host, port, timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", body, headers)
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.getheader("Retry-After")
        except (OSError, http.client.HTTPException):
            return 0, None
        finally:
            conn.close()

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, range(n)))
    statuses: dict[str, int] = {}
    for st, _ in got:
        statuses[str(st)] = statuses.get(str(st), 0) + 1
    return {
        "sent": n,
        "statuses": statuses,
        "429_without_retry_after": sum(1 for st, ra in got if st == 429 and not ra),
    }


def _references(args: Any, results: list[dict[str, Any]], pooled: bool) -> dict[str, Any]:
    """Regenerate every recorded answer with generate() on the same models, here; with a draft
    pool on the server (`pooled`), the greedy ones only (the module docstring says why)."""
    from specdec.backends import load_model
    from specdec.backends.chat import encode_prediction, stop_ids
    from specdec.core.config import SpecConfig, Warp
    from specdec.core.decode import generate

    kw: dict[str, Any] = {"n_threads": args.threads} if args.threads else {}
    target = load_model(args.target, deterministic=args.deterministic, **kw)
    draft = load_model(args.draft, **kw) if args.draft else None
    spec_kw = {"drafter": args.drafter, "k": args.k}
    spec = SpecConfig(**{key: v for key, v in spec_kw.items() if v is not None})
    tok = target.tokenizer or getattr(draft, "tokenizer", None)
    stops = stop_ids(tok)
    compared, mismatches, not_comparable = 0, [], 0
    for r in results:
        if "ids" not in r or r.get("prompt_ids") is None or r["error"]:
            continue  # no complete answer to compare (a stream that failed is unexpected)
        body = r["body"]
        if pooled and body["temperature"] > 0:
            not_comparable += 1
            continue
        pred = (body.get("prediction") or {}).get("content")
        out = generate(
            target,
            r["prompt_ids"],
            draft=draft,
            spec=spec,
            warp=Warp(body["temperature"]),
            max_new_tokens=body["max_tokens"],
            seed=body["seed"],
            stop_ids=stops,
            prediction=encode_prediction(tok, pred) if pred else None,
        ).tokens
        compared += 1
        ok = out[: len(r["ids"])] == r["ids"] if body.get("stop") else out == r["ids"]
        if not ok:
            first = next(
                (j for j, (a, b) in enumerate(zip(out, r["ids"], strict=False)) if a != b), None
            )
            mismatches.append(
                {
                    "kind": r["kind"],
                    "i": r["i"],
                    "temperature": body["temperature"],
                    "prompt_tokens": len(r["prompt_ids"]),
                    "cached_tokens": r.get("cached"),
                    "first_difference": first,
                    "server": r["ids"],
                    "generate": out,
                }
            )
    cached = sum(1 for r in results if (r.get("cached") or 0) > 0 and not r["error"])
    return {
        "compared": compared,
        "not_comparable": not_comparable,
        "with_cached_prefix": cached,
        "mismatches": len(mismatches),
        "samples": mismatches[:5],
    }


def _pooled(host: str, port: int, headers: dict) -> bool:
    """Whether the server drafts from a cross-request draft pool (its /v1/models card)."""
    status, raw = _get(host, port, "/v1/models", headers)
    card = json.loads(raw)["data"][0] if status == 200 else {}
    return card.get("speculation", {}).get("draft_pool", {}).get("scope", "key") != "off"


def hostile_soak(args: Any, host: str, port: int, headers: dict, model: str) -> dict[str, Any]:
    prompts = list(SHORT_PROMPTS)
    plans = {
        i: _plan(HOSTILE_MIX[i % len(HOSTILE_MIX)], i, model, prompts) for i in range(args.requests)
    }

    track = RssTrack(args.pid)

    def run(i: int) -> dict[str, Any]:
        kind = HOSTILE_MIX[i % len(HOSTILE_MIX)]
        r = _one(host, port, kind, i, plans[i], headers)
        r["body"] = plans[i].get("body")
        r["room_sized"] = plans[i].get("room_sized", False)
        if i < WARMUP_OFFSET:
            track.completed()
        return r

    def mix(indices: range) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            return list(pool.map(run, indices))

    # Warm-up: three rounds of the mix at full concurrency, so that one-time allocations (every
    # worker thread's malloc arena meeting a 1 MiB body, caches, pools) come before the RSS is
    # first read; other indices, so other prompts and seeds.
    warm = range(WARMUP_OFFSET, WARMUP_OFFSET + 3 * len(HOSTILE_MIX))
    for i in warm:
        plans[i] = _plan(HOSTILE_MIX[i % len(HOSTILE_MIX)], i, model, prompts)
    mix(warm)
    before = {
        **_proc(args.pid),
        "log": _log(args.server_log),
        "504": _count_504(host, port, headers),
    }
    monitor = Monitor(host, port)
    t0 = time.perf_counter()
    results = mix(range(args.requests))
    results += _cache_phase(host, port, model, headers)
    burst = _burst(host, port, model, headers, 4 * args.max_queue)
    wall = time.perf_counter() - t0
    time.sleep(2.0)  # let the engine finish what departed clients left
    health = monitor.stop()
    after = {
        **_proc(args.pid),
        "log": _log(args.server_log),
        "504": _count_504(host, port, headers),
    }
    alive = args.pid is None or Path(f"/proc/{args.pid}").exists()
    status, _ = _get(host, port, "/health", {})

    by_kind: dict[str, dict[str, int]] = {}
    unexpected = []
    for r in results:
        counts = by_kind.setdefault(r["kind"], {})
        counts[str(r["status"])] = counts.get(str(r["status"]), 0) + 1
        allowed = EXPECTED[r["kind"]]
        if r["kind"] == "prediction":
            allowed = (400,) if r["room_sized"] else (200,)
        if r["error"] or r["status"] not in allowed:
            unexpected.append(
                f"{r['kind']} #{r['i']}: {r['status']} {r.get('code') or ''} {r['error'] or ''}"
            )
    wrong_typed_s = sorted(r["s"] for r in results if r["kind"] == "wrong_typed" and "s" in r)
    refs = _references(args, results, _pooled(host, port, headers)) if args.target else None
    rss_growth = (
        (after["rss_mb"] - before["rss_mb"]) / before["rss_mb"]
        if before["rss_mb"] and after["rss_mb"]
        else None
    )
    well_formed_5xx = sum(
        1
        for r in results
        if r["kind"] in ("good", "stop_hit", "prediction", "cache", "cache_seq")
        and isinstance(r["status"], int)
        and r["status"] >= 500
    )
    record = {
        "target": args.target,
        "drafter": args.drafter,
        "deterministic": args.deterministic,
        "requests": len(results),
        "concurrency": args.concurrency,
        "wall_s": round(wall, 1),
        "by_kind": by_kind,
        "crashes": 0 if alive and status == 200 else 1,
        "well_formed_5xx": well_formed_5xx,
        "unexpected": len(unexpected),
        "unexpected_samples": unexpected[:8],
        "health": health,
        "wrong_typed_1mib_s": {
            "median": wrong_typed_s[len(wrong_typed_s) // 2] if wrong_typed_s else None,
            "max": wrong_typed_s[-1] if wrong_typed_s else None,
        },
        "burst": burst,
        "before": before,
        "after": after,
        "rss_growth": rss_growth,
        "rss_course": track.summary(),
        "new_504": after["504"] - before["504"],
        "new_tracebacks": (after["log"]["tracebacks"] or 0) - (before["log"]["tracebacks"] or 0),
        "log_bytes_added": (after["log"]["bytes"] or 0) - (before["log"]["bytes"] or 0),
        "reference": refs,
    }
    record["ok"] = bool(
        record["crashes"] == 0
        and well_formed_5xx == 0
        and not unexpected
        and health["p99_ms"] is not None
        and health["p99_ms"] < 200
        and health["failures"] == 0
        and rss_growth is not None
        and rss_growth <= 0.05
        and record["rss_course"]["plateau"] is not False
        and record["new_504"] == 0
        and record["new_tracebacks"] == 0
        and burst["429_without_retry_after"] == 0
        and refs is not None
        and refs["mismatches"] == 0
        and (refs["with_cached_prefix"] > 0 or not args.deterministic)  # the cache was exercised
    )
    return record
