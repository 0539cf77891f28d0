"""The completion replay's sessions (study.run.completion): requests as llama.vscode builds
them, typed back in order, from real files of installed packages."""

from __future__ import annotations

import pytest

from specdec.study.run import completion as cr


@pytest.fixture(scope="module")
def src() -> cr.Source:
    return cr.source("h11", "h11/_connection.py")


def test_a_source_names_its_distribution_and_licence(src: cr.Source) -> None:
    assert src.name.startswith("h11-") and src.licence == "MIT" and "class Connection" in src.text
    with pytest.raises(ValueError, match="not installed"):
        cr.source("no-such-dist-here", "x.py")
    with pytest.raises(ValueError, match="has no file"):
        cr.source("h11", "h11/nothing.py")


def test_typing_a_line_back_sends_a_request_at_its_start_and_after_each_word(src) -> None:
    start = cr.cut_points(src, 1, skip=3)[0]
    lines = src.text.splitlines()
    extra = cr.chunks([cr.source("jinja2", "jinja2/lexer.py")], 1)
    keys = cr.session(src, start, 2, extra, index=7)
    assert [k.kind for k in keys].count("line") == 2 and keys[0].kind == "line"
    assert all(k.session == 7 for k in keys)
    for k in keys:
        b = k.body
        typed = lines[k.line][: k.col]
        assert b["prompt"] == typed and b["input_extra"] == extra
        # the prefix: the lines before, whole; the suffix: the rest of the line (none: it is
        # being typed), then the lines after the ones still to type
        assert b["input_prefix"] == "".join(x + "\n" for x in lines[max(0, k.line - 256) : k.line])
        assert b["input_suffix"].startswith("\n" + lines[start + 2] + "\n")
        assert b["n_indent"] == len(typed) - len(typed.lstrip())
        assert b["temperature"] == 0 and b["cache_prompt"] and b["n_predict"] == 128
    for line in (start, start + 1):  # each line typed forward, pausing after words
        cols = [k.col for k in keys if k.line == line]
        assert cols == sorted(set(cols)) and len(cols) > 2
        assert all(lines[line][c - 1].isalnum() or lines[line][c - 1] == "_" for c in cols[1:])


def test_cut_points_are_single_line_statements_opening_a_body(src) -> None:
    lines = src.text.splitlines()
    points = cr.cut_points(src, 3)
    assert len(points) == 3 == len(set(points)) and points == sorted(points)
    assert all(lines[p].startswith(" ") and not lines[p].strip().startswith('"""') for p in points)
    with pytest.raises(ValueError, match="functions to cut"):
        cr.cut_points(src, 10_000)


def test_summaries_and_agreement() -> None:
    s = cr.summary([float(x) for x in range(1, 21)])
    assert s["median"] == 10.5 and s["p95"] == 19 and s["n"] == 20
    assert cr.summary([]) == {}
    assert cr.agrees("abc", "abcdef") and cr.agrees("abc", "abc") and not cr.agrees("abx", "abc")
