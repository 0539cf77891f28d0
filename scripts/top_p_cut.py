#!/usr/bin/env python3
"""Top-p's and typical-p's cut, before and now (docs/requests.md): the whole row sorted (the
reference of tests/core/test_sampling.py, `_keep_mass_by_full_sort`) against the cut looked for
among the first tokens (`core.sampling._keep_mass`), interleaved in one process, one thread.

1. `warped` on 40 rows of the target's logits (code, prose, chat), a row and five rows a call,
   every call's output asserted equal both ways, and how each row's cut was decided;
2. end to end: three chat prompts, target-only and the draft model at K = 4, T = 0.8 and
   top-p 0.95, fixed seeds, both ways interleaved, two rounds, the tokens asserted equal.

    .venv/bin/python scripts/top_p_cut.py

Run it on an idle machine, one benchmark at a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.backends import load_model
from specdec.core import sampling
from specdec.core.config import Warp
from specdec.core.generate import generate

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS / "core"), str(_TESTS)]  # the test module and its statistics helper
from test_sampling import _keep_mass_by_full_sort  # noqa: E402  (the reference: the old cut)

TEXTS = [
    'def parse_config(path):\n    """Read a TOML config file and return a dict."""\n'
    "    with open(path) as f:\n",
    "The three most important things to know about the French Revolution are",
    "<|im_start|>user\nWrite a short poem about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
]
CHATS = [
    "Write a short poem about autumn leaves.",
    "Explain what a hash map is to a new programmer.",
    "Give three tips for writing clear commit messages.",
]
WARPS = [
    Warp(0.8, top_p=0.95),
    Warp(0.8, top_p=0.99),
    Warp(1.0, top_p=0.9),
    Warp(0.8, typical_p=0.9),
    Warp(0.8, top_k=40, top_p=0.99),
    Warp(0.8),
]
NOW = sampling._keep_mass


def _before(fn, *args, **kw):
    """`fn` with the whole-row cut in place of the current one."""
    sampling._keep_mass = _keep_mass_by_full_sort
    try:
        return fn(*args, **kw)
    finally:
        sampling._keep_mass = NOW


def _decided_at(row: torch.Tensor, w: Warp) -> int | str:
    """How one row's cut is decided: among the first 256 or 2,048 tokens, or the whole row;
    read off the cut `warped` itself asks `_keep_mass` for (its last, where it asks twice)."""
    ways: list[int | str] = []

    def record(probs: torch.Tensor, order: torch.Tensor, mass: float) -> torch.Tensor:
        first = (
            m for m in (256, 2048) if sampling._cut_among_first(probs, order, mass, m)[1].all()
        )
        ways.append(next(first, "row"))
        return NOW(probs, order, mass)

    sampling._keep_mass = record
    try:
        sampling.warped(row[None], w)
    finally:
        sampling._keep_mass = NOW
    return ways[-1]


def rows_bench(target) -> None:
    rows = []
    for text in TEXTS:
        target.reset()
        rows.append(target.extend(target.tokenizer(text)["input_ids"])[-16:])
    logits = torch.cat(rows)[:40]  # [40, V]
    for w in WARPS:
        cut = w.top_p is not None or w.typical_p is not None
        ways = [_decided_at(r, w) for r in logits] if cut else []
        for b in (1, 5):
            calls = [logits[i : i + b] for i in range(0, 40, b)]
            for x in calls:
                assert torch.equal(_before(sampling.warped, x, w), sampling.warped(x, w))
            before, now = [], []
            for _ in range(3):
                t = time.perf_counter()
                for x in calls:
                    _before(sampling.warped, x, w)
                before.append((time.perf_counter() - t) / len(calls))
                t = time.perf_counter()
                for x in calls:
                    sampling.warped(x, w)
                now.append((time.perf_counter() - t) / len(calls))
            counts = {k: ways.count(k) for k in (256, 2048, "row")} if cut else "-"
            print(f"{w}, {b} row(s) a call: before {statistics.median(before) * 1e3:.2f} ms, "
                  f"now {statistics.median(now) * 1e3:.2f} ms; decided at {counts}")  # fmt: skip


def end_to_end(target, draft, tokens: int) -> None:
    tok = target.tokenizer
    prompts = []
    for c in CHATS:
        ids = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    methods = {"target-only": {}, "draft model, K = 4": {"draft": draft, "k": 4}}
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(2):
        for name, kw in methods.items():
            outs = {}
            for way in ("before", "now"):
                run = _before if way == "before" else (lambda fn, *a, **k: fn(*a, **k))
                t0, n, outs[way] = time.perf_counter(), 0, []
                for i, p in enumerate(prompts):
                    r = run(generate, target, p, max_new_tokens=tokens, temperature=0.8,
                            top_p=0.95, seed=i, **kw)  # fmt: skip
                    n += len(r.tokens)
                    outs[way].append(r.tokens)
                rates.setdefault((name, way), []).append(n / (time.perf_counter() - t0))
            assert outs["before"] == outs["now"], name
    for name in methods:
        b, a = rates[(name, "before")], rates[(name, "now")]
        ratio = statistics.mean(a) / statistics.mean(b)
        both = [" / ".join(f"{x:.1f}" for x in r) for r in (b, a)]
        print(f"{name}: before {both[0]} tok/s, now {both[1]} tok/s ({ratio:.2f}x); same tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="llamacpp:qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a prompt, end to end")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_model(args.target)
    rows_bench(target)
    end_to_end(target, load_model(args.draft), args.tokens)


if __name__ == "__main__":
    main()
