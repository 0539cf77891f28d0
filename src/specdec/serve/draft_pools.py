"""The server's cross-request draft pools (core.pool): which pool a request drafts from and
feeds, and what the pools hold, for /metrics.

Scope (`--draft-pool`):
    key      one pool per API key (serve.keys: the key's tenant id, a keyed digest, never the
             key); a server without keys has one tenant, "anonymous". The default: a pool shared
             by several tenants lets one of them measure, through speed alone, whether its text
             matches another's (a fast answer says an earlier request wrote what it asked for).
    shared   one pool for every request, as llama.cpp's ngram-mod: for one tenant that holds
             several keys, or a server whose clients trust each other.
    off      no pool: prompt lookup sees the current request alone.

A request's pool is the one its scope reads and writes: while it runs, prompt lookup (drafters
lookup, composite, and prediction's fallback) drafts from it (generate.stream(pool=)); once it
ends, finished or cut off, its prompt and the tokens it committed are added to it, whatever its
drafter, so the scope's next request can draft from them. Pools change only between requests
(one worker), so a request never drafts from text written during its own rounds. The prompt
cache follows the same scopes (serve.engine: the KV a request left is kept for its scope alone).

Memory: each scope's pool is allocated in full when the scope is first seen (DraftPool:
`pool_memory_bytes(tokens)`, 36 bytes a token at a power of two), at most `scopes` of them (the
least recently used scope's pool goes first), so the pools never take more than
PoolConfig.memory_limit_bytes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.checks import check_int
from specdec.core.pool import KEYS, DraftPool, DraftPools, PoolStats
from specdec.serve.metrics import Metrics

POOL_MODES = ("key", "shared", "off")
#: 256 Ki tokens a scope: 9 MiB; some 60 whole-file answers of 2,000 tokens with their prompts.
DEFAULT_POOL_TOKENS = 1 << 18
#: DraftPool's own minimum (it refuses fewer: two of its longest n-gram), checked at start-up.
MIN_POOL_TOKENS = 2 * max(KEYS)
#: 64 Mi tokens: 2.3 GiB a scope, past any use; a larger number is a typo, not a plan.
MAX_POOL_TOKENS = 1 << 26
#: Pools held at once in `key` mode, at most (and never more than the server's keys).
DEFAULT_POOL_SCOPES = 16
#: The scope of every request under --draft-pool shared.
SHARED = "shared"


def pool_memory_bytes(tokens: int) -> int:
    """The bytes a DraftPool of `tokens` allocates (its ring of int32 ids and one int64 hash
    table per n-gram length, of the power of two >= 2 * tokens slots), without allocating it;
    a test pins it to DraftPool.memory_bytes."""
    slots = 1 << (2 * tokens - 1).bit_length()
    return 4 * tokens + len(KEYS) * 8 * slots


@dataclass(frozen=True)
class PoolConfig:
    """`--draft-pool`, `--draft-pool-tokens`, `--draft-pool-scopes`; ValueError naming the flag
    for a value out of range."""

    mode: str = "key"
    tokens: int = DEFAULT_POOL_TOKENS  # capacity of each scope's pool, in tokens
    scopes: int = DEFAULT_POOL_SCOPES  # pools held at once

    def __post_init__(self) -> None:
        if self.mode not in POOL_MODES:
            raise ValueError(
                f"--draft-pool must be one of {', '.join(POOL_MODES)}, got {self.mode!r}"
            )
        for flag, v, lo, hi in (
            ("--draft-pool-tokens", self.tokens, MIN_POOL_TOKENS, MAX_POOL_TOKENS),
            ("--draft-pool-scopes", self.scopes, 1, 1 << 16),
        ):
            check_int(flag, v, lo, hi)

    def for_tenants(self, tenants: int) -> PoolConfig:
        """This config on a server with `tenants` possible scopes (its API keys, or 1): no more
        pools than there can be scopes, so memory_limit_bytes is the real bound."""
        n = 1 if self.mode == SHARED else min(self.scopes, max(1, tenants))
        return dataclasses.replace(self, scopes=n)

    @property
    def memory_limit_bytes(self) -> int:
        return 0 if self.mode == "off" else self.scopes * pool_memory_bytes(self.tokens)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "off":
            return "draft pool: off"
        per = "for all requests" if self.mode == SHARED else f"per API key, {self.scopes} at most"
        return (
            f"draft pool: {self.tokens} tokens ({_size(pool_memory_bytes(self.tokens))}) "
            f"{per}: {_size(self.memory_limit_bytes)} at most"
        )


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


@dataclass
class PoolUse:
    """One request's pool, and its counters when the request began (its share is the
    difference at the end)."""

    pool: DraftPool
    before: PoolStats


#: PoolStats field -> the /metrics counter that adds up its increments (serve.metrics defines
#: them); `tokens` is a level, not a count: it is a gauge.
COUNTERS = {
    "documents": "specdec_draft_pool_documents_total",
    "evicted": "specdec_draft_pool_evicted_tokens_total",
    "lookups": "specdec_draft_pool_lookups_total",
    "hits": "specdec_draft_pool_hits_total",
    "drafted": "specdec_draft_pool_drafted_tokens_total",
    "accepted": "specdec_draft_pool_accepted_tokens_total",
}


class ServedPools:
    """The engine's pools. `begin` and `end` run on the worker only (the pools are not
    thread-safe); `gauges` may be read from any thread: it is a snapshot, replaced whole after
    each request."""

    def __init__(self, cfg: PoolConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self._pools = None if cfg.mode == "off" else DraftPools(cfg.scopes, cfg.tokens)
        # The pools DraftPools still holds, to sum the tokens they hold (DraftPools does not
        # list its pools): one it drops is freed, and leaves this map with it.
        self._held: weakref.WeakValueDictionary[str, DraftPool] = weakref.WeakValueDictionary()
        self._gauges = self._measure()

    def scope(self, tenant: str) -> str:
        """Whose earlier requests a request by `tenant` may read: its own (key, off), or every
        tenant's (shared)."""
        return SHARED if self.cfg.mode == SHARED else tenant

    def begin(self, tenant: str) -> PoolUse | None:
        """The pool of a request by `tenant` (serve.keys), created on its scope's first
        request; None when pools are off."""
        if self._pools is None:
            return None
        scope = self.scope(tenant)
        pool = self._pools.get(scope)
        self._held[scope] = pool
        return PoolUse(pool, dataclasses.replace(pool.stats))

    def end(self, use: PoolUse | None, document: Sequence[int]) -> None:
        """Add a request's text (its prompt, then what it committed) to its pool, and count
        what the request did with the pool."""
        if use is None:
            return
        use.pool.add(document)
        now = use.pool.stats
        for name, metric in COUNTERS.items():
            self.metrics.inc(metric, getattr(now, name) - getattr(use.before, name))
        self._gauges = self._measure()

    def gauges(self) -> dict[str, float]:
        return self._gauges

    def _measure(self) -> dict[str, float]:
        pools = self._pools
        return {
            "specdec_draft_pool_scopes": 0 if pools is None else len(pools),
            "specdec_draft_pool_tokens": sum(p.stats.tokens for p in self._held.values()),
            "specdec_draft_pool_memory_bytes": 0 if pools is None else pools.memory_bytes,
            "specdec_draft_pool_memory_limit_bytes": self.cfg.memory_limit_bytes,
            "specdec_draft_pool_capacity_tokens": 0 if self._pools is None else self.cfg.tokens,
        }
