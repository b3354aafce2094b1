"""KV caches stored quantized, for the batches the engine keeps (`serving.kv_cache_type` q8_0 or q4_0 on MLX).

mlx-lm quantizes one row's cache (`QuantizedKVCache`) but batches only full-precision ones (`BatchKVCache`: merge
rows, pad, extend a batch, filter rows, extract one). `BatchQuantizedKVCache` is that batch cache with each of its
keys and values a quantized triple (packed values, scales, biases): every move `BatchKVCache` makes along the batch
or position axis applies to the three alike, and mlx-lm's attention reads the triple as it reads a
`QuantizedKVCache`'s, by its `bits` and `group_size`. Keys and values are quantized as they are written, so a prompt's
own attention already reads them quantized, as each later token's does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
from jetshard_schema.types import kv_group_size

from jetshard_worker.library_boundary import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

Triple = tuple[mx.array, mx.array, mx.array]
"""A quantized tensor as `mx.quantize` gives it: packed values, scales, biases; the axes before the last are the
tensor's own (batch, head, position)."""


def quantized_layers(cache: list[Any], bits: int) -> list[Any]:
    """A fresh prompt cache (`make_prompt_cache`) with each full-context layer stored in `bits`. Sliding-window and
    recurrent layers keep their own caches: they hold a window or a state, not the whole context."""
    return [QuantizedRow(bits) if type(layer) is KVCache else layer for layer in cache]


def _each(triple: Triple, move: Any) -> Triple:
    packed, scales, biases = triple
    return move(packed), move(scales), move(biases)


class QuantizedRow(QuantizedKVCache):  # type: ignore[misc]
    """One row's quantized cache, as a saved prefix keeps it, that merges with others into a
    `BatchQuantizedKVCache` (where mlx-lm's has no `merge`)."""

    keys: Any  # a Triple, None while empty (mlx-lm's attributes)
    values: Any
    offset: int

    def __init__(self, bits: int, group_size: int = 0) -> None:
        super().__init__(group_size=group_size, bits=bits)

    @classmethod
    def merge(cls, rows: list[QuantizedRow]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge_rows(rows)


class BatchQuantizedKVCache(BatchKVCache):  # type: ignore[misc]
    """mlx-lm's `BatchKVCache` (left padding, one write index `_idx` for all rows) over quantized keys and values."""

    keys: Any  # a Triple, None while empty (mlx-lm's attributes)
    values: Any
    offset: mx.array
    left_padding: mx.array
    _idx: int
    _right_padding: Any  # the rows' right padding until `finalize`, else None

    def __init__(self, left_padding: list[int], bits: int, group_size: int = 0) -> None:
        super().__init__(left_padding)
        self.bits = bits
        self.group_size = group_size
        """Values a scale and bias cover: chosen from the heads' width at the first write (0 until then)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        if not self.group_size:
            self.group_size = _group_size(keys, values)
        start, steps = self._idx, keys.shape[2]
        if self.keys is None or start + steps > self.keys[0].shape[2]:
            room = (self.step + steps - 1) // self.step * self.step
            grown_keys, grown_values = self._zeros(keys, room), self._zeros(values, room)
            if self.keys is None:
                self.keys, self.values = grown_keys, grown_values
            else:
                self.keys = _joined(_each(self.keys, lambda a: a[..., :start, :]), grown_keys, axis=2)
                self.values = _joined(_each(self.values, lambda a: a[..., :start, :]), grown_values, axis=2)
        self.offset = self.offset + steps
        self._idx += steps
        for stored, new in _paired((self.keys, self.values), (self._quantize(keys), self._quantize(values))):
            stored[..., start : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        end = self._idx
        return _each(self.keys, lambda a: a[..., :end, :]), _each(self.values, lambda a: a[..., :end, :])

    def finalize(self) -> None:
        """Moves each row's right padding (prefilled with the others' longer prompts) to its left."""
        if self._right_padding is None:
            return
        shifts = self._right_padding[:, None]
        self.keys = _each(self.keys, lambda a: dynamic_roll(a, shifts, axis=2))
        self.values = _each(self.values, lambda a: dynamic_roll(a, shifts, axis=2))
        self.offset = self.offset - self._right_padding
        self.left_padding += self._right_padding
        self._right_padding = None

    def filter(self, batch_indices: list[int]) -> None:
        """Keeps the rows `batch_indices`, and drops the padding every one of them has on its left."""
        if self.keys is not None:
            self.keys = _each(self.keys, lambda a: a[batch_indices])
            self.values = _each(self.values, lambda a: a[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(cast("list[int]", self.left_padding.tolist()))
        if shared > 0:
            if self.keys is not None:
                self.keys = _each(self.keys, lambda a: a[..., shared:, :])
                self.values = _each(self.values, lambda a: a[..., shared:, :])
            self._idx -= shared
            self.left_padding -= shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Appends `other`'s rows, both right-aligned at the longer one's write index."""
        self.group_size = self.group_size or other.group_size
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other._idx)
        filled = self if self.keys is not None else other
        length = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        mine, theirs = (c._aligned(end, length, filled) for c in (self, other))
        self.keys = _joined(mine[0], theirs[0], axis=0)
        self.values = _joined(mine[1], theirs[1], axis=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([mine[2], theirs[2]])
        self._idx = end

    def _aligned(self, end: int, length: int, filled: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array]:
        """This batch's keys, values and left padding with its write index moved to `end` and `length` positions
        in all (an empty batch: zero positions shaped as `filled`'s)."""
        rows = self.offset.shape[0]
        if self.keys is None:
            keys = _each(filled.keys, lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype))
            values = _each(filled.values, lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype))
        else:
            keys, values = self.keys, self.values
        left = end - self._idx
        right = length - keys[0].shape[2] - left
        if right < 0:
            keys, values = (_each(t, lambda a: a[..., :right, :]) for t in (keys, values))
            right = 0
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            keys, values = (_each(t, lambda a: mx.pad(a, widths)) for t in (keys, values))
        return keys, values, self.left_padding + left

    def extract(self, idx: int) -> QuantizedRow:
        padding = cast("list[int]", self.left_padding.tolist())[idx]
        row = QuantizedRow(self.bits, self.group_size)
        row.keys = _each(self.keys, lambda a: mx.contiguous(a[idx : idx + 1, :, padding : self._idx]))
        row.values = _each(self.values, lambda a: mx.contiguous(a[idx : idx + 1, :, padding : self._idx]))
        row.offset = self._idx - padding
        return row

    @classmethod
    def merge_rows(cls, rows: list[QuantizedRow]) -> BatchQuantizedKVCache:
        """One batch of `rows` (fresh, or saved prefixes), each right-aligned at the longest's length."""
        lengths = [row.offset for row in rows]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        filled = [row for row in rows if row.offset]
        batch = cls(padding, rows[0].bits, filled[0].group_size if filled else 0)
        if not filled:
            return batch
        template = filled[0]
        shape = (len(rows), *template.keys[0].shape[1:2])
        batch.keys = _each(template.keys, lambda a: mx.zeros((*shape, longest, a.shape[3]), a.dtype))
        batch.values = _each(template.values, lambda a: mx.zeros((*shape, longest, a.shape[3]), a.dtype))
        for i, (pad, row) in enumerate(zip(padding, rows, strict=True)):
            if not row.offset:
                continue
            for stored, own in _paired((batch.keys, batch.values), (row.keys, row.values)):
                stored[i : i + 1, :, pad:] = own[..., : row.offset, :]
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def _quantize(self, x: mx.array) -> Triple:
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return packed, scales, biases

    def _zeros(self, like: mx.array, length: int) -> Triple:
        """Room for `length` positions of tensors shaped as `like` (batch, heads, positions, width), quantized."""
        rows, heads, _, width = like.shape
        per_word = 32 // self.bits
        groups = width // self.group_size
        return (
            mx.zeros((rows, heads, length, width // per_word), mx.uint32),
            mx.zeros((rows, heads, length, groups), like.dtype),
            mx.zeros((rows, heads, length, groups), like.dtype),
        )


def _paired(first: tuple[Triple, Triple], second: tuple[Triple, Triple]) -> Iterator[tuple[mx.array, mx.array]]:
    """Each array of `first`'s keys and values beside the same one of `second`'s."""
    for mine, theirs in zip(first, second, strict=True):
        yield from zip(mine, theirs, strict=True)


def _joined(first: Triple, second: Triple, axis: int) -> Triple:
    packed, scales, biases = (mx.concatenate([a, b], axis=axis) for a, b in zip(first, second, strict=True))
    return packed, scales, biases


def _group_size(keys: mx.array, values: mx.array) -> int:
    size = kv_group_size(math.gcd(keys.shape[-1], values.shape[-1]))
    if size is None:
        raise ValueError(
            f"a quantized KV cache stores heads of a multiple of 32 values; this model's keys have {keys.shape[-1]} "
            f"and its values {values.shape[-1]}"
        )
    return size
