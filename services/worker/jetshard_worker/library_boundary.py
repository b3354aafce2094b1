"""The worker's one boundary with mlx-lm, mlx-vlm and llguidance, and with mlx's ring backend's socket.

Every name the worker takes from mlx-lm, mlx-vlm or llguidance is taken here (save `schema_check`'s one, for
llama.cpp runners, which never import MLX), so that a new version of any is checked in one place:
tests/test_library_boundary.py pins each of them, and the methods the worker calls on the objects they return
(mlx-lm's KV caches, its TokenizerWrapper, llguidance's matcher and tokenizer, mlx-vlm's model and processor), with
the shape used. services/worker/pyproject.toml declares the versions that test passes on.

mlx-vlm is the optional `vision` extra (it pulls opencv, datasets, audio and web-server packages a node serving
text models only should not carry), so it is imported only where a vision model is loaded or prompted.

Public API is used wherever there is one; each private use says why there is none.
"""

from __future__ import annotations

import importlib
import io
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import llguidance.hf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    PromptTrie,
    QuantizedKVCache,
    can_trim_prompt_cache,
    dynamic_roll,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_tokenizer

if TYPE_CHECKING:
    # Only llguidance's type stub for its native module defines the options' TypedDict; nothing public names it.
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "BatchKVCache",
    "KVCache",
    "LLMatcher",
    "LLTokenizer",
    "PromptTrie",
    "QuantizedKVCache",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "can_trim_prompt_cache",
    "create_attention_mask",
    "dynamic_roll",
    "grammar_tokenizer_of",
    "hf_tokenizer_of",
    "infer_quant_config",
    "json_schema_grammar",
    "load_config",
    "load_tokenizer",
    "make_frequency_penalty",
    "make_presence_penalty",
    "make_prompt_cache",
    "make_repetition_penalty",
    "model_classes",
    "prompt_embeddings",
    "prompt_inputs",
    "ring_socket_from_previous_rank",
    "shard_across",
    "splits_across_ranks",
    "think_markers_of",
    "trim_prompt_cache",
    "vision_model",
    "vision_processor",
    "vision_weights",
]


def model_classes(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's model class and its arguments class for `config`, chosen as mlx-lm's loader chooses them (remapped
    model types included). ValueError if mlx-lm has no module for the model type.

    `_get_classes` is private: mlx-lm's public loader (`load_model`) takes it only as the default of its
    `get_model_classes` argument, and offers no way to get the classes without loading every weight.
    """
    return _get_classes(dict(config))


def splits_across_ranks(model_class: Any) -> bool:
    """Whether mlx-lm can split every layer of `model_class`'s models across the ranks of a group (tensor
    parallelism): the class has mlx-lm's `shard(group)` method."""
    return callable(getattr(model_class, "shard", None))


def shard_across(model: Any, group: Any) -> None:
    """Replace each layer's projections of `model` by mlx-lm's sharded ones for this rank of `group`: query, key,
    value, gate and up projections keep this rank's output slice, the output and down projections this rank's input
    slice and sum over the group (`mlx.nn.layers.distributed.shard_linear`). Works on lazily loaded weights: only
    the slices are ever evaluated and kept."""
    model.shard(group)


def hf_tokenizer_of(wrapper: TokenizerWrapper) -> Any:
    """The Hugging Face tokenizer that mlx-lm's `TokenizerWrapper` wraps.

    `_tokenizer` is private: the wrapper forwards attribute reads to it but has no public name for the tokenizer
    itself, which llguidance needs as an object of its own.
    """
    return wrapper._tokenizer


def think_markers_of(wrapper: TokenizerWrapper) -> tuple[str, str, tuple[int, ...], tuple[int, ...]] | None:
    """The model's think markers as mlx-lm's `TokenizerWrapper` detects them in the vocabulary: the start and end
    marker's text and token ids; None for a model that does not think."""
    if not wrapper.has_thinking:
        return None
    start_tokens, end_tokens = wrapper.think_start_tokens, wrapper.think_end_tokens
    return wrapper.think_start, wrapper.think_end, tuple(start_tokens), tuple(end_tokens)


def grammar_tokenizer_of(tokenizer: Any, vocab_size: int) -> LLTokenizer:
    """llguidance's view of `tokenizer`, a fast Hugging Face tokenizer or mlx-lm's TokenizerWrapper around one, with
    `vocab_size` tokens (the model's logits width). With a TokenizerWrapper each of its EOS ids is an EOS."""
    if isinstance(tokenizer, TokenizerWrapper):
        eos = sorted(tokenizer.eos_token_ids)
        return llguidance.hf.from_tokenizer(hf_tokenizer_of(tokenizer), n_vocab=vocab_size, eos_token=eos)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def json_schema_grammar(schema: dict[str, Any], options: JsonCompileOptions) -> str:
    """llguidance's grammar for JSON documents valid for `schema`, compiled with `options`; ValueError if `schema`
    is not a JSON object (llguidance checks the schema itself only when a matcher is made of the grammar)."""
    return LLMatcher.grammar_from_json_schema(schema, overrides=options)


def _mlx_vlm(module: str) -> ModuleType:
    try:
        return importlib.import_module(f"mlx_vlm.{module}")
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("mlx_vlm"):
            raise
        raise RuntimeError(
            "this node cannot serve vision models: mlx-vlm is not installed (install jetshard's `vision` extra, "
            "e.g. `uv sync --extra vision`)"
        ) from error


def vision_model(config: Mapping[str, Any]) -> nn.Module:
    """mlx-vlm's whole model (vision tower, projector, language model) for a vision model's `config`, built as
    mlx-vlm's loader builds it; its parameters stay lazy until loaded or evaluated."""
    utils = _mlx_vlm("utils")
    config = dict(config)
    module, _ = utils.get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = utils.update_module_configs(
        model_config, module, config, ["text", "vision", "perceiver", "projector"]
    )
    model: nn.Module = module.Model(model_config)
    return model


def vision_weights(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`weights` renamed and reshaped as mlx-vlm's loader does for `model` (a Hugging Face checkpoint's names to
    mlx-vlm's; an MLX checkpoint's pass unchanged)."""
    utils = _mlx_vlm("utils")
    weights = utils.sanitize_weights(model, weights)
    return utils.sanitize_weights(type(model.vision_model), weights, model.config.vision_config)


def vision_processor(model_dir: Any) -> Any:
    """The model's processor (tokenizer, image processor, chat template) as mlx-vlm loads it."""
    return _mlx_vlm("utils").load_processor(model_dir, add_detokenizer=False)


MAX_IMAGE_PIXELS = 40_000_000
"""An image larger than this (about 8000x5000) is refused before it is decoded: each processor shrinks it anyway,
and a small file can unpack to gigabytes."""


def prompt_inputs(
    processor: Any, prompt: str, images: Sequence[bytes], image_token_index: int | None
) -> dict[str, np.ndarray]:
    """The model's inputs for the rendered `prompt` and its `images` (encoded files), as mlx-vlm's generate
    prepares them, as numpy arrays: `input_ids` (1, L) with each image's placeholder expanded to its tokens,
    `pixel_values` and whatever else the model's `get_input_embeddings` takes (Idefics3's `pixel_attention_mask`).
    ValueError naming the image for one that is not a readable PNG, JPEG, GIF or WebP file."""
    utils = _mlx_vlm("utils")
    inputs = utils.prepare_inputs(
        processor,
        images=[_decoded(i, data) for i, data in enumerate(images)],
        prompts=prompt,
        image_token_index=image_token_index,
        add_special_tokens=False,
    )
    return {key: np.asarray(value) for key, value in inputs.items() if key != "attention_mask" and value is not None}


def _decoded(index: int, data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError  # mlx-vlm's image library

    try:
        image = Image.open(io.BytesIO(data), formats=("PNG", "JPEG", "GIF", "WEBP"))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"image {index} is {image.width}x{image.height}; at most {MAX_IMAGE_PIXELS} pixels")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as error:  # PIL's errors for a broken file
        raise ValueError(f"image {index} is not a readable PNG, JPEG, GIF or WebP file: {error}") from error


def prompt_embeddings(model: nn.Module, input_ids: mx.array, inputs: Mapping[str, mx.array]) -> mx.array:
    """The language model's input embeddings (1, L, hidden) for `input_ids` (1, L) with the images' features in
    place of their tokens: mlx-vlm's vision tower and projector, merged as its generate merges them."""
    features = model.get_input_embeddings(input_ids, **inputs)
    embeddings: mx.array = features.inputs_embeds
    return embeddings


def ring_socket_from_previous_rank(listen_port: int) -> socket.socket | None:
    """The TCP socket mlx's ring backend accepted from the previous rank: the connected one whose local port is
    this rank's hostfile port (mlx closes the listening socket after accepting). None if there is none.

    mlx exposes no handle on its ring backend's sockets, so this scans the process's file descriptors.
    """
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else range(1024):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # Only TCP: a unix socket's name is a str (the runner's own NATS or logging sockets).
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockname()[1] == listen_port
            ):
                sock.getpeername()  # connected, not a listener
                return sock
        except OSError:
            pass
        sock.close()
    return None
