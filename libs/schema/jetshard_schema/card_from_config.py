"""Build a custom model card from what the Hub serves for a repo: `config.json`, the safetensors index and
the repo's file sizes. Pure: the caller fetches, this only interprets, so every rule here is testable offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jetshard_schema.cards import DEFAULT_CAPABILITIES, VISION_ARCHITECTURES, ModelCapability, ModelCard, Quantization
from jetshard_schema.ids import parse_model_id
from jetshard_schema.sampling import generation_config_defaults

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma"})
"""`model_type`s the worker's shard engine can split into layer ranges (its forward pass is written per
architecture; tests/test_engine.py checks it covers this set). mlx-lm knows many more; they are refused
until the shard engine handles them."""
TENSOR_PARALLEL_ARCHITECTURES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Those of them mlx-lm can split every layer of across ranks (its models' `shard(group)`), for tensor-parallel
instances; tests/test_library_boundary.py checks it against mlx-lm."""
# Config keys differ between model families (GPT-2 style `n_layer`, T5 style `d_model`, ...); the first key
# present wins, so the common Hugging Face name comes first.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
_VOCAB_KEYS = ("vocab_size", "n_vocab", "padded_vocab_size")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
THINK_MARKERS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))
"""The single-token think markers mlx-lm's tokenizer wrapper recognises in a vocabulary (`_infer_thinking`)."""


class UnsupportedModelError(ValueError):
    """The repo is a well-formed model that jetshard cannot shard or load (architecture, weight format)."""


def card_from_hub_metadata(
    model_id: str,
    config: Mapping[str, Any],
    safetensors_index: Mapping[str, Any] | None,
    file_sizes: Mapping[str, int],
    generation_config: object = None,
    tokenizer_config: object = None,
) -> ModelCard:
    """Describe a Hub repo as a custom card.

    `config` is the parsed `config.json`; `safetensors_index` the parsed `model.safetensors.index.json`, or
    None for a single-file model; `file_sizes` maps each repo path to its size in bytes; `generation_config`
    the parsed `generation_config.json`, or None, whose sampling values become the card's `generation`;
    `tokenizer_config` the parsed `tokenizer_config.json`, or None, whose added tokens say whether the model thinks.
    Raises `UnsupportedModelError` for an architecture or weight format jetshard cannot serve, and
    `ValueError` naming the field for a config that lacks or garbles a required value.
    """
    valid_id = parse_model_id(model_id)
    if not isinstance(config, Mapping):
        raise ValueError(f"{valid_id}: config.json must be a JSON object, got {type(config).__name__}")

    # Multimodal configs keep the language model's numbers under `text_config`; that is the part jetshard
    # shards, so its values win over any same-named top-level ones (which may describe another tower).
    text_config = config.get("text_config")
    if text_config is not None and not isinstance(text_config, Mapping):
        raise ValueError(f"{valid_id}: config.json 'text_config' must be an object")
    scopes: tuple[Mapping[str, Any], ...] = (text_config, config) if text_config is not None else (config,)

    architecture = _architecture(valid_id, config, text_config)
    num_layers = _required_int(valid_id, scopes, _LAYER_KEYS)
    hidden_size = _required_int(valid_id, scopes, _HIDDEN_KEYS)
    heads = _required_int(valid_id, scopes, _HEAD_KEYS)
    kv_heads = _optional_int(valid_id, scopes, _KV_HEAD_KEYS)
    # Without a kv-head count the model uses plain multi-head attention: one kv head per query head.
    kv_heads = heads if kv_heads is None else kv_heads
    vocab_size = _required_int(valid_id, scopes, _VOCAB_KEYS)
    context_length = _optional_int(valid_id, scopes, _CONTEXT_KEYS)

    storage_size = _storage_size(valid_id, safetensors_index, file_sizes)
    quantization = _quantization(valid_id, config)
    # A config without any context key leaves the card's own default in force rather than inventing one here.
    card_fields: dict[str, Any] = {}
    if context_length is not None:
        card_fields["context_length"] = context_length
    try:
        return ModelCard(
            model_id=valid_id,
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab_size,
            architecture=architecture,
            storage_size_bytes=storage_size,
            storage_size_estimated=False,
            quantization=quantization,
            checkpoint_dtype=_checkpoint_dtype(scopes),
            is_custom=True,
            display_name=valid_id.split("/", 1)[1],
            generation=generation_config_defaults(generation_config),
            capabilities=capabilities_of(architecture, tokenizer_config),
            **card_fields,
        )
    except ValueError as error:  # a value beyond a card's bounds (`ModelCard.__post_init__`)
        raise ValueError(f"{valid_id}: config.json describes no servable model: {error}") from error


def capabilities_of(architecture: str, tokenizer_config: object) -> tuple[ModelCapability, ...]:
    """What a model does, from its architecture (a vision model's, whose tower the engine runs) and its tokenizer's
    added tokens (think markers, found as mlx-lm finds them). A tokenizer config of another shape says nothing:
    capabilities never refuse a model."""
    capabilities = list(DEFAULT_CAPABILITIES)
    tokens = added_tokens(tokenizer_config)
    if any(set(pair) <= tokens for pair in THINK_MARKERS):
        capabilities.append(ModelCapability.THINKING)
    if architecture in VISION_ARCHITECTURES:
        capabilities.append(ModelCapability.VISION)
    return tuple(capabilities)


def added_tokens(tokenizer_config: object) -> set[str]:
    """The texts of the added tokens `tokenizer_config.json` lists (`added_tokens_decoder`, as transformers writes
    it)."""
    decoder = tokenizer_config.get("added_tokens_decoder") if isinstance(tokenizer_config, Mapping) else None
    if not isinstance(decoder, Mapping):
        return set()
    return {
        entry["content"]
        for entry in decoder.values()
        if isinstance(entry, Mapping) and isinstance(entry.get("content"), str)
    }


def _architecture(model_id: str, config: Mapping[str, Any], text_config: Mapping[str, Any] | None) -> str:
    # mlx-lm dispatches on the top-level model_type; only a config without one falls back to text_config's.
    model_type = config.get("model_type")
    if model_type is None and text_config is not None:
        model_type = text_config.get("model_type")
    if model_type is None:
        raise ValueError(f"{model_id}: config.json has no 'model_type'")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{model_id}: config.json 'model_type' must be a non-empty string, got {model_type!r}")
    if model_type not in SUPPORTED_ARCHITECTURES | VISION_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{model_id}: architecture {model_type!r} is not supported; supported architectures: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES | VISION_ARCHITECTURES))
        )
    return model_type


def _lookup(scopes: tuple[Mapping[str, Any], ...], keys: tuple[str, ...]) -> tuple[str, object] | None:
    for scope in scopes:
        for key in keys:
            if key in scope and scope[key] is not None:
                return key, scope[key]
    return None


def _positive_int(model_id: str, key: str, value: object) -> int:
    # bool is an int subclass; `true` as a layer count is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{model_id}: config.json {key!r} must be a positive integer, got {value!r}")
    return value


def _required_int(model_id: str, scopes: tuple[Mapping[str, Any], ...], keys: tuple[str, ...]) -> int:
    found = _lookup(scopes, keys)
    if found is None:
        raise ValueError(f"{model_id}: config.json has no {keys[0]!r} (nor any of {', '.join(keys[1:])})")
    return _positive_int(model_id, *found)


def _optional_int(model_id: str, scopes: tuple[Mapping[str, Any], ...], keys: tuple[str, ...]) -> int | None:
    found = _lookup(scopes, keys)
    return None if found is None else _positive_int(model_id, *found)


def _checkpoint_dtype(scopes: tuple[Mapping[str, Any], ...]) -> str:
    # transformers writes `torch_dtype`, its newer versions `dtype`; anything but the three float dtypes (an
    # absent or "auto" value) is unknown.
    found = _lookup(scopes, ("torch_dtype", "dtype"))
    value = found[1] if found is not None else None
    return value if isinstance(value, str) and value in ("float32", "bfloat16", "float16") else ""


def _quantization(model_id: str, config: Mapping[str, Any]) -> Quantization | None:
    # mlx-lm writes its settings under `quantization` (newer versions copy them to `quantization_config`);
    # a `quantization_config` alone may come from a Hugging Face quantizer instead.
    key = "quantization" if config.get("quantization") is not None else "quantization_config"
    settings = config.get(key)
    if settings is None:
        return None
    if not isinstance(settings, Mapping):
        raise ValueError(f"{model_id}: config.json {key!r} must be an object, got {settings!r}")
    # Hugging Face quantizers (gptq, awq, bitsandbytes, fp8, ...) name themselves in `quant_method` and store
    # weights in layouts mlx-lm cannot load: refuse now rather than fail on every node that loads them.
    method = settings.get("quant_method")
    if key == "quantization_config" and method is not None:
        raise UnsupportedModelError(
            f"{model_id}: weights are quantized with {method!r}; jetshard loads only unquantized or "
            "MLX-quantized safetensors (look for an mlx-community conversion of this model)"
        )
    for field in ("bits", "group_size"):
        if field not in settings:
            raise ValueError(f"{model_id}: config.json {key!r} has no {field!r}")
    return Quantization(
        bits=_positive_int(model_id, f"{key}.bits", settings["bits"]),
        group_size=_positive_int(model_id, f"{key}.group_size", settings["group_size"]),
    )


def _storage_size(model_id: str, index: Mapping[str, Any] | None, file_sizes: Mapping[str, int]) -> int:
    if index is not None:
        metadata = index.get("metadata") if isinstance(index, Mapping) else None
        total = metadata.get("total_size") if isinstance(metadata, Mapping) else None
        if total is not None:
            return _positive_int(model_id, "model.safetensors.index.json metadata.total_size", total)
    # Single-file models have no index, and some indexes omit the total: the files themselves are the truth.
    weights = {path: size for path, size in file_sizes.items() if path.endswith(".safetensors")}
    if not weights:
        raise UnsupportedModelError(
            f"{model_id}: the repo has no .safetensors weights; jetshard loads only safetensors"
        )
    for path, size in weights.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{model_id}: size of {path!r} must be a non-negative integer, got {size!r}")
    return sum(weights.values())
