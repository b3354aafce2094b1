"""Model cards for tests: a small llama shape, with whatever a test cares about overridden."""

from __future__ import annotations

from typing import Any

from jetshard_schema.cards import ModelCard
from jetshard_schema.ids import ModelId


def tiny_card(model_id: str, **fields: Any) -> ModelCard:
    """A llama card of 4 layers, 64 wide, 1 MiB; `fields` override any of these."""
    shape: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "architecture": "llama",
        "storage_size_bytes": 1 << 20,
    }
    return ModelCard(model_id=ModelId(model_id), **{**shape, **fields})
