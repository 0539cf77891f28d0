"""The vendored prompt set: id, category, text, and for whole-file rewrites the original file.

    data/prompts.jsonl   the paper's categories (coding, explanation, summarization...)
    data/rewrite.jsonl   "rewrite": a source file (30-120 lines) plus one edit instruction
                         asking for the whole updated file; `prediction` is that file,
                         verbatim (OpenAI's Predicted Outputs, Cursor's speculative edits)
    data/sessions.jsonl  "session": multi-turn edit sessions on one file (`load_sessions`):
                         each turn's instruction applies to the previous turn's answer, as
                         an editor sends them; not in `load_prompts` (a session is several
                         requests, run by the bench's session protocol)

Files are read in that order, so the first N prompts of the set stay the same as before the
rewrite tasks were added.
"""

from __future__ import annotations

import json
import re
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
    """The vendored prompt set (src/specdec/study/run/data/*.jsonl), in file order."""
    prompts = []
    for name in FILES:
        raw = resources.files("specdec.study.run").joinpath(name).read_text("utf-8")
        for line in raw.splitlines():
            if line.strip():
                r = json.loads(line)
                prompts.append(Prompt(r["id"], r["category"], r["prompt"], r.get("prediction")))
    return prompts[:limit] if limit is not None else prompts


SESSIONS = "data/sessions.jsonl"
SESSION = "session"  # the category of the sessions' turns
#: What every turn asks for, as the rewrite tasks do: the whole file back, nothing else.
REPLY = "Reply with the complete updated file in one code block and nothing else."
_FENCED = re.compile(r"```[^\n`]*\n(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class Session:
    """A multi-turn edit session on one file: `turns[0]` is sent with the file, each later
    turn alone after the conversation so far (the file as the previous answer left it)."""

    id: str
    language: str  # the code fence's language
    file: str
    turns: tuple[str, ...]

    def user_turn(self, n: int) -> str:
        """The user message of turn n (0-based)."""
        if n == 0:
            return f"{self.turns[0]}\n\n```{self.language}\n{self.file}\n```\n\n{REPLY}"
        return f"{self.turns[n]}\n\n{REPLY}"

    def opening(self) -> Prompt:
        """Turn 1 as a single prompt (what a bench selects the session by)."""
        return Prompt(self.id, SESSION, self.user_turn(0), self.file)


def load_sessions(limit: int | None = None) -> list[Session]:
    """The vendored edit sessions (src/specdec/study/run/data/sessions.jsonl), in file order."""
    raw = resources.files("specdec.study.run").joinpath(SESSIONS).read_text("utf-8")
    out = []
    for line in raw.splitlines():
        if line.strip():
            r = json.loads(line)
            out.append(Session(r["id"], r["language"], r["file"], tuple(r["turns"])))
    return out[:limit] if limit is not None else out


def edited_file(answer: str) -> str:
    """The file an answer leaves, as an editor applies it: its first fenced code block, else
    the whole answer (stripped)."""
    m = _FENCED.search(answer)
    return m.group(1) if m else answer.strip()
