"""Editing sessions replayed as an editor sends them to `/infill` (issue 62's completion
benchmark; scripts/completion_replay.py runs it against specdec and llama-server).

A session is a real file of a public package (installed here, pinned by requirements.txt, its
licence read from its distribution) in which lines of a function body are typed back: the lines
are taken out, the cursor is put where the first began, and they are typed again one at a time,
as llama.vscode and llama.vim build their requests (their defaults: the 256 lines before the
cursor's line as `input_prefix`, the rest of the line and the 64 after it as `input_suffix`, the
line up to the cursor as `prompt`, `n_indent` the line's indentation, chunks of other files as
`input_extra`, n_predict 128, top_k 40, top_p 0.99, samplers [top_k, top_p, infill],
cache_prompt, t_max_prompt_ms 500, t_max_predict_ms 1000). A request goes out at the start of
each line (after Enter and the editor's indent) and after each word typed: the keystrokes after
which the user pauses past the clients' debounce (75 ms) at typing speed. Temperature is 0, so
every engine's answers can be compared with target-only's.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: llama.vscode's and llama.vim's defaults
N_PREFIX_LINES = 256
N_SUFFIX_LINES = 64
N_PREDICT = 128
T_MAX_PROMPT_MS = 500
T_MAX_PREDICT_MS = 1000
RING_CHUNK_LINES = 64
#: The fields every request carries (llama.vscode's defaultRequestParams), T = 0 added
FIXED = {
    "n_predict": N_PREDICT,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": T_MAX_PROMPT_MS,
    "t_max_predict_ms": T_MAX_PREDICT_MS,
    "temperature": 0.0,
}
_WORD_END = re.compile(r"\w(?=\W)")  # the last character of a word followed by more


@dataclass(frozen=True)
class Source:
    """A file of an installed distribution, with what its licence is."""

    dist: str
    version: str
    path: str  # inside the distribution
    licence: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.dist}-{self.version}/{self.path}"


def source(dist: str, path: str) -> Source:
    """`path` of the installed distribution `dist` (ValueError naming what is missing)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"{dist} is not installed; install requirements.txt") from None
    files = {str(f): f for f in d.files or ()}
    if path not in files:
        raise ValueError(f"{dist} {d.version} has no file {path}")
    meta = d.metadata
    licence = meta.get("License-Expression") or meta.get("License") or ""
    if not licence or len(licence) > 60:  # a whole licence text: its classifier names it
        classifiers = [c for c in meta.get_all("Classifier") or () if c.startswith("License ::")]
        licence = classifiers[0].rsplit("::", 1)[-1].strip() if classifiers else licence[:60]
    text = Path(str(d.locate_file(files[path]))).read_text()
    return Source(dist, d.version, path, licence, text)


@dataclass(frozen=True)
class Keystroke:
    """One request of a session: where it was sent and its body."""

    session: int
    line: int  # the line typed (0-based in the file)
    col: int  # the cursor's column
    kind: str  # "line": the line's start, after Enter; "word": after a word
    body: dict[str, Any] = field(repr=False)


def cut_points(src: Source, per_file: int, skip: int = 0) -> list[int]:
    """The first line of the body of `per_file` functions, evenly spread over the file (after
    `skip` of them): a body of at least two lines, past the docstring."""
    tree = ast.parse(src.text)
    starts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if len(body) >= 2 and body[0].lineno == body[0].end_lineno:
                starts.append(body[0].lineno - 1)
    starts = sorted(set(starts))[skip:]
    if len(starts) < per_file:
        raise ValueError(f"{src.name}: {len(starts)} functions to cut, {per_file} wanted")
    step = len(starts) / per_file
    return [starts[int(i * step)] for i in range(per_file)]


def chunks(others: list[Source], n: int) -> list[dict[str, str]]:
    """The ring's chunks: the first RING_CHUNK_LINES lines of `n` other files."""
    return [
        {"filename": s.path, "text": "\n".join(s.text.splitlines()[:RING_CHUNK_LINES]) + "\n"}
        for s in others[:n]
    ]


def request(lines: list[str], line: int, col: int, extra: list[dict[str, str]]) -> dict:
    """llama.vscode's /infill body with the cursor at (line, col) of the document `lines`."""
    cur = lines[line]
    prefix = "".join(x + "\n" for x in lines[max(0, line - N_PREFIX_LINES) : line])
    after = lines[line + 1 : line + 1 + N_SUFFIX_LINES]
    suffix = cur[col:] + "\n" + "".join(x + "\n" for x in after)
    indent = len(cur) - len(cur.lstrip(" \t"))
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra}
    body |= {"prompt": cur[:col], **FIXED}
    if indent:
        body["n_indent"] = indent
    return body


def session(
    src: Source, start: int, n_lines: int, extra: list[dict[str, str]], index: int
) -> list[Keystroke]:
    """The requests of typing back lines start..start+n_lines of `src`, in order: the document
    holds the lines before and those after; each typed line begins with its indent."""
    original = src.text.splitlines()
    typed = original[start : start + n_lines]
    out = []
    for i, text in enumerate(typed):
        # lines typed so far, the current one being typed, then the rest of the file
        indent = len(text) - len(text.lstrip(" \t"))
        ends = [indent] + [m.end() for m in _WORD_END.finditer(text, indent)]
        for col in dict.fromkeys(ends):
            doc = [*original[: start + i], text[:col], *original[start + n_lines :]]
            kind = "line" if col == indent else "word"
            body = request(doc, start + i, col, extra)
            out.append(Keystroke(index, start + i, col, kind, body))
    return out


def summary(latencies: list[float]) -> dict[str, float]:
    """Median, p95 (nearest rank) and mean of `latencies`, seconds."""
    xs = sorted(latencies)
    if not xs:
        return {}
    p95 = xs[min(len(xs) - 1, max(0, -(-95 * len(xs) // 100) - 1))]
    return {"n": len(xs), "median": statistics.median(xs), "p95": p95, "mean": sum(xs) / len(xs)}


def agrees(a: str, b: str) -> bool:
    """Two answers at T = 0 agree where they can be compared: one is a prefix of the other
    (t_max_predict_ms cuts an answer at a newline once its time is up, which differs by
    engine)."""
    return a.startswith(b) or b.startswith(a)
