"""The worker's one boundary with mlx-lm and llguidance, and with mlx's ring backend's socket.

Every name the worker takes from mlx-lm or llguidance is taken here, so that a new version of either is checked in
one place: tests/test_library_boundary.py pins each of them, and the methods the worker calls on the objects they
return (mlx-lm's KV caches, its TokenizerWrapper, llguidance's matcher and tokenizer), with the shape used.
services/worker/pyproject.toml declares the mlx-lm versions that test passes on.

Public API is used wherever there is one; each private use says why there is none.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llguidance.hf
from llguidance import LLMatcher, LLTokenizer
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_p
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_tokenizer

if TYPE_CHECKING:
    # Only llguidance's type stub for its native module defines the options' TypedDict; nothing public names it.
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "LLMatcher",
    "LLTokenizer",
    "PromptTrie",
    "apply_top_p",
    "can_trim_prompt_cache",
    "create_attention_mask",
    "grammar_tokenizer_of",
    "hf_tokenizer_of",
    "infer_quant_config",
    "json_schema_grammar",
    "load_config",
    "load_tokenizer",
    "make_prompt_cache",
    "model_classes",
    "ring_socket_from_previous_rank",
    "shard_across",
    "splits_across_ranks",
    "think_markers_of",
    "trim_prompt_cache",
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
