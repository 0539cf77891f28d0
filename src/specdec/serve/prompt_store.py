"""Many prompts' KV in RAM (llama-server's `--cache-ram`): a slot's cache, copied out before
another request overwrites it, and copied back for a later request that shares a longer
prefix with it than any free slot holds. An editor moving between two files, or two users
taking turns on one slot, then prefill only what changed.

Entries are per scope (serve.draft_pools: a key's, or everyone's where pools are shared), as the
slots' KV is: a request is matched against its own scope's entries alone. The store holds at
most `max_bytes`; the least recently used entry goes first. An entry whose tokens begin
another's is dropped when the longer one comes in (it holds nothing the longer one lacks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.drafters import common_prefix
from specdec.core.model import Saved

#: llama-server's --cache-ram default, in MiB
DEFAULT_CACHE_RAM_MIB = 8192


@dataclass(frozen=True, eq=False)
class Entry:
    """A slot's caches as a request left them: the target's and, where a draft model ran, the
    draft's (None: none, or not kept)."""

    scope: str
    target: Saved
    draft: Saved | None

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)


class PromptStore:
    """Saved caches, by scope, least recently used first, at most `max_bytes` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # by id(entry), LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, scope: str, prompt: Sequence[int]) -> tuple[Entry | None, int]:
        """`scope`'s entry sharing the longest prefix with `prompt`, and that length (None, 0:
        none shares any); the entry becomes the most recently used."""
        best, n = None, 0
        for e in self._entries.values():
            if e.scope == scope:
                m = common_prefix(e.target.tokens, prompt)
                if m > n:
                    best, n = e, m
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, n

    def holds(self, scope: str, tokens: Sequence[int]) -> bool:
        """An entry of `scope` already holds `tokens` (or more after them): saving them again
        would add nothing."""
        t = tuple(tokens)
        return any(
            e.scope == scope and e.target.tokens[: len(t)] == t for e in self._entries.values()
        )

    def put(self, entry: Entry) -> bool:
        """Keep `entry`, dropping what it covers and then the least recently used until it
        fits; False (nothing kept) where it alone exceeds max_bytes."""
        if entry.nbytes > self.max_bytes:
            return False
        tokens = entry.target.tokens
        for key, e in list(self._entries.items()):
            if e.scope == entry.scope and tokens[: len(e.target.tokens)] == e.target.tokens:
                self._drop(key)
        while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[id(entry)] = entry
        self.nbytes += entry.nbytes
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
