"""Prompt-prefix reuse (generate.stream(reuse_prefix=True), the server's prompt cache): only the
part of a prompt the target's cache does not already hold is prefilled, and the output is the
output of a fresh prefill (mock models are batch-invariant, so exactly)."""

from __future__ import annotations

from typing import Any

import torch
from serverkit import MOCK_SPEC, SlowMock, V, metric, serve_models

from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.serve.cycle import PROMPT_CACHE_BLOCK
from specdec.serve.prompt_store import Entry, PromptStore


class CountingMock(MockModel):
    """Counts the prompt tokens it is asked to prefill."""

    prefilled = 0

    def _prefill(self, ids: list[int]) -> None:
        self.prefilled += len(ids)
        super()._prefill(ids)


def _run(target: MockModel, prompt: list[int], **kw: Any) -> Any:
    kw.setdefault("warp", Warp(1.0))
    return generate(target, prompt, max_new_tokens=12, seed=3, debug=True, **kw)


def test_a_second_request_prefills_only_what_the_cache_lacks_and_samples_the_same() -> None:
    target = CountingMock(V, seed=0)
    draft = MockModel.near(target, seed=1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (40,), generator=g).tolist()
    first = _run(target, prompt, draft=draft, spec=SpecConfig(k=3), reuse_prefix=True)
    assert first.stats.cached_prompt_tokens == 0 and target.prefilled == len(prompt) - 1
    # a chat's next turn: the previous prompt and answer, then more
    follow = [*prompt, *first.tokens, 5, 6, 7]
    target.prefilled = 0
    again = _run(target, follow, draft=draft, spec=SpecConfig(k=3), reuse_prefix=True)
    kept = len(prompt) + len(first.tokens) - 1  # the cache held seq[:-1]
    assert again.stats.cached_prompt_tokens == kept
    assert target.prefilled == len(follow) - 1 - kept
    fresh = _run(CountingMock(V, seed=0), follow, draft=draft, spec=SpecConfig(k=3))
    assert again.tokens == fresh.tokens and fresh.stats.cached_prompt_tokens == 0


def test_a_different_prompt_keeps_only_the_shared_prefix_and_reuse_is_off_by_default() -> None:
    target = CountingMock(V, seed=0)
    _run(target, [1, 2, 3, 4, 5, 6], reuse_prefix=True)
    target.prefilled = 0
    r = _run(target, [1, 2, 3, 9, 9, 9, 9], reuse_prefix=True)
    assert r.stats.cached_prompt_tokens == 3 and target.prefilled == 3  # 9 9 9 (the last 9 is fed)
    assert r.tokens == _run(MockModel(V, seed=0), [1, 2, 3, 9, 9, 9, 9]).tokens
    target.prefilled = 0
    r = _run(target, [1, 2, 3, 9, 9, 9, 9])
    assert r.stats.cached_prompt_tokens == 0 and target.prefilled == 6


def test_reuse_in_blocks_rounds_the_kept_prefix_down() -> None:
    target = CountingMock(V, seed=0)
    _run(target, list(range(20)), reuse_prefix=8)
    target.prefilled = 0
    r = _run(target, [*range(19), 40, 41], reuse_prefix=8)  # 19 shared: 16 kept
    assert r.stats.cached_prompt_tokens == 16 and target.prefilled == 20 - 16


def test_the_server_reuses_and_reports_whole_blocks_and_answers_as_a_fresh_prefill() -> None:
    """The prompt cache keeps whole PROMPT_CACHE_BLOCK-token blocks only: a client that guesses
    part of another's prompt learns at most whether a whole block matched (issue 21)."""
    srv = serve_models(SlowMock(V, seed=0, name=MOCK_SPEC))
    try:
        prompt = [i * 7 % V for i in range(300)]
        body = {"model": MOCK_SPEC, "prompt": prompt, "max_tokens": 6}
        body.update(temperature=0, return_token_ids=True)
        status, _, first = srv.request("POST", "/v1/completions", body)
        assert status == 200
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        follow = [*prompt, *first["choices"][0]["token_ids"], 40, 41]  # 306 tokens shared
        status, _, second = srv.request("POST", "/v1/completions", {**body, "prompt": follow})
        assert status == 200
        blocks = 306 // PROMPT_CACHE_BLOCK * PROMPT_CACHE_BLOCK
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks
        fresh = generate(MockModel(V, seed=0), follow, max_new_tokens=6, warp=Warp(0.0))
        assert second["choices"][0]["token_ids"] == fresh.tokens
        # a guess sharing a block and 5 tokens with the last request: told one block
        guess = {**body, "prompt": [*follow[: PROMPT_CACHE_BLOCK + 5], 1, 2, 3]}
        status, _, third = srv.request("POST", "/v1/completions", guess)
        assert status == 200
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_CACHE_BLOCK
        total = metric(srv.metrics(), "specdec_cached_prompt_tokens_total")
        assert total == blocks + PROMPT_CACHE_BLOCK
    finally:
        srv.close()


def _files(n: int, tokens: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (tokens,), generator=g).tolist() for _ in range(n)]


def test_two_keys_and_two_files_in_turn_on_one_slot_stay_cached_from_ram() -> None:
    """Issue 62's check: two keys × two files of ~600 tokens sent in turn to one slot
    (--parallel 1), each twice: every repeat comes back from the RAM store (≥ 90% cached, whole
    blocks) with the tokens of a server without a prompt cache; without the store the slot's
    one prompt is overwritten each time and nothing is cached. A key never gets another's."""
    keys = ("key-a", "key-b")
    files = _files(2, 600, seed=4)
    draft = MockModel.near(SlowMock(V, seed=0), seed=2)

    def run(**cfg: Any) -> list[dict]:
        srv = serve_models(SlowMock(V, seed=0, name=MOCK_SPEC), draft, api_keys=keys, **cfg)
        out = []
        try:
            for _ in range(2):
                for key in keys:
                    for f in files:
                        body = {"model": MOCK_SPEC, "prompt": f, "max_tokens": 8, "seed": 5}
                        auth = {"Authorization": f"Bearer {key}"}
                        status, _, r = srv.request("POST", "/v1/completions", body, auth)
                        assert status == 200, r
                        out.append(r)
            text = srv.engine.metrics.render(srv.engine.cycle.store_gauges())  # no operator key
            restored = metric(text, "specdec_prompt_store_restored_total")
            held = metric(text, "specdec_prompt_store_entries")
        finally:
            srv.close()
        return out, restored, held

    stored, restored, held = run()
    plain, none_restored, _ = run(cache_ram=0)
    off, _, _ = run(prompt_cache=False)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in stored]
    assert cached[:4] == [0] * 4  # each key's first sight of a file: nothing of its own
    assert all(c >= 0.9 * 600 and c % PROMPT_CACHE_BLOCK == 0 for c in cached[4:]), cached
    assert restored == 4 and held == 4 and none_restored == 0
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in plain)
    texts = [[r["choices"][0]["text"] for r in rs] for rs in (stored, plain, off)]
    assert texts[0] == texts[1] == texts[2]


def test_the_store_keeps_what_fits_newest_first_and_drops_what_a_longer_entry_covers() -> None:
    target = MockModel(V, seed=0)
    store = PromptStore(max_bytes=8 * 100)

    def entry(scope: str, tokens: list[int]) -> Entry:
        target.reset()
        target.prefill(tokens)
        saved = target.save()
        assert saved is not None
        return Entry(scope, saved, None)

    assert store.put(entry("a", list(range(30))))
    assert store.put(entry("a", list(range(40))))  # covers the first
    assert len(store) == 1 and store.nbytes == 8 * 40
    assert store.put(entry("b", list(range(40))))  # another scope: kept beside it
    assert store.best("b", [0, 1, 2, 9])[1] == 3
    assert store.put(entry("a", [7] * 50))  # 130 tokens would not fit: the oldest goes ("a")
    assert len(store) == 2 and store.best("a", list(range(40))) == (None, 0)
    assert not store.put(entry("a", [1] * 101))  # alone larger than the store
    assert store.holds("b", list(range(12))) and not store.holds("a", list(range(12)))
