"""One rank's KV caches, which only the ring's step messages change (see `protocol` and `RankCaches`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from jetshard_worker.library_boundary import trim_prompt_cache

from .images import unpack_prompt
from .protocol import (
    FLAG_COHORT,
    GATHER_PREFIX,
    GATHER_PREFIX_LEN,
    GATHER_SLOT,
    GATHER_TOKENS,
    ROLLBACK_DROP,
    Header,
    Op,
)
from .quantized_cache import quantized_layers
from .shard import Shard


@dataclass
class _CohortCache:
    cache: list[Any]
    slots: list[int]
    padded: bool  # prepared for right padding: finalized (the padding moved to the left) as it joins
    restored: list[int]  # the prompt tokens each row's cache starts with (a saved prefix's)


@dataclass
class _PromptEmbeddings:
    """A vision prompt's input embeddings, its images' features in place of their tokens (rank 0 only)."""

    embeddings: mx.array  # (1, L, hidden)
    used: int = 0  # columns its cohort's PREFILL steps took so far


class RankCaches:
    """One rank's KV caches: each prefill cohort's, each micro-batch's (its rows' caches merged; row i of group g
    is slot `rows[g][i]`), and the saved prefixes. The leader and the followers change them through the same
    methods, from the same step headers, in the same order. mlx-lm's batch caches do the padding, merging,
    extending and extracting, as in its BatchGenerator; with `kv_bits`, `quantized_cache`'s do, over keys and values
    stored in that many bits."""

    def __init__(self, shard: Shard, kv_bits: int | None = None) -> None:
        self._shard = shard
        self._kv_bits = kv_bits
        self._cohorts: dict[int, _CohortCache] = {}
        self._saved: dict[int, tuple[list[Any], int]] = {}  # prefix -> (cache, tokens in it); never mutated
        self.rows: dict[int, list[int]] = {}
        self._batches: dict[int, list[Any]] = {}
        self._prompts: dict[int, _PromptEmbeddings] = {}  # cohort -> its vision prompt's embeddings

    def images(self, header: Header, payload: mx.array) -> None:
        """Rank 0 embeds cohort `header.slot`'s vision prompt (one row, after its GATHER) with its images once; its
        PREFILL steps take their columns (`embed`), from the end of the saved prefix its cache starts from. The
        other ranks see only hidden states."""
        if not self._shard.is_first:
            return
        tokens, arrays = unpack_prompt(payload)
        embeddings = self._shard.embed_prompt(tokens, arrays)
        mx.eval(embeddings)
        self.for_prefill(header)  # the cohort's GATHER came first
        (restored,) = self._cohorts[header.slot].restored  # a vision prompt is prefilled alone
        self._prompts[header.slot] = _PromptEmbeddings(embeddings, used=restored)

    def embed(self, header: Header, tokens: mx.array) -> mx.array:
        """Rank 0's input to its layers for a PREFILL or DECODE step's token ids."""
        prompt = self._prompts.get(header.slot) if header.op == Op.PREFILL else None
        if prompt is None:
            return self._shard.embed(tokens)
        start = prompt.used
        prompt.used += tokens.shape[1]
        return prompt.embeddings[:, start : prompt.used]

    def gather(self, header: Header, table: mx.array) -> None:
        rows = cast("list[list[int]]", table.tolist())
        starts = [self._start(row[GATHER_PREFIX], row[GATHER_PREFIX_LEN]) for row in rows]
        merged = [type(layers[0]).merge(list(layers)) for layers in zip(*starts, strict=True)]
        lengths = [row[GATHER_TOKENS] for row in rows]
        padding = [max(lengths) - n for n in lengths]
        if any(padding):
            for layer in merged:
                layer.prepare(lengths=lengths, right_padding=padding)
        restored = [row[GATHER_PREFIX_LEN] if row[GATHER_PREFIX] >= 0 else 0 for row in rows]
        self._cohorts[header.slot] = _CohortCache(merged, [row[GATHER_SLOT] for row in rows], any(padding), restored)

    def for_prefill(self, header: Header) -> list[Any]:
        if header.slot not in self._cohorts:
            raise RuntimeError(f"a {header.op.name} step names cohort {header.slot}, which has no cache")
        return self._cohorts[header.slot].cache

    def join(self, header: Header, table: mx.array) -> None:
        self.for_prefill(header)
        cohort = self._cohorts.pop(header.slot)
        self._prompts.pop(header.slot, None)
        if cohort.padded:
            for layer in cohort.cache:
                layer.finalize()
        for row, (save, tokens) in enumerate(cast("list[list[int]]", table.tolist())):
            if save >= 0:
                self._saved[save] = ([layer.extract(row) for layer in cohort.cache], tokens)
        rows = self.rows.setdefault(header.group, [])
        if rows:
            for batched, joining in zip(self._batches[header.group], cohort.cache, strict=True):
                batched.extend(joining)
        else:
            self._batches[header.group] = cohort.cache
        rows.extend(cohort.slots)

    def cohort_bytes(self, cohort: int) -> int:
        found = self._cohorts.get(cohort)
        return 0 if found is None else sum(layer.nbytes for layer in found.cache)

    def release(self, header: Header) -> None:
        if header.flags & FLAG_COHORT:
            self._cohorts.pop(header.slot, None)
            self._prompts.pop(header.slot, None)
            return
        group = next((g for g, rows in self.rows.items() if header.slot in rows), None)
        if group is None:
            return
        keep = [i for i, row in enumerate(self.rows[group]) if row != header.slot]
        self.rows[group] = [self.rows[group][i] for i in keep]
        if not keep:
            del self._batches[group]
            return
        for layer in self._batches[group]:
            layer.filter(keep)

    def rollback(self, header: Header, table: mx.array) -> None:
        """Cuts each row of micro-batch `header.group` by its `ROLLBACK_DROP` positions: the batch by the fewest,
        then each row by the rest, as right padding moved to its left (masked from then on), so that all rows
        still end at the batch's one write index."""
        drops = [row[ROLLBACK_DROP] for row in cast("list[list[int]]", table.tolist())]
        fewest = min(drops)
        for layer in self.for_decode(header):
            if fewest:
                layer.trim(fewest)
            if any(n > fewest for n in drops):
                layer.prepare(right_padding=[n - fewest for n in drops])
                layer.finalize()

    def evict(self, prefix: int) -> None:
        self._saved.pop(prefix, None)

    def for_decode(self, header: Header) -> list[Any]:
        rows = self.rows.get(header.group, [])
        if header.batch != len(rows):
            raise RuntimeError(
                f"a decode step carries {header.batch} rows, micro-batch {header.group} holds {len(rows)}"
            )
        return self._batches[header.group]

    def _start(self, prefix: int, prefix_len: int) -> list[Any]:
        """A row's cache before its prefill: empty, or a copy of saved prefix `prefix` cut to `prefix_len`."""
        if prefix < 0:
            fresh = self._shard.make_cache()
            return fresh if self._kv_bits is None else quantized_layers(fresh, self._kv_bits)
        if prefix not in self._saved:
            raise RuntimeError(f"a cohort's row starts from saved prefix {prefix}, which this rank lacks")
        saved, tokens = self._saved[prefix]
        cache = copy.deepcopy(saved)
        if tokens > prefix_len:
            trim_prompt_cache(cache, tokens - prefix_len)
        return cache
