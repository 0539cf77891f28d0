"""The draft pool across requests (core.pool): its index against a brute-force search, its
bounds (memory fixed, oldest text evicted, never a match across documents or into evicted
text), scoping (a pool per key: one key's text never drafts for another), and exactness of the
pool drafter as every drafter is tested (greedy identity, level-2 sampled chi-square with a
pool full of unrelated and wrong text)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from stats_util import two_sample_chi2

from specdec.backends.mock import MockModel
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.core.pool import KEYS, DraftPool, DraftPools, PoolDrafter
from specdec.study.run.significance import paired_permutation_p

V = 16
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3]


def _held(pool: DraftPool) -> list[list[int]]:
    """The documents the pool still holds whole, oldest first (brute-force view)."""
    lo = max(0, pool._end - pool.capacity)
    text = [pool._at(p) for p in range(lo, pool._end)]
    docs, cur = [], []
    for t in text:
        if t == -1:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs[1:] if lo > 0 else docs  # the first may be cut by eviction


def _brute(pool: DraftPool, context: list[int]) -> int:
    """The longest suffix of `context` (at most 64 tokens) that occurs in a held document."""
    best = 0
    for doc in _held(pool):
        for end in range(1, len(doc) + 1):
            m = 0
            while m < min(64, len(context), end) and doc[end - 1 - m] == context[-1 - m]:
                m += 1
            best = max(best, m)
    return best


def test_a_match_is_real_and_its_continuation_follows_it() -> None:
    rng = random.Random(0)
    pool = DraftPool(capacity=4096)
    docs = [[rng.randrange(50) for _ in range(rng.randrange(20, 200))] for _ in range(10)]
    for d in docs:
        pool.add(d)
    missed = 0
    for _ in range(300):
        doc = rng.choice(docs)
        i = rng.randrange(KEYS[-1], len(doc))
        ctx = [99, 98, *doc[rng.randrange(0, i - KEYS[-1] + 1) : i]]  # a document's span
        hit = pool.match(ctx)
        if hit is None:  # lossy hashing may miss (a newer n-gram took the slot), rarely
            missed += 1
            continue
        m, end = hit
        assert m == _brute(pool, ctx) or m >= KEYS[0]  # the longest, up to the long key
        assert [pool._at(p) for p in range(end - m, end)] == ctx[-m:]  # a real occurrence
        cont = pool.continuation(end, 8)
        assert cont == [pool._at(p) for p in range(end, end + len(cont))]
        assert -1 not in cont
    assert missed <= 300 * 0.05


def test_the_latest_long_occurrence_is_found_without_collisions() -> None:
    pool = DraftPool(capacity=1024)
    a = list(range(100, 140))
    pool.add([1, 2, *a, 7, 8])
    pool.add([3, *a, 9])  # the same passage again, later: its continuation wins
    m, end = pool.match([50, *a[:20]])
    assert m == 20 and pool.continuation(end, 3) == a[20:23]
    m, end = pool.match(a)
    assert pool.continuation(end, 3) == [9]  # the latest occurrence, and not past its end
    assert pool.match([60, 61, 62, 63, 64]) is None
    assert pool.stats.lookups == 3 and pool.stats.hits == 2


def test_no_match_across_documents() -> None:
    pool = DraftPool(capacity=1024)
    pool.add([1, 2, 3, 4, 5])
    pool.add([6, 7, 8, 9, 10])
    assert pool.match([3, 4, 5, 6, 7]) is None  # 4 5 6 7 spans the boundary: no such text
    assert pool.match([4, 5, 6, 7, 8, 9])[0] == 4  # the match stops at the document's start
    # a document's last n-gram is not indexed: nothing follows it, a draft from it is empty
    assert pool.match([0, 2, 3, 4, 5]) is None
    m, end = pool.match([0, 1, 2, 3, 4])
    assert m == 4 and pool.continuation(end, 4) == [5]


def test_memory_is_fixed_and_old_text_is_evicted() -> None:
    pool = DraftPool(capacity=256)
    mem = pool.memory_bytes
    first = list(range(1000, 1100))
    pool.add(first)
    assert pool.match(first[:30]) is not None
    rng = random.Random(1)
    for _ in range(50):
        pool.add([rng.randrange(500) for _ in range(40)])
        assert pool.stats.tokens <= pool.capacity and pool.memory_bytes == mem
    assert pool.match(first[:30]) is None  # evicted: never a draft from overwritten text
    assert pool.stats.evicted >= 100 and pool.stats.documents == 51
    big = list(range(2000, 2600))  # longer than the pool: its tail is kept
    pool.add(big)
    assert pool.match(big[-40:-20]) is not None and pool.match(big[:20]) is None


def test_a_500_request_soak_stays_under_the_cap_and_keys_stay_apart() -> None:
    """500 requests from 8 keys through DraftPools(max_pools=4): memory never above 4 pools,
    each pool within its capacity, and no request drafts another key's text."""
    pools = DraftPools(max_pools=4, capacity=512)
    per_pool = DraftPool(512).memory_bytes
    rng = random.Random(2)
    for _ in range(500):
        key = f"key{rng.randrange(8)}"
        secret = [10_000 * (int(key[3:]) + 1) + j for j in range(30)]  # only this key writes it
        pool = pools.get(key)
        pool.add([*secret, *(rng.randrange(100) for _ in range(rng.randrange(10, 120)))])
        assert pools.memory_bytes <= 4 * per_pool and len(pools) <= 4
        assert pool.stats.tokens <= pool.capacity
        other = pools.get(f"key{(int(key[3:]) + 1) % 8}")
        assert other.match(secret[:20]) is None or other is pool  # never another key's text
    assert pools.get("key0") is pools.get("key0")


def test_pool_drafter_prefers_the_longer_match_and_counts_what_it_drafted() -> None:
    pool = DraftPool(capacity=1024)
    passage = list(range(200, 240))
    pool.add([5, *passage, 6])
    d = PoolDrafter(pool)
    ctx = [1, 2, 3, 1, 2, *passage[:17]]  # local match "1 2" (2 tokens), pool match 17 tokens
    assert d.source(ctx) == "pool16+"
    x = d.propose(ctx, 5).x.tolist()
    assert x == passage[17:22]
    d.observe(3)
    assert pool.stats.drafted == 5 and pool.stats.accepted == 3
    local = [*passage[:10], 7, *passage[:10]]  # the request repeats itself: 10 tokens...
    assert d.source(local) == "lookup8+"  # ...beats the pool's 10: a tie goes to the request
    assert PoolDrafter(DraftPool(64)).source([1, 2, 3]) is None


# ------------------------------------------------------------------ exactness
@pytest.fixture(scope="module")
def target() -> MockModel:
    return MockModel(V, seed=0, scale=3.0)


@pytest.fixture(scope="module")
def pool(target) -> DraftPool:
    """Earlier requests: the target's own sampled outputs (so drafts are often right) and
    unrelated random text (wrong drafts)."""
    p = DraftPool(capacity=4096)
    rng = random.Random(3)
    for s in range(20):
        out = generate(target, PROMPT, max_new_tokens=40, warp=Warp(1.0), seed=90_000 + s)
        p.add([*PROMPT, *out.tokens])
        p.add([rng.randrange(V) for _ in range(60)])
    return p


def test_pool_drafter_greedy_equals_target_only(target, pool) -> None:
    for prompt in (PROMPT, [9, 9, 9, 9], [3, 14 % V, 15, 9, 2, 6, 5, 3, 5]):
        base = generate(target, prompt, max_new_tokens=40, warp=Warp(0.0)).tokens
        before = pool.stats.drafted
        spec = generate(
            target,
            prompt,
            max_new_tokens=40,
            warp=Warp(0.0),
            spec=SpecConfig(drafter=PoolDrafter(pool), k=6),
            debug=True,
        )
        assert spec.tokens == base
        assert pool.stats.drafted >= before


@pytest.mark.stats
def test_pool_drafter_is_lossless_at_t1(target, pool) -> None:
    n = 600
    base = [
        generate(target, PROMPT, max_new_tokens=30, warp=Warp(1.0), seed=50_000 + s).tokens
        for s in range(n)
    ]
    seqs, before = [], pool.stats.drafted
    for s in range(n):
        r = generate(
            target,
            PROMPT,
            max_new_tokens=30,
            warp=Warp(1.0),
            seed=s,
            spec=SpecConfig(drafter=PoolDrafter(pool), k=4),
            debug=True,
        )
        seqs.append(r.tokens)
    assert pool.stats.drafted - before > n  # the pool really drafted
    count = lambda ss: np.bincount([t for s in ss for t in s], minlength=V)  # noqa: E731
    chi2, dof, p_table = two_sample_chi2(count(seqs), count(base))
    p = paired_permutation_p(seqs, base, n_perm=1000)
    assert p > 0.01, f"chi2={chi2:.1f} dof={dof} p_perm={p:.4f} p_table={p_table:.4f}"


def test_generate_drafts_from_a_pool_of_earlier_requests(target) -> None:
    """stream(pool=...): prompt lookup drafts from earlier requests too. A request repeated
    after its answer went into the pool is drafted from it from the first round (sources
    pool*), and greedy output is unchanged."""
    p = DraftPool(capacity=1024)
    spec = SpecConfig(drafter="lookup", k=8)
    base = generate(target, PROMPT, max_new_tokens=40, warp=Warp(0.0), spec=spec, pool=p)
    p.add([*PROMPT, *base.tokens])
    again = generate(target, PROMPT, max_new_tokens=40, warp=Warp(0.0), spec=spec, pool=p)
    assert again.tokens == base.tokens
    pooled = {s: n for s, n in again.stats.accepted_by_source.items() if s.startswith("pool")}
    assert sum(pooled.values()) >= 30 and p.stats.accepted == sum(pooled.values())
    assert again.stats.rounds < base.stats.rounds
