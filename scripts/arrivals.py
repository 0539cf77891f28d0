"""A running stream's gaps while long prompts arrive (issue 42), against a running server.

    specdec serve --target llamacpp:smollm2-135m --parallel 4 --port 8124 &
    .venv/bin/python scripts/arrivals.py --port 8124 --prompts 3 --prompt-tokens 1000 \\
        --out /tmp/arrivals.json

Streams one greedy completion and, once it has streamed for --lead seconds, sends --prompts
prompts of --prompt-tokens random token ids each, at once (max_tokens 1 each: their cost is the
prefill). Reports the stream's median gap between chunks before they arrive (its round) and its
longest gap then, its longest gap from their arrival until the last of them is answered (also
in those rounds: a stream whose drafts grow meanwhile has longer rounds), its tokens/s before
and meanwhile, and the newcomers' time to their answer. A benchmark, not a test: run it on an
idle machine.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

from loadtest_common import connect, write_record

from specdec.study.engines.stream import StreamReader, read_stream


def _post(port: int, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def _stream(port: int, model: str, max_tokens: int, times: list[float], sizes: list[int]) -> None:
    body = {"model": model, "prompt": "Once upon a time, in a land far away,", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}  # fmt: skip
    resp = _post(port, body)
    assert resp.status == 200, resp.read()

    def arrived(reader: StreamReader) -> bool:
        # after each line: a chunk that brought token ids is one arrival of that many tokens
        if len(reader.token_ids) > sum(sizes):
            times.append(time.perf_counter())
            sizes.append(len(reader.token_ids) - sum(sizes))
        return False

    read_stream(resp, f"http://127.0.0.1:{port}/v1/completions", until=arrived)


def _newcomer(port: int, model: str, ids: list[int], out: list[float]) -> None:
    t0 = time.perf_counter()
    resp = _post(port, {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0})
    resp.read()
    assert resp.status == 200
    out.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--lead", type=float, default=3.0, help="seconds streamed before arrivals")
    ap.add_argument("--label", default="", help="what this run is (e.g. the commit served)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = connect(f"http://127.0.0.1:{args.port}", None, None).model  # its first model
    load = os.getloadavg()[0]  # the machine should be idle: said in the record
    rng = random.Random(0)
    times: list[float] = []
    sizes: list[int] = []  # tokens in each chunk (a round's)
    stream = threading.Thread(target=_stream,
                              args=(args.port, model, args.max_tokens, times, sizes))  # fmt: skip
    stream.start()
    while not times or time.perf_counter() - times[0] < args.lead:
        time.sleep(0.01)
    before = list(times)
    arrived = time.perf_counter()
    ttft: list[float] = []
    news = [threading.Thread(target=_newcomer, args=(args.port, model,
                             [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)], ttft))
            for _ in range(args.prompts)]  # fmt: skip
    for t in news:
        t.start()
    for t in news:
        t.join()
    answered = time.perf_counter()
    stream.join()
    round_s = statistics.median(b - a for a, b in itertools.pairwise(before))
    during = [t for t in times if t >= arrived]
    edges = [arrived, *[t for t in during if t <= answered]]
    after = next((t for t in during if t > answered), None)
    if after is not None:
        edges.append(after)
    longest = max(b - a for a, b in itertools.pairwise(edges))
    first = len(before)
    last = next((i for i, t in enumerate(times) if t > answered), len(times))
    rate = lambda a, b: sum(sizes[a + 1 : b]) / (times[b - 1] - times[a])  # noqa: E731
    report = {
        "label": args.label,
        "model": model,
        "load_before": load,  # meta.machine's load_avg is read at the end
        "stream_tok_s_before": rate(0, first),
        "stream_tok_s_during": rate(first - 1, last) if last > first else None,
        "round_s": round_s,
        "longest_gap_before_s": max(b - a for a, b in itertools.pairwise(before)),
        "longest_gap_s": longest,
        "longest_gap_rounds": longest / round_s,
        "newcomer_s": sorted(ttft),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "chunks": len(times),
    }
    print(json.dumps(report, indent=1))
    write_record(str(args.out) if args.out else None, "specdec.arrivals/1", report)


if __name__ == "__main__":
    main()
