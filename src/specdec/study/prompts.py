"""The vendored prompt set (study/data/prompts.jsonl): id, category, text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(limit: int | None = None) -> list[Prompt]:
    """The vendored prompt set (src/specdec/study/data/prompts.jsonl), in file order."""
    raw = resources.files("specdec.study").joinpath("data/prompts.jsonl").read_text("utf-8")
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    prompts = [Prompt(r["id"], r["category"], r["prompt"]) for r in rows]
    return prompts[:limit] if limit is not None else prompts
