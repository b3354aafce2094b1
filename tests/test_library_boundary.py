"""Every touchpoint of mlx-lm, mlx-vlm, llguidance and mlx's ring socket that `jetshard_worker.library_boundary`
relies on: each name exists, takes the arguments the worker passes and gives back what the worker reads, on the
mlx-lm, mlx-vlm and llguidance versions installed. A new version that moves or reshapes one of them fails here,
not in a runner.

Fast: a one-layer tiny model, no cluster."""

from __future__ import annotations

import inspect
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers.tiny_models import make_tiny_model
from helpers.tiny_vlm import make_tiny_vlm, png
from jetshard_schema.card_from_config import SUPPORTED_ARCHITECTURES, TENSOR_PARALLEL_ARCHITECTURES
from jetshard_worker import library_boundary as boundary
from jetshard_worker.schema_check import json_schema_errors
from jetshard_worker.text.constrained import JSON_OPTIONS
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

TINY_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("boundary") / "model", num_layers=1, num_files=1)


@pytest.fixture(scope="module")
def wrapper(model_dir: Path) -> Any:
    return boundary.load_tokenizer(model_dir, None, [2, 3])


# --------------------------------------------------------------------------- mlx-lm: loading


def test_load_config_and_model_classes(model_dir: Path) -> None:
    config = boundary.load_config(model_dir)
    assert config["model_type"] == "llama"
    for model_type, module in [("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"), ("gemma", "gemma")]:
        model_class, args_class = boundary.model_classes({"model_type": model_type})
        assert model_class.__module__ == f"mlx_lm.models.{module}"
        assert hasattr(args_class, "from_dict")
    with pytest.raises(ValueError):
        boundary.model_classes({"model_type": "no-such-architecture"})


def test_infer_quant_config_takes_a_path_an_unquantized_module_and_the_weights() -> None:
    assert parameters(boundary.infer_quant_config) == ["path", "module", "weights"]
    linear = nn.Linear(64, 8, bias=False)
    weight, scales, biases = mx.quantize(mx.zeros((8, 64)), group_size=32, bits=4)
    found = boundary.infer_quant_config("x", linear, {"x.weight": weight, "x.scales": scales, "x.biases": biases})
    assert found == {"group_size": 32, "bits": 4, "mode": "affine"}


def test_load_tokenizer_takes_extra_config_and_eos_ids_positionally(wrapper: Any) -> None:
    assert parameters(boundary.load_tokenizer)[:3] == ["model_path", "tokenizer_config_extra", "eos_token_ids"]
    assert isinstance(wrapper, boundary.TokenizerWrapper)
    assert {2, 3} <= set(wrapper.eos_token_ids)


# --------------------------------------------------------------------------- mlx-lm: tokenizer wrapper


def test_the_tokenizer_wrapper_attributes_the_worker_reads(wrapper: Any) -> None:
    hf = boundary.hf_tokenizer_of(wrapper)
    assert hf is not wrapper and not isinstance(hf, boundary.TokenizerWrapper)
    assert len(wrapper) == len(hf)
    ids = list(hf.encode("hello", add_special_tokens=False))
    assert list(wrapper.encode("hello", add_special_tokens=False)) == ids
    assert wrapper.decode(ids) == "hello"
    rendered = wrapper.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str) and "hi" in rendered
    for name in ("has_tool_calling", "tool_call_start", "tool_call_end", "tool_parser"):
        getattr(wrapper, name)
    detokenizer = wrapper.detokenizer
    for token in ids:
        detokenizer.add_token(token)
    text = detokenizer.last_segment
    detokenizer.finalize()
    assert text + detokenizer.last_segment == "hello"


def test_the_think_markers_mlx_lm_finds_in_a_vocabulary(wrapper: Any, tmp_path: Path) -> None:
    assert boundary.think_markers_of(wrapper) is None
    thinking_dir = make_tiny_model(tmp_path / "thinking", num_layers=1, num_files=1, thinking=True)
    thinking = boundary.load_tokenizer(thinking_dir, None, [2, 3])
    start, end, start_tokens, end_tokens = boundary.think_markers_of(thinking) or ("", "", (), ())
    assert (start, end) == ("<think>", "</think>")
    assert start_tokens == tuple(thinking.encode("<think>", add_special_tokens=False))
    assert end_tokens == tuple(thinking.encode("</think>", add_special_tokens=False))
    assert len(start_tokens) == len(end_tokens) == 1
    # The template gets `enable_thinking` from the wrapper, and the request's own value wins.
    question = [{"role": "user", "content": "hi"}]
    default = thinking.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    off = thinking.apply_chat_template(question, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert "</think>" not in default and off.endswith("<think>\n\n</think>")


# --------------------------------------------------------------------------- mlx-lm: forward pass and caches


def test_attention_masks_and_prompt_caches(model_dir: Path) -> None:
    model_class, args_class = boundary.model_classes(boundary.load_config(model_dir))
    model = model_class(args_class.from_dict(boundary.load_config(model_dir)))
    cache = boundary.make_prompt_cache(model)
    assert len(cache) == len(model.model.layers) and isinstance(cache[0], KVCache)
    assert "window_size" in parameters(boundary.create_attention_mask)
    h = mx.zeros((1, 4, 64))
    boundary.create_attention_mask(h, cache[0], window_size=None)

    keys = mx.ones((1, 2, 5, 8))
    cache[0].update_and_fetch(keys, keys)
    assert boundary.can_trim_prompt_cache(cache)
    boundary.trim_prompt_cache(cache, 2)
    assert cache[0].offset == 3


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_ARCHITECTURES))
def test_mlx_lm_splits_the_tensor_parallel_architectures_layers(model_type: str) -> None:
    """Placement offers tensor parallelism for exactly the architectures whose models mlx-lm can split, each layer's
    projections replaced by mlx's sharded linears (on one rank, a whole slice)."""
    config = {**TINY_CONFIG, "model_type": model_type}
    model_class, args_class = boundary.model_classes(config)
    assert boundary.splits_across_ranks(model_class) == (model_type in TENSOR_PARALLEL_ARCHITECTURES)
    if model_type not in TENSOR_PARALLEL_ARCHITECTURES:
        return
    model = model_class(args_class.from_dict(config))
    boundary.shard_across(model, mx.distributed.init())
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attention.q_proj, AllToShardedLinear) and isinstance(mlp.up_proj, AllToShardedLinear)
    assert isinstance(attention.o_proj, ShardedToAllLinear) and isinstance(mlp.down_proj, ShardedToAllLinear)
    assert attention.q_proj.weight.shape == (32, 32)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_ARCHITECTURES))
def test_the_model_layout_the_shard_engine_runs(model_type: str) -> None:
    """What shard.py reads of mlx-lm's model on each architecture it runs: the decoder layer list, the embedding
    (tied as the head, or an lm_head), the final norm and the arguments, each layer called as (h, mask, cache)."""
    config = {**TINY_CONFIG, "model_type": model_type}
    model_class, args_class = boundary.model_classes(config)
    model = model_class(args_class.from_dict(config))
    assert isinstance(model.model.layers, list) and len(model.model.layers) == 2
    assert model.model.args.hidden_size == 32
    cache = boundary.make_prompt_cache(model)
    h = model.model.embed_tokens(mx.array([[1, 2, 3]]))
    for layer, layer_cache in zip(model.model.layers, cache, strict=True):
        mask = boundary.create_attention_mask(h, layer_cache, window_size=None)
        h = layer(h, mask, layer_cache)
    h = model.model.norm(h)
    logits = model.lm_head(h) if "lm_head" in model else model.model.embed_tokens.as_linear(h)
    assert logits.shape == (1, 3, 64)


def test_batch_caches_merge_pad_join_and_split() -> None:
    """The calls the rank caches make: merge rows' caches, prepare and finalize right padding, extend a batch,
    extract a row, filter rows, and size them."""
    rows = []
    for length in (3, 5):
        row = KVCache()
        row.update_and_fetch(mx.ones((1, 2, length, 8)), mx.ones((1, 2, length, 8)))
        rows.append(row)
    merged = type(rows[0]).merge(rows)
    assert isinstance(merged, BatchKVCache)
    merged.prepare(lengths=[3, 5], right_padding=[2, 0])
    merged.finalize()
    other = type(rows[0]).merge([rows[1]])
    merged.extend(other)
    assert isinstance(merged.extract(0), KVCache)
    merged.filter([0, 2])
    assert merged.nbytes > 0 and isinstance(merged.nbytes, int)
    assert merged.state is not None


def test_quantized_caches_and_the_attention_that_reads_them() -> None:
    """What `engines.mlx.quantized_cache` builds on: a `QuantizedKVCache` keeps (packed, scales, biases) triples and
    its offset, a `BatchKVCache` its left padding, `_idx` and right padding; `dynamic_roll` rolls each row by its
    own shift; and mlx-lm's attention takes any cache with `bits` and `group_size` as quantized."""
    row = boundary.QuantizedKVCache(group_size=64, bits=8)
    keys, _ = row.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    assert len(keys) == 3 and keys[0].dtype == mx.uint32 and row.offset == 3 and row.is_trimmable()
    batch = boundary.BatchKVCache([1, 0])
    batch.prepare(right_padding=[0, 2])
    assert (batch._idx, batch.left_padding.tolist(), batch._right_padding.tolist()) == (0, [1, 0], [0, 2])
    assert boundary.dynamic_roll(mx.array([[0, 1, 2], [0, 1, 2]]), mx.array([1, 2]), axis=1).tolist() == [
        [2, 0, 1],
        [1, 2, 0],
    ]
    queries = mx.ones((1, 4, 1, 64))
    reads = SimpleNamespace(bits=8, group_size=64)
    out = scaled_dot_product_attention(queries, keys, keys, cache=reads, scale=0.125, mask=None)
    assert out.shape == (1, 4, 1, 64)


def test_prompt_trie_finds_exact_shorter_and_longer_entries() -> None:
    trie = boundary.PromptTrie()
    trie.add(0, [1, 2, 3], "a")
    trie.add(0, [1, 2, 3, 4, 5], "b")
    assert trie.search(0, [1, 2, 3]).exact == [1, 2, 3]
    found = trie.search(0, [1, 2, 3, 4])
    assert (found.shorter, found.longer, found.common_prefix) == ([1, 2, 3], [1, 2, 3, 4, 5], 4)
    assert trie.get(0, [1, 2, 3, 4, 5]) == "b"
    assert trie.pop_prefixes(0, [1, 2, 3, 4, 5]) == [(3, "a")]
    trie.pop(0, [1, 2, 3, 4, 5])
    assert trie.search(0, [1, 2, 3, 4, 5]).exact is None


def test_apply_top_p_masks_the_unlikely_tail() -> None:
    logprobs = mx.log(mx.array([[0.6, 0.3, 0.1]]))
    kept = np.array(boundary.apply_top_p(logprobs, 0.8))
    assert np.isfinite(kept[0, :2]).all() and not np.isfinite(kept[0, 2])


def test_top_k_and_min_p_mask_all_but_the_likeliest() -> None:
    logprobs = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(np.array(boundary.apply_top_k(logprobs, 2))[0]).tolist() == [True, True, False, False]
    # min_p 0.5: at least half as likely as the likeliest (0.5)
    assert np.isfinite(np.array(boundary.apply_min_p(logprobs, 0.5))[0]).tolist() == [True, True, False, False]


def test_penalty_processors_take_a_factor_or_amount_and_a_context_size() -> None:
    tokens = mx.array([1, 2, 2])

    def logits() -> mx.array:  # a fresh array each time: the processors may write into the one they are given
        return mx.array([[1.0, -1.0, 2.0, 0.5]])

    for make in (boundary.make_repetition_penalty, boundary.make_presence_penalty, boundary.make_frequency_penalty):
        assert parameters(make) == ["penalty", "context_size"]
    repetition = boundary.make_repetition_penalty(2.0, 10)(tokens, logits())
    assert repetition.tolist() == [[1.0, -2.0, 1.0, 0.5]]  # a factor: divides a positive logit, multiplies a negative
    presence = boundary.make_presence_penalty(1.0, 10)(tokens, logits())
    assert presence.tolist() == [[1.0, -2.0, 1.0, 0.5]]
    frequency = boundary.make_frequency_penalty(1.0, 10)(tokens, logits())
    assert frequency.tolist() == [[1.0, -2.0, 0.0, 0.5]]  # once per occurrence
    assert boundary.make_frequency_penalty(1.0, 1)(tokens, logits()).tolist() == [[1.0, -1.0, 1.0, 0.5]]


# --------------------------------------------------------------------------- llguidance


def test_grammar_tokenizer_and_matcher(wrapper: Any) -> None:
    ll = boundary.grammar_tokenizer_of(wrapper, 520)
    assert isinstance(ll, boundary.LLTokenizer)
    assert ll.vocab_size == 520 and sorted(ll.eos_tokens) == sorted(wrapper.eos_token_ids)
    plain = boundary.grammar_tokenizer_of(boundary.hf_tokenizer_of(wrapper), 512)
    assert plain.vocab_size == 512
    assert ll.decode_bytes(ll.greedy_tokenize('{"a":1}')) == b'{"a":1}'

    schema = {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}}
    grammar = boundary.json_schema_grammar(schema, JSON_OPTIONS)
    matcher = boundary.LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.validate_tokens(ll.greedy_tokenize('{ "a"')) == 1  # only "{": no flexible whitespace
    assert matcher.consume_tokens(ll.greedy_tokenize('{"a":'))
    assert len(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)) * 8 >= ll.vocab_size
    copy = matcher.deep_copy()
    assert copy.consume_tokens(ll.greedy_tokenize("1}")) and copy.is_accepting()
    assert copy.rollback(1) and not copy.is_accepting()
    assert isinstance(matcher.compute_ff_tokens(), list)
    assert not matcher.is_stopped()
    with pytest.raises(ValueError):
        boundary.json_schema_grammar("not a schema", JSON_OPTIONS)  # type: ignore[arg-type]


def test_the_llama_cpp_engines_schema_check_finds_contradictions_and_passes_what_llguidance_does_not_implement() -> (
    None
):
    contradiction = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
    assert json_schema_errors({**contradiction, "required": ["n"]})[0].startswith("Unsatisfiable schema")
    assert json_schema_errors({"type": "bogus"}) == ["Invalid type: bogus"]
    assert json_schema_errors({"type": "array", "uniqueItems": True, "not": {"type": "string"}}) == []


# --------------------------------------------------------------------------- mlx's ring socket


def test_the_ring_socket_is_the_accepted_connection_on_the_listen_port() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    listener.close()  # as mlx's ring backend closes its listener once the previous rank is in
    try:
        found = boundary.ring_socket_from_previous_rank(port)
        assert found is not None
        assert found.getsockname()[1] == port and found.getpeername() == accepted.getpeername()
        found.close()
    finally:
        accepted.close()
        client.close()


# --------------------------------------------------------------------------- mlx-vlm (the `vision` extra)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("boundary") / "vlm", num_layers=1)


def test_mlx_vlms_model_its_weights_processor_inputs_and_embeddings(vlm_dir: Path) -> None:
    """What the shard engine takes of mlx-vlm: its model for a vision config (a vision tower, a projector and a
    language model whose `embed_tokens` its merge reads), its weight sanitizing, its processor and input
    preparation, and `get_input_embeddings` with the images' features where their tokens are."""
    config = boundary.load_config(vlm_dir)
    model = boundary.vision_model(config)
    assert {"vision_model", "connector", "language_model"} <= set(model.keys())
    weights = mx.load(str(vlm_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    assert set(boundary.vision_weights(model, weights)) == set(weights)  # an MLX checkpoint passes unchanged
    model.load_weights(list(weights.items()))

    processor = boundary.vision_processor(vlm_dir)
    prompt = f"<|im_start|>User:<image>{'hi'}<end_of_utterance>\nAssistant:"
    inputs = boundary.prompt_inputs(processor, prompt, [png(40, 48, seed=0)], config["image_token_id"])
    input_ids = inputs.pop("input_ids")
    assert input_ids.shape[0] == 1 and {"pixel_values", "pixel_attention_mask"} <= set(inputs)
    image_tokens = input_ids[0] == config["image_token_id"]
    assert image_tokens.sum() == 5 * 4  # 2x2 tiles and the global view, 4 tokens each

    tokens = mx.array(input_ids)
    embeddings = boundary.prompt_embeddings(model, tokens, {k: mx.array(v) for k, v in inputs.items()})
    plain = model.language_model.embed_tokens(tokens)
    assert embeddings.shape == plain.shape
    differs = mx.any(embeddings != plain, axis=-1)[0]
    assert np.array_equal(np.array(differs), image_tokens)

    with pytest.raises(ValueError, match="image 0 is not a readable PNG"):
        boundary.prompt_inputs(processor, prompt, [b"\x89PNG\r\n\x1a\n broken"], config["image_token_id"])


def test_a_node_without_the_vision_extra_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx_vlm.utils", None)  # as if mlx-vlm were not installed
    with pytest.raises(RuntimeError, match="install jetshard's `vision` extra"):
        boundary.vision_model({"model_type": "idefics3"})
