"""Multi-turn edit sessions as a benchmark category: the session data, the protocol (every
method on the same turn, the conversation built from the reference answers, the prediction
the file as the last answer left it), requests carrying the conversation, the servers' prompt
cache on, and the per-turn table. (Speed is measured by the lead's benchmark, not here.)"""

from __future__ import annotations

import json
import re

import pytest

from specdec.core.config import SpecConfig, Warp
from specdec.study.engines import endpoint
from specdec.study.present.sessions import format_sessions
from specdec.study.present.tables import format_table
from specdec.study.run import bench, bench_settings, methods
from specdec.study.run import prompts as prompt_set
from specdec.study.run.bench import run_bench
from specdec.study.run.bench_settings import Peers, bench_config

MOCK = ("mock:vocab=48,seed=1", "mock:vocab=48,seed=0")


def _fence_languages(prompts: list[prompt_set.Prompt]) -> set[str]:
    return {m.group(1) for p in prompts if (m := re.search(r"```(\w+)\n", p.text))}


def test_the_sessions_are_edit_sessions_in_the_rewrite_sets_languages() -> None:
    sessions = prompt_set.load_sessions()
    rewrite_langs = _fence_languages([p for p in prompt_set.load_prompts() if p.prediction])
    assert len(sessions) >= 8 and len({s.id for s in sessions}) == len(sessions)
    assert all(3 <= len(s.turns) <= 5 for s in sessions)
    assert {s.language for s in sessions} <= rewrite_langs
    assert len({s.language for s in sessions}) >= 8
    for s in sessions:
        opening = s.opening()
        assert opening.category == "session" and opening.prediction == s.file
        assert f"```{s.language}\n{s.file}\n```" in s.user_turn(0)
        assert all(s.file not in s.user_turn(n) for n in range(1, len(s.turns)))
        assert all(t.strip() and prompt_set.REPLY in s.user_turn(n) for n, t in enumerate(s.turns))


@pytest.mark.model
def test_every_session_fits_a_4096_token_context(smol_llamacpp) -> None:
    """The last turn's conversation (every answer taken as 1.5x the file, generously) plus 768
    new tokens fits the 4,096-token context both servers run with."""
    tok = smol_llamacpp.tokenizer
    for s in prompt_set.load_sessions():
        file = len(tok(s.file)["input_ids"])
        turns = sum(len(tok(s.user_turn(n))["input_ids"]) for n in range(len(s.turns)))
        answers = (len(s.turns) - 1) * 1.5 * file
        assert turns + answers + 768 + 64 < 4096, s.id


def test_the_answer_the_editor_applies_is_its_first_code_block() -> None:
    assert prompt_set.edited_file("Here:\n```go\npackage a\n\nfunc F() {}\n```\nDone.") == (
        "package a\n\nfunc F() {}"
    )
    assert prompt_set.edited_file("```\nx\n```") == "x"
    assert prompt_set.edited_file("  no fence  ") == "no fence"


def test_session_category_is_selected_alone_and_checked() -> None:
    openings = bench_settings.select_prompts(("session",))
    assert [p.id for p in openings] == [s.id for s in prompt_set.load_sessions()]
    assert "session" in bench_settings.CATEGORIES
    with pytest.raises(ValueError, match="runs alone"):
        bench_settings.select_prompts(("session", "rewrite"))
    with pytest.raises(ValueError, match="chat conversation"):
        bench_config(
            None,
            *MOCK,
            categories=("session",),
            n_prompts=2,
            warmup=0,
            peers=Peers(endpoint_api="completions"),
        )


def test_the_session_protocol_on_mock_models(tmp_path, monkeypatch) -> None:
    """Every method gets the same turn: the conversation so far with the reference answers, and
    the prediction is the file the last reference answer left. Rows are turns."""
    seen: list[methods.Task] = []
    real = bench._run_methods

    def spy(runners, sequence, task, *a):
        seen.append(task)
        return real(runners, sequence, task, *a)

    monkeypatch.setattr(bench, "_run_methods", spy)
    cfg = bench_config(
        None,
        *MOCK,
        categories=("session",),
        n_prompts=2,
        warmup=0,
        max_new_tokens=10,
        spec=SpecConfig("lookup", 3),
        warp=Warp(temperature=0.0),
        variants=("lookup:auto",),
    )
    art = run_bench(cfg, tmp_path, progress=False)
    sessions = prompt_set.load_sessions()[:2]
    assert [r.prompt_id for r in art.rows] == [
        f"{s.id}/t{n + 1}" for s in sessions for n in range(len(s.turns))
    ]
    assert [r.category for r in art.rows[:2]] == ["session-t1", "session-t2+"]
    first = len(sessions[0].turns)
    for n, (task, row) in enumerate(zip(seen[:first], art.rows[:first], strict=True)):
        assert len(task.history) == 2 * n and task.text == sessions[0].user_turn(n)
        if n:  # the previous reference answer is the last assistant turn
            ref = " ".join(map(str, art.rows[n - 1].baseline["tokens"]))  # mock "text"
            assert task.history[-1] == {"role": "assistant", "content": ref}
            assert task.prediction_text == prompt_set.edited_file(ref)
        assert row.prompt_tokens == len(task.ids)
        for m in ("baseline", "speculative", "lookup-kauto"):
            assert row.run(m)["agrees_with_reference"] is True  # greedy: identical answers
    assert [r.prompt_tokens for r in art.rows[:first]] == sorted(
        r.prompt_tokens for r in art.rows[:first]
    )  # the conversation grows
    table = format_sessions(art)
    assert table is not None and "session-t2+" in table and "speculative" in table
    assert "sessions, per turn kind" in format_table(art)
    assert (
        format_sessions(
            run_bench(
                bench_config(None, *MOCK, n_prompts=1, warmup=0, max_new_tokens=2), tmp_path, False
            )
        )
        is None
    )


def test_a_request_carries_the_conversation() -> None:
    ep = endpoint.Endpoint("http://127.0.0.1:1", model="m", extra={"cache_prompt": True})
    history = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
    with endpoint.Client(ep) as c:
        body = c.body(endpoint.Request("c", 8, Warp(0.0), 0, history=history))
    assert body["messages"] == [*map(dict, history), {"role": "user", "content": "c"}]
    assert body["cache_prompt"] is True


def test_session_runs_turn_the_servers_prompt_cache_on() -> None:
    cfg = bench_config(
        None,
        "llamacpp:smollm2-135m",
        "llamacpp:smollm2-135m",
        categories=("session",),
        spec=SpecConfig("prediction", "auto"),
        n_prompts=1,
        warmup=0,
        peers=Peers(served=True),
    )
    servers = methods.specdec_servers(cfg)
    for srv in servers.values():
        cmd = srv.command()
        assert "--prompt-cache" in cmd and "--no-prompt-cache" not in cmd
    plain = bench_config(
        None,
        "llamacpp:smollm2-135m",
        "llamacpp:smollm2-135m",
        categories=("rewrite",),
        spec=SpecConfig("prediction", "auto"),
        n_prompts=1,
        warmup=0,
        peers=Peers(served=True),
    )
    assert all("--no-prompt-cache" in s.command() for s in methods.specdec_servers(plain).values())


@pytest.mark.model
def test_a_served_session_end_to_end(tmp_path) -> None:
    """A tiny session run through two `specdec serve` processes (target-only and the
    prediction drafter), their prompt caches on: later turns are served partly from the cache,
    and the answers are the reference's."""
    model_spec = "llamacpp:smollm2-135m"
    cfg = bench_config(
        None,
        model_spec,
        model_spec,
        categories=("session",),
        spec=SpecConfig("prediction", "auto"),
        n_prompts=1,
        warmup=0,
        max_new_tokens=12,
        warp=Warp(temperature=0.0),
        peers=Peers(served=True),
    )
    art = run_bench(cfg, tmp_path, progress=False)
    assert len(art.rows) == len(prompt_set.load_sessions()[0].turns)
    later = art.rows[1:]
    assert all(r.speculative["cached_prompt_tokens"] >= 256 for r in later)
    assert all(r.baseline["cached_prompt_tokens"] >= 256 for r in later)
    assert all(r.speculative["agrees_with_reference"] for r in art.rows)
    on_disk = json.loads(art.path.read_text())
    assert on_disk["config"]["categories"] == ["session"]
