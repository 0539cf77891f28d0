"""The cross-request draft pool in `specdec serve` (issue 22, item 3), over loopback HTTP on mock
models: serve.draft_pools, serve.keys and the engine's wiring.

repeat        a request that repeats an earlier one drafts its answer from the pool (sources
              pool*), accepts more in fewer rounds, and its greedy output is the target's;
              past the end of its prediction, drafter prediction drafts from the pool too
scope         per API key by default: key B never drafts from key A's pool (the pool counters
              and the request's own sources say so); --draft-pool shared shares, off is off;
              a server without keys has one anonymous scope (a Bearer token there chooses
              nothing); a request cut off still feeds its pool
soak          500 requests from 3 keys through 2 pools of 256 tokens: memory fixed at the cap,
              tokens within capacity, text and whole pools evicted
distribution  lookup over a pool of earlier samples vs the target alone at T = 1: one
              distribution (tests/serve/test_speculation.py's harness)
flags         bad --draft-pool* values and key files fail at start-up, naming the fix
"""

from __future__ import annotations

import http.client
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serverkit import MOCK_SPEC, Server, SlowMock, V, bearer, metric, stream_events
from stats_util import two_sample_chi2

from specdec.cli import main as cli
from specdec.cli.serve import resolve_api_keys
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.core.pool import DraftPool
from specdec.serve.config import ServeConfig
from specdec.serve.cycle import PROMPT_CACHE_BLOCK
from specdec.serve.draft_pools import (
    DEFAULT_POOL_TOKENS,
    MIN_POOL_TOKENS,
    PoolConfig,
    pool_memory_bytes,
)
from specdec.serve.engine import Engine
from specdec.serve.errors import ApiError
from specdec.serve.keys import ANONYMOUS, KeyRing
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation
from specdec.study.run.significance import paired_permutation_p

#: A mock whose greedy answer to PROMPT does not repeat itself within ANSWER tokens, so prompt
#: lookup inside the request finds nothing to draft: what it drafts comes from the pool.
BIG_V = 512
BIG_SPEC = "mock:vocab=512,seed=1,scale=1"
PROMPT = [5, 17, 29, 3, 41, 8, 22, 36, 11, 2]
ANSWER = 64
LOOKUP = {"drafter": "lookup", "k": 8}
KEY_A, KEY_B, KEY_C = "key-of-tenant-a", "key-of-tenant-b", "key-of-tenant-c"
OPERATOR = "key-of-the-operator"  # /metrics on a server with keys (serve.app._check_operator)


class CharTokenizer:
    """One character per id of the big mock's vocabulary (what the server needs of a
    tokenizer to read a text prediction and write text)."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None
    base = 0x100  # ids 0..511 -> U+0100..U+02FF: printable, one code point each

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - self.base for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(self.base + i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(self.base + i): i for i in range(BIG_V)}


def _server(
    *,
    mode: str = "key",
    keys: tuple[str, ...] = (),
    tokens: int = 4096,
    scopes: int = 16,
    big: bool = True,
    delay: float = 0.0,
    tokenizer: Any = None,
) -> Server:
    """A target-only server (no draft model) whose draft pools are set as `specdec serve`'s
    flags would set them."""
    spec = BIG_SPEC if big else MOCK_SPEC
    target = SlowMock(BIG_V, seed=1, scale=1.0, name=spec) if big else SlowMock(V, name=spec)
    target.delay = delay
    target.tokenizer = tokenizer
    cfg = ServeConfig(
        target=spec,
        api_keys=keys,
        draft_pool=mode,
        draft_pool_tokens=tokens,
        draft_pool_scopes=scopes,
        metrics_key=OPERATOR if keys else None,
    )
    engine = Engine(target, None, cfg)
    engine.warm_up()
    return Server(engine, cfg)


def _complete(
    srv: Server,
    key: str | None = None,
    prompt: list[int] = PROMPT,
    speculation: dict | None = LOOKUP,
    **body: Any,
) -> dict[str, Any]:
    req = {
        "model": srv.engine.models.model_id,
        "prompt": prompt,
        "max_tokens": ANSWER,
        "temperature": 0,
        "return_token_ids": True,
        **({"speculation": speculation} if speculation is not None else {}),
        **body,
    }
    status, _, reply = srv.request("POST", "/v1/completions", req, bearer(key))
    assert status == 200, reply
    return reply


def _tokens(reply: dict[str, Any]) -> list[int]:
    return reply["choices"][0]["token_ids"]


def _pooled(reply: dict[str, Any]) -> tuple[int, int]:
    """(drafted, accepted) from the pool's draft sources in usage.speculation.by_source."""
    by = reply["usage"]["speculation"]["by_source"]
    pool = [v for s, v in by.items() if s.startswith("pool")]
    return sum(v["drafted"] for v in pool), sum(v["accepted"] for v in pool)


def _metrics(srv: Server, key: str | None = None) -> str:
    """/metrics, read with the operator's key where `key` says the server has keys."""
    status, _, text = srv.request("GET", "/metrics", headers=bearer(key and OPERATOR))
    assert status == 200, text
    return text


def _pool(text: str, name: str) -> float:
    return metric(text, f"specdec_draft_pool_{name}")


def _target_only(srv: Server, prompt: list[int], n: int) -> list[int]:
    e = srv.engine.models
    with srv.engine.lock:
        return generate(
            e.target, prompt, max_new_tokens=n, warp=Warp(0.0), stop_ids=e.stop_ids
        ).tokens


@pytest.fixture
def srv_ab() -> Server:
    s = _server(keys=(KEY_A, KEY_B))
    yield s
    s.close()


# ---------------------------------------------------------------------------- the repeat
@pytest.mark.parametrize("k", [8, "auto"])
def test_a_repeated_request_drafts_from_the_pool_and_accepts_more(k: int | str) -> None:
    """The second request can draft the first's answer from the pool; its greedy tokens are the
    target's alone, and /metrics counts exactly what its usage.speculation says the pool
    drafted. At a fixed K it does draft it: pool* sources, more tokens accepted in fewer rounds,
    and the stream's token origins name the pool. (k=auto decides from measured costs whether
    drafting pays, so what it drafts is the benchmark's question, not this test's.)"""
    srv = _server()
    try:
        spec = {"drafter": "lookup", "k": k}
        first = _complete(srv, speculation=spec)
        m1 = _metrics(srv)
        second = _complete(srv, speculation=spec)
        m2 = _metrics(srv)
        want = _target_only(srv, PROMPT, ANSWER)
        assert _tokens(first) == _tokens(second) == want
        assert _pooled(first) == (0, 0)  # the pool was empty: nothing of its own repeats either
        drafted, accepted = _pooled(second)
        assert _pool(m2, "drafted_tokens_total") - _pool(m1, "drafted_tokens_total") == drafted
        assert _pool(m2, "accepted_tokens_total") - _pool(m1, "accepted_tokens_total") == accepted
        assert _pool(m1, "hits_total") == 0 and _pool(m2, "hits_total") > 0  # it was found
        assert _pool(m2, "documents_total") == 2
        assert _pool(m2, "tokens") == 2 * (len(PROMPT) + ANSWER)
        if k == "auto":
            return
        assert accepted >= ANSWER // 2, second["usage"]["speculation"]
        s1, s2 = first["usage"]["speculation"], second["usage"]["speculation"]
        assert s2["accepted"] > s1["accepted"] and s2["rounds"] < s1["rounds"]
        sources = {r["source"] for r in _origins(srv, PROMPT) if r["k"]}  # a third, streamed
        assert sources and all(s.startswith("pool") for s in sources), sources
    finally:
        srv.close()


def _origins(srv: Server, prompt: list[int], key: str | None = None) -> list[dict[str, Any]]:
    """A streamed request's per-round speculation records (stream_options.include_speculation)."""
    body = {
        "model": srv.engine.models.model_id,
        "prompt": prompt,
        "max_tokens": ANSWER,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_speculation": True},
        "speculation": LOOKUP,
    }
    events = stream_events(srv, "/v1/completions", body)
    return [e["choices"][0]["speculation"] for e in events if "speculation" in e["choices"][0]]


# ---------------------------------------------------------------------------- scope
def test_key_b_never_drafts_from_key_a_pool(srv_ab: Server) -> None:
    """Per key (the default): B's first request finds nothing, although A's pool holds its
    answer (the shared test below shows the same request drafting from it there); each key then
    drafts from its own pool. An unknown key gets 401 and creates no pool."""
    a1 = _complete(srv_ab, KEY_A)
    before = _metrics(srv_ab, KEY_A)
    b1 = _complete(srv_ab, KEY_B)
    after = _metrics(srv_ab, KEY_A)
    assert _tokens(b1) == _tokens(a1)
    assert _pooled(b1) == (0, 0), b1["usage"]["speculation"]["by_source"]
    for name in ("hits_total", "drafted_tokens_total", "accepted_tokens_total"):
        assert _pool(after, name) == _pool(before, name), name  # B's searches found nothing
    assert _pool(after, "lookups_total") > _pool(before, "lookups_total")  # it did search
    assert _pool(after, "scopes") == 2
    assert _pooled(_complete(srv_ab, KEY_A))[1] > 0  # A's own pool
    assert _pooled(_complete(srv_ab, KEY_B))[1] > 0  # B's own pool, from B's first request
    status, _, err = srv_ab.request(
        "POST", "/v1/completions", {"model": BIG_SPEC, "prompt": PROMPT}, bearer(KEY_C)
    )
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert _pool(_metrics(srv_ab, KEY_B), "scopes") == 2
    card = srv_ab.request("GET", "/v1/models", headers=bearer(KEY_A))[2]
    assert card["data"][0]["speculation"]["draft_pool"] == {"scope": "key", "tokens": 4096}


def test_the_prompt_cache_is_kept_for_the_same_scope_only(srv_ab: Server) -> None:
    """The KV the previous request left is reused (usage.prompt_tokens_details.cached_tokens)
    by a request of its own key only: another key's would learn how much of its prompt the
    last request shared."""
    prompt = [random.Random(5).randrange(BIG_V) for _ in range(600)]

    def cached(key: str) -> int:
        r = _complete(srv_ab, key, prompt, max_tokens=4)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert srv_ab.engine.cycle.prompt_cache  # the mock is batch-invariant: on by default
    kept = 599 // PROMPT_CACHE_BLOCK * PROMPT_CACHE_BLOCK  # the cache holds seq[:-1]
    assert [cached(KEY_A), cached(KEY_A), cached(KEY_B), cached(KEY_B)] == [0, kept, 0, kept]


def test_shared_pool_is_one_pool_for_every_key() -> None:
    srv = _server(mode="shared", keys=(KEY_A, KEY_B))
    try:
        a1 = _complete(srv, KEY_A)
        b1 = _complete(srv, KEY_B)
        assert _tokens(b1) == _tokens(a1)
        assert _pooled(b1)[1] >= ANSWER // 2  # A's answer, drafted for B
        m = _metrics(srv, KEY_B)
        assert _pool(m, "scopes") == 1 and _pool(m, "documents_total") == 2
        # Keys that share a pool trust each other: they share the prompt cache too.
        assert b1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # 9 kept: no block
        long = list(range(300))
        _complete(srv, KEY_A, long, max_tokens=2)
        b2 = _complete(srv, KEY_B, long, max_tokens=2)
        kept = 299 // PROMPT_CACHE_BLOCK * PROMPT_CACHE_BLOCK
        assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == kept
        assert _pool(m, "memory_limit_bytes") == pool_memory_bytes(4096)  # one pool at most
    finally:
        srv.close()


def test_without_keys_every_request_shares_the_anonymous_scope() -> None:
    """On a server without keys a Bearer token authenticates nothing, so it scopes nothing."""
    srv = _server()
    try:
        _complete(srv, "made-up-token-1")
        again = _complete(srv, "made-up-token-2")
        assert _pooled(again)[1] >= ANSWER // 2
        assert _pool(_metrics(srv), "scopes") == 1
    finally:
        srv.close()


def test_off_is_off() -> None:
    srv = _server(mode="off")
    try:
        first = _complete(srv)
        second = _complete(srv)
        assert _tokens(first) == _tokens(second)
        assert _pooled(second) == (0, 0)
        m = _metrics(srv)
        for name in ("scopes", "tokens", "memory_bytes", "memory_limit_bytes", "documents_total"):
            assert _pool(m, name) == 0, name
        lookup = Speculation(SpecConfig("lookup", 8))
        assert srv.engine.models.stream_args(lookup, None)["pool"] is None
        card = srv.request("GET", "/v1/models")[2]["data"][0]["speculation"]["draft_pool"]
        assert card == {"scope": "off", "tokens": 0}
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("drafter", "reads_pool"),
    [
        ("lookup", True),
        ("prediction", True),
        ("composite", True),
        ("model", False),
        ("none", False),
    ],
)
def test_the_drafters_that_run_prompt_lookup_get_the_pool(drafter: str, reads_pool: bool) -> None:
    """generate.stream gets the pool for lookup, composite and prediction (whose fallback is
    lookup); the draft model alone and "none" never run prompt lookup."""
    engine = Engine(SlowMock(V), None, ServeConfig(target=MOCK_SPEC, draft_pool="key"))
    pool = DraftPool(MIN_POOL_TOKENS)
    sp = resolve_speculation({"drafter": drafter}, SpecDefaults(has_draft=True), False)
    got = engine.models.stream_args(sp, [1], pool)
    assert (got["pool"] is pool) == reads_pool


def test_past_its_prediction_a_request_drafts_from_the_pool() -> None:
    """drafter prediction: the prediction first (the answer's first part), then, where the
    prediction has nothing more, prompt lookup, which drafts the rest from the pool."""
    srv = _server(tokenizer=CharTokenizer())
    try:
        answer = _tokens(_complete(srv))
        head = CharTokenizer().decode(answer[:24])
        second = _complete(
            srv,
            speculation={"drafter": "prediction", "k": 8},
            prediction={"type": "content", "content": head},
        )
        assert _tokens(second) == answer
        by = second["usage"]["speculation"]["by_source"]
        from_prediction = sum(v["accepted"] for s, v in by.items() if s.startswith("prediction"))
        assert from_prediction > 0 and _pooled(second)[1] >= 24, by
    finally:
        srv.close()


def test_a_request_cut_off_still_feeds_its_pool() -> None:
    """A streamed request whose client leaves after its first chunk: its prompt and the tokens
    it committed go into the pool all the same."""
    srv = _server(delay=0.01)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {"model": BIG_SPEC, "prompt": PROMPT, "max_tokens": 400, "stream": True}
        body |= {"temperature": 0, "speculation": LOOKUP}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # the first chunk is on its way: generation has started
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 30
        while metric(m := _metrics(srv), "specdec_generations_total", outcome="cancelled") < 1:
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.05)
        srv.wait_idle()
        m = _metrics(srv)
        assert _pool(m, "documents_total") == 1
        assert len(PROMPT) < _pool(m, "tokens") < len(PROMPT) + 400  # prompt + what it committed
    finally:
        srv.close()


# ---------------------------------------------------------------------------- soak
@pytest.mark.slow
def test_a_500_request_soak_stays_under_the_cap() -> None:
    """3 keys, 2 pools of 256 tokens: once both pools exist the pools' memory never moves from
    their fixed size (the cap), the tokens held never pass capacity, old text is evicted, and a
    third key's arrival drops the least recently used pool."""
    cap, scopes = 256, 2
    keys = (KEY_A, KEY_B, KEY_C)
    srv = _server(keys=keys, tokens=cap, scopes=scopes, big=False)
    per_pool = pool_memory_bytes(cap)
    rng = random.Random(7)
    full = set()
    try:
        for i in range(500):
            key = rng.choice(keys)
            prompt = [rng.randrange(V) for _ in range(rng.randrange(10, 60))]
            spec = rng.choice([LOOKUP, {"drafter": "none"}])  # fixed K: a deterministic soak
            _complete(
                srv, key, prompt, spec, max_tokens=rng.randrange(4, 24), temperature=1.0, seed=i
            )
            m = _metrics(srv, key)
            mem, held = _pool(m, "memory_bytes"), _pool(m, "scopes")
            assert mem == held * per_pool <= _pool(m, "memory_limit_bytes") == scopes * per_pool
            assert _pool(m, "tokens") <= held * cap
            if held == scopes:
                full.add(mem)
        assert full == {scopes * per_pool}  # constant, at the cap, from the second key on
        assert _pool(m, "documents_total") == 500
        assert _pool(m, "evicted_tokens_total") > 10 * cap
        assert _pool(m, "drafted_tokens_total") > 0
    finally:
        srv.close()


# ---------------------------------------------------------------------------- distribution
N_SAMPLED = 400
N_TOKENS = 20
P_MIN = 0.01


def _sampled(srv: Server, speculation: dict, seeds: range) -> list[list[int]]:
    out = []
    for seed in seeds:
        r = _complete(
            srv, None, [1, 2, 3], speculation, max_tokens=N_TOKENS, temperature=1.0, seed=seed
        )
        out.append(_tokens(r))
    return out


@pytest.mark.stats
def test_drafting_from_the_pool_samples_the_target_distribution() -> None:
    """tests/serve/test_speculation.py's harness: the target alone (drafter none; its samples
    fill the pool) and prompt lookup over that pool at K = 4 (each request drafting the latest
    earlier sample that matches, right or wrong), disjoint seeds: paired permutation p of the
    two-sample chi-square over tokens and bigrams > 0.01; and the pool really drafted."""
    srv = _server(big=False, tokens=DEFAULT_POOL_TOKENS)
    try:
        off = _sampled(srv, {"drafter": "none"}, range(50_000, 50_000 + N_SAMPLED))
        on = _sampled(srv, {"drafter": "lookup", "k": 4}, range(N_SAMPLED))
        m = _metrics(srv)
        assert _pool(m, "drafted_tokens_total") > N_SAMPLED  # the pool drafted for most
        assert 0 < _pool(m, "accepted_tokens_total") < _pool(m, "drafted_tokens_total")
    finally:
        srv.close()

    def bigrams(seqs: list[list[int]]) -> list[list[int]]:
        return [[a * V + b for a, b in zip([3, *s[:-1]], s, strict=True)] for s in seqs]

    for name, a, b, width in (
        ("tokens", on, off, V),
        ("bigrams", bigrams(on), bigrams(off), V * V),
    ):
        counts = [np.bincount([t for s in seqs for t in s], minlength=width) for seqs in (a, b)]
        chi2, dof, _ = two_sample_chi2(*counts)
        p = paired_permutation_p(a, b, n_perm=1000)
        assert p > P_MIN, f"{name}: chi2={chi2:.1f} dof={dof} p_perm={p:.4f}"


# ---------------------------------------------------------------------------- keys
def test_tenant_ids_are_stable_distinct_and_not_the_key() -> None:
    ring = KeyRing([KEY_A, KEY_B, KEY_A])
    a, b = ring.tenant(f"Bearer {KEY_A}"), ring.tenant(f"bearer  {KEY_B} ")
    assert len(ring) == 2 and a == ring.tenant(f"Bearer {KEY_A}") and a != b
    assert KEY_A not in a and a != ANONYMOUS and len(a) == 32
    assert KeyRing([KEY_A]).tenant(f"Bearer {KEY_A}") != a  # a secret of each ring's own
    for header in ("", f"Basic {KEY_A}", "Bearer nope", KEY_A, f"Bearer {KEY_A}x"):
        with pytest.raises(ApiError) as e:
            ring.tenant(header)
        assert e.value.status == 401
    assert KeyRing([]).tenant("Bearer anything") == ANONYMOUS
    assert KEY_A not in repr(vars(ring))  # only digests are kept


def test_the_app_keeps_no_raw_key(srv_ab: Server) -> None:
    ctx = srv_ab.uv.config.app.state.specdec
    assert ctx.cfg.api_key is None and ctx.cfg.api_keys == ()


def test_api_keys_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# tenants\n{KEY_A}\n\n  {KEY_B}  \n{KEY_A}\n")
    assert resolve_api_keys(None, None, str(f), {}) == (KEY_A, KEY_B)
    (tmp_path / "none").write_text("# nobody yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        resolve_api_keys(None, None, str(tmp_path / "none"), {})
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_keys(None, None, str(tmp_path / "missing"), {})
    assert resolve_api_keys(None, str(f), None, {}) == ("# tenants",)  # --api-key-file: line 1
    assert "--api-keys-file" in capsys.readouterr().err  # ...and it says so
    assert resolve_api_keys("k", None, None, {}) == ("k",)
    assert resolve_api_keys(None, None, None, {}) == ()


# ---------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--draft-pool", "sometimes"], "invalid choice: 'sometimes'"),
        (["--draft-pool-tokens", "0"], "--draft-pool-tokens must be an integer in [32, "),
        (["--draft-pool-tokens", "1e9"], "invalid int value: '1e9'"),
        (["--draft-pool-tokens", str(1 << 40)], "--draft-pool-tokens must be an integer in"),
        (["--draft-pool-scopes", "0"], "--draft-pool-scopes must be an integer in [1, "),
        (["--api-keys-file", "/nonexistent/keys"], "--api-keys-file /nonexistent/keys: cannot"),
    ],
)
def test_bad_pool_flags_fail_at_start_up(
    flags: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    """Before any model loads (the target does not exist: its error would come later)."""
    code = cli.main(["serve", "--target", "llamacpp:/nonexistent/model.gguf", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "nonexistent/model" not in err


def test_pool_config_names_the_values() -> None:
    with pytest.raises(ValueError, match="--draft-pool must be one of key, shared, off"):
        ServeConfig(target=MOCK_SPEC, draft_pool="Key")
    with pytest.raises(ValueError, match="--draft-pool-tokens"):
        PoolConfig(tokens=True)
    assert ServeConfig(target=MOCK_SPEC).pool_config() == PoolConfig("key", DEFAULT_POOL_TOKENS, 1)
    many = ServeConfig(target=MOCK_SPEC, api_keys=tuple(f"k{i}" for i in range(40)))
    assert many.pool_config().scopes == 16  # --draft-pool-scopes bounds it


def test_help_states_the_memory(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    mib = pool_memory_bytes(DEFAULT_POOL_TOKENS) / (1 << 20)
    assert f"default {DEFAULT_POOL_TOKENS}" in out and f"{mib:g} MiB at the default" in out


@pytest.mark.parametrize("tokens", [MIN_POOL_TOKENS, 1000, 4096, 300_000])
def test_pool_memory_bytes_is_what_a_pool_allocates(tokens: int) -> None:
    assert pool_memory_bytes(tokens) == DraftPool(tokens).memory_bytes
