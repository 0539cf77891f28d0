"""The docs are checked like code: every path, command and code block they name is real.

Over README.md and docs/*.md:

    paths     every repository path named in backticks or as a link target exists, and a link
              to a heading (`page.md#heading`) finds that heading
    commands  every `specdec SUBCOMMAND --flag ...` names a real subcommand and real flags of it;
              every command of a shell code block parses whole with the CLI's own argparse
              parser (nothing runs); every `make TARGET` is a target of the Makefile
    python    every ```python block runs, as written but for two swaps: the bigger models it
              names become llamacpp:smollm2-135m, the test model (the session's, conftest.py),
              so that a block runs in seconds; and a block that calls a server
              (http://127.0.0.1:8000/v1) calls one started here, in process, on that model,
              the way tests/serverkit.py starts them (`specdec serve --drafter lookup -k auto`)

The first two load no model; the python blocks are marked `model`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import specdec
from specdec.cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Where a path a doc names may live: the repository root, the package (`core/decode.py`), or
#: the doc's own directory (added per doc).
BASES = (ROOT, ROOT / "src" / "specdec")
#: Paths that are not the repository's and so are not looked for: what commands write (runs/),
#: an installed package's files, and llama.cpp's own source tree, which the build unpacks
#: (docs/kernels.md cites its files).
ELSEWHERE = ("runs/", "site-packages/", "vendor/", "ggml/", "ggml-cpu/", "common/", "examples/")
#: A media type (`application/json`) has a slash too.
MEDIA_TYPE = re.compile(r"(application|text|image|multipart)/[\w.+-]+$")
#: File names a doc may name without a directory, checked to exist somewhere in the repository.
NAMED_FILES = (".py", ".md", ".json", ".jsonl", ".png", ".h", ".c", ".cpp", ".patch", ".toml")
#: The server a python block calls, swapped for one started here.
BASE_URL = "http://127.0.0.1:8000/v1"
#: The test model, and the models a block may name that it stands in for.
SMOL = "llamacpp:smollm2-135m"
BIGGER = re.compile(r"\b(?:llamacpp|hf):(?:qwen2\.5-coder-(?:0\.5|1\.5)b|gemma3-270m)\b")
#: Every python block runs in this test: keep them few and short (the suite's time).
MAX_PYTHON_BLOCKS = 6

_FENCE = re.compile(r"^(`{3,})([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # a span may wrap onto the next line
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", re.MULTILINE)
_SHELL = {"sh", "bash", "shell", "console"}


@dataclass(frozen=True)
class Block:
    doc: Path
    lang: str
    text: str
    line: int

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _split(doc: Path) -> tuple[list[Block], str]:
    """The doc's fenced code blocks, and its prose with the blocks blanked out."""
    text = doc.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(doc, m.group(2).lower(), m.group(3), line))
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return blocks, prose


def _blocks(*langs: str) -> list[Block]:
    return [b for doc in DOCS for b in _split(doc)[0] if b.lang in langs]


def _spans(doc: Path) -> list[str]:
    return [" ".join(s.split()) for s in _SPAN.findall(_split(doc)[1])]


# ------------------------------------------------------------------------------------- paths
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_split(doc)[1])}


def _path_words(span: str) -> Iterator[str]:
    """The words of a code span that name a path: with a directory, or a file's extension."""
    for word in span.split():
        word = word.strip(".,;:()'\"")
        if (
            not word
            or word.startswith(("$", "~", "/", "-", "<"))
            or re.match(r"[a-z]+:", word)  # a model spec or a URL
            or any(c in word for c in "*{}[]|=<>")
            or "..." in word
            or word.startswith(ELSEWHERE)
            or MEDIA_TYPE.match(word)
        ):
            continue
        if "/" in word or word.endswith(NAMED_FILES):
            yield word


def _exists(word: str, doc: Path) -> bool:
    if "/" not in word:  # a bare file name: somewhere in the repository
        return (
            any(
                p.name == word
                for d in ("src", "tests", "scripts", "docs", "results")
                for p in (ROOT / d).rglob(word)
            )
            or (ROOT / word).exists()
        )
    return any((base / word).exists() for base in (*BASES, doc.parent))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = [w for s in _spans(doc) for w in _path_words(s) if not _exists(w, doc)]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_link_finds_its_page_and_heading(doc: Path) -> None:
    bad = []
    for target in _LINK.findall(_split(doc)[1]):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        page, _, anchor = target.partition("#")
        path = (doc.parent / page).resolve() if page else doc
        if not path.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{target} (no heading #{anchor} in {path.name})")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"


# ---------------------------------------------------------------------------------- commands
def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _shell_commands(block: Block) -> Iterator[list[str]]:
    """Each command line of a shell block as words (continuations joined, comments dropped,
    leading VAR=value assignments dropped). In an unlabelled block only `$ ` lines are
    commands; the rest is output."""
    text = block.text.replace("\\\n", " ")
    for line in text.splitlines():
        if block.lang == "":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words:
            yield words


def _parse(argv: list[str]) -> str | None:
    """None if `specdec ARGV` parses; else argparse's complaint."""
    if argv == ["--version"]:
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser(argv[0] if argv else None).parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else "exited"
    return None


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for m in re.finditer(r"^([\w.-]+)\s*:(?!=)", text, re.M) for t in [m.group(1)]}


def _check_span_command(words: list[str]) -> str | None:
    """A `specdec ...` span: a real subcommand (and sub-subcommand), and only its flags. Its
    values may be placeholders (SPEC, N), so it is not parsed whole."""
    if words[1:2] == ["--version"]:
        return None
    if len(words) < 2 or words[1] not in COMMANDS:
        return f"no subcommand {words[1:2]}"
    parser = _subparser(build_parser(words[1]), words[1])
    assert parser is not None
    if len(words) > 2 and not words[2].startswith("-"):
        nested = _subparser(parser, words[2])
        parser = nested if nested is not None else parser
    known = _options(parser)
    flags = [w.split("=")[0] for w in words[2:] if re.match(r"--?[a-zA-Z]", w)]
    unknown = [f for f in flags if f not in known]
    return f"unknown flags {unknown}" if unknown else None


def _span_words(span: str) -> list[str]:
    try:
        return shlex.split(span)
    except ValueError:
        return span.split()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_command_a_doc_names_is_real(doc: Path) -> None:
    """Commands in prose (code spans) and in shell blocks."""
    targets = _makefile_targets()
    bad = []
    for span in _spans(doc):
        words = _span_words(span)
        if words[:1] == ["specdec"]:
            problem = _check_span_command(words)
            if problem:
                bad.append(f"`{span}`: {problem}")
        elif words[:1] == ["make"] and len(words) > 1 and words[1] not in targets:
            bad.append(f"`{span}`: no Makefile target {words[1]}")
    for block in _split(doc)[0]:
        if block.lang not in _SHELL | {""}:
            continue
        for words in _shell_commands(block):
            if words[0] == "specdec":
                problem = _parse(words[1:])
                if problem:
                    bad.append(f"{block}: {shlex.join(words)}: {problem}")
            elif words[0] == "make" and not {w for w in words[1:] if "=" not in w} <= targets:
                # (VAR=value words set make's variables)
                bad.append(f"{block}: {shlex.join(words)}: no such Makefile target")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_wrong_command_and_path() -> None:
    """The checks above can fail: a made-up flag, subcommand, target and path are caught."""
    assert _parse(["serve", "--target", SMOL]) is None
    assert "unrecognized arguments" in (_parse(["serve", "--target", SMOL, "--turbo"]) or "")
    assert _parse(["bench", "--config", "all_gguf", "-k", "fast"])  # not an int, auto, schedule
    assert _check_span_command(["specdec", "models", "fetch", "--all"]) is None
    assert _check_span_command(["specdec", "models", "fetch", "--every"])
    assert _check_span_command(["specdec", "teleport"])
    assert "demo" in _makefile_targets() and "deploy" not in _makefile_targets()
    doc = ROOT / "README.md"
    assert _exists("src/specdec/core/decode.py", doc) and _exists("core/decode.py", doc)
    assert not _exists("src/specdec/core/decoder.py", doc)
    assert list(_path_words("runs/demo/ $SPECDEC_HOME/costs application/json")) == []
    assert _slug("The draft pool: drafting from earlier requests") == (
        "the-draft-pool-drafting-from-earlier-requests"
    )


def test_readme_is_short_and_names_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text


# ------------------------------------------------------------------------------ python blocks
PYTHON_BLOCKS = _blocks("python", "py")


def test_python_blocks_are_few() -> None:
    assert 0 < len(PYTHON_BLOCKS) <= MAX_PYTHON_BLOCKS, [str(b) for b in PYTHON_BLOCKS]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_python_block_compiles(block: Block) -> None:
    """Without a model: the block is Python (the run below needs the test model)."""
    compile(block.text, str(block), "exec")


def _as_tested(block: Block) -> str:
    """The block with the bigger models swapped for the test model."""
    return BIGGER.sub(SMOL, block.text)


@pytest.fixture
def session_models(monkeypatch: pytest.MonkeyPatch, smol_llamacpp):
    """`specdec.load_model(SMOL)` gives the session's model (one thread, an empty cache)
    instead of loading another copy."""
    real = specdec.load_model

    def load_model(spec: str, *args, **kwargs):
        if spec == SMOL:
            smol_llamacpp.reset()
            return smol_llamacpp
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(specdec, "load_model", load_model)
    return smol_llamacpp


@contextlib.contextmanager
def _server(target) -> Iterator[str]:
    """A server on `target`, as `specdec serve --target SMOL --drafter lookup -k auto` starts
    one; yields its base URL."""
    from serverkit import Server

    from specdec.serve.config import ServeConfig
    from specdec.serve.engine import Engine

    cfg = ServeConfig(target=SMOL, drafter="lookup", k="auto")
    engine = Engine(target, None, cfg)
    srv = Server(engine, cfg)
    try:
        yield srv.base_url
    finally:
        srv.close()


@pytest.mark.model
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_python_block_runs(block: Block, session_models) -> None:
    source = _as_tested(block)
    with contextlib.ExitStack() as stack:
        if "OpenAI(" in source:
            assert BASE_URL in source, f"{block}: a client block calls {BASE_URL}"
            source = source.replace(BASE_URL, stack.enter_context(_server(session_models)))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, str(block), "exec"), {"__name__": "__doc_block__"})
    assert out.getvalue().strip(), f"{block} printed nothing"
