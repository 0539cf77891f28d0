"""Multi-turn edit sessions as a benchmark category: the per-turn table of a session run.

A session run is `specdec bench --category session ...` (bench.py's session protocol; the
sessions are study/run/data/sessions.jsonl, prompts.load_sessions). Its rows are turns, in the
categories session-t1 (the opening turn: the file in the prompt) and session-t2+ (later turns:
the conversation so far, which a server's prompt cache holds). `format_sessions` reads them
back: per method and turn kind, time to first token, end-to-end rate, the tokens drafted and
accepted (by source where the method reports them), the prompt tokens its cache served, and
the end-to-end ratio against the best llama-server mode on the same turns.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.study.artifacts import BenchArtifact
from specdec.study.present import fmt

KINDS = ("session-t1", "session-t2+")
_PEERS = ("llama-server", "llama-lookup")  # method names of stock llama.cpp (anchors)


def is_session_run(art: BenchArtifact) -> bool:
    return any(r.category in KINDS for r in art.rows)


def _methods(art: BenchArtifact) -> list[str]:
    return ["baseline", "speculative", *(art.rows[0].variants if art.rows else ())]


def _best_peer(runs: Mapping[str, Mapping[str, Any]]) -> float | None:
    """The fastest stock llama.cpp method's end-to-end rate on one turn."""
    rates = [r["tokens_per_s"] for m, r in runs.items() if m.startswith(_PEERS)]
    return max(rates) if rates else None


def _accepted(runs: Sequence[Mapping[str, Any]]) -> str:
    """accepted / drafted, and by source when the records say (in-process: by source; specdec
    serve: the prediction's share)."""
    drafted = [r.get("drafted") for r in runs]
    if any(d is None for d in drafted):
        return "-"
    acc = sum(r.get("accepted") or 0 for r in runs)
    text = f"{acc}/{sum(drafted)}"
    by: dict[str, int] = {}
    for r in runs:
        for s, n in (r.get("accepted_by_source") or {}).items():
            key = "prediction" if s.startswith("prediction") else s.rstrip("+0123456789")
            by[key] = by.get(key, 0) + n
        if "accepted_by_source" not in r and r.get("accepted_prediction_tokens") is not None:
            by["prediction"] = by.get("prediction", 0) + r["accepted_prediction_tokens"]
    parts = [f"{s} {n}" for s, n in sorted(by.items()) if n]
    return text + (f" ({', '.join(parts)})" if parts else "")


def _row(art: BenchArtifact, method: str, kind: str) -> list[str]:
    rows = [r for r in art.rows if r.category == kind]
    runs = [r.run(method) for r in rows]
    ratios = []
    for r in rows:
        peer = _best_peer({m: r.run(m) for m in _methods(art)})
        if peer:
            ratios.append(r.run(method)["tokens_per_s"] / peer)
    cached = [r.get("cached_prompt_tokens") for r in runs]
    same = [r.get("agrees_with_reference") for r in runs]
    return [
        method,
        kind,
        str(len(runs)),
        fmt.num(statistics.fmean(r["ttft_s"] for r in runs), ".2f", plain=True),
        fmt.num(statistics.fmean(r["tokens_per_s"] for r in runs), ".1f", plain=True),
        fmt.x(math.exp(statistics.fmean(map(math.log, ratios))) if ratios else None, plain=True),
        _accepted(runs),
        "-" if None in cached else f"{statistics.fmean(cached):.0f}",
        f"{sum(bool(s) for s in same)}/{len(same)}",
    ]


def format_sessions(art: BenchArtifact) -> str | None:
    """The per-turn-kind table of a session run (None for any other run)."""
    if not is_session_run(art):
        return None
    header = ["method", "turns", "n", "TTFT (s)", "tok/s", "vs best llama.cpp"]
    header += ["accepted/drafted", "cached prompt", "agrees w/ ref."]
    lines = [
        _row(art, m, kind)
        for m in _methods(art)
        for kind in KINDS
        if any(r.category == kind for r in art.rows)
    ]
    note = (
        "sessions, per turn kind (t1: the file in the prompt; t2+: later turns on the "
        "conversation so far): means over turns; 'vs best llama.cpp' is the geometric mean over "
        "turns of the end-to-end rate against the fastest stock llama.cpp method of that turn"
    )
    return "\n".join([note, fmt.text_table(header, lines)])
