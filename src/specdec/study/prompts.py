"""The vendored prompt set: id, category, text, and for whole-file rewrites the original file.

    study/data/prompts.jsonl   the paper's categories (coding, explanation, summarization...)
    study/data/rewrite.jsonl   "rewrite": a source file (30-120 lines) plus one edit instruction
                               asking for the whole updated file; `prediction` is that file,
                               verbatim (OpenAI's Predicted Outputs, Cursor's speculative edits)

Files are read in that order, so the first N prompts of the set stay the same as before the
rewrite tasks were added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

FILES = ("data/prompts.jsonl", "data/rewrite.jsonl")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    prediction: str | None = None  # what the answer is expected to mostly repeat


def load_prompts(limit: int | None = None) -> list[Prompt]:
    """The vendored prompt set (src/specdec/study/data/*.jsonl), in file order."""
    prompts = []
    for name in FILES:
        raw = resources.files("specdec.study").joinpath(name).read_text("utf-8")
        for line in raw.splitlines():
            if line.strip():
                r = json.loads(line)
                prompts.append(Prompt(r["id"], r["category"], r["prompt"], r.get("prediction")))
    return prompts[:limit] if limit is not None else prompts
