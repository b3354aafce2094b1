"""The cluster's model catalogue: built-in cards plus custom cards from State, with measured sizes."""

from __future__ import annotations

from msgspec.structs import replace

from jetshard_schema.cards import ModelCard
from jetshard_schema.catalogue import builtin_cards
from jetshard_schema.ids import ModelId
from jetshard_schema.state import State


def _with_measured_size(state: State, card: ModelCard) -> ModelCard:
    measured = state.measured_sizes.get(card.model_id)
    if measured is None or (measured == card.storage_size_bytes and not card.storage_size_estimated):
        return card
    return replace(card, storage_size_bytes=measured, storage_size_estimated=False)


def find_card(state: State, model_id: ModelId) -> ModelCard | None:
    card = state.custom_cards.get(model_id) or builtin_cards().get(model_id)
    return None if card is None else _with_measured_size(state, card)


def all_cards(state: State) -> dict[ModelId, ModelCard]:
    merged = {**builtin_cards(), **state.custom_cards}
    return {model_id: _with_measured_size(state, card) for model_id, card in sorted(merged.items())}


def is_builtin(model_id: ModelId) -> bool:
    return model_id in builtin_cards()
