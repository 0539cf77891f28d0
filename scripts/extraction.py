"""Schema-constrained extraction, served (issue 43): specdec with speculation (the grammar's
forced tokens + prompt lookup, k=auto) against specdec target-only with the same grammar, and
against llama-server's `json_schema`, on the same prompts, interleaved, greedy.

    specdec serve --target llamacpp:qwen2.5-coder-1.5b --threads 2 --draft-pool off --port 8131 &
    llama-server -m qwen2.5-coder-1.5b.gguf -t 2 --port 8132 &       # optional, the peer
    .venv/bin/python scripts/extraction.py --specdec 8131 --llama-server 8132 \\
        --out results/cpu/structured/extraction.json

Each prompt is a paragraph about one person and a JSON schema of ten required fields; each
method answers it once per repeat, methods in turn (a ratio from one run, never across runs).
The specdec server runs with --draft-pool off: a pool would draft from the target-only
method's answer to the same prompt.
Reports per method: completion tokens, seconds and tokens/s (median over requests), how much
sooner the speculative answer comes than each method's (seconds: answers differ in length
across engines), and whether each specdec speculative answer equals the target-only one token
for token. A
benchmark, not a test: run it on an idle machine, one server busy at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from typing import Any

from loadtest_common import write_record

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "country": {"type": "string"},
        "email": {"type": "string"},
        "phone": {"type": "string"},
        "company": {"type": "string"},
        "title": {"type": "string"},
        "years_experience": {"type": "integer"},
        "remote": {"type": "boolean"},
    },
    "required": [
        "name",
        "age",
        "city",
        "country",
        "email",
        "phone",
        "company",
        "title",
        "years_experience",
        "remote",
    ],
    "additionalProperties": False,
}
PEOPLE = [
    ("Maria Gonzalez", 34, "Valencia", "Spain", "maria.gonzalez@example.es", "+34 961 234 567",
     "Orange Grove Analytics", "data engineer", 9, True),
    ("Kenji Watanabe", 51, "Osaka", "Japan", "k.watanabe@example.jp", "+81 6 1234 5678",
     "Kansai Robotics", "head of manufacturing", 27, False),
    ("Amara Okafor", 28, "Lagos", "Nigeria", "amara@okafor.example.ng", "+234 1 555 0199",
     "Lagoon Fintech", "backend developer", 5, True),
    ("Lars Eriksson", 45, "Gothenburg", "Sweden", "lars.eriksson@example.se", "+46 31 555 12 34",
     "Nordic Freight AB", "logistics manager", 19, False),
    ("Priya Raman", 39, "Pune", "India", "priya.raman@example.in", "+91 20 5555 0142",
     "Deccan Health Systems", "product manager", 14, True),
    ("Tomasz Nowak", 31, "Wroclaw", "Poland", "t.nowak@example.pl", "+48 71 555 0123",
     "Odra Games", "game designer", 8, False),
]  # fmt: skip


def paragraph(p: tuple) -> str:
    name, age, city, country, email, phone, company, title, years, remote = p
    where = "works fully remotely" if remote else "goes into the office every day"
    return (
        f"{name} is a {age}-year-old {title} living in {city}, {country}. For the last "
        f"{years} years they have built a career that now has them at {company}, where they "
        f"{where}. Colleagues say they answer email quickly at {email}, and the team's "
        f"directory lists {phone} as the best number to reach them."
    )


def messages(p: tuple) -> list[dict[str, str]]:
    ask = "Extract the person's details as a JSON object with the fields of the schema."
    return [{"role": "user", "content": f"{paragraph(p)}\n\n{ask}"}]


def post(port: int, body: dict[str, Any], timeout: float = 600) -> tuple[dict[str, Any], float]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def model_of(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specdec", type=int, required=True, help="specdec serve's port")
    ap.add_argument("--llama-server", type=int, help="llama-server's port (the peer)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    methods: dict[str, tuple[int, dict[str, Any]]] = {
        TARGET_ONLY: (args.specdec, {"speculation": {"drafter": "none"}}),
        SPECULATIVE: (args.specdec, {"speculation": {"drafter": "lookup", "k": "auto"}}),
    }
    if args.llama_server:
        methods["llama-server json_schema"] = (args.llama_server, {})
    models = {port: model_of(port) for port, _ in methods.values()}
    load = os.getloadavg()[0]
    rows = run(methods, models, args)
    record = {
        "label": "extraction",
        "models": sorted(set(models.values())),
        "load_before": load,
        **summarize(rows, list(methods)),
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}, indent=1))
    write_record(args.out, "specdec.extraction/1", record)
    return 0


TARGET_ONLY, SPECULATIVE = "specdec target-only", "specdec lookup k=auto"


def run(
    methods: dict[str, tuple[int, dict[str, Any]]], models: dict[int, str], args: Any
) -> list[dict[str, Any]]:
    """Every prompt through every method, in turn, `args.repeats` times: one row a request."""
    spec = {"name": "person", "schema": SCHEMA, "strict": True}
    rf = {"type": "json_schema", "json_schema": spec}
    base = {"temperature": 0, "max_tokens": args.max_tokens, "response_format": rf}
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for i, person in enumerate(PEOPLE):
            answers = {}
            for name, (port, extra) in methods.items():
                body = {"model": models[port], "messages": messages(person), **base, **extra}
                if port == args.specdec:
                    body["return_token_ids"] = True
                out, seconds = post(port, body)
                choice = out["choices"][0]
                tokens = out["usage"]["completion_tokens"]
                answers[name] = choice.get("token_ids")
                parsed = _parsed(choice["message"]["content"])
                by_source = out["usage"].get("speculation", {}).get("by_source")
                rows.append(
                    {
                        "method": name, "prompt": i, "repeat": rep, "seconds": seconds,
                        "completion_tokens": tokens, "tok_s": tokens / seconds,
                        "valid_json": _valid(parsed),
                        "fields_right": _fields_right(parsed, person), "by_source": by_source,
                    }
                )  # fmt: skip
                print(f"{rep} {i} {name:26s} {tokens:4d} tok {seconds:6.2f} s "
                      f"{tokens / seconds:6.1f} tok/s {by_source or ''}")  # fmt: skip
            rows[-len(methods) + 1]["equal_to_target_only"] = (
                answers[SPECULATIVE] == answers[TARGET_ONLY]
            )
    return rows


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Per method: medians over requests; the ratios; how many answers equal target-only's."""
    summary = {}
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        summary[name] = {
            "requests": len(mine),
            "median_tok_s": statistics.median(r["tok_s"] for r in mine),
            "median_seconds": statistics.median(r["seconds"] for r in mine),
            "valid_json": sum(r["valid_json"] for r in mine),
            "fields_right": sum(r["fields_right"] for r in mine),
        }
    equal = [r["equal_to_target_only"] for r in rows if "equal_to_target_only" in r]
    t_only = summary[TARGET_ONLY]["median_tok_s"]
    # the answers differ in length across engines (llama-server's JSON keeps whitespace):
    # seconds per answer is the user's measure; tokens/s compares like with like only within
    # one grammar
    spec_s = summary[SPECULATIVE]["median_seconds"]
    return {
        "equal_to_target_only": f"{sum(equal)}/{len(equal)}",
        "summary": summary,
        "speed_vs_target_only": {n: s["median_tok_s"] / t_only for n, s in summary.items()},
        "speculation_faster_by_seconds": {
            n: s["median_seconds"] / spec_s for n, s in summary.items()
        },
    }


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _valid(parsed: Any) -> bool:
    return isinstance(parsed, dict) and set(parsed) == set(SCHEMA["required"])


def _fields_right(parsed: Any, person: tuple) -> int:
    if not isinstance(parsed, dict):
        return 0
    want = dict(zip(SCHEMA["required"], person, strict=True))
    return sum(str(parsed.get(k)).lower() == str(v).lower() for k, v in want.items())


if __name__ == "__main__":
    raise SystemExit(main())
