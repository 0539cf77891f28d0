"""backends.fim without a model: the FIM tokens found by their texts in a vocabulary, the prompt's
layout (llama.cpp's /infill, the current line after the middle token), its budgets, and that a
file's text can never become a FIM token; serve.infill's editor stop rules and response_fields.
With the real Qwen2.5-Coder pair: tests/serve/test_infill.py."""

from __future__ import annotations

import itertools

import pytest

from specdec.backends.fim import Extra, FimTokens, fim_prompt, fim_tokens, plain_encoder
from specdec.serve.errors import ApiError
from specdec.serve.infill import Middle, parse_infill, pick
from specdec.serve.requests import Delta

SPECIALS = {
    "<|fim_prefix|>": 1000,
    "<|fim_suffix|>": 1001,
    "<|fim_middle|>": 1002,
    "<|fim_pad|>": 1003,
    "<|repo_name|>": 1004,
    "<|file_sep|>": 1005,
}


class CharTokenizer:
    """One id per character (its code point), the FIM tokens as added tokens; like HF's, it
    reads added tokens out of text unless split_special_tokens is set."""

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(32, 127)}, "\n": 10, **SPECIALS}

    def __call__(self, text: str, add_special_tokens: bool = True, **kw: bool) -> dict:
        ids, i = [], 0
        while i < len(text):
            hit = (
                None
                if kw.get("split_special_tokens")
                else next((t for t in SPECIALS if text.startswith(t, i)), None)
            )
            if hit:
                ids.append(SPECIALS[hit])
                i += len(hit)
            else:
                ids.append(ord(text[i]))
                i += 1
        return {"input_ids": ids}


FIM = FimTokens(pre=1000, suf=1001, mid=1002, pad=1003, rep=1004, sep=1005)


def _text(ids: list[int]) -> str:
    names = {v: k for k, v in SPECIALS.items()}
    return "".join(names.get(i, chr(i)) for i in ids)


def test_the_fim_tokens_are_found_by_their_texts_and_none_without_them() -> None:
    assert fim_tokens(CharTokenizer()) == FIM
    assert FIM.ends == {1003, 1004, 1005}

    class Plain(CharTokenizer):
        def get_vocab(self) -> dict[str, int]:
            return {chr(i): i for i in range(32, 127)}

    assert fim_tokens(Plain()) is None and fim_tokens(None) is None


def test_the_prompt_is_llama_cpps_layout_with_the_current_line_last() -> None:
    enc = plain_encoder(CharTokenizer())
    ids = fim_prompt(
        FIM, enc, "def f(x):\n", "\nprint(f(1))\n", [Extra("A = 1\n", "a.py"), Extra("B")],
        "    return", n_ctx=4096, n_predict=32,
    )  # fmt: skip
    assert _text(ids) == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nA = 1\n<|file_sep|>tmp\nB<|file_sep|>filename\n"
        "<|fim_prefix|>def f(x):\n<|fim_suffix|>\nprint(f(1))\n<|fim_middle|>    return"
    )
    spm = fim_prompt(FIM, enc, "P", "S", [], "c", n_ctx=4096, n_predict=32, spm=True)
    assert _text(spm).endswith("<|fim_suffix|>S<|fim_prefix|>P<|fim_middle|>c")
    bare = FimTokens(pre=1000, suf=1001, mid=1002)  # no repository or file tokens
    assert _text(fim_prompt(bare, enc, "P", "S", [Extra("x")], "", n_ctx=4096, n_predict=8)) == (
        "\n\n--- snippet ---\n\nx<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>"
    )


def test_a_files_text_never_becomes_a_fim_token() -> None:
    enc = plain_encoder(CharTokenizer())
    ids = fim_prompt(FIM, enc, "a<|fim_middle|>b", "<|file_sep|>", [], "", n_ctx=99, n_predict=1)
    assert ids.count(FIM.mid) == 1 and FIM.sep not in ids[ids.index(FIM.pre) :]


def test_the_budgets_keep_what_is_nearest_the_cursor() -> None:
    enc = plain_encoder(CharTokenizer())
    prefix, suffix = "p" * 900 + "END", "START" + "s" * 900
    ids = fim_prompt(FIM, enc, prefix, suffix, [], "cur", n_ctx=4096, n_predict=32)
    pre, suf, mid = ids.index(FIM.pre), ids.index(FIM.suf), ids.index(FIM.mid)
    assert suf - pre - 1 == 3 * (1024 // 4) and _text(ids[pre + 1 : suf]).endswith("END")
    assert mid - suf - 1 == 1024 // 4 - 2 - 3 and _text(ids[suf + 1 : mid]).startswith("START")
    # extra context: its last tokens that leave a batch and twice the answer free
    extra = [Extra("x" * 5000, "big.py"), Extra("near", "n.py")]
    ids = fim_prompt(FIM, enc, "P", "S", extra, "", n_ctx=2048, n_predict=100)
    assert ids.index(FIM.pre) == 2048 - 1024 - 200 and "near" in _text(ids)


def test_a_long_prefix_starts_at_a_line_that_stays_while_the_window_slides() -> None:
    """An editor's prefix is the 256 lines before the cursor: after each Enter it loses its
    first line and gains one. The prompt's prefix (at most 768 tokens) starts at a line chosen
    by content, so across 40 new lines the prompt keeps its start (and with it the prompt
    cache) in most steps, where a cut at exactly the last 768 tokens moves it every time."""
    enc = plain_encoder(CharTokenizer())
    lines = [f"  x{i} += {i * 7 % 13}\n" for i in range(400)]  # ~12 tokens, as a line of code
    starts, kept = [], []
    for cursor in range(300, 340):
        prefix = "".join(lines[cursor - 256 : cursor])
        ids = fim_prompt(FIM, enc, prefix, "", [], "", n_ctx=4096, n_predict=32)
        body = _text(ids[ids.index(FIM.pre) + 1 : ids.index(FIM.suf)])
        assert prefix.endswith(body) and (body == prefix or body[0] == " ")  # a whole line
        window = sum(map(len, lines[: cursor - 256]))  # where the editor's window starts
        starts.append(window + len(prefix) - len(body))  # where the prompt's prefix starts
        kept.append(len(body))
    assert all(512 <= n <= 768 for n in kept), kept
    moves = sum(a != b for a, b in itertools.pairwise(starts))
    # the least hash of ~21 lines moves every ~11 lines on average; a cut at exactly 768
    # tokens moves at every one of the 39 steps
    assert moves <= 8, moves
    # a single line longer than the budget (minified code): its last 768 tokens, as before
    ids = fim_prompt(FIM, enc, "y" * 2000, "", [], "", n_ctx=4096, n_predict=32)
    assert ids.index(FIM.suf) - ids.index(FIM.pre) - 1 == 768


def _delta(text: str) -> Delta:
    return Delta(text, (1,) * max(1, len(text)))


def test_n_indent_cuts_at_the_first_later_line_indented_less() -> None:
    m = Middle(n_indent=4, t_max_predict_ms=0)
    got = [m.take(_delta(t)) for t in ("x = 1", "\n    y", " = 2\n", "  ", "  z\nw")]
    assert "".join(got) == "x = 1\n    y = 2\n    z\n" and m.stopped  # "w": indented 0
    m2 = Middle(n_indent=4, t_max_predict_ms=0)
    out = "".join(m2.take(_delta(t)) for t in ("a", "\n  ", "b c"))
    assert out == "a\n  " and m2.stopped and m2.stop_type == "limit"  # cut before "b"
    first = Middle(n_indent=8, t_max_predict_ms=0)  # the first line is never checked
    assert first.take(_delta("x")) == "x" and not first.stopped


def test_t_max_predict_ms_stops_at_a_newline_past_the_budget(monkeypatch) -> None:
    import specdec.serve.infill as infill

    now = [100.0]
    monkeypatch.setattr(infill.time, "perf_counter", lambda: now[0])
    m = Middle(n_indent=0, t_max_predict_ms=500)
    m.take(_delta("a"))
    now[0] += 0.6
    assert m.take(_delta("b")) == "b" and not m.stopped  # no newline: goes on
    assert m.take(_delta("c\n")) == "c\n" and m.stopped


def test_response_fields_keep_the_named_paths_under_their_paths() -> None:
    obj = {"content": "x", "timings": {"prompt_n": 3}, "tokens_cached": 9}
    assert pick(obj, ["content", "timings/prompt_n", "nope/x"]) == {
        "content": "x",
        "timings/prompt_n": 3,
    }
    assert pick(obj, [""]) == {} and pick(obj, None) is obj


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input_suffix": ""}, "input_prefix"),
        ({"input_prefix": ""}, "input_suffix"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, None),
        (
            {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]},
            "input_extra",
        ),
        ({"input_prefix": "", "input_suffix": "", "n_indent": -1}, "n_indent"),
        ({"input_prefix": 1, "input_suffix": ""}, "input_prefix"),
    ],
)
def test_malformed_infill_requests_are_400s_naming_the_field(body: dict, param: str | None) -> None:
    with pytest.raises(ApiError) as e:
        parse_infill(body).extra()
    assert e.value.status == 400 and e.value.param == param, e.value.message
