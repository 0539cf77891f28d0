"""What the soaks of scripts/loadtest.py and scripts/loadtest_parallel.py share, written once: the
server under test and a GET of it, one planned request sent and what came back, the server's
process and /metrics read from outside, the tally of a mix against the statuses each kind may
get, the answers regenerated with `generate()` on the server's models, and the artifact written
with the project's `write_json` and `meta_block`.

Requests go out over the standard library's http.client (a hostile client needs its sockets);
a streamed answer is read by the library's one reader of streams (specdec.study.engines.stream),
and specdec is otherwise imported to regenerate answers (after a soak, loading the models here)
and to write the artifact.

A soak's mix is a table of request kinds: request i is of kind MIX[i % len(MIX)], and
`turn(i, MIX)` counts how many of its kind came before it, which rotates a kind's variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import ipaddress
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdec.study.engines.stream import EndpointError, StreamReader, read_stream

#: Indices of warm-up requests: other prompts and seeds than those of the run.
WARMUP_OFFSET = 1_000_000
#: How long a "cancel" client waits after sending before it goes away: into the prefill.
CANCEL_AFTER_S = 0.05
#: How long a "never read" client holds its stream unread before it goes away.
UNREAD_HOLD_S = 1.0

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


@dataclass(frozen=True)
class Server:
    """The server under test: a loopback address, the headers every request carries
    (Content-Type, and the Bearer key if it wants one) and the model id to ask for."""

    host: str
    port: int
    headers: dict[str, str]
    model: str
    metrics_key: str | None = None  # the operator's key for /metrics (None: the headers' key)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def connect(url: str, api_key: str | None, model: str | None) -> Server:
    """The server at `url`; its first model when `model` is None. ValueError unless the URL is
    http:// on a loopback address (this is a load generator)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or not loopback:
        raise ValueError(f"--url must be http:// on a loopback address, got {url!r}")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    server = Server(host, port, headers, model or "")
    if model is None:
        status, raw = get(server, "/v1/models")
        if status != 200:
            raise ValueError(f"GET {url}/v1/models answered {status or 'nothing'}")
        server = Server(host, port, headers, json.loads(raw)["data"][0]["id"])
    return server


def add_server_args(ap: argparse.ArgumentParser, requests: int, timeout: float) -> None:
    """The flags every load script takes: the server (--url, --model, its key), the run's size
    (-n, -c), a request's timeout and where the record goes (--out)."""
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    ap.add_argument(
        "-n", "--requests", type=int, default=requests, help=f"requests (int; default {requests})"
    )
    ap.add_argument("-c", "--concurrency", type=int, default=8, help="clients (int; default 8)")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    key = ap.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    key.add_argument("--api-key-file", default=None, help="read the key from this file (path)")
    ap.add_argument(
        "--metrics-key-file", default=None, help="the server's --metrics-key-file (path)"
    )
    ap.add_argument(
        "--timeout", type=float, default=timeout, help=f"per request, s (default {timeout:g})"
    )
    ap.add_argument("--out", default=None, help="write the JSON record here (path)")


def connect_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Server:
    """The server add_server_args' flags name, the run's size checked; ap.error otherwise."""
    if not (1 <= args.requests <= 100_000 and 1 <= args.concurrency <= 256):
        ap.error("need 1 <= --requests <= 100000 and 1 <= --concurrency <= 256")
    key = args.api_key
    if args.api_key_file:  # its first line, as `specdec serve --api-key-file` reads it
        key = Path(args.api_key_file).read_text().splitlines()[0].strip()
    try:
        server = connect(args.url, key, args.model)
    except ValueError as e:
        ap.error(str(e))
    if args.metrics_key_file:
        metrics_key = Path(args.metrics_key_file).read_text().splitlines()[0].strip()
        server = dataclasses.replace(server, metrics_key=metrics_key)
    return server


def get(server: Server, path: str, key: str | None = None) -> tuple[int, bytes]:
    """GET `path` with the server's headers (`key`: another Bearer key): (status, body), or
    (0, b"") if it did not answer."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    headers = {**server.headers, "Authorization": f"Bearer {key}"} if key else server.headers
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


def turn(i: int, mix: Sequence[str]) -> int:
    """How many requests of request i's kind came before it: the index that rotates a kind's
    variants (i itself would not: every i of one kind has the same residue mod len(mix))."""
    return i // len(mix)


def run_mix(
    fn: Callable[[int], dict[str, Any]], indices: Iterable[int], concurrency: int
) -> list[dict]:
    """fn(i) for every index, `concurrency` at a time; the results in index order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(fn, indices))


# ------------------------------------------------------------------------------ one request
@dataclass
class Plan:
    """What request i of a soak sends, and how its client behaves.

    leave: None reads the whole answer; "sent" goes away as soon as the request is sent;
    "cancel" CANCEL_AFTER_S later; "unread" once the status line is in, after UNREAD_HOLD_S with
    the stream unread; "first_line" after the first line of a 200 (other statuses read whole).
    """

    kind: str
    i: int
    data: bytes | None = None  # what is sent: `body` as JSON, or raw bytes
    body: dict[str, Any] | None = None  # the JSON body, kept to regenerate the answer
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)  # over the server's
    leave: str | None = None
    room_sized: bool = False  # a prediction larger than the context: a 400, and only it

    @classmethod
    def of(cls, kind: str, i: int, body: dict[str, Any], **kw: Any) -> Plan:
        return cls(kind, i, data=json.dumps(body).encode(), body=body, **kw)


def send(server: Server, plan: Plan, timeout: float = 300.0) -> dict[str, Any]:
    """Send one planned request: its kind and index, the status it got (an int, or "left" where
    the client went away on purpose), any error, the seconds it took (`s`), Retry-After, the
    error code of a 4xx/5xx, and with return_token_ids the prompt and completion ids and the
    cached prompt tokens and the body sent (`prompt_ids`, `ids`, `cached`, `body`)."""
    out: dict[str, Any] = {"kind": plan.kind, "i": plan.i, "status": None, "error": None}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request(plan.method, plan.path, plan.data, {**server.headers, **plan.headers})
        if plan.leave in ("sent", "cancel"):
            time.sleep(CANCEL_AFTER_S if plan.leave == "cancel" else 0.0)
            conn.sock.shutdown(socket.SHUT_RDWR)
            out["status"] = "left"
            return out
        resp = conn.getresponse()
        out["status"] = resp.status
        if plan.leave == "unread" or (plan.leave == "first_line" and resp.status == 200):
            if plan.leave == "unread":
                time.sleep(UNREAD_HOLD_S)  # the stream's first bytes sit unread
            else:
                resp.readline()  # the first event, then the client goes away mid-stream
            out["status"] = "left"
            return out
        raw = resp.read()
        out["retry_after"] = resp.getheader("Retry-After")
        _read_answer(out, resp.status, raw, plan.body or {}, server.url + plan.path)
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out["s"] = time.perf_counter() - t0
    return out


def _read_answer(
    out: dict[str, Any], status: int, raw: bytes, body: dict[str, Any], url: str
) -> None:
    got = None
    if status == 200 and body.get("stream"):
        got, out["error"] = streamed(raw, url)
        if got is None:
            return
    if status == 200 and body.get("return_token_ids"):
        out["prompt_ids"], out["ids"], out["cached"] = ids_of(raw, got)
        out["body"] = body  # what generate() is asked afterwards
    elif status >= 400:  # an error answer is JSON with a code (ValueError otherwise)
        error = json.loads(raw).get("error", {})
        out["code"], out["param"] = error.get("code"), error.get("param")


def streamed(raw: bytes, url: str) -> tuple[StreamReader | None, str | None]:
    """A whole streamed 200 answer, read: (what it said, None), or (None, what was wrong: an
    error event, a malformed event, or no [DONE] at its end)."""
    try:
        got = read_stream([raw], url)
    except EndpointError as e:
        return None, f"{e.kind}: {e}"
    return (got, None) if got.done else (None, "the stream ended without data: [DONE]")


def ids_of(raw: bytes, got: StreamReader | None) -> tuple[list[int] | None, list[int], int | None]:
    """(prompt ids, completion ids, cached prompt tokens) of a 200 answer with return_token_ids:
    the stream `got` read, or else the JSON body `raw`."""
    if got is not None:
        return got.prompt_token_ids, got.token_ids, _cached(got.usage)
    obj = json.loads(raw)
    return (
        obj.get("prompt_token_ids"),
        obj["choices"][0].get("token_ids", []),
        _cached(obj["usage"]),
    )


def _cached(usage: dict[str, Any] | None) -> int | None:
    """The prompt tokens the server's prompt cache held (usage.prompt_tokens_details)."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def tally(
    results: list[dict[str, Any]], allowed: Callable[[dict[str, Any]], tuple[Any, ...]]
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The outcomes counted by kind, and one line for each request that erred or got an outcome
    outside allowed(result) (an empty tuple allows any)."""
    by_kind: dict[str, dict[str, int]] = {}
    unexpected = []
    for r in results:
        counts = by_kind.setdefault(r["kind"], {})
        counts[str(r["status"])] = counts.get(str(r["status"]), 0) + 1
        ok = allowed(r)
        if r["error"] or (ok and r["status"] not in ok):
            what = (r["status"], r.get("code"), r["error"])
            unexpected.append(f"{r['kind']} #{r['i']}: " + " ".join(str(x) for x in what if x))
    return by_kind, unexpected


def server_errors(results: list[dict[str, Any]], kinds: Iterable[str]) -> int:
    """How many requests of these kinds got a 5xx."""
    wanted = set(kinds)
    return sum(
        1
        for r in results
        if r["kind"] in wanted and isinstance(r["status"], int) and r["status"] >= 500
    )


def growth(before: float | None, after: float | None) -> float | None:
    """(after - before) / before; None without both readings."""
    return (after - before) / before if before and after else None


# ------------------------------------------------------------------------------ the server, read
def snapshot(server: Server, pid: int | None, log: str | None) -> dict[str, Any]:
    """The server read from outside: its RSS (MB) and open descriptors from /proc/PID, its
    Prometheus series and 504 answers from /metrics (-1: /metrics did not answer), and its
    stderr log's size and tracebacks."""
    return {**_proc(pid), **_metrics(server), "log": _log(log)}


def _proc(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"rss_mb": None, "fds": None}
    rss = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # the server is gone
        return {"rss_mb": None, "fds": None}
    return {"rss_mb": rss, "fds": fds}


def rss_mb(pid: int | None) -> float | None:
    return _proc(pid)["rss_mb"]


def _metrics(server: Server) -> dict[str, Any]:
    status, text = get(server, "/metrics", server.metrics_key)
    if status != 200:
        return {"series": -1, "504": -1.0}
    samples = [x for x in text.decode(errors="replace").splitlines() if x and x[0] != "#"]
    answers_504 = sum(
        float(x.split()[-1])
        for x in samples
        if x.startswith("specdec_requests_total{") and 'code="504"' in x
    )
    return {"series": len(samples), "504": answers_504}


def _log(path: str | None) -> dict[str, Any]:
    if not path or not Path(path).is_file():
        return {"bytes": None, "tracebacks": None}
    text = Path(path).read_text(errors="replace")
    return {"bytes": len(text.encode()), "tracebacks": text.count("Traceback")}


def crashes(server: Server, pid: int | None) -> int:
    """1 if the server's process is gone or /health does not answer 200, else 0."""
    alive = pid is None or Path(f"/proc/{pid}").exists()
    status, _ = get(server, "/health")
    return 0 if alive and status == 200 else 1


# ------------------------------------------------------------------------------ generate()
@dataclass
class Reference:
    """The server's models loaded in this process, with the settings it was given."""

    target: Any
    draft: Any
    spec: Any  # SpecConfig
    tokenizer: Any
    stops: list[int]


def load_reference(args: Any) -> Reference:
    """Load --target (and --draft) as the server did: --threads, --deterministic, --drafter, -k."""
    from specdec.backends import load_model
    from specdec.backends.chat import stop_ids
    from specdec.core.config import SpecConfig

    kw: dict[str, Any] = {"n_threads": args.threads} if args.threads else {}
    target = load_model(args.target, deterministic=args.deterministic, **kw)
    draft = load_model(args.draft, **kw) if args.draft else None
    spec_kw = {"drafter": args.drafter, "k": args.k}
    spec = SpecConfig(**{key: v for key, v in spec_kw.items() if v is not None})
    tok = target.tokenizer or getattr(draft, "tokenizer", None)
    return Reference(target, draft, spec, tok, stop_ids(tok))


def regenerate(ref: Reference, prompt_ids: list[int], body: dict[str, Any]) -> list[int]:
    """What `generate()` answers to a chat request's body (temperature, max_tokens, seed,
    prediction) on these prompt ids."""
    from specdec.backends.chat import encode_prediction
    from specdec.core.config import Warp
    from specdec.core.generate import generate

    pred = (body.get("prediction") or {}).get("content")
    return generate(
        ref.target,
        prompt_ids,
        draft=ref.draft,
        spec=ref.spec,
        warp=Warp(body.get("temperature", 0.0)),
        max_new_tokens=body["max_tokens"],
        seed=body.get("seed", 0),
        stop_ids=ref.stops,
        prediction=encode_prediction(ref.tokenizer, pred) if pred else None,
    ).tokens


# ------------------------------------------------------------------------------ the artifact
def write_record(path: str | None, schema: str, record: dict[str, Any]) -> None:
    """Write `record` as a specdec artifact (its schema id, meta with the machine) to `path`."""
    if not path:
        return
    from specdec.study.artifacts import write_json
    from specdec.study.artifacts.provenance import meta_block

    meta = meta_block()
    # the command line is recorded: a key given with --api-key must not be
    meta["command"] = re.sub(r"(--api-key[= ])\S+", r"\1<redacted>", meta["command"])
    write_json(path, {"schema": schema, "meta": meta, **record})
    print(f"wrote {path}")
