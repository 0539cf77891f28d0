#!/usr/bin/env python3
"""Issue 62's completion replay: editing sessions on real files of pinned packages
(study.run.completion), sent as llama.vscode sends them to `/infill`, one request at a time,
to each engine on a fresh server, one after another (never two at once); written as a
specdec.completion_replay/1 record:

    python scripts/completion_replay.py --out results/cpu/completion/replay.json

    engines   specdec serve target-only (the T = 0 reference), with prompt lookup, with the
              draft model (composite); stock llama-server at its FIM preset's settings
              (--fim-qwen-1.5b-default: -b 1024 -ub 1024 --cache-reuse 256) and with the draft
              model (-md, as --fim-qwen-7b-spec); same GGUF files, 2 threads each. With
              --engines: ik_llama.cpp's server (ik-llama-server, ik-llama-server-suffix)
    requests  per file, lines of one function body typed back: a request at each line's start
              and after each word; the latency of each (client wall time), what the engine
              says of its prompt (prompt_n, cache_n, prompt_ms) and the answer
    keystroke on specdec: a ~2,000-token prompt, sent, then the same with one character more;
              the keystroke's time to first token (timings.prompt_ms, streamed) against the
              time to prefill a fresh 64-token prompt
    agree     every answer against target-only's at T = 0: equal, or one a prefix of the other
              where t_max_predict_ms cut one of them at a newline
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from loadtest_common import write_record

from specdec.backends import parse_spec
from specdec.backends.registry import resolve
from specdec.study.engines.anchors import LlamaServer, PromptCachingServer
from specdec.study.engines.peers import PEERS
from specdec.study.run import completion as cr

FILES = (  # (distribution, path): pinned in requirements.txt, licences recorded
    ("h11", "h11/_connection.py"),
    ("jinja2", "jinja2/lexer.py"),
    ("uvicorn", "uvicorn/config.py"),
    ("fastapi", "fastapi/routing.py"),
)
TARGET, DRAFT = "llamacpp:qwen2.5-coder-1.5b", "llamacpp:qwen2.5-coder-0.5b"
PRESET = ("-b", "1024", "-ub", "1024", "--cache-reuse", "256")  # --fim-qwen-1.5b-default
CTX = 8192
THREADS = 2


def _send(url: str, key: str, path: str, body: dict) -> tuple[Any, Any]:
    """POST `body` as JSON with `key`: the connection and its response, unread."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    head = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request("POST", path, json.dumps(body), head)
    return conn, conn.getresponse()


def post(url: str, key: str, path: str, body: dict) -> tuple[int, Any]:
    conn, r = _send(url, key, path, body)
    raw = r.read()
    conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw.decode(errors="replace")


class Raw:
    """An engine whose /infill does not build the FIM prompt from llama.vscode's fields (ik's:
    it answers from `prompt` alone) gets specdec's FIM prompt as token ids on /completion:
    the same tokens specdec's engines see, so its speed is compared like for like."""

    def __init__(self, target: str) -> None:
        from specdec.backends.fim import Extra, fim_prompt, fim_tokens, plain_encoder
        from specdec.backends.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve(parse_spec(target)[1]))
        fim = fim_tokens(tok)
        assert fim is not None
        encode = plain_encoder(tok)

        def ids(b: dict) -> list[int]:
            extra = [Extra(c["text"], c.get("filename", "")) for c in b.get("input_extra", [])]
            return fim_prompt(fim, encode, b["input_prefix"], b["input_suffix"], extra,
                              b.get("prompt", ""), n_ctx=CTX, n_predict=b["n_predict"])  # fmt: skip

        self.ids = ids

    def __call__(self, body: dict) -> tuple[str, dict]:
        keep = ("n_predict", "temperature", "top_k", "top_p", "cache_prompt", "stream")
        out = {k: body[k] for k in keep if k in body}
        out |= {"prompt": self.ids(body), "t_max_predict_ms": body.get("t_max_predict_ms", 0)}
        if "n_indent" in body:
            out["n_indent"] = body["n_indent"]
        return "/completion", out


def _route(raw: Raw | None, body: dict) -> tuple[str, dict]:
    return raw(body) if raw is not None else ("/infill", body)


def replay(server: LlamaServer, keystrokes: list[cr.Keystroke], raw: Raw | None) -> list[dict]:
    """Every keystroke's request in order, one at a time: its latency and what came back."""
    out = []
    for i, k in enumerate(keystrokes):
        path, body = _route(raw, k.body)
        t0 = time.perf_counter()
        status, r = post(server.url, server.key, path, body)
        wall = time.perf_counter() - t0
        if status != 200:
            raise SystemExit(f"{server.kind}: {path} answered {status}: {str(r)[:300]}")
        t = r.get("timings", {})
        out.append({
            "session": k.session, "line": k.line, "col": k.col, "kind": k.kind,
            "latency_s": round(wall, 4), "content": r.get("content", ""),
            "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"),
            "prompt_ms": t.get("prompt_ms"), "predicted_n": t.get("predicted_n"),
            "predicted_ms": t.get("predicted_ms"), "stop_type": r.get("stop_type"),
        })  # fmt: skip
        print(f"  {i + 1}/{len(keystrokes)} {k.kind:4} {wall:6.2f} s  cache_n={t.get('cache_n')}")
    return out


def keystroke_probe(
    server: LlamaServer, src: cr.Source, extra: list[dict], raw: Raw | None
) -> dict:
    """A ~2,000-token /infill prompt sent twice (cached), then once with a character more,
    streamed: that keystroke's time to first token against a fresh 64-token prompt's
    prefill (timings.prompt_ms of a request whose prefix is new)."""
    lines = src.text.splitlines()
    body = cr.request([*lines[:150], "    retur", *lines[150:200]], 150, 9, extra)
    body |= {"n_predict": 8, "t_max_predict_ms": 0}
    for _ in range(2):
        post(server.url, server.key, *_route(raw, body))
    typed = cr.request([*lines[:150], "    return", *lines[150:200]], 150, 10, extra)
    typed |= {"n_predict": 8, "t_max_predict_ms": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, record, first = _stream(server, *_route(raw, typed), t0)
    return {
        "first_events": first,
        "prompt_n": record.get("tokens_evaluated"),
        "cache_n": record.get("timings", {}).get("cache_n"),
        "keystroke_ttft_ms": round(1000 * ttft, 1),
        "keystroke_prompt_ms": record.get("timings", {}).get("prompt_ms"),
    }


def prefill_ms(target: str, tokens: int = 64, reps: int = 5) -> float:
    """The median time to prefill `tokens` fresh prompt tokens in process (no server running):
    the keystroke target's yardstick."""
    from specdec.backends import load_model

    m = load_model(target, n_threads=THREADS)
    ids = m.tokenizer("def f(x):\n    return x\n" * 40)["input_ids"][:tokens]
    times = []
    for _ in range(reps + 1):
        m.reset()
        t0 = time.perf_counter()
        m.prefill(ids)
        times.append(time.perf_counter() - t0)
    m.close()
    return round(1000 * statistics.median(times[1:]), 1)


def _stream(server: LlamaServer, path: str, body: dict, t0: float) -> tuple[float, dict, list[str]]:
    conn, r = _send(server.url, server.key, path, body)
    ttft, last, first = None, {}, []
    for raw in r:
        line = raw.decode().strip()
        if line and len(first) < 3:
            first.append(line[:200])
        if not line.startswith("data:"):
            continue
        event = json.loads(line[5:])
        if ttft is None and event.get("content"):
            ttft = time.perf_counter() - t0
        last = event
    conn.close()
    return ttft or float("nan"), last, first


def engines(target: str, draft: str) -> dict[str, LlamaServer]:
    t_path = resolve(parse_spec(target)[1])
    d_path = resolve(parse_spec(draft)[1])
    common = ("--ctx-size", str(CTX), "--threads", str(THREADS))

    def spec(name: str, *args: str) -> LlamaServer:
        return PromptCachingServer(t_path, target=target, name=name, args=(*common, *args))

    return {
        "specdec-target": spec("specdec-target", "--draft", "none"),
        "specdec-lookup": spec("specdec-lookup", "--drafter", "lookup"),
        "specdec-draft": spec("specdec-draft", "--draft", draft, "--drafter", "composite"),
        "llama-server": LlamaServer(t_path, PRESET, threads=THREADS, ctx=CTX),
        "llama-server-draft": LlamaServer(
            t_path, (*PRESET, "-md", str(d_path)), threads=THREADS, ctx=CTX
        ),
        # ik_llama.cpp from its upstream tree (`specdec anchors build --peer ik --src DIR`), at
        # its best for a CPU (--run-time-repack), with the FIM preset's batch (it has no
        # --cache-reuse), sent specdec's FIM prompt on /completion (Raw); off the default
        # list: a build that CI's machines lack
        "ik-llama-server": _ik(t_path, "none", ()),
        "ik-llama-server-suffix": _ik(t_path, "suffix", ("--spec-type", "suffix")),
    }


def _ik(t_path: Path, mode: str, args: tuple[str, ...]) -> LlamaServer:
    flags = (*PEERS["ik"].flags, "-b", "1024", "-ub", "1024", *args)
    return LlamaServer(t_path, flags, mode=f"ik-{mode}", peer="ik", threads=THREADS, ctx=CTX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--engines", default=None, help="comma-separated (default: all)")
    ap.add_argument("--lines", type=int, default=2, help="lines typed back per session")
    ap.add_argument("--sessions-per-file", type=int, default=1)
    ap.add_argument("--files", type=int, default=len(FILES), help="the first N files")
    args = ap.parse_args()
    sources = [cr.source(d, p) for d, p in FILES]
    typed = sources[: args.files]
    keystrokes: list[cr.Keystroke] = []
    sessions = []
    for i, src in enumerate(typed):
        others = sources[i + 1 :] + sources[:i]
        extra = cr.chunks(others, 2)
        for start in cr.cut_points(src, args.sessions_per_file, skip=3):
            n = len(sessions)
            keys = cr.session(src, start, args.lines, extra, n)
            sessions.append({"file": src.name, "licence": src.licence, "line": start + 1,
                             "requests": len(keys)})  # fmt: skip
            keystrokes += keys
    print(f"{len(sessions)} sessions, {len(keystrokes)} requests")
    all_engines = engines(TARGET, DRAFT)
    names = args.engines.split(",") if args.engines else [n for n in all_engines if "ik" not in n]
    runs: dict[str, Any] = {}
    for name in names:
        server = all_engines[name]
        print(f"{name}: starting")
        with server:
            post(server.url, server.key, "/infill", {"input_prefix": "x", "input_suffix": "",
                                                      "n_predict": 4})  # fmt: skip
            raw = Raw(TARGET) if name.startswith("ik-") else None
            records = replay(server, keystrokes, raw)
            probe = keystroke_probe(server, sources[0], cr.chunks(sources[1:3], 2), raw)
            runs[name] = {"describe": server.describe(), "requests": records, "probe": probe}
        _summarize(name, runs[name])
    yardstick = prefill_ms(TARGET)
    print(f"prefill of 64 tokens: {yardstick} ms")
    ref = runs.get("specdec-target")
    for run in runs.values():
        if ref is not None:
            pairs = [
                (a["content"], b["content"])
                for a, b in zip(run["requests"], ref["requests"], strict=True)
            ]
            run["agree"] = sum(cr.agrees(a, b) for a, b in pairs)
            run["equal"] = sum(a == b for a, b in pairs)
    record = {
        "sessions": sessions,
        "settings": {"target": TARGET, "draft": DRAFT, "ctx": CTX, "threads": THREADS,
                     "preset": list(PRESET), "fixed": cr.FIXED, "lines": args.lines},
        "load": os.getloadavg(),
        "prefill_64_ms": yardstick,
        "runs": runs,
        "summary": {n: _stats(r) for n, r in runs.items()},
    }  # fmt: skip
    write_record(args.out, "specdec.completion_replay/1", record)


def _stats(run: dict) -> dict:
    reqs = run["requests"]
    first = {r["session"]: r for r in reversed(reqs)}  # each session's first request
    rest = [r for r in reqs if first[r["session"]] is not r]
    return {
        "all": cr.summary([r["latency_s"] for r in reqs]),
        "first": cr.summary([r["latency_s"] for r in first.values()]),
        "after_first": cr.summary([r["latency_s"] for r in rest]),
        "line": cr.summary([r["latency_s"] for r in rest if r["kind"] == "line"]),
        "word": cr.summary([r["latency_s"] for r in rest if r["kind"] == "word"]),
        "agree": run.get("agree"),
        "equal": run.get("equal"),
        "probe": run["probe"],
    }


def _summarize(name: str, run: dict) -> None:
    s = _stats(run)
    print(f"{name}: all {s['all']}\n  first {s['first']}\n  probe {s['probe']}")


if __name__ == "__main__":
    main()
