"""A vision prompt on its way to rank 0: its token ids and its images' arrays as the model's processor made them
(pixel values, and whatever else the model's embedding takes), packed into the bytes of one IMAGES step."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np

INPUT_IDS = "input_ids"


def pack_prompt(tokens: Sequence[int], arrays: Mapping[str, np.ndarray]) -> mx.array:
    """(1, n) uint8: the prompt's tokens and its image arrays, in numpy's own archive format."""
    if INPUT_IDS in arrays:
        raise ValueError(f"image arrays must not be named {INPUT_IDS!r}: that is the prompt's tokens")
    buffer = io.BytesIO()
    named: dict[str, np.ndarray] = {INPUT_IDS: np.asarray(tokens, dtype=np.int32)[None, :], **arrays}
    np.savez(buffer, allow_pickle=False, **named)
    return mx.array(np.frombuffer(buffer.getvalue(), dtype=np.uint8)[None, :])


def unpack_prompt(payload: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
    """The prompt's token ids (1, L) and its image arrays, as `pack_prompt` packed them."""
    with np.load(io.BytesIO(np.asarray(payload).tobytes()), allow_pickle=False) as archive:
        arrays = {name: mx.array(archive[name]) for name in archive.files}
    return arrays.pop(INPUT_IDS), arrays
