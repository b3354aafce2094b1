"""MLX's quantized KV cache (`serving.kv_cache_type` q8_0 or q4_0 on MLX): how far it moves a model's choices, and
what it holds, on a tiny model read whole by mlx-lm (no engine: `test_engine` holds the engine's batches to mlx-lm's
own quantized cache, token for token).

The tiny model's weights are random, so its top logits are often near ties: a worse case for rounding than a trained
model's (the demo, on MLX, begins its greedy answers the same with 8 bits: `test_faster_tokens`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.cards import tiny_card
from helpers.tiny_models import make_tiny_model
from jetshard_schema.placement import kv_cache_bytes
from jetshard_schema.types import KvCacheType
from jetshard_worker.engines.mlx.quantized_cache import BatchQuantizedKVCache
from jetshard_worker.library_boundary import BatchKVCache
from mlx_lm import load as mlx_load

ROWS, POSITIONS, CHUNK = 3, 300, 37
SAME_GREEDY_SHARE = 0.85
"""The share of positions at which the 8-bit cache's greedy token is the 32-bit cache's, at least. Measured: 0.93 of
these 900, the others where the tiny model's two best tokens stood within a logit of each other."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A tiny llama whose heads are 64 values wide (groups of 64), computing in float32."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("kv") / "model", hidden_size=256, num_files=1)
    loaded, _ = mlx_load(str(model_dir))
    return loaded


def log_probabilities(model: object, bits: int | None) -> tuple[mx.array, int]:
    """The model's log-probabilities at every position of `ROWS` rows of random tokens, prefilled in chunks of
    `CHUNK` through a batch cache of `bits` (None: as computed), and the bytes its caches hold then."""
    caches = [
        BatchKVCache([0] * ROWS) if bits is None else BatchQuantizedKVCache([0] * ROWS, bits)
        for _ in model.layers  # type: ignore[attr-defined]
    ]
    tokens = mx.random.randint(0, 500, (ROWS, POSITIONS), key=mx.random.key(0))
    chunks = []
    for start in range(0, POSITIONS, CHUNK):
        logits = model(tokens[:, start : start + CHUNK], cache=caches)  # type: ignore[operator]
        chunks.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return mx.concatenate(chunks, axis=1), sum(cache.nbytes for cache in caches)


def test_an_8_bit_kv_cache_keeps_nearly_every_greedy_choice_in_a_third_of_the_memory(model: object) -> None:
    as_computed, computed_bytes = log_probabilities(model, None)
    in_8_bits, quantized_bytes = log_probabilities(model, 8)
    same = mx.argmax(in_8_bits, axis=-1) == mx.argmax(as_computed, axis=-1)
    assert mx.mean(same).item() >= SAME_GREEDY_SHARE
    # Where the choice changed, the 32-bit model's two best were close: rounding breaks near ties only.
    top_two = mx.sort(as_computed, axis=-1)[..., -2:]
    assert mx.max(mx.where(same, 0.0, top_two[..., 1] - top_two[..., 0])).item() < 2.0
    # 8 bits and a float32 scale and bias for each group of 64: 9 bits a value where float32 takes 32, as placement
    # counts it.
    assert computed_bytes / quantized_bytes == pytest.approx(32 / 9)
    card = tiny_card("acme/tiny", hidden_size=256, context_length=POSITIONS, checkpoint_dtype="float32")
    ratio = kv_cache_bytes(card) / kv_cache_bytes(card, kv_cache_type=KvCacheType.Q8_0)
    assert ratio == pytest.approx(32 / 9, rel=1e-3)


def test_a_4_bit_kv_cache_holds_about_a_seventh_and_an_8_bit_one_is_closer_to_as_computed(model: object) -> None:
    as_computed, computed_bytes = log_probabilities(model, None)
    in_8_bits, _ = log_probabilities(model, 8)
    in_4_bits, quantized_bytes = log_probabilities(model, 4)
    assert computed_bytes / quantized_bytes == pytest.approx(32 / 5)
    assert mx.mean(mx.abs(in_8_bits - as_computed)).item() < mx.mean(mx.abs(in_4_bits - as_computed)).item()
