"""Model cards for tests: a small llama shape, with whatever a test cares about overridden."""

from __future__ import annotations

from typing import Any

from jetshard_schema.cards import ModelCard
from jetshard_schema.ids import ModelId

# A llama card's fields but its id: 4 layers, 64 wide, 1 MiB (JSON-ready, for wire-level tests too).
TINY_SHAPE: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "architecture": "llama",
    "storage_size_bytes": 1 << 20,
}


def tiny_card(model_id: str, **fields: Any) -> ModelCard:
    """A card of `TINY_SHAPE`; `fields` override any of its fields."""
    return ModelCard(model_id=ModelId(model_id), **{**TINY_SHAPE, **fields})
