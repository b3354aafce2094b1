"""Where sampling values come from when a request leaves them out (pure: no network, no services)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from jetshard_schema.cards import GenerationDefaults, ModelCard
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards, parse_card
from jetshard_schema.codec import encode
from jetshard_schema.ids import ModelId
from jetshard_schema.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ResolvedSampling,
    documented_defaults,
    generation_config_defaults,
    resolve_sampling,
)
from jetshard_schema.types import SamplingParams

NONE = GenerationDefaults()
CARD = GenerationDefaults(temperature=0.2, top_p=0.9, max_tokens=300)
MODEL = GenerationDefaults(temperature=0.6, top_p=0.95, max_tokens=1000)


def test_nothing_set_anywhere_gives_the_documented_defaults() -> None:
    resolved = resolve_sampling(SamplingParams(), NONE, NONE)
    assert resolved == ResolvedSampling(temperature=1.0, top_p=1.0, max_tokens=512)
    assert (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_MAX_TOKENS) == (1.0, 1.0, 512)


def test_each_value_comes_from_the_first_source_that_sets_it() -> None:
    assert resolve_sampling(SamplingParams(), NONE, CARD) == ResolvedSampling(
        temperature=0.2, top_p=0.9, max_tokens=300
    )
    assert resolve_sampling(SamplingParams(), MODEL, CARD) == ResolvedSampling(
        temperature=0.6, top_p=0.95, max_tokens=1000
    )
    request = SamplingParams(temperature=0.7, top_p=0.5, max_tokens=7)
    assert resolve_sampling(request, MODEL, CARD) == ResolvedSampling(temperature=0.7, top_p=0.5, max_tokens=7)
    # Per value, not per source: a source that sets only one value leaves the others to the next.
    only_top_p = GenerationDefaults(top_p=0.8)
    assert resolve_sampling(SamplingParams(max_tokens=9), only_top_p, CARD) == ResolvedSampling(
        temperature=0.2, top_p=0.8, max_tokens=9
    )


def test_the_cuts_and_penalties_come_from_the_first_source_that_sets_them() -> None:
    model = GenerationDefaults(top_k=20, repetition_penalty=1.05)
    card = GenerationDefaults(top_k=40, min_p=0.05, repetition_penalty=1.1)
    assert resolve_sampling(SamplingParams(), model, card) == ResolvedSampling(
        temperature=DEFAULT_TEMPERATURE,
        top_p=DEFAULT_TOP_P,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.05,
        max_tokens=DEFAULT_MAX_TOKENS,
    )
    request = SamplingParams(top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.5, frequency_penalty=-1)
    resolved = resolve_sampling(request, model, card)
    # A request's neutral values win over the model's: top_k 0 is "no cut", not "unset".
    assert (resolved.top_k, resolved.min_p, resolved.repetition_penalty) == (0, 0.0, 1.0)
    assert (resolved.presence_penalty, resolved.frequency_penalty) == (0.5, -1.0)


def test_nothing_set_anywhere_cuts_and_penalises_nothing() -> None:
    resolved = resolve_sampling(SamplingParams(), NONE, NONE)
    assert (resolved.top_k, resolved.min_p, resolved.repetition_penalty) == (0, 0.0, 1.0)
    assert (resolved.presence_penalty, resolved.frequency_penalty) == (0.0, 0.0)


@pytest.mark.parametrize(
    "wire",
    [
        {"top_k": -1},
        {"min_p": 1.01},
        {"repetition_penalty": 0},
        {"repetition_penalty": 10.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.5},
        {"repeat_last_n": -1},
    ],
)
def test_a_task_read_back_with_a_value_out_of_range_does_not_decode(wire: dict[str, Any]) -> None:
    """A task on the bus is untrusted: the engine never sees a value the API would have refused."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(wire), type=SamplingParams)


def test_an_explicit_zero_temperature_is_a_value_not_a_gap() -> None:
    assert resolve_sampling(SamplingParams(temperature=0.0), MODEL, CARD).temperature == 0.0
    assert resolve_sampling(SamplingParams(), GenerationDefaults(temperature=0.0), CARD).temperature == 0.0


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, NONE),
        ({"bos_token_id": 1, "eos_token_id": [2, 3]}, NONE),
        # Qwen3's generation_config.json
        (
            {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
            GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20),
        ),
        # vLLM reads these too; top_k 0 is a value (no cut), not a gap
        (
            {"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1},
            GenerationDefaults(top_k=0, min_p=0.05, repetition_penalty=1.1),
        ),
        ({"max_new_tokens": 256, "temperature": 1}, GenerationDefaults(temperature=1.0, max_tokens=256)),
        # transformers decodes greedily when do_sample is false, whatever temperature says
        ({"do_sample": False, "temperature": 0.7, "top_p": 0.9}, GenerationDefaults(temperature=0.0, top_p=0.9)),
        # values of the wrong type or out of range are the model author's mistake: ignored, not fatal
        (
            {"temperature": "0.7", "top_p": 0, "max_new_tokens": 0, "do_sample": "no"},
            NONE,
        ),
        ({"temperature": True, "top_p": 1.5, "max_new_tokens": 12.5}, NONE),
        ({"top_k": -1, "min_p": 1.5, "repetition_penalty": 0}, NONE),
        ({"top_k": 20.0, "min_p": "0.1", "repetition_penalty": 11}, NONE),
        ({"temperature": float("nan"), "top_p": float("inf"), "max_new_tokens": True}, NONE),
        ([1, 2], NONE),
        (None, NONE),
    ],
)
def test_generation_config_values(config: Any, expected: GenerationDefaults) -> None:
    assert generation_config_defaults(config) == expected


def test_the_smollm2_cards_carry_their_sampling_defaults() -> None:
    cards = builtin_cards()
    # The model card's recommendation for the full-precision model; the 4-bit demo is greedy (see its card).
    assert cards[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")].generation == GenerationDefaults(
        temperature=0.2, top_p=0.9
    )
    assert documented_defaults(cards[DEMO_MODEL_ID].generation) == ResolvedSampling(
        temperature=0.0, top_p=DEFAULT_TOP_P, max_tokens=DEFAULT_MAX_TOKENS
    )


def test_a_card_without_generation_values_still_decodes_and_defaults_to_none() -> None:
    demo = builtin_cards()[DEMO_MODEL_ID]
    wire = msgspec.json.decode(encode(demo))
    del wire["generation"]
    assert msgspec.json.decode(msgspec.json.encode(wire), type=ModelCard).generation == NONE


CARD_HEAD = """
model_id = "acme/tiny"
architecture = "llama"
num_layers = 2
hidden_size = 64
num_attention_heads = 4
num_key_value_heads = 4
vocab_size = 2000
storage_size_bytes = 1000000
"""


@pytest.mark.parametrize(
    ("table", "complaint"),
    [
        ("temprature = 0.2", "generation.temprature"),
        ("temperature = 2.5", "generation.temperature"),
        ("top_p = 0.0", "generation.top_p"),
        ("max_tokens = 0", "generation.max_tokens"),
        ("top_k = -1", "generation.top_k"),
        ("min_p = 1.5", "generation.min_p"),
        ("repetition_penalty = 0.0", "generation.repetition_penalty"),
        ("presence_penalty = 0.5", "generation.presence_penalty"),
    ],
)
def test_the_catalogue_refuses_a_misspelt_or_out_of_range_generation_value(table: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_card("acme--tiny.toml", f"{CARD_HEAD}\n[generation]\n{table}\n")


def test_the_catalogue_reads_a_generation_table() -> None:
    card = parse_card("acme--tiny.toml", f"{CARD_HEAD}\n[generation]\ntemperature = 0.3\nmax_tokens = 64\n")
    assert card.generation == GenerationDefaults(temperature=0.3, max_tokens=64)
