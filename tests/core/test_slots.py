"""Slots: several generations on one model, one target pass a round for all of them
(SpecModel.slots, core.model.extend_together, decode.rounds_together, serve --parallel).

The property under test is exact: on a batch-invariant target a row has the same bits in a pass
shared with other sequences as in a pass of its own, so each greedy answer is token-identical
alone and in company, whatever its neighbours' lengths, drafters and start times. The mock runs
it with 1, 2, 4 and 8 neighbours; llama.cpp (smollm2, four sequences in one context, a KV stream
each) with the real kernels, rollback of one slot included. The sampled counterpart (level 2,
statistical) is in tests/core/test_decode.py.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from serverkit import MOCK_SPEC, V, metric, mock_server, wait_for

from specdec.backends import chat as prompting
from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import Generation, rounds_together
from specdec.core.generate import generate, stream
from specdec.core.model import SpecModel, SpecModelError, extend_together
from specdec.core.policy import CostModelK, FixedK, choose_together

GREEDY = Warp(temperature=0)
#: (drafter, K) of the i-th generation, cycled: every kind of neighbour
MIX = [("none", 4), ("lookup", "auto"), ("model", 3), ("prediction", "auto"), ("composite", 5)]


def _spec(i: int) -> dict:
    drafter, k = MIX[i % len(MIX)]
    return {"spec": SpecConfig(drafter=None if drafter == "none" else drafter, k=k)}


def _prompt(i: int, width: int) -> list[int]:
    """Prompts of different lengths, repetitive enough for prompt lookup to draft from."""
    g = torch.Generator().manual_seed(100 + i)
    motif = torch.randint(0, width, (3 + i % 4,), generator=g).tolist()
    return (motif * (2 + 3 * i))[: 5 + 11 * i]


def _alone(target: SpecModel, draft: SpecModel | None, i: int, n_tok: int, **kw) -> list[int]:
    spec = _spec(i)
    draft = draft if spec["spec"].drafter in ("model", "composite") else None
    return generate(target, _prompt(i, target.vocab_size), draft=draft, warp=GREEDY,
                    max_new_tokens=n_tok, **spec, **kw).tokens  # fmt: skip


def _in_company(
    targets: list[SpecModel], drafts: list[SpecModel | None], n_tok: int, prediction=None, **kw
) -> list[list[int]]:
    """Generation i on slot i, run staggered (`_staggered`) until all are done."""
    gens: list[Generation] = []
    for i, (t, d) in enumerate(zip(targets, drafts, strict=True)):
        spec = _spec(i)
        d = d if spec["spec"].drafter in ("model", "composite") else None
        pred = (
            prediction(i)
            if prediction is not None and MIX[i % len(MIX)][0] == "prediction"
            else None
        )
        s = stream(t, _prompt(i, t.vocab_size), draft=d, warp=GREEDY, max_new_tokens=n_tok,
                   prediction=pred, **spec, **kw)  # fmt: skip
        gens.append(s.generation)
    return _staggered(gens, chunk=7)


def _staggered(gens: list[Generation], chunk: int) -> list[list[int]]:
    """Generation i started at round i, its prompt prefilled `chunk` tokens a round while the
    others decode (as the server does), every started one stepped with rounds_together."""
    started: list[Generation] = []
    while any(not g.done for g in gens):
        if len(started) < len(gens):
            started.append(gens[len(started)])
        for g in started:
            if not g.prefilled:
                g.prefill(chunk)
        ready = [g for g in started if g.prefilled and not g.done]
        if ready:
            for got in rounds_together(ready):
                assert not isinstance(got, Exception), got
    return [g.tokens for g in gens]


# ------------------------------------------------------------------------------ mock
@pytest.mark.parametrize("neighbours", [1, 2, 4, 8])
def test_greedy_answers_are_the_same_alone_and_in_company(neighbours) -> None:
    target = MockModel(V, seed=3)
    draft = MockModel.near(target, noise=0.7, seed=4)
    n = neighbours + 1
    targets, drafts = target.slots(n), draft.slots(n)

    def prediction(i: int) -> list[int]:  # the answer itself, with an edit in the middle
        ref = generate(target, _prompt(i, V), warp=GREEDY, max_new_tokens=30).tokens
        return [*ref[:10], (ref[10] + 1) % V, *ref[11:]]

    got = _in_company(targets, drafts, 30, prediction=prediction, debug=True)
    for i in range(n):
        pred = prediction(i) if MIX[i % len(MIX)][0] == "prediction" else None
        want = _alone(target, draft, i, 30, prediction=pred)
        assert got[i] == want, f"generation {i} of {n}"


@pytest.mark.parametrize("part", ["want", "propose", "accept"])
def test_a_generation_that_raises_in_a_joint_round_fails_alone(part: str) -> None:
    """Generation 1's drafter, draft or accept walk raises in its third round (a warp that
    leaves no token once did, and failed every request of the pass): it gets its exception,
    the others go on in the same passes, and their greedy answers are their solo answers."""
    target = MockModel(V, seed=3)
    draft = MockModel.near(target, noise=0.7, seed=4)
    kinds = (0, 1, 2, 4)  # MIX's, but the prediction (it needs one)
    targets, drafts = target.slots(len(kinds)), draft.slots(len(kinds))
    gens = []
    for i, t, d in zip(kinds, targets, drafts, strict=True):
        spec = _spec(i)
        d = d if spec["spec"].drafter in ("model", "composite") else None
        s = stream(t, _prompt(i, V), draft=d, warp=GREEDY, max_new_tokens=30, debug=True, **spec)
        gens.append(s.generation)
    real, calls = getattr(gens[1], part), []

    def raising(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("its own failure")
        return real(*args, **kw)

    setattr(gens[1], part, raising)
    for g in gens:
        while not g.prefill():
            pass
    failed: list[Exception] = []
    live = list(gens)
    while live:
        for g, got in zip(list(live), rounds_together(live), strict=True):
            if isinstance(got, Exception):
                failed.append(got)
                live.remove(g)
        live = [g for g in live if not g.done]
    assert [str(e) for e in failed] == ["its own failure"] and not gens[1].done
    for j in (0, 2, 3):
        assert gens[j].tokens == _alone(target, draft, kinds[j], 30), f"generation {j}"


@pytest.mark.parametrize("order", [(4, 128, None), (None, 1, 128)])
def test_a_joint_round_verifies_each_ones_own_rows_and_pads_nobody(order) -> None:
    """The review's neighbours: plain decoding (no drafter), K = 1, K = 128, in one pass. Each
    drafts its own K and reports only that in its k_histogram; the pass is the sum of their rows
    (once the pass was 3 x the widest draft, and a K = 1 request reported a K = 15 round)."""
    target = MockModel(V, seed=3)
    rounds: dict[int, list] = {i: [] for i in range(3)}
    gens = [
        stream(
            t,
            _prompt(5, V),  # repetitive: prompt lookup drafts its whole K
            spec=SpecConfig(drafter=None if k is None else "lookup", k=k or 1),
            warp=GREEDY,
            max_new_tokens=200,
            on_round=rounds[i].append,
        ).generation
        for i, (t, k) in enumerate(zip(target.slots(3), order, strict=True))
    ]
    for g in gens:
        while not g.prefill():
            pass
    for _ in range(3):
        assert not any(isinstance(got, Exception) for got in rounds_together(gens))
    for i, k in enumerate(order):
        assert {r.k for r in rounds[i]} <= {k or 0, *range(k or 1)}, (i, k, rounds[i])
        assert set(gens[i].stats.k_histogram) <= set(range((k or 0) + 1))
    for n in range(3):  # one pass a round, its rows the sum of what each verified
        got = [rounds[i][n] for i in range(3)]
        assert len({r.verify_s for r in got}) == 1
        assert all(r.rows == sum(x.k + 1 for x in got) for r in got)
    for g in gens:  # the rejected drafts rolled back
        assert g.target.cached_tokens == g.seq[:-1]


def test_extend_together_checks_every_call_before_any_work() -> None:
    a, b = MockModel(V, seed=0).slots(2)
    with pytest.raises(SpecModelError, match="appears twice"):
        extend_together([(a, [1]), (a, [2])])
    with pytest.raises(SpecModelError, match="outside the vocabulary"):
        extend_together([(a, [1]), (b, [V])])
    assert a.n_cached == b.n_cached == 0


def test_a_failed_joint_extend_leaves_every_slot_as_it_was(monkeypatch) -> None:
    """SpecModel._extend_slots' default runs the slots one after another; when one fails,
    those that ran are rolled back, so every backend cache holds what its slot recorded (as
    llama.cpp's one pass leaves them)."""

    class Held(MockModel):  # a backend cache of its own per slot, as a real backend has
        def _extend(self, ids: list[int]) -> torch.Tensor:
            self.__dict__.setdefault("held", []).extend(ids)
            return super()._extend(ids)

        def _truncate(self, n: int) -> None:
            del self.__dict__.setdefault("held", [])[n:]

    a, b = Held(V, seed=0).slots(2)
    a.extend([1, 2, 3])
    b.extend([4, 5])

    def broken(ids: list[int]) -> torch.Tensor:
        raise RuntimeError("the pass failed")

    monkeypatch.setattr(b, "_extend", broken)
    with pytest.raises(RuntimeError, match="the pass failed"):
        extend_together([(a, [6, 7]), (b, [8])])
    assert a.cached_tokens == a.held == [1, 2, 3] and b.cached_tokens == b.held == [4, 5]


def test_a_backend_with_one_sequence_says_how_to_serve_several() -> None:
    class OneSeq(MockModel):
        def _make_slots(self, n: int) -> list[SpecModel]:
            return SpecModel._make_slots(self, n)

    with pytest.raises(SpecModelError, match="--parallel"):
        OneSeq(V).slots(2)
    m = OneSeq(V)
    assert m.slots(1) == [m]


# ------------------------------------------------------------------------------ K for the pass
def _learned(curve: dict[int, float], alpha: float, k_max: int = 32) -> CostModelK:
    """A k="auto" policy with `curve` that saw 60 rounds at K = 32 of a copy source accepted at
    `alpha` a position (each pass timed as the curve says)."""
    from specdec.core.metrics import Round

    rng = random.Random(0)
    p = CostModelK(k_max)
    p.load_curve(curve)
    for _ in range(60):
        n = 0
        while n < 32 and rng.random() < alpha:
            n += 1
        p.observe(Round("prediction", 32, n, n + 1, 0.0, curve[33]))
    return p


def test_k_for_the_pass_shortens_as_sequences_are_added() -> None:
    """A memory-bound curve (a pass over b rows: 1 + 0.05 (b - 1) steps) and a source that
    copies (95% a position): long drafts for one sequence, shorter for eight; none where a row
    costs a whole step and drafts are coin flips (no batching gain to spend)."""
    flat = {b: 1 + 0.05 * (b - 1) for b in range(1, 300)}
    policy = _learned(flat, 0.95)
    ks = [choose_together([(policy, "prediction", 500)] * n) for n in (1, 2, 4, 8)]
    assert all(len(set(x)) == 1 for x in ks), ks  # the same policy and source: the same K
    ks1 = [x[0] for x in ks]
    assert ks1 == sorted(ks1, reverse=True) and ks1[0] >= 8 and ks1[-1] < ks1[0], ks
    # alone, the K CostModelK.choose picks (it maximizes the same rate)
    solo = _learned(flat, 0.95)
    solo.probe = 0.0
    assert ks1[0] == solo.choose("prediction", 500)
    steep = {b: float(b) for b in range(1, 300)}
    assert choose_together([(_learned(steep, 0.5), "prediction", 500)] * 4) == [0] * 4
    # k=auto policies of other k_max in one pass (a draft model's 8 beside lookup's 64): each
    # drafts up to its own k_max (the pass once raised "k must be in [0, 8]")
    deep = _learned(flat, 0.95, k_max=64)
    shallow = CostModelK(8, verify_s=flat)
    k_deep, k_shallow = choose_together([(deep, "prediction", 500), (shallow, "model", 500)])
    assert k_deep > 8 and 0 < k_shallow <= 8
    # a fixed K is its own, a neighbour without a drafter drafts nothing: nobody is padded
    assert choose_together([(FixedK(6), "lookup3", 500), (None, None, 500)]) == [6, 0]
    assert choose_together([(None, None, 500)] * 3) == [0, 0, 0]
    # a k="auto" sequence beside a K = 6 one prices its rows on top of the other's seven
    alone = choose_together([(policy, "prediction", 500)])[0]
    beside = choose_together([(policy, "prediction", 500), (FixedK(6), "lookup3", 500)])[0]
    assert 0 < beside <= alone


# ------------------------------------------------------------------------------ llama.cpp
@pytest.mark.model
def test_llamacpp_slots_give_each_sequence_its_own_bits(smol_path, smol_llamacpp) -> None:
    """Four sequences in one context (a KV stream each): every answer, greedy, with every kind
    of neighbour started at a different round, equals the one-sequence model's; a rollback of
    one slot leaves the others' logits as they were."""
    from support import TEST_THREADS

    from specdec.backends.llamacpp import LlamaCppModel

    tok = smol_llamacpp.tokenizer
    texts = ["Explain why the sky is blue.", "def fib(n):\n    " * 3, "Name three colours.",
             "Rewrite in the passive voice: the cat chased the dog. " * 2]  # fmt: skip
    prompts = [prompting.encode(tok, t) for t in texts]
    alone = [generate(smol_llamacpp, p, warp=GREEDY, max_new_tokens=24).tokens for p in prompts]
    edited = [*alone[3][:8], alone[0][0], *alone[3][9:]]  # the answer with an edit
    specs = [  # every kind of neighbour: none, prompt lookup at k=auto and K = 6, a prediction
        {},
        {"spec": SpecConfig(drafter="lookup", k="auto")},
        {"spec": SpecConfig(drafter="lookup", k=6)},
        {"spec": SpecConfig(drafter="prediction", k="auto"), "prediction": edited},
    ]
    multi = LlamaCppModel(smol_path, tokenizer=tok, n_seq=4, n_threads=TEST_THREADS)
    try:
        slots = multi.slots(4)
        assert [s.owner for s in slots] == [multi] * 4 and multi.batch_invariant
        gens = [
            stream(s, p, warp=GREEDY, max_new_tokens=24, **kw).generation
            for s, p, kw in zip(slots, prompts, specs, strict=True)
        ]
        assert _staggered(gens, chunk=5) == alone
        assert gens[3].stats.accepted > 0 and gens[2].stats.drafted > 0
        # rollback of slot 1 only: slot 0's next logits are what the one-sequence model gives
        slots[1].truncate(3)
        a, b = extend_together([(slots[0], [7, 8]), (slots[1], [9])])
        smol_llamacpp.reset()
        smol_llamacpp.prefill(slots[0].cached_tokens[:-2])
        assert torch.equal(a, smol_llamacpp.extend([7, 8]))
        smol_llamacpp.reset()
        smol_llamacpp.prefill(prompts[1][:3])
        assert torch.equal(b, smol_llamacpp.extend([9]))
        # a cache saved from one slot restores into another, bit for bit (serve.prompt_store)
        saved = slots[0].save()
        slots[2].restore(saved)
        assert slots[2].cached_tokens == slots[0].cached_tokens
        c, d = extend_together([(slots[0], [11]), (slots[2], [11])])
        assert torch.equal(c, d)
    finally:
        multi.close()


@pytest.mark.model
def test_llamacpp_refuses_slots_whose_caches_do_not_fit(smol_path, monkeypatch) -> None:
    """--parallel 64 once allocated 4.9 GB of KV caches at start, unannounced: now the backend
    says what they take and refuses, before allocating, what would not fit 80% of the memory
    available."""
    from specdec.backends import llamacpp

    one = llamacpp.LlamaCppModel(smol_path, n_seq=1)
    per_seq = one.kv_bytes
    one.close()
    # 30 layers x 3 KV heads x 64 values x 4096 cells, K in q8_0 (34 / 32 bytes), V in f16
    assert per_seq == int(4096 * 30 * 3 * 64 * (34 / 32 + 2))
    monkeypatch.setattr(llamacpp, "_available_bytes", lambda: int(per_seq * 3))
    with pytest.raises(SpecModelError, match=r"4 sequences .*--parallel.*--ctx-size"):
        llamacpp.LlamaCppModel(smol_path, n_seq=4)
    two = llamacpp.LlamaCppModel(smol_path, n_seq=2)  # 2 of 2.4 that fit
    assert two.kv_bytes == 2 * per_seq
    two.close()
    with pytest.raises(SpecModelError, match="at most 256 sequences"):
        llamacpp.LlamaCppModel(smol_path, n_seq=257)  # llama.cpp's own limit, said up front
    # a short context (serve --ctx-size 100) with slots: llama.cpp pads each sequence's cells
    # to 256, so the model says 256 (once a batch sized by 100 failed an assertion in it)
    short = llamacpp.LlamaCppModel(smol_path, n_ctx=100, n_seq=2)
    try:
        assert short.n_ctx == 256 and short.kv_bytes == 2 * per_seq // 16
        a, b = short.slots(2)
        assert extend_together([(a, [1, 2, 3]), (b, [4])])[0].shape[0] == 3
    finally:
        short.close()


@pytest.mark.model
def test_llamacpp_refuses_more_slots_than_its_context_holds(smol_llamacpp) -> None:
    with pytest.raises(SpecModelError, match="n_seq=2"):
        smol_llamacpp.slots(2)


# ------------------------------------------------------------------------------ the server
def _solo(e, body: dict) -> list[int]:
    """generate()'s greedy answer alone to a /v1/completions `body` on engine `e`'s models, with
    its `speculation` (the server's default, composite at k="auto", when it has none)."""
    sp = body.get("speculation", {"drafter": "composite"})
    drafter = None if sp["drafter"] == "none" else sp["drafter"]
    m = e.models
    draft = m.draft if drafter in ("model", "composite") else None
    with e.lock:
        return generate(m.target, body["prompt"], draft=draft, warp=GREEDY,
                        spec=SpecConfig(drafter=drafter, k=sp.get("k", "auto")),
                        max_new_tokens=body["max_tokens"], stop_ids=m.stop_ids).tokens  # fmt: skip


def test_a_parallel_server_answers_each_request_as_if_alone() -> None:
    """--parallel 4, eight greedy requests of different lengths and drafters at once, and one
    with a vanishing top_p: each answer is generate()'s alone, the engine ran several at a
    time, and /metrics says so."""
    srv = mock_server(parallel=4, delay=0.002)
    kinds = [None, {"drafter": "none"}, {"drafter": "lookup", "k": "auto"},
             {"drafter": "model", "k": 3}, {"drafter": "lookup", "k": 5}]  # fmt: skip
    bodies = []
    for i in range(8):
        body = {"model": MOCK_SPEC, "prompt": _prompt(i, V), "max_tokens": 12 + 3 * i,
                "temperature": 0, "return_token_ids": True}  # fmt: skip
        if kinds[i % len(kinds)] is not None:
            body["speculation"] = kinds[i % len(kinds)]
        bodies.append(body)
    # a neighbour sampling with a top_p below float32's least positive value: it keeps only
    # the most likely token, so its answer is the greedy one (it once failed the whole pass)
    bodies.append({**bodies[2], "temperature": 1.0, "top_p": 1e-300, "seed": 5})
    most = [0]
    try:
        e = srv.engine
        with ThreadPoolExecutor(len(bodies)) as pool:
            futs = [pool.submit(srv.request, "POST", "/v1/completions", b) for b in bodies]
            while not all(f.done() for f in futs):
                most[0] = max(most[0], e.running)
                time.sleep(0.002)
            outs = [f.result(60) for f in futs]
        assert most[0] > 1  # they ran together, not one after another
        for b, (status, _, out) in zip(bodies, outs, strict=True):
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == _solo(e, b)
        text = srv.metrics()
        assert metric(text, "specdec_slots") == 4 and metric(text, "specdec_running") == 0
    finally:
        srv.close()


def test_an_abandoned_request_frees_its_slot() -> None:
    """A streaming client that goes away mid-answer: its slot is freed and its cache reset by
    the next request's start; the requests after it are all answered."""
    import http.client

    srv = mock_server(parallel=2, delay=0.01)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {"model": MOCK_SPEC, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
                "temperature": 0}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()
        wait_for(lambda: srv.engine.running == 1, 10, "the request never started")
        conn.close()  # the client goes away
        wait_for(lambda: srv.engine.running == 0, 20, "the abandoned request kept its slot")
        with ThreadPoolExecutor(4) as pool:
            small = {"model": MOCK_SPEC, "prompt": [4, 5], "max_tokens": 5, "temperature": 0}
            outs = list(pool.map(lambda _: srv.request("POST", "/v1/completions", small), range(4)))
        assert [o[0] for o in outs] == [200] * 4
        assert len({json.dumps(o[2]["choices"][0]["text"]) for o in outs}) == 1
    finally:
        srv.close()


def test_neighbours_that_end_early_or_fail_leave_the_others_exact(monkeypatch) -> None:
    """--parallel 4 with every kind of early end beside greedy requests: a neighbour whose
    accept walk raises mid-pass (500, alone), one that stops at max_tokens 1, one at K = 128,
    one whose client goes away mid-stream. Every other answer is generate()'s alone."""
    import http.client

    poison = [47, 46, 45, 44]  # the prompt whose own part of each round raises
    real = Generation.accept

    def accept(self: Generation, *a, **kw):
        if self.prompt == poison and self.tokens:
            raise RuntimeError("a neighbour's accept walk broke")
        return real(self, *a, **kw)

    monkeypatch.setattr(Generation, "accept", accept)
    srv = mock_server(parallel=4, delay=0.002)
    base = {"model": MOCK_SPEC, "temperature": 0, "return_token_ids": True}
    kinds = [{"drafter": "none"}, {"drafter": "lookup", "k": "auto"},
             {"drafter": "model", "k": 2}, {"drafter": "lookup", "k": 3}]  # fmt: skip
    good = [{**base, "prompt": _prompt(i, V), "max_tokens": 20 + 5 * i, "speculation": sp}
            for i, sp in enumerate(kinds)]  # fmt: skip
    hostile = [
        {**base, "prompt": poison, "max_tokens": 30},
        {**base, "prompt": _prompt(1, V), "max_tokens": 1},
        {**base, "prompt": _prompt(3, V), "max_tokens": 60,
         "speculation": {"drafter": "lookup", "k": 128}},
    ]  # fmt: skip

    def disconnecting() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {**base, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()
        conn.close()

    try:
        e = srv.engine
        with ThreadPoolExecutor(8) as pool:
            gone = pool.submit(disconnecting)
            futs = [pool.submit(srv.request, "POST", "/v1/completions", b)
                    for b in good + hostile]  # fmt: skip
            outs = [f.result(60) for f in futs]
            gone.result(60)
        assert outs[len(good)][0] == 500, outs[len(good)]
        for b, (status, _, out) in zip(good + hostile[1:], outs[:len(good)] + outs[len(good) + 1:],
                                       strict=True):  # fmt: skip
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == _solo(e, b), b
            sp = b.get("speculation", {"drafter": "composite", "k": "auto"})
            drafter = None if sp["drafter"] == "none" else sp["drafter"]
            hist = out["usage"]["speculation"]["k_histogram"] if drafter else {}
            own = sp.get("k", 0) if drafter else 0  # its k_histogram: its own K only
            assert all(int(k) <= (own if isinstance(own, int) else 64) for k in hist), hist
        wait_for(lambda: e.running == 0, 20, "a slot was never freed")
    finally:
        srv.close()
