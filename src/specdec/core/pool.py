"""A draft pool: a bounded index over earlier requests' text, to draft from across requests.

An editor or an agent sends the same file again and again, and an answer repeats what earlier
answers wrote; prompt lookup (core.drafters.LookupDrafter) sees only the current request.
`DraftPool` keeps the recent documents (what a server adds: prompts, outputs) and finds the
longest earlier occurrence of the context's last tokens, as llama.cpp's ngram-mod pool and
vLLM's suffix decoding (Arctic Inference) do; `PoolDrafter` drafts its continuation, or the
current request's own longest match, whichever is longer (a source k=auto weighs like any
other: "pool4+", "pool8+", "pool16+").

Bounded by construction, all memory allocated up front (`memory_bytes` never changes):
    tokens   a ring of `capacity` token ids (int32); the oldest are overwritten (evicted) first,
             and a document is never matched across its boundary (a separator follows each)
    index    two hash tables (n-gram of KEYS[0] and of KEYS[1] tokens -> the latest position it
             ended at), 2 * capacity slots each (int64): a newer n-gram overwrites an older one
             in its slot, like llama.cpp's hashed n-gram pool; a hit is verified against the
             ring, so a collision or an evicted position is a miss, never a wrong draft
Lookup is O(n + match): hash the context's last KEYS tokens, verify, then extend the match
backwards up to MAX_MATCH tokens. Adding a document costs O(its length).

Scope: one pool holds what its owner may read. A pool shared by several tenants lets one
measure, through speed alone, whether its text matches another's; `DraftPools` keeps one pool
per scope (an API key by default), at most `max_pools` of them (the least recently used goes).
Not thread-safe: one engine thread adds and drafts.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.drafters import LookupDrafter, Proposal, lookup_source

#: The n-gram lengths hashed: a long key first (a copy of a passage), then a short one.
KEYS = (16, 4)
#: Longest match measured backwards from a hit (matches are bucketed for the K policy anyway).
MAX_MATCH = 64
#: Match-length buckets of the pool's draft sources (like drafters.LOOKUP_BUCKETS).
POOL_BUCKETS = (16, 8, 4)
_SEP = -1  # follows every document: no context token equals it, so no match crosses it


@dataclass
class PoolStats:
    """Counters a server exports (e.g. /metrics). Definitions:

    documents   documents added since creation
    tokens      tokens held now (<= capacity; older ones were evicted)
    evicted     tokens overwritten since creation
    lookups     match() calls;  hits: those that found an earlier occurrence
    drafted     tokens PoolDrafter drafted from the pool (verified by the target)
    accepted    of those, tokens the target accepted
    """

    documents: int = 0
    tokens: int = 0
    evicted: int = 0
    lookups: int = 0
    hits: int = 0
    drafted: int = 0
    accepted: int = 0


class DraftPool:
    """A bounded ring of recent documents with a hashed n-gram index (module docstring)."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity < 2 * max(KEYS):
            raise ValueError(f"a draft pool needs capacity >= {2 * max(KEYS)} tokens")
        self.capacity = capacity
        self._ring = array("i", [_SEP]) * capacity  # global position p lives at p % capacity
        self._slots = 1 << (2 * capacity - 1).bit_length()  # a power of two >= 2 * capacity
        self._tables = [array("q", [0]) * self._slots for _ in KEYS]  # 0: empty; else end + 1
        self._end = 0  # global positions written so far
        self.stats = PoolStats()

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the ring and the index: fixed at construction."""
        return self._ring.itemsize * len(self._ring) + sum(
            t.itemsize * len(t) for t in self._tables
        )

    def _at(self, p: int) -> int:
        """The token at global position p, or _SEP once it has been evicted."""
        return self._ring[p % self.capacity] if self._end - self.capacity <= p < self._end else _SEP

    def add(self, tokens: Sequence[int]) -> None:
        """Append a document (e.g. a request's prompt and answer) and index its n-grams; a
        document longer than the pool keeps its tail."""
        doc = list(tokens)[-(self.capacity - 1) :]
        if not doc:
            return
        start = self._end
        for t in [*doc, _SEP]:
            old = self._ring[self._end % self.capacity]
            self._ring[self._end % self.capacity] = t
            self._end += 1
            self.stats.evicted += old != _SEP
            self.stats.tokens += (t != _SEP) - (old != _SEP)
        # every n-gram a token follows (one at the document's end would draft nothing)
        for n, table in zip(KEYS, self._tables, strict=True):
            for end in range(start + n, start + len(doc)):
                key = tuple(doc[end - start - n : end - start])
                table[hash(key) & (self._slots - 1)] = end + 1
        self.stats.documents += 1

    def match(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(match length, global position after the match) of the longest earlier occurrence of
        the context's last tokens found (KEYS[0]-gram first), or None. O(n + match)."""
        self.stats.lookups += 1
        best = None
        for n, table in zip(KEYS, self._tables, strict=True):
            if len(context) < n:
                continue
            end = table[hash(tuple(context[-n:])) & (self._slots - 1)] - 1
            if end < 0 or end < self._end - self.capacity + n:
                continue  # empty slot, or the n-gram was evicted
            m = 0
            while m < min(MAX_MATCH, len(context)) and self._at(end - 1 - m) == context[-1 - m]:
                m += 1
            if m >= n and (best is None or m > best[0]):
                best = (m, end)
            if best is not None:
                break  # the long key matched: no need for the short one
        self.stats.hits += best is not None
        return best

    def continuation(self, end: int, k: int) -> list[int]:
        """Up to k tokens that followed the match ending at global position `end` (stopping at
        the document's end or at evicted text)."""
        out = []
        for p in range(end, min(end + k, self._end)):
            t = self._at(p)
            if t == _SEP:
                break
            out.append(t)
        return out


class DraftPools:
    """One DraftPool per scope (e.g. an API key; pass one shared scope to share), at most
    `max_pools` of them: the least recently used is dropped for a new one, so the memory is
    at most max_pools * DraftPool(capacity).memory_bytes."""

    def __init__(self, max_pools: int = 16, capacity: int = 1 << 18) -> None:
        if max_pools < 1:
            raise ValueError("max_pools must be >= 1")
        self.max_pools = max_pools
        self.capacity = capacity
        self._pools: OrderedDict[str, DraftPool] = OrderedDict()

    def get(self, scope: str) -> DraftPool:
        """The scope's pool, created on first use (evicting the least recently used)."""
        pool = self._pools.pop(scope, None)
        if pool is None:
            if len(self._pools) >= self.max_pools:
                self._pools.popitem(last=False)
            pool = DraftPool(self.capacity)
        self._pools[scope] = pool
        return pool

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def memory_bytes(self) -> int:
        return sum(p.memory_bytes for p in self._pools.values())


class PoolDrafter:
    """Drafts the continuation of the longest earlier occurrence of the context's last tokens,
    in the pool or in the current request (prompt lookup), whichever match is longer (the
    request's own on a tie). Deterministic given the context and the pool: q = None, exact at
    any temperature (the pool changes only between requests, never during one's drafting
    rounds, as long as the server adds a request's text after it finishes)."""

    model = None

    def __init__(self, pool: DraftPool, local: LookupDrafter | None = None) -> None:
        self.pool = pool
        self.local = local if local is not None else LookupDrafter()
        self._from_pool = False
        self._proposed = 0

    def _pick(self, context: list[int]) -> tuple[str, int, int] | None:
        """(source, match length, where the draft starts: a context index or pool position)."""
        own = self.local.match(context)
        hit = self.pool.match(context)
        if hit is not None and (own is None or hit[0] > own[0]):
            bucket = next(b for b in POOL_BUCKETS if hit[0] >= b)
            return f"pool{bucket}+", hit[0], hit[1]
        if own is None:
            return None
        return lookup_source(own[0]), own[0], own[1]

    def source(self, context: list[int]) -> str | None:
        pick = self._pick(context)
        return None if pick is None else pick[0]

    def propose(self, context: list[int], k: int) -> Proposal:
        pick = self._pick(context)
        self._from_pool = pick is not None and pick[0].startswith("pool")
        if pick is None:
            tokens: list[int] = []
        elif self._from_pool:
            tokens = self.pool.continuation(pick[2], k)
        else:
            tokens = context[pick[2] : pick[2] + k]
        self._proposed = len(tokens)
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def observe(self, n_accepted: int) -> None:
        if self._from_pool:
            self.pool.stats.drafted += self._proposed
            self.pool.stats.accepted += n_accepted
        self._from_pool, self._proposed = False, 0
