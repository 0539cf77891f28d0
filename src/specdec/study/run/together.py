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
`slowest_s`, the longest request; each request's record, its answer's text included, and the
drafted, accepted and rounds its server reported (specdec serve's `spec`; llama-server's
`timings` drafted and accepted; None otherwise). Per method (`methods`): the geometric means of
the rows' tokens_per_s and slowest_s; `same_answers`: how many of its answers equal, character
for character, the first method's to the same prompt (at T = 0 every lossless engine should
give its own target-only answer; specdec's first method is target-only one at a time, the
answers a single stream gives); its failed requests (`errors`); the nearest-rank p50 and p95 of
its requests' latency (sent -> [DONE], the queue wait included) and time to first token; and
its acceptance rate and tokens per round, pooled over the requests whose server reported them.

Against one running server (`specdec bench --concurrency C --endpoint URL`, say after
`specdec serve --parallel C`) this is the load test: the prompts C at a time, and what each
request waited, streamed and drafted.
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

from specdec.core.config import Warp
from specdec.study.artifacts import TogetherArtifact, write_json
from specdec.study.artifacts.provenance import meta_block
from specdec.study.engines import anchors, endpoint
from specdec.study.run import methods
from specdec.study.run.bench import artifact_name
from specdec.study.run.bench_settings import BenchConfig, select_prompts

SCHEMA = TogetherArtifact.SCHEMA


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
                    client.stream(endpoint.Request(prompts[0].text, 8, Warp(0.0), 0))  # warm-up
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
            cfg.warp,
            first + j,
            prediction=p.prediction if prediction else None,
        )
        start = time.perf_counter() - t0
        try:
            r = client.stream(req)
            drafted, accepted = endpoint.draft_counts(r) or (None, None)
            out[j] = {
                "prompt_id": p.id,
                "start_s": start,
                "end_s": start + r.wall_s,
                "wall_s": r.wall_s,
                "ttft_s": r.ttft_s,
                "tokens": endpoint.count((r.usage or {}).get("completion_tokens")),
                "text": r.text,
                "drafted": drafted,
                "accepted": accepted,
                "rounds": endpoint.count((r.spec or {}).get("rounds")),  # specdec serve's
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
    """Per method: geometric means of its rows' tokens_per_s and slowest_s, its errors, how
    many answers equal the first method's to the same prompt (same repeat), and its requests'
    `latency` and `ttft` (latency_p50_s, ...; `percentiles`), pooled acceptance and tokens per
    round (`drafts`)."""
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
        answered = [q for _, q in answers]
        out[name] = {
            "tokens_per_s": _geomean([r["tokens_per_s"] for r in mine]),
            "slowest_s": _geomean([r["slowest_s"] for r in mine]),
            "errors": sum(r["errors"] for r in mine),
            "answers": len(answers),
            "same_answers": same,
            **percentiles("latency", [q["wall_s"] for q in answered]),
            **percentiles("ttft", [q["ttft_s"] for q in answered if q.get("ttft_s") is not None]),
            **drafts(answered),
        }
    return out


def percentiles(what: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """`what`_p50_s and `what`_p95_s (nearest rank) of these seconds; None for none."""
    return {f"{what}_p{q}_s": endpoint.percentile(seconds, q) for q in (50, 95)}


def drafts(answers: Sequence[dict]) -> dict[str, float | None]:
    """acceptance_rate (accepted / drafted, pooled over the answers whose server reported
    both) and tokens_per_round (tokens / rounds, pooled over those that reported rounds:
    specdec serve's `spec`); None where no answer reported them."""
    counted = [q for q in answers if q.get("drafted") is not None]
    drafted = sum(q["drafted"] for q in counted)
    rounded = [q for q in answers if q.get("rounds") and q.get("tokens") is not None]
    rounds = sum(q["rounds"] for q in rounded)
    return {
        "acceptance_rate": sum(q["accepted"] for q in counted) / drafted if drafted else None,
        "tokens_per_round": sum(q["tokens"] for q in rounded) / rounds if rounds else None,
    }


def _geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0


def format_table(record: dict[str, Any]) -> str:
    """The per-method summary as a terminal table: aggregate tokens/s, the slowest request,
    the requests' latency and time to first token (p50/p95), acceptance, same answers, errors."""
    ms = record["methods"]
    lines = [
        f"{'method':<28} {'tok/s':>8} {'slowest s':>10} {'lat p50/p95 s':>14} "
        f"{'ttft p50/p95 s':>15} {'accept':>7} {'same':>7} {'errors':>6}"
    ]
    for name, m in ms.items():
        same = f"{m['same_answers']}/{m['answers']}"
        lat = f"{_num(m.get('latency_p50_s'))}/{_num(m.get('latency_p95_s'))}"
        ttft = f"{_num(m.get('ttft_p50_s'))}/{_num(m.get('ttft_p95_s'))}"
        accept = _num(m.get("acceptance_rate"))
        lines.append(
            f"{name:<28} {m['tokens_per_s']:>8.2f} {m['slowest_s']:>10.1f} {lat:>14} "
            f"{ttft:>15} {accept:>7} {same:>7} {m['errors']:>6}"
        )
    return "\n".join(lines)


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
