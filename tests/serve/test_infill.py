"""Code completion with the real Qwen2.5-Coder 0.5B: `POST /infill` as llama.vscode and llama.vim
send it and read it, `suffix` on /v1/completions, and `specdec.complete`; every middle at T = 0
equal to target-only's, with every drafter; a model without FIM tokens refused by name."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverkit import Server, serve_models
from support import TEST_THREADS

from specdec.backends import load_model
from specdec.backends.fim import complete

PREFIX = "import math\n\n\ndef area(r):\n"
SUFFIX = "\n\n\ndef perimeter(r):\n    return 2 * math.pi * r\n"
EXTRA = [{"filename": "shapes.py", "text": "def square(a):\n    return a * a\n", "time": 1}]
LINE = "    return"
#: llama.vim's request (autoload/llama.vim), as it sends it
VIM = {
    "id_slot": 0,
    "input_prefix": PREFIX,
    "input_suffix": SUFFIX,
    "input_extra": EXTRA,
    "prompt": LINE,
    "n_predict": 16,
    "stop": [],
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "stream": False,
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000,
    "temperature": 0,
    "response_fields": [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/prompt_per_token_ms",
        "timings/prompt_per_second",
        "timings/predicted_n",
        "timings/predicted_ms",
        "timings/predicted_per_token_ms",
        "timings/predicted_per_second",
        "truncated",
        "tokens_cached",
    ],
}


@pytest.fixture(scope="module")
def srv(qwen05_path: Path) -> Iterator[Server]:
    spec = f"llamacpp:{qwen05_path}"
    target = load_model(spec, n_threads=TEST_THREADS)
    draft = load_model(spec, n_threads=TEST_THREADS)
    s = serve_models(target, draft, spec=spec)
    yield s
    s.close()


def _post(srv: Server, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, raw


def _target_only(srv: Server, *args: Any, **kw: Any) -> Any:
    with srv.engine.lock:
        return complete(srv.engine.models.target, *args, temperature=0, **kw)


def test_llama_vims_request_is_answered_as_it_reads_it_and_equals_target_only(srv: Server):
    want = _target_only(srv, PREFIX, SUFFIX, EXTRA, LINE, max_new_tokens=16)
    full = srv.engine.models.target.tokenizer.decode(want.tokens, skip_special_tokens=True)
    for drafter in ("lookup", "model", "composite"):
        status, raw = _post(srv, "/infill", {**VIM, "speculation": {"drafter": drafter}})
        assert status == 200, raw
        # llama.vim keeps a body only if it is one line matching "content":" (no space)
        assert b"\n" not in raw and re.search(rb'"content"\s*:"', raw), raw[:200]
        r = json.loads(raw)
        assert set(r) == set(VIM["response_fields"]), r
        # n_indent 4 may cut the middle at a later line: it is target-only's, to the cut
        assert full.startswith(r["content"]) and r["content"], (drafter, r["content"], full)
        assert r["timings/prompt_n"] > 0 and r["tokens_cached"] > r["timings/predicted_n"] > 0


def test_llama_vscodes_request_gets_a_list_for_n_cmpl_and_the_fields_it_reads(srv: Server):
    body = {k: v for k, v in VIM.items() if k != "response_fields"}
    body.update({"n_cmpl": 2, "top_p": 0.99, "t_max_predict_ms": 2500})
    status, raw = _post(srv, "/infill", body)
    assert status == 200, raw
    both = json.loads(raw)
    assert isinstance(both, list) and len(both) == 2
    assert both[0]["content"] == both[1]["content"]  # T = 0: the same middle
    r = both[0]
    assert r["generation_settings"]["n_ctx"] == srv.engine.models.n_ctx
    assert r["stop"] is True and r["stop_type"] in ("eos", "limit") and r["tokens_cached"] > 0
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"} <= set(r["timings"])


def test_a_stream_sends_the_pieces_then_the_record_without_done(srv: Server) -> None:
    body = {k: v for k, v in VIM.items() if k != "response_fields"}
    _, whole = _post(srv, "/infill", body)
    status, raw = _post(srv, "/infill", {**body, "stream": True})
    assert status == 200 and b"[DONE]" not in raw
    events = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")
    ]
    pieces, last = events[:-1], events[-1]
    assert all(not e["stop"] for e in pieces) and last["stop"] is True
    assert "".join(e["content"] for e in pieces) == json.loads(whole)["content"]


def test_a_suffix_on_completions_is_the_same_middle(srv: Server) -> None:
    want = _target_only(srv, "def add(a, b):\n    return", "\n", max_new_tokens=12)
    model = srv.engine.models.target.name
    body = {"model": model, "prompt": "def add(a, b):\n    return", "suffix": "\n"}
    body.update({"max_tokens": 12, "temperature": 0, "return_token_ids": True})
    status, raw = _post(srv, "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want.tokens
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "suffix": "y"}
    status, raw = _post(srv, "/v1/chat/completions", chat)
    assert status == 400 and json.loads(raw)["error"]["param"] == "suffix"


def test_complete_equals_target_only_with_every_drafter(srv: Server) -> None:
    models = srv.engine.models
    want = _target_only(srv, PREFIX, SUFFIX, EXTRA, LINE, max_new_tokens=24)
    with srv.engine.lock:
        for kw in ({"drafter": "lookup", "k": 4}, {"draft": models.draft, "k": "auto"}):
            got = complete(models.target, PREFIX, SUFFIX, EXTRA, LINE, temperature=0,
                           max_new_tokens=24, **kw)  # fmt: skip
            assert got.tokens == want.tokens, kw


def test_a_model_without_fim_tokens_is_refused_by_name(smol_path: Path) -> None:
    spec = f"llamacpp:{smol_path}"
    srv = serve_models(load_model(spec, n_threads=TEST_THREADS), spec=spec)
    try:
        status, raw = _post(srv, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 501 and b"fill-in-the-middle" in raw, raw
        body = {"model": srv.engine.models.target.name, "prompt": "a", "max_tokens": 2}
        status, raw = _post(srv, "/v1/completions", {**body, "suffix": "b"})
        assert status == 400 and json.loads(raw)["error"]["code"] == "fim_not_supported"
        status, raw = _post(srv, "/v1/completions", {**body, "suffix": ""})  # asks for nothing
        assert status == 200, raw
        with pytest.raises(ValueError, match="fill-in-the-middle"):
            complete(srv.engine.models.target, "a", "b")
    finally:
        srv.close()


def test_two_keys_and_two_files_in_turn_on_one_slot_come_back_from_ram(qwen05_path: Path):
    """Issue 62's check with the real 0.5B: two keys × two files of ~600 tokens sent in turn
    to one slot (--parallel 1), each twice: every repeat ≥ 90% cached (the slot's cache copied
    back from the RAM store), and every middle the target's own at T = 0."""
    from specdec.study.run.completion import source

    spec = f"llamacpp:{qwen05_path}"
    target = load_model(spec, n_threads=TEST_THREADS)
    keys = ("key-a", "key-b")
    s = serve_models(target, spec=spec, api_keys=keys)
    files = [
        "\n".join(source(d, p).text.splitlines()[:110]) + "\n"
        for d, p in (("h11", "h11/_connection.py"), ("jinja2", "jinja2/lexer.py"))
    ]
    try:
        seen: dict[tuple[str, int], list[dict]] = {}
        for _ in range(2):
            for key in keys:
                for i, f in enumerate(files):
                    body = {"input_prefix": f, "input_suffix": "\n", "n_predict": 8}
                    body["temperature"] = 0
                    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
                    head = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
                    conn.request("POST", "/infill", json.dumps(body), head)
                    resp = conn.getresponse()
                    assert resp.status == 200
                    seen.setdefault((key, i), []).append(json.loads(resp.read()))
                    conn.close()
        with s.engine.lock:  # the target's own middle, once per file: both keys' must equal it
            want = [complete(target, f, "\n", temperature=0, max_new_tokens=8) for f in files]
        for (_, i), (first, again) in seen.items():
            t = again["timings"]
            assert 500 < t["cache_n"] + t["prompt_n"] and t["cache_n"] >= 0.9 * (
                t["cache_n"] + t["prompt_n"]
            ), t
            assert first["timings"]["cache_n"] == 0 and again["content"] == first["content"]
            assert first["content"] == target.tokenizer.decode(
                want[i].tokens, skip_special_tokens=True
            )
    finally:
        s.close()
