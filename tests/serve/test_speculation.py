"""Speculation seen and steered through the API (issue 24), over loopback HTTP on mock models.

speculation            a request's {"drafter", "k", "k_max"} over the server's start-up flags:
                       every bad value is a 400 naming the field and the fix; the setting
                       takes effect (its rounds say so); "none" is the target alone, token for
                       token and in distribution
usage.speculation      equal to the generation's own GenerationStats, read through the real
                       `openai` client (extra_body in, model_extra out)
include_speculation    each chunk's token origins add up to the completion's tokens and match
                       the Round records the loop made; off by default, where the stream is
                       byte for byte what it was before the extension
defaults               k=auto; `--drafter prediction` starts and drafts from a request's
                       prediction, else prompt lookup
"""

from __future__ import annotations

import difflib
import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from serverkit import MOCK_SPEC, Server, SlowMock, V, metric, stream_events
from stats_util import two_sample_chi2
from stream_golden import TemplateTokenizer, capture, golden_server

from specdec.backends import chat as prompting
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.core.metrics import GenerationStats, Round
from specdec.serve.config import ServeConfig
from specdec.serve.connections import GRACEFUL_SHUTDOWN_S
from specdec.serve.engine import Engine
from specdec.serve.speculation import MAX_REQUEST_K
from specdec.study.run.significance import paired_permutation_p

GOLDEN = Path(__file__).parents[1] / "fixtures" / "default_stream.golden"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REPEATS = "abcabcabcabc, abcabcabcabc"  # prompt lookup finds matches in it


def _server(with_draft: bool, **cfg_kw: Any) -> Server:
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = TemplateTokenizer()
    draft = None
    if with_draft:
        draft = SlowMock.near(target, noise=0.7, seed=1)
        draft.tokenizer = target.tokenizer
    cfg = ServeConfig(target=MOCK_SPEC, draft_pool="off", **cfg_kw)
    engine = Engine(target, draft, cfg)
    engine.warm_up()
    return Server(engine, cfg)


@pytest.fixture(scope="module")
def srv() -> Server:
    """A target and a draft model; by default the draft model at a fixed K = 4."""
    s = _server(True, k=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def free_srv() -> Server:
    """No draft model; by default no drafter (a prediction is drafted from, else nothing)."""
    s = _server(False, k="auto")
    yield s
    s.close()


def _messages(text: str = REPEATS) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _post(srv: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, parsed = srv.request("POST", path, {"model": MOCK_SPEC, **body})
    return status, parsed


def _events(srv: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's events, parsed, up to [DONE]."""
    return stream_events(srv, path, {"model": MOCK_SPEC, **body})


def _expected(srv: Server, prompt: list[int], spec: SpecConfig, draft: bool, **kw: Any) -> Any:
    """generate() on the server's own models with these settings (the engine's lock held)."""
    e = srv.engine.models
    with srv.engine.lock:
        return generate(
            e.target,
            prompt,
            draft=e.draft if draft else None,
            spec=spec,
            stop_ids=e.stop_ids,
            **kw,
        )


# ---------------------------------------------------------------------------- the default stream
def test_default_stream_is_byte_for_byte_what_it_was_before_the_extension() -> None:
    """tests/fixtures/default_stream.golden was recorded from the server before this issue
    (tests/stream_golden.py says how); ids, timestamps and the two timings are masked."""
    server = golden_server()
    try:
        got, want = capture(server), GOLDEN.read_bytes()
    finally:
        server.close()
    if got != want:
        diff = difflib.unified_diff(
            want.decode().splitlines(), got.decode().splitlines(), "golden", "now", lineterm=""
        )
        pytest.fail(
            "the default stream changed:\n"
            + "\n".join(list(diff)[:40])
            + "\nIf only the mock's tokens changed (a core change to sampling, drafting or K "
            "policy), not the stream's shape, re-record: PYTHONPATH=src python "
            "tests/stream_golden.py > tests/fixtures/default_stream.golden"
        )


# ---------------------------------------------------------------------------- bad values -> 400
BAD_SPECULATION = [
    ("not-an-object", {"speculation": "lookup"}, "speculation", "must be an object"),
    ("a-list", {"speculation": ["lookup"]}, "speculation", "must be an object"),
    ("unknown-field", {"speculation": {"K": 4}}, "speculation", "fields are drafter, k, k_max"),
    (
        "unknown-drafter",
        {"speculation": {"drafter": "eagle"}},
        "speculation.drafter",
        "one of none, lookup, prediction, model, composite",
    ),
    ("drafter-number", {"speculation": {"drafter": 1}}, "speculation.drafter", "one of none"),
    ("k-zero", {"speculation": {"k": 0}}, "speculation.k", f"integer in [1, {MAX_REQUEST_K}]"),
    ("k-huge", {"speculation": {"k": 10**6}}, "speculation.k", "'auto', 'schedule' or"),
    ("k-word", {"speculation": {"k": "fast"}}, "speculation.k", "'auto', 'schedule' or"),
    ("k-bool", {"speculation": {"k": True}}, "speculation.k", "got True"),
    ("k-float", {"speculation": {"k": 2.5}}, "speculation.k", "got 2.5"),
    ("k-max-zero", {"speculation": {"k_max": 0}}, "speculation.k_max", "integer in [1, 128]"),
    ("k-max-auto", {"speculation": {"k_max": "auto"}}, "speculation.k_max", "an integer in"),
    (
        "k-max-with-fixed-k",
        {"speculation": {"k": 3, "k_max": 8}},
        "speculation.k_max",
        "leave k_max out, or send k 'auto'",
    ),
    (
        "k-with-none",
        {"speculation": {"drafter": "none", "k": 3}},
        "speculation.k",
        "no effect with drafter 'none'",
    ),
    (
        "include-speculation-not-streamed",
        {"stream_options": {"include_speculation": True}},
        "stream_options",
        "needs stream: true",
    ),
    (
        "include-speculation-not-bool",
        {"stream": True, "stream_options": {"include_speculation": "yes"}},
        "stream_options",
        "valid boolean",
    ),
]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [b[1:] for b in BAD_SPECULATION],
    ids=[b[0] for b in BAD_SPECULATION],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_speculation_is_a_400_that_names_the_fix(
    srv: Server, path: str, fields: dict, param: str, says: str
) -> None:
    body = {"messages": _messages()} if path == CHAT else {"prompt": [1, 2, 3]}
    status, resp = _post(srv, path, {**body, "max_tokens": 4, **fields})
    assert status == 400, resp
    err = resp["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert says in err["message"], err["message"]
    status, resp = _post(srv, path, {**body, "max_tokens": 4, "temperature": 0})
    assert status == 200, resp  # and the server keeps serving


@pytest.mark.parametrize("drafter", ["model", "composite"])
def test_model_drafters_need_a_server_with_a_draft_model(free_srv: Server, drafter: str) -> None:
    status, resp = _post(
        free_srv, CHAT, {"messages": _messages(), "speculation": {"drafter": drafter}}
    )
    assert status == 400 and resp["error"]["param"] == "speculation.drafter", resp
    msg = resp["error"]["message"]
    assert "needs a draft model" in msg and "--draft" in msg and "none, lookup or prediction" in msg
    drafters = free_srv.client().models.list().data[0].model_extra["speculation"]["drafters"]
    assert drafters == ["none", "lookup", "prediction"]


def test_k_with_the_servers_default_none_says_so(free_srv: Server) -> None:
    status, resp = _post(free_srv, CHAT, {"messages": _messages(), "speculation": {"k": 3}})
    assert status == 400 and "(this server's default)" in resp["error"]["message"], resp


# ---------------------------------------------------------------------------- the openai client
def _check_usage_equals_stats(spec: dict[str, Any], st: GenerationStats) -> None:
    assert spec["rounds"] == st.rounds and spec["drafting_rounds"] == st.drafting_rounds
    assert spec["drafted"] == st.drafted and spec["accepted"] == st.accepted
    assert spec["acceptance_rate"] == pytest.approx(st.acceptance_rate)
    assert spec["mean_acceptance_length"] == pytest.approx(st.mean_acceptance_length)
    assert spec["tokens_per_round"] == pytest.approx(st.tokens_per_round)
    assert spec["k_histogram"] == {str(k): n for k, n in st.k_histogram.items()}
    assert spec["by_source"] == {
        s: {"drafted": n, "accepted": st.accepted_by_source[s]}
        for s, n in st.drafted_by_source.items()
    }
    assert spec["drafted_per_position"] == st.drafted_per_pos
    assert spec["accepted_per_position"] == st.accepted_per_pos


@pytest.mark.parametrize(
    ("speculation", "draft"),
    [
        ({"drafter": "lookup", "k": 3}, False),
        ({"drafter": "model", "k": 2}, True),
        ({"drafter": "composite", "k": "schedule", "k_max": 5}, True),
    ],
)
def test_openai_client_sets_speculation_and_reads_its_metrics(
    srv: Server, speculation: dict, draft: bool
) -> None:
    """The server's default is the draft model at K = 4; each request asks for something else,
    gets it, and reads back usage.speculation equal to generate()'s stats for those settings."""
    client = srv.client()
    r = client.chat.completions.create(
        model=MOCK_SPEC,
        messages=_messages(),
        max_tokens=24,
        temperature=0,
        seed=5,
        extra_body={"speculation": speculation, "return_token_ids": True},
    )
    spec = r.usage.model_extra["speculation"]
    assert spec["drafter"] == speculation["drafter"] and spec["k"] == speculation["k"]
    assert spec["k_max"] == speculation.get("k_max")
    prompt = prompting.encode_messages(srv.engine.models.tokenizer, _messages())
    kind = "lookup" if speculation["drafter"] == "lookup" else speculation["drafter"]
    cfg = SpecConfig(kind, speculation["k"], speculation.get("k_max"))
    want = _expected(srv, prompt, cfg, draft, warp=Warp(0.0), max_new_tokens=24, seed=5)
    assert r.choices[0].model_extra["token_ids"] == want.tokens
    _check_usage_equals_stats(spec, want.stats)
    assert r.usage.completion_tokens == want.stats.generated
    assert spec["drafted"] > 0  # the setting took effect: these rounds drafted
    top = speculation["k"] if isinstance(speculation["k"], int) else speculation["k_max"]
    assert max(map(int, spec["k_histogram"])) <= top
    sources = set(spec["by_source"])
    if speculation["drafter"] == "lookup":
        assert sources and all(s.startswith("lookup") for s in sources)
    if speculation["drafter"] == "model":
        assert sources == {"model"}


def test_speculation_none_is_the_target_alone_token_for_token(srv: Server) -> None:
    """drafter "none", greedy and sampled: generate()'s target-only tokens for the same seed
    (target-only sampling consumes the seed the same way), on a server whose default drafts."""
    prompt = [1, 2, 3, 4, 1, 2]
    client = srv.client()
    for temperature, seed in ((0.0, 0), (1.0, 1), (0.8, 2), (1.0, 3)):
        r = client.completions.create(
            model=MOCK_SPEC,
            prompt=prompt,
            max_tokens=20,
            temperature=temperature,
            seed=seed,
            extra_body={"speculation": {"drafter": "none"}, "return_token_ids": True},
        )
        want = _expected(
            srv, prompt, SpecConfig(), False, warp=Warp(temperature), max_new_tokens=20, seed=seed
        )
        assert r.choices[0].model_extra["token_ids"] == want.tokens
        spec = r.usage.model_extra["speculation"]
        assert spec["drafter"] == "none" and spec["drafted"] == 0
        assert spec["k_histogram"] == {"0": 20}


N_SAMPLED = 400
N_TOKENS = 20
P_MIN = 0.01


def _sampled(srv: Server, speculation: dict, seeds: range) -> list[list[int]]:
    out = []
    for seed in seeds:
        status, r = _post(
            srv,
            COMPLETIONS,
            {
                "prompt": [1, 2, 3],
                "max_tokens": N_TOKENS,
                "temperature": 1.0,
                "seed": seed,
                "speculation": speculation,
                "return_token_ids": True,
            },
        )
        assert status == 200, r
        out.append(r["choices"][0]["token_ids"])
    return out


@pytest.mark.stats
def test_speculation_on_and_off_per_request_sample_one_distribution(srv: Server) -> None:
    """The statistical harness of tests/core/test_decode.py over HTTP: requests with speculation off
    and requests with the draft model at K = 4 (disjoint seeds, so the samples are independent):
    paired permutation p of the two-sample chi-square over tokens and bigrams > 0.01."""
    off = _sampled(srv, {"drafter": "none"}, range(50_000, 50_000 + N_SAMPLED))
    on = _sampled(srv, {"drafter": "model", "k": 4}, range(N_SAMPLED))
    assert sum(map(len, on)) == sum(map(len, off)) == N_SAMPLED * N_TOKENS

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


# ---------------------------------------------------------------------------- token origins
@pytest.fixture
def recorded_rounds(monkeypatch: pytest.MonkeyPatch) -> list[Round]:
    """Every Round the loop records while the test runs (the server runs in this process)."""
    rounds: list[Round] = []
    record = GenerationStats.record

    def spy(self: GenerationStats, r: Round) -> None:
        rounds.append(r)
        record(self, r)

    monkeypatch.setattr(GenerationStats, "record", spy)
    return rounds


def _check_origins(events: list[dict], rounds: list[Round]) -> tuple[list[int], str]:
    """Origins against the loop's rounds; returns the streamed token ids and text."""
    records = [
        e["choices"][0]["speculation"]
        for e in events
        if e["choices"] and "speculation" in e["choices"][0]
    ]
    usage = events[-1]["usage"]
    assert len(records) == len(rounds) == usage["speculation"]["rounds"]
    ids: list[int] = []
    for i, (rec, r) in enumerate(zip(records, rounds, strict=True)):
        assert rec["round"] == i + 1 and rec["k"] == r.k and rec["accepted"] == r.n_accepted
        assert rec["source"] == (r.source if r.k else None)
        origins = [t["origin"] for t in rec["tokens"]]
        assert len(origins) == r.n_emitted
        last = "target" if r.k == 0 else "bonus" if r.n_accepted == r.k else "corrected"
        assert origins == (["accepted"] * r.n_accepted + [last])[: r.n_emitted]
        ids += [t["id"] for t in rec["tokens"]]
    assert len(ids) == usage["completion_tokens"]  # origins add up to the completion
    spec = usage["speculation"]
    accepted = sum(t["origin"] == "accepted" for rec in records for t in rec["tokens"])
    assert accepted <= spec["accepted"]  # equal unless the budget cut a round's accepted drafts
    hist: dict[str, int] = {}
    for rec in records:
        hist[str(rec["k"])] = hist.get(str(rec["k"]), 0) + 1
    assert hist == spec["k_histogram"]
    text = "".join(t["text"] for rec in records for t in rec["tokens"])
    return ids, text


@pytest.mark.parametrize(
    ("path", "speculation", "temperature"),
    [
        (CHAT, {"drafter": "model", "k": 4}, 0.0),
        (CHAT, {"drafter": "lookup", "k": "auto"}, 1.0),
        (COMPLETIONS, {"drafter": "composite", "k": 3}, 0.7),
        (COMPLETIONS, {"drafter": "none"}, 1.0),
    ],
)
def test_stream_origins_add_up_and_match_the_rounds(
    srv: Server, recorded_rounds: list[Round], path: str, speculation: dict, temperature: float
) -> None:
    body = {"messages": _messages()} if path == CHAT else {"prompt": [1, 2, 3, 1, 2, 3, 1, 2]}
    events = _events(
        srv,
        path,
        {
            **body,
            "max_tokens": 30,
            "temperature": temperature,
            "seed": 9,
            "speculation": speculation,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "include_speculation": True},
        },
    )
    ids, text = _check_origins(events, recorded_rounds)
    streamed = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])]
    assert ids == streamed
    content = "".join(
        (e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") or "")
        for e in events
        if e["choices"]
    )
    assert text == content  # no stop string: the pieces are the streamed text
    assert events[-1]["usage"]["speculation"]["drafter"] == speculation["drafter"]


def test_origins_with_a_stop_string_still_add_up(srv: Server, recorded_rounds: list[Round]) -> None:
    """A stop string cuts the text, not the committed tokens: origins still count them all."""
    events = _events(
        srv,
        CHAT,
        {
            "messages": _messages(),
            "max_tokens": 40,
            "temperature": 1.0,
            "seed": 4,
            "stop": ["5", "A", "Q"],
            "stream_options": {"include_usage": True, "include_speculation": True},
        },
    )
    _, text = _check_origins(events, recorded_rounds)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text.startswith(content)


def test_a_prediction_shows_as_the_source_of_its_drafts(free_srv: Server) -> None:
    """No drafter flag: a request's prediction is drafted from (source prediction*), and the
    answer is exactly the target's."""
    prompt = prompting.encode_messages(free_srv.engine.models.tokenizer, _messages("copy"))
    want = _expected(free_srv, prompt, SpecConfig(), False, warp=Warp(0.0), max_new_tokens=30)
    answer = prompting.decode(free_srv.engine.models.tokenizer, want.tokens)
    events = _events(
        free_srv,
        CHAT,
        {
            "messages": _messages("copy"),
            "max_tokens": 30,
            "temperature": 0,
            "prediction": {"type": "content", "content": answer},
            "stream_options": {"include_usage": True, "include_speculation": True},
        },
    )
    records = [
        e["choices"][0]["speculation"]
        for e in events
        if e["choices"] and "speculation" in e["choices"][0]
    ]
    assert [t["id"] for r in records for t in r["tokens"]] == want.tokens
    sources = {r["source"] for r in records if r["k"]}
    assert sources and all(s.startswith("prediction") for s in sources), sources
    spec = events[-1]["usage"]["speculation"]
    assert spec["drafter"] == "prediction" and spec["k"] == "auto" and spec["k_max"] == 64


# ---------------------------------------------------------------------------- defaults
def test_server_defaults_are_k_auto() -> None:
    assert ServeConfig(target=MOCK_SPEC).spec_config().k == "auto"
    assert ServeConfig(target=MOCK_SPEC, k=3).spec_config().k == 3


def test_a_draft_model_with_lookup_as_the_default() -> None:
    """--draft with --drafter lookup (refused before: "uses no draft model") now starts: requests
    get prompt lookup unless they ask for the draft model, which the warm-up checked too."""
    s = _server(True, drafter="lookup")
    try:
        body = {"prompt": [1, 2, 3, 1, 2, 3, 1, 2], "max_tokens": 12, "temperature": 0}
        status, r = _post(s, COMPLETIONS, body)
        assert status == 200 and r["usage"]["speculation"]["drafter"] == "lookup"
        assert r["usage"]["speculation"]["k"] == "auto"
        status, r = _post(s, COMPLETIONS, {**body, "speculation": {"drafter": "model", "k": 2}})
        assert status == 200 and set(r["usage"]["speculation"]["by_source"]) == {"model"}
    finally:
        s.close()


def test_metrics_count_generations_by_drafter(srv: Server) -> None:
    before = metric(srv.metrics(), "specdec_generations_by_drafter_total", drafter="lookup")
    _post(
        srv, COMPLETIONS, {"prompt": [1, 2], "max_tokens": 3, "speculation": {"drafter": "lookup"}}
    )
    after = metric(srv.metrics(), "specdec_generations_by_drafter_total", drafter="lookup")
    assert after == before + 1


_DRAFTER_PREDICTION_SERVE = """
import sys
from specdec.backends import load_model
from specdec.serve import config, launch
from stream_golden import TemplateTokenizer

real = load_model
def with_tokenizer(spec, **kw):  # a mock model that reads text, to send a text prediction
    m = real(spec, **kw)
    m.tokenizer = TemplateTokenizer()
    return m
import specdec.backends
specdec.backends.load_model = with_tokenizer  # build_engine imports it when it runs
cfg = config.ServeConfig(target="mock:vocab=48,seed=0", drafter="prediction", port=int(sys.argv[1]))
sys.exit(launch.serve(cfg))
"""


def _wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "serve did not come up"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)


@pytest.mark.slow
def test_serve_drafter_prediction_starts_and_drafts_prediction_else_lookup() -> None:
    """`specdec serve --drafter prediction` used to exit at start-up ("drafter 'prediction' needs
    a prediction"); now it serves, drafting from a request's prediction, else prompt lookup."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env_path = str(Path(__file__).parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRAFTER_PREDICTION_SERVE, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": env_path},
    )
    try:
        _wait_ready(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        kw = dict(model=MOCK_SPEC, messages=_messages(), max_tokens=30, temperature=0)
        plain = client.chat.completions.create(**kw)
        spec = plain.usage.model_extra["speculation"]
        assert spec["drafter"] == "prediction" and spec["k"] == "auto"
        assert all(s.startswith("lookup") for s in spec["by_source"]), spec
        text = plain.choices[0].message.content
        pred = {"prediction": {"type": "content", "content": text}}
        guided = client.chat.completions.create(**kw, extra_body=pred)
        assert guided.choices[0].message.content == text
        sources = guided.usage.model_extra["speculation"]["by_source"]
        assert any(s.startswith("prediction") for s in sources), sources
        assert guided.usage.completion_tokens_details.accepted_prediction_tokens > 0
        proc.terminate()
        assert proc.wait(GRACEFUL_SHUTDOWN_S + 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
