"""The leader's index of saved prefix caches: which token prefixes every rank holds a KV cache for.

Every rank keeps the caches themselves (its own layers' part); only the leader decides which to keep, finds
the nearest one for a new prompt and evicts, and every rank follows its step messages (see `protocol`). The
lookup is mlx-lm's `PromptTrie` (exact, shorter or longer match); eviction is least recently used, bounded
by bytes, like mlx-lm's `LRUPromptCache`, except that the leader must know which entries it drops, to tell
the other ranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from jetshard_worker.library_boundary import PromptTrie

_MODEL = 0  # PromptTrie keys its tries by model; an engine serves one


@dataclass(frozen=True)
class PrefixHit:
    entry: int
    tokens: int
    """How many of the prompt's first tokens the entry's cache holds, once cut to them."""


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    size_bytes: int
    trimmable: bool


class PrefixIndex:
    def __init__(self, budget_bytes: int, min_tokens: int = 16) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self._trie = PromptTrie()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The saved cache that covers most of `tokens`, if it covers at least `min_tokens` of them."""
        if not self._entries or len(tokens) < self.min_tokens:
            return None
        key = list(tokens)
        found = self._trie.search(_MODEL, key)
        candidates: list[tuple[list[int], int]] = []
        if found.exact is not None:
            candidates.append((found.exact, len(key)))
        if found.shorter is not None:
            candidates.append((found.shorter, len(found.shorter)))
        if found.longer is not None:
            candidates.append((found.longer, found.common_prefix))
        for entry_tokens, covered in sorted(candidates, key=lambda c: -c[1]):
            entry_id: int = self._trie.get(_MODEL, entry_tokens)
            entry = self._entries[entry_id]
            if covered < self.min_tokens or (covered < len(entry.tokens) and not entry.trimmable):
                continue
            self._entries.move_to_end(entry_id)
            return PrefixHit(entry_id, covered)
        return None

    def holds(self, tokens: Sequence[int]) -> bool:
        found = self._trie.search(_MODEL, list(tokens))
        return found.exact is not None

    def add(self, tokens: Sequence[int], size_bytes: int, trimmable: bool) -> tuple[int | None, list[int]]:
        """Save a cache of `tokens`: its entry id (None when it alone exceeds the budget) and the entries
        evicted to make room, or made redundant (a trimmable cache serves each of its prefixes)."""
        if size_bytes > self.budget_bytes or len(tokens) < self.min_tokens or self.holds(tokens):
            return None, []
        entry_id = self._next_id
        self._next_id += 1
        key = list(tokens)
        evicted = []
        self._trie.add(_MODEL, key, entry_id)
        if trimmable:  # pop_prefixes walks the path `add` just made
            for length, prefix_id in self._trie.pop_prefixes(_MODEL, key):
                evicted.append(prefix_id)
                self._forget(prefix_id, key[:length], popped=True)
        self._entries[entry_id] = _Entry(tuple(key), size_bytes, trimmable)
        self.size_bytes += size_bytes
        while self.size_bytes > self.budget_bytes:
            oldest_id, oldest = next(iter(self._entries.items()))
            evicted.append(oldest_id)
            self._forget(oldest_id, list(oldest.tokens))
        return entry_id, evicted

    def _forget(self, entry_id: int, tokens: list[int], popped: bool = False) -> None:
        if not popped:
            self._trie.pop(_MODEL, tokens)
        self.size_bytes -= self._entries.pop(entry_id).size_bytes
