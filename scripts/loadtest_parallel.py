"""The --parallel soak: a mixed soak of a running `specdec serve --parallel N`, whose greedy
answers are then compared with their solo answers.

The acceptance check it runs: 0 failed requests in a 500-request mixed soak at `--parallel 4`
with all five drafters, fixed and auto K, sampled and greedy, and hostile neighbours (tiny
`top_p`, `k:128`); every greedy answer equal to its solo answer.

    specdec serve --target llamacpp:smollm2-135m --draft llamacpp:smollm2-135m --parallel 4 \\
        --threads 2 --draft-pool off --port 8123 2> serve.log &
    .venv/bin/python scripts/loadtest_parallel.py --url http://127.0.0.1:8123 -n 500 -c 8 \\
        --pid $! --server-log serve.log --target llamacpp:smollm2-135m --threads 2 \\
        --out results/cpu/loadtest_parallel.json

First the priors: one greedy chat and one greedy completion of each prompt, whose answers are
the "previous answer" predictions of the mix and whose prompt ids let the mix send completions
as token ids. Then N requests at concurrency C (more clients than slots, so that the slots stay
full), a deterministic mix (--seed): request i is of kind MIX[i % len(MIX)], its details drawn
from a generator seeded with (seed, i).

    good          /v1/completions or /v1/chat/completions, streamed or not; drafter none, lookup,
                  model, composite or prediction crossed with k 1, 3, 8, 128 or "auto", greedy
                  (temperature 0) or sampled (temperature 0.7-1.2, a seed): the good requests
                  cycle through every combination; some carry a `prediction` (a previous answer,
                  the prompt itself, an edited prompt or another prompt's answer)
    tiny_top_p    temperature 1, top_p 1e-300 (the warped distribution is the argmax)
    lookup_k128   speculation {"drafter": "lookup", "k": 128} on a repetitive prompt
    leave         a streamed request whose client goes away mid-stream (after 3 events) or
                  during its prefill
    max_tokens_1  max_tokens 1
    stop          stop strings

Prompts run from one line to ~800 tokens; some are repetitive (rules, code, lists), so prompt
lookup drafts. Every request asks for `return_token_ids`. A failed request is one that did not
get a whole 200 answer (another status, an error event in its stream, a stream cut short or a
client exception); a client that goes away on purpose is not counted, unless it got another
status than 200 first.

After the soak, each greedy answer's solo answer is computed here with specdec's own
`generate()` on --target, loaded as the server loaded it (--threads, --deterministic):
target-only greedy on the prompt ids the server returned (streamed completions send ids). On a
batch-invariant target (smollm2 and the Qwen pair in the default mode: the record says) greedy
speculative output equals target-only greedy output with any drafter and K, alone or batched
with other slots, so this is every greedy request's solo answer. A stop-string answer must be
a prefix of it; a tiny-top_p answer is compared too, and counted apart. Without --target
nothing is compared.

The record (--out, a specdec artifact `specdec.loadtest_parallel/1`): counts by kind and status,
the good requests' drafter x k x mode coverage, every failure with its body and error, the
greedy answers compared and equal (mismatches with both token lists), wall time, the server's
RSS before and after (--pid), its log's new tracebacks (--server-log), and each request's
outcome (token ids for the greedy ones). The exit status is 0 only if it is `ok`: no failure,
the server alive, and every compared greedy answer equal to its solo answer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest_common import (
    CANCEL_AFTER_S,
    SHORT_PROMPTS,
    Server,
    add_server_args,
    connect_from_args,
    crashes,
    get,
    ids_of,
    run_mix,
    snapshot,
    streamed,
    turn,
    write_record,
)

DRAFTERS = ("none", "lookup", "model", "composite", "prediction")
KS: tuple[int | str, ...] = (1, 3, 8, 128, "auto")
#: Every (drafter, k, greedy) a good request can have; "none" takes no k.
COMBOS = [
    (d, k, g) for d in DRAFTERS for k in (KS if d != "none" else (None,)) for g in (True, False)
]
MIX = ("good",) * 7 + ("tiny_top_p", "lookup_k128", "leave", "max_tokens_1", "stop")
MAX_TOKENS = (8, 16, 24, 32)
PRIOR_TOKENS = 32
TINY_TOP_P = 1e-300
STOPS = (["\n"], [".", ","], [" the", " a"], ["e"])
#: A "leave" client reads this many stream events, then goes away.
LEAVE_AFTER_EVENTS = 3
WORDS = (
    "river stone lamp garden window copper thread orange silent market winter paper ladder "
    "music harbor pencil mountain candle engine forest bottle mirror signal planet"
).split()
CODE_FUNC = '''def total_{n}(items):
    """Sum the value of every item in group {n}."""
    value = 0
    for item in items:
        value += item.price * {m}
    return value
'''


# ------------------------------------------------------------------------------ the prompts
@dataclass(frozen=True)
class Prompt:
    text: str
    edited: str  # a slightly edited text: a prediction the answer may partly repeat
    repetitive: bool = False


def _edit(text: str) -> str:
    words = text.split(" ")
    return " ".join("changed" if n % 9 == 4 else w for n, w in enumerate(words))


def build_prompts() -> list[Prompt]:
    """Short questions, a medium paragraph, and long (~300-800 token) prompts, most of them
    repetitive: numbered rules, near-identical functions, a list, a table; one of random words."""
    rng = random.Random(0)
    rules = " ".join(
        f"Rule {n}: answer in plain words, and say when you are unsure." for n in range(47)
    )
    code = "\n".join(CODE_FUNC.format(n=n, m=n % 4 + 1) for n in range(14))
    items = "\n".join(
        f"Item {n}: {WORDS[n % len(WORDS)]} costs {n * 3 % 17} coins." for n in range(45)
    )
    table = "a,b,c\n" + "\n".join(f"{n},{n * 7 % 13},{WORDS[n % len(WORDS)]}" for n in range(90))
    prose = " ".join(rng.choice(WORDS) for _ in range(420))
    medium = (
        "HTTP status codes group answers by class: 2xx for success, 3xx for redirects, 4xx for "
        "client errors and 5xx for server errors. A 429 asks the client to slow down, and a "
        "Retry-After header may say for how long. "
    )
    out = [Prompt(p, _edit(p)) for p in SHORT_PROMPTS]
    out.append(Prompt(f"{medium}\n\nWhich class does 503 belong to, and why?", _edit(medium)))
    out.append(Prompt(f"{rules}\n\nWhat does rule 7 say?", _edit(rules), True))
    rename = f"{code}\nRename `value` to `amount` in the code above and print the whole code."
    out.append(Prompt(rename, code.replace("value", "amount"), True))
    out.append(Prompt(f"{items}\n\nContinue the list with five more items.", _edit(items), True))
    out.append(Prompt(f"{table}\n\nRepeat the table above.", _edit(table), True))
    out.append(Prompt(f"Summarize this text in one sentence: {prose}", _edit(prose)))
    return out


# ------------------------------------------------------------------------------ the plan
@dataclass
class Req:
    """One planned request: what is sent, how its client behaves (leave None reads the whole
    answer; "mid" goes away after LEAVE_AFTER_EVENTS events, "cancel" CANCEL_AFTER_S after
    sending), and what it is (`meta`: prompt, drafter, k, mode, prediction)."""

    kind: str
    i: int
    path: str
    body: dict[str, Any]
    leave: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Mix:
    """What the plans are drawn from: the model id, the prompts and the priors' answers
    (("chat", j) and ("completion", j): text; ("ids", j): a completion prompt's token ids)."""

    model: str
    seed: int
    prompts: list[Prompt]
    priors: dict[tuple[str, int], Any] = field(default_factory=dict)


def _body(
    mix: Mix, rng: random.Random, j: int, chat: bool, stream: bool, max_tokens: int
) -> tuple[str, dict[str, Any]]:
    """The path and the base body of a request of prompt j."""
    body: dict[str, Any] = {
        "model": mix.model,
        "max_tokens": max_tokens,
        "stream": stream,
        "return_token_ids": True,
    }
    if stream and rng.random() < 0.5:
        opts = {"include_usage": True, "include_speculation": rng.random() < 0.3}
        body["stream_options"] = opts
    if chat:
        msgs = [{"role": "user", "content": mix.prompts[j].text}]
        if rng.random() < 0.2:
            msgs.insert(0, {"role": "system", "content": "You are a concise assistant."})
        return "/v1/chat/completions", {**body, "messages": msgs}
    ids = mix.priors.get(("ids", j))
    # streamed completions send token ids: a stream does not return the prompt's ids
    use_ids = ids is not None and (stream or rng.random() < 0.5)
    return "/v1/completions", {**body, "prompt": ids if use_ids else mix.prompts[j].text}


def _sampling(body: dict[str, Any], greedy: bool, rng: random.Random) -> None:
    if greedy:
        body["temperature"] = 0.0
        return
    body["temperature"] = round(rng.uniform(0.7, 1.2), 2)
    body["seed"] = rng.randrange(1 << 31)
    extra = rng.random()
    if extra < 0.2:
        body["top_p"] = 0.9
    elif extra < 0.4:
        body["top_k"] = 40


def _prediction(mix: Mix, rng: random.Random, j: int, chat: bool, drafter: str) -> str | None:
    """A prediction for a request of prompt j: always (but 1 in 10) with the prediction
    drafter, 1 in 5 otherwise; a previous answer, the prompt, an edited prompt or another
    prompt's answer (a wrong one)."""
    if rng.random() >= (0.9 if drafter == "prediction" else 0.2):
        return None
    endpoint = "chat" if chat else "completion"
    other = (j + 1 + rng.randrange(len(mix.prompts) - 1)) % len(mix.prompts)
    choices = {
        "answer": mix.priors.get((endpoint, j)),
        "prompt": mix.prompts[j].text,
        "edited": mix.prompts[j].edited,
        "other": mix.priors.get((endpoint, other)),
    }
    kind = rng.choice(sorted(choices))
    return choices[kind] or mix.prompts[j].text  # a prior that failed: the prompt


def plan(mix: Mix, i: int) -> Req:
    """Request i of the mix (the module docstring lists the kinds)."""
    kind = MIX[i % len(MIX)]
    rng = random.Random(f"{mix.seed}/{i}")
    if kind == "good":
        g = turn(i, MIX) * MIX.count("good") + MIX[: i % len(MIX)].count("good")
        drafter, k, greedy = COMBOS[g % len(COMBOS)]
    else:
        drafter = rng.choice(DRAFTERS)
        k = None if drafter == "none" else rng.choice(KS)
        greedy = rng.random() < 0.7
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    max_tokens = rng.choice(MAX_TOKENS)
    j = rng.randrange(len(mix.prompts))
    leave = None
    if kind == "lookup_k128":
        drafter, k = "lookup", 128
        j = rng.choice([n for n, p in enumerate(mix.prompts) if p.repetitive])
    elif kind == "leave":
        stream, max_tokens = True, 64
        leave = "mid" if rng.random() < 0.7 else "cancel"
    elif kind == "max_tokens_1":
        max_tokens = 1
    path, body = _body(mix, rng, j, chat, stream, max_tokens)
    body["speculation"] = {"drafter": drafter, **({} if k is None else {"k": k})}
    _sampling(body, greedy, rng)
    if kind == "tiny_top_p":
        body.update(temperature=1.0, top_p=TINY_TOP_P, seed=rng.randrange(1 << 31))
        body.pop("top_k", None)
    elif kind == "stop":
        body["stop"] = rng.choice(STOPS)
    pred = _prediction(mix, rng, j, chat, drafter)
    if pred is not None:
        body["prediction"] = {"type": "content", "content": pred}
    mode = "greedy" if body["temperature"] == 0 else "sampled"
    meta = {"prompt": j, "drafter": drafter, "k": k, "mode": mode, "prediction": pred is not None}
    return Req(kind, i, path, body, leave, meta)


# ------------------------------------------------------------------------------ one request
def send(server: Server, req: Req, timeout: float) -> dict[str, Any]:
    """Send one request: its kind, index, path and meta, the status (an int, or "left" where the
    client went away on purpose), an error (the error body, a stream's error event, an
    exception), the seconds it took, and for a whole 200 answer its text and token ids."""
    out: dict[str, Any] = {"kind": req.kind, "i": req.i, "path": req.path, **req.meta}
    out.update(leave=req.leave, status=None, error=None)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", req.path, json.dumps(req.body).encode(), server.headers)
        if req.leave == "cancel":
            time.sleep(CANCEL_AFTER_S)
            conn.sock.shutdown(socket.SHUT_RDWR)
            out["status"] = "left"
            return out
        resp = conn.getresponse()
        out["status"] = resp.status
        if req.leave == "mid" and resp.status == 200:
            events = 0
            while events < LEAVE_AFTER_EVENTS and (line := resp.readline()):
                events += line.startswith(b"data: ")
            resp.close()  # with conn.close() below: the socket's last reference
            out["status"] = "left"
            return out
        _answer(out, resp.status, resp.read(), req.body, server.url + req.path)
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out["s"] = round(time.perf_counter() - t0, 3)
    return out


def _answer(out: dict[str, Any], status: int, raw: bytes, body: dict[str, Any], url: str) -> None:
    if status != 200:
        out["error"] = raw.decode(errors="replace")[:2000]
        return
    got = None
    if body.get("stream"):
        got, error = streamed(raw, url)
        if got is None:
            out["error"] = str(error)[:2000]
            return
        out["text"], out["finish"] = got.text, got.finish_reason
    else:
        choice = json.loads(raw)["choices"][0]
        out["text"] = choice["message"]["content"] if "message" in choice else choice["text"]
        out["finish"] = choice.get("finish_reason")
    prompt_ids, out["ids"], out["cached"] = ids_of(raw, got)
    if prompt_ids is None and isinstance(body.get("prompt"), list):
        prompt_ids = body["prompt"]  # sent as token ids: the server's prompt ids
    out["prompt_ids"] = prompt_ids


def failed(r: dict[str, Any]) -> bool:
    """Whether a request failed: anything but a whole 200 answer, or, for a client that went
    away on purpose, another status than 200 first (or an error before it left)."""
    if r["status"] == "left":
        return r["error"] is not None
    return r["status"] != 200 or r["error"] is not None


# ------------------------------------------------------------------------------ the soak
def priors(server: Server, mix: Mix, concurrency: int, timeout: float) -> list[dict[str, Any]]:
    """A greedy chat and a greedy completion of every prompt, not streamed: their answers become
    the mix's "previous answer" predictions, the completions' prompt ids its id prompts."""
    reqs = []
    for j, p in enumerate(mix.prompts):
        base = {"model": mix.model, "max_tokens": PRIOR_TOKENS, "temperature": 0.0}
        base["return_token_ids"] = True
        chat = {**base, "messages": [{"role": "user", "content": p.text}]}
        text = {**base, "prompt": p.text, "speculation": {"drafter": "lookup", "k": "auto"}}
        meta = {"prompt": j, "mode": "greedy"}
        reqs.append(Req("prior", -1 - 2 * j, "/v1/chat/completions", chat, meta=meta))
        reqs.append(Req("prior", -2 - 2 * j, "/v1/completions", text, meta=meta))
    got = run_mix(lambda n: send(server, reqs[n], timeout), range(len(reqs)), concurrency)
    for r in got:
        if failed(r):
            continue
        chat = r["path"] == "/v1/chat/completions"
        mix.priors["chat" if chat else "completion", r["prompt"]] = r["text"]
        if not chat:
            mix.priors["ids", r["prompt"]] = r["prompt_ids"]
    for r, q in zip(got, reqs, strict=True):
        r["body"] = q.body
    return got


def soak(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """The priors, then the mix; the record (see the module docstring)."""
    mix = Mix(server.model, args.seed, build_prompts())
    before = snapshot(server, args.pid, args.server_log)
    log_offset = before["log"]["bytes"] or 0
    t0 = time.perf_counter()
    prior_results = priors(server, mix, args.concurrency, args.timeout)
    reqs = [plan(mix, i) for i in range(args.requests)]
    t1 = time.perf_counter()

    def run(i: int) -> dict[str, Any]:
        r = send(server, reqs[i], args.timeout)
        r["body"] = reqs[i].body
        return r

    results = run_mix(run, range(args.requests), args.concurrency)
    wall = time.perf_counter() - t1
    time.sleep(2.0)  # let the engine finish what departed clients left
    seen = {
        "priors_s": round(t1 - t0, 1),
        "wall_s": round(wall, 1),
        "before": before,
        "after": snapshot(server, args.pid, args.server_log),
        "crashes": crashes(server, args.pid),
        "slots": _slots(server),
        "tracebacks": _tracebacks(args.server_log, log_offset),
    }
    refs = solo_answers(args, prior_results + results) if args.target else None
    return _record(args, prior_results, results, refs, seen)


def _slots(server: Server) -> int | None:
    """The server's --parallel, from its /metrics gauge specdec_slots."""
    status, text = get(server, "/metrics")
    for line in text.decode(errors="replace").splitlines() if status == 200 else ():
        if line.startswith("specdec_slots "):
            return int(float(line.split()[-1]))
    return None


def _tracebacks(log: str | None, offset: int) -> list[str]:
    """The tracebacks the server's log gained after `offset` bytes (each up to 60 lines)."""
    if not log or not Path(log).is_file():
        return []
    text = Path(log).read_bytes()[offset:].decode(errors="replace")
    blocks = text.split("Traceback (most recent call last):")[1:]
    return ["Traceback (most recent call last):" + "\n".join(b.splitlines()[:60]) for b in blocks]


# ------------------------------------------------------------------------------ solo answers
def _comparable(r: dict[str, Any]) -> str | None:
    """ "greedy" or "tiny_top_p" for an answer compared with its solo answer, else None."""
    if failed(r) or r["status"] != 200 or r.get("prompt_ids") is None:
        return None
    body = r["body"]
    if body["temperature"] == 0:
        return "greedy"
    return "tiny_top_p" if body.get("top_p") == TINY_TOP_P else None


def solo_answers(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Target-only greedy generate() on --target for every compared answer's prompt ids (once
    per prompt, as long as its longest request: greedy output is a prefix of a longer one), and
    each answer compared with it: equal, or a prefix where the request had stop strings."""
    from specdec.backends import load_model
    from specdec.backends.chat import stop_ids
    from specdec.core.config import Warp
    from specdec.core.generate import generate

    kw: dict[str, Any] = {"n_threads": args.threads} if args.threads else {}
    target = load_model(args.target, deterministic=args.deterministic, **kw)
    stops = stop_ids(target.tokenizer)
    todo = [r for r in results if _comparable(r)]
    longest: dict[tuple[int, ...], int] = {}
    for r in todo:
        key = tuple(r["prompt_ids"])
        longest[key] = max(longest.get(key, 0), r["body"]["max_tokens"])
    t0 = time.perf_counter()
    solo = {
        key: generate(target, list(key), warp=Warp(0.0), max_new_tokens=n, stop_ids=stops).tokens
        for key, n in longest.items()
    }
    out: dict[str, Any] = {"batch_invariant": getattr(target, "batch_invariant", None)}
    mismatches = []
    for cls in ("greedy", "tiny_top_p"):
        mine = [r for r in todo if _comparable(r) == cls]
        bad = [r for r in mine if not _same(r, solo[tuple(r["prompt_ids"])])]
        out[cls] = {"compared": len(mine), "equal": len(mine) - len(bad)}
        mismatches += [_mismatch(r, solo[tuple(r["prompt_ids"])]) for r in bad]
    out.update(solo_prompts=len(solo), solo_s=round(time.perf_counter() - t0, 1))
    out["mismatches"] = mismatches
    return out


def _same(r: dict[str, Any], solo: list[int]) -> bool:
    want = solo[: r["body"]["max_tokens"]]
    if r["body"].get("stop"):
        return want[: len(r["ids"])] == r["ids"]
    return r["ids"] == want


def _mismatch(r: dict[str, Any], solo: list[int]) -> dict[str, Any]:
    want = solo[: r["body"]["max_tokens"]]
    pairs = zip(want, r["ids"], strict=False)
    first = next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(want), len(r["ids"])))
    return {
        **_brief(r),
        "prompt_tokens": len(r["prompt_ids"]),
        "first_difference": first,
        "server": r["ids"],
        "solo": want,
        "body": _short(r["body"]),
    }


# ------------------------------------------------------------------------------ the record
def _short(x: Any) -> Any:
    """A body for the record: long strings and token lists cut."""
    if isinstance(x, dict):
        return {k: _short(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_short(v) for v in x[:40]] + ([f"... {len(x)} items"] if len(x) > 40 else [])
    if isinstance(x, str) and len(x) > 200:
        return f"{x[:200]}... ({len(x)} chars)"
    return x


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("kind", "i", "path", "drafter", "k", "mode", "prediction", "status", "s", "error")
    out = {k: r.get(k) for k in keys}
    out["stream"] = bool(r["body"].get("stream"))
    if r.get("leave"):
        out["leave"] = r["leave"]
    if r.get("mode") == "greedy" and "ids" in r:
        out["ids"] = r["ids"]
    return out


def _record(
    args: argparse.Namespace,
    prior_results: list[dict[str, Any]],
    results: list[dict[str, Any]],
    refs: dict[str, Any] | None,
    seen: dict[str, Any],
) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for r in prior_results + results:
        by_kind.setdefault(r["kind"], Counter())[str(r["status"])] += 1
    coverage = Counter(
        f"{r['drafter']}/k={r['k']}/{r['mode']}" for r in results if r["kind"] == "good"
    )
    fails = [{**_brief(r), "body": _short(r["body"])} for r in prior_results + results if failed(r)]
    before, after = seen["before"], seen["after"]
    record = {
        "url": args.url,
        "target": args.target,
        "slots": seen["slots"],
        "requests": len(results),
        "priors": len(prior_results),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "wall_s": seen["wall_s"],
        "priors_s": seen["priors_s"],
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "by_path": dict(
            Counter(f"{r['path']} stream={bool(r['body'].get('stream'))}" for r in results)
        ),
        "coverage": dict(sorted(coverage.items())),
        "failures": len(fails),
        "failure_details": fails,
        "crashes": seen["crashes"],
        "solo": refs,
        "rss_mb_before": before["rss_mb"],
        "rss_mb_after": after["rss_mb"],
        "fds_before": before["fds"],
        "fds_after": after["fds"],
        "new_tracebacks": seen["tracebacks"],
        "outcomes": [_brief(r) for r in prior_results + results],
    }
    record["ok"] = bool(
        not fails
        and seen["crashes"] == 0
        and (refs is None or (not refs["mismatches"] and refs["greedy"]["compared"] > 0))
    )
    return record


def report(record: dict[str, Any]) -> None:
    """The record in a few lines; failures and mismatches on stderr."""
    solo = record["solo"] or {}
    g, t = solo.get("greedy", {}), solo.get("tiny_top_p", {})
    print(
        f"parallel soak: {record['requests']} requests (+{record['priors']} priors) at "
        f"concurrency {record['concurrency']} on {record['slots']} slots in {record['wall_s']} s"
        f" | failed {record['failures']} | crashes {record['crashes']} | greedy == solo: "
        f"{g.get('equal', 0)}/{g.get('compared', 0)} | tiny top_p == solo: "
        f"{t.get('equal', 0)}/{t.get('compared', 0)} | batch-invariant target: "
        f"{solo.get('batch_invariant')} | RSS {record['rss_mb_before']} -> "
        f"{record['rss_mb_after']} MB | new tracebacks {len(record['new_tracebacks'])} | ok "
        f"{record['ok']}"
    )
    print(f"  by kind: {json.dumps(record['by_kind'])}")
    for f in record["failure_details"][:20]:
        print(f"  failed: {json.dumps(f)[:1500]}", file=sys.stderr)
    for m in solo.get("mismatches", [])[:10]:
        print(f"  mismatch: {json.dumps(m)[:1500]}", file=sys.stderr)


# ------------------------------------------------------------------------------ the command line
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_server_args(ap, requests=500, timeout=900.0)
    ap.add_argument("--seed", type=int, default=0, help="the mix's seed (int; default 0)")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS")
    ap.add_argument("--server-log", default=None, help="the server's stderr, for tracebacks")
    ap.add_argument("--target", default=None, help="the server's --target, for solo answers")
    ap.add_argument("--threads", type=int, default=None, help="the server's --threads")
    ap.add_argument("--deterministic", action="store_true", help="the server runs --deterministic")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    record = soak(args, connect_from_args(ap, args))
    report(record)
    write_record(args.out, "specdec.loadtest_parallel/1", record)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
