"""The concurrency bench (`specdec bench --serve --concurrency C`, or --endpoint URL): C requests
at once, what a server that generates several at a time (`specdec serve --parallel`,
llama-server's -np) buys over one that serves them in turn, on the same prompts and weights, in
one run.

Protocol (`run_together`):
    * the run's prompts in groups of C (`n_prompts` a multiple of C), each prompt chat-templated
      by the server, T and seed as the bench's (seed = the prompt's index);
    * every method on a fresh server of its own (a warm-up request first, not recorded), so
      that no method drafts from another's answers (a draft pool, llama-server's n-gram cache):
          served[-DRAFTER]-pC    specdec serve --parallel C: target-only ("served") and the run's
                                 drafter and K, the prediction in each request where the drafter
                                 is "prediction"
          served[-DRAFTER]-p1    the same server with --parallel 1: the requests in turn
          <llama-server mode>-npC   each --llama-server-modes mode, -np C (its context C times
                                 the per-request one, as --parallel gives specdec's)
      --endpoint and --endpoint-baseline, servers running already (vLLM, SGLang, another
      specdec), come first, at whatever concurrency they serve; the methods' order reverses on
      every other repeat (`repeats`), so a slow drift of the machine charges each alike;
    * a group's C requests are sent at once (a thread each), streamed, and timed by the client
      (study.engines.endpoint: ttft_s, wall_s, the tokens the server reports).

Per method and group (a row): `tokens_per_s`, the completion tokens of the group over the time
from the first request sent to the last answer's end (the aggregate a client fleet sees);
`slowest_s`, the longest request; each request's record, its answer's text included. Per method
(`methods`): the geometric means of the rows' tokens_per_s and slowest_s, and `same_answers`:
how many of its answers equal, character for character, the first method's to the same prompt
(at T = 0 every lossless engine should give its own target-only answer; specdec's first method is
target-only one at a time, the answers a single stream gives).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdec.study.artifacts.provenance import meta_block
from specdec.study.artifacts.schema import write_json
from specdec.study.engines import anchors, endpoint
from specdec.study.run import methods
from specdec.study.run.bench import BenchConfig, artifact_name, select_prompts

SCHEMA = "specdec.together/1"


class Given:
    """A server the run does not start (--endpoint, --endpoint-baseline): what the protocol
    asks of a started one, for a running one."""

    def __init__(self, ep: endpoint.Endpoint) -> None:
        self.ep = ep

    def __enter__(self) -> Given:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def endpoint(self) -> endpoint.Endpoint:
        return self.ep

    def describe(self) -> dict[str, Any]:
        return {}


def servers(cfg: BenchConfig, concurrency: int) -> list[tuple[str, Any, bool]]:
    """(method name, server, whether its requests carry the prediction) for every method of the
    protocol, in run order: --endpoint-baseline and --endpoint as they are (their own
    concurrency), then specdec's and llama.cpp's. As in the per-prompt bench, the prediction
    goes to the speculative method alone, and only with --drafter prediction."""
    predicts = cfg.spec.drafter == "prediction"
    given = methods.given_endpoints(cfg)
    out: list[tuple[str, Any, bool]] = [
        (name, Given(given[role]), role == "speculative" and predicts)
        for role, name in (("baseline", "endpoint-baseline"), ("speculative", "endpoint"))
        if role in given
    ]
    for role, srv in methods.specdec_servers(cfg).items():
        for p in (1, concurrency):
            name = f"{srv.name}-p{p}"
            served = replace(srv, args=(*srv.args, "--parallel", str(p)), name=name)
            out.append((name, served, role == "speculative" and predicts))
    for srv in anchors.servers_for(cfg.peers.llama_server, cfg.target, cfg.draft):
        if isinstance(srv, anchors.LlamaServer):
            srv.parallel, srv.ctx = concurrency, srv.ctx * concurrency
            out.append((f"{anchors.method_name(srv.mode)}-np{concurrency}", srv, False))
    return out


def _shown(srv: Any) -> str:
    """How the progress line names a server: its URL, or its command's flags."""
    return srv.ep.url if isinstance(srv, Given) else " ".join(srv.command()[3:])


def run_together(
    cfg: BenchConfig,
    concurrency: int,
    out_dir: str | Path,
    repeats: int = 1,
    tag: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the protocol above; write and return the specdec.together/1 record."""
    if concurrency < 2 or cfg.n_prompts % concurrency:
        raise ValueError(
            f"--concurrency {concurrency}: needs >= 2 and --prompts a multiple of it "
            f"(got --prompts {cfg.n_prompts})"
        )
    if not (cfg.peers.served or cfg.peers.endpoint or cfg.peers.endpoint_baseline):
        raise ValueError("--concurrency measures servers: add --serve, or --endpoint URL")
    prompts = select_prompts(cfg.categories, cfg.n_prompts)
    groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    plan = servers(cfg, concurrency)
    rows: list[dict[str, Any]] = []
    settings: dict[str, Any] = {}
    for rep in range(repeats):
        for name, srv, pred in plan if rep % 2 == 0 else plan[::-1]:
            if progress:
                print(f"[{rep + 1}/{repeats}] {name}: {_shown(srv)}", file=sys.stderr)
            with srv:
                ep = replace(srv.endpoint(), label=name, timeout_s=3600.0)
                settings[name] = {**ep.describe(), **srv.describe()}
                with endpoint.Client(ep) as client:
                    client.stream(endpoint.Request(prompts[0].text, 8, 0.0, 0))  # warm-up
                    for g, group in enumerate(groups):
                        replies = _at_once(client, group, g * concurrency, cfg, pred)
                        rows.append(_row(name, rep, g, replies))
    record = {
        "schema": SCHEMA,
        "meta": meta_block(),
        "config": {**cfg.to_json(), "concurrency": concurrency, "repeats": repeats},
        "engines": settings,
        "rows": rows,
        "methods": summarize(rows, [name for name, *_ in plan]),
    }
    path = Path(out_dir) / artifact_name(cfg, tag).replace("bench_", "together_", 1)
    write_json(path, record)
    record["path"] = str(path)
    return record


def _at_once(
    client: endpoint.Client, group: Sequence[Any], first: int, cfg: BenchConfig, prediction: bool
) -> list[dict[str, Any]]:
    """The group's requests sent at once, each on a thread; their records, in order, each with
    its send and end times relative to the first send."""
    out: list[dict[str, Any]] = [{} for _ in group]
    t0 = time.perf_counter()

    def send(j: int) -> None:
        p = group[j]
        req = endpoint.Request(
            p.text,
            cfg.max_new_tokens,
            cfg.warp.temperature,
            first + j,
            prediction=p.prediction if prediction else None,
        )
        start = time.perf_counter() - t0
        try:
            r = client.stream(req)
            tokens = endpoint.count((r.usage or {}).get("completion_tokens"))
            out[j] = {
                "prompt_id": p.id,
                "start_s": start,
                "end_s": start + r.wall_s,
                "wall_s": r.wall_s,
                "ttft_s": r.ttft_s,
                "tokens": tokens,
                "text": r.text,
            }
        except endpoint.EndpointError as e:
            out[j] = {"prompt_id": p.id, "error": f"{e.kind}: {e}"}

    threads = [threading.Thread(target=send, args=(j,)) for j in range(len(group))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _row(name: str, rep: int, g: int, replies: list[dict]) -> dict:
    ok = [r for r in replies if "error" not in r]
    span = max((r["end_s"] for r in ok), default=0.0)
    tokens = sum(r["tokens"] or 0 for r in ok)
    return {
        "method": name,
        "repeat": rep,
        "group": g,
        "errors": len(replies) - len(ok),
        "tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "slowest_s": max((r["wall_s"] for r in ok), default=0.0),
        "requests": replies,
    }


def summarize(rows: Sequence[dict], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per method: geometric means of its rows' tokens_per_s and slowest_s, its errors, and how
    many answers equal the first method's to the same prompt (same repeat)."""
    ref = {
        (r["repeat"], q["prompt_id"]): q.get("text")
        for r in rows
        if r["method"] == names[0]
        for q in r["requests"]
    }
    out = {}
    for name in names:
        mine = [r for r in rows if r["method"] == name]
        answers = [(r["repeat"], q) for r in mine for q in r["requests"] if "error" not in q]
        same = sum(q["text"] == ref.get((rep, q["prompt_id"])) for rep, q in answers)
        out[name] = {
            "tokens_per_s": _geomean([r["tokens_per_s"] for r in mine]),
            "slowest_s": _geomean([r["slowest_s"] for r in mine]),
            "errors": sum(r["errors"] for r in mine),
            "answers": len(answers),
            "same_answers": same,
        }
    return out


def _geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0


def format_table(record: dict[str, Any]) -> str:
    """The per-method summary as a terminal table, with each method's ratio to the first
    served method's aggregate."""
    ms = record["methods"]
    lines = [f"{'method':<28} {'tok/s':>8} {'slowest s':>10} {'same':>7} {'errors':>6}"]
    for name, m in ms.items():
        same = f"{m['same_answers']}/{m['answers']}"
        lines.append(
            f"{name:<28} {m['tokens_per_s']:>8.2f} {m['slowest_s']:>10.1f} {same:>7} "
            f"{m['errors']:>6}"
        )
    return "\n".join(lines)
