"""Tiny but real mlx-lm models generated on disk, without any network access.

A generated directory looks like a Hugging Face repo of an MLX model: `config.json`,
`generation_config.json`, a byte-level BPE `tokenizer.json` with a ChatML chat template, and
float32 safetensors split by layer (`model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`), so `mlx_lm.load()` and transformers' `AutoTokenizer` accept it
and a downloader can fetch only the files holding a layer range.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

ARCHS = ("llama", "qwen3")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2  # fewer kv heads than query heads: exercises grouped-query attention
# 256 byte tokens plus the special tokens is the smallest byte-level BPE vocabulary.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3's thinking switch: a model told not to think gets an empty reasoning in its prompt. (Qwen3 adds a blank line
# after it, which the scripted model's answer does not need.) `think_in_prompt` opens the reasoning in the prompt
# instead, as Qwen3-Thinking-2507's and DeepSeek-R1's templates always do: the model's output starts inside it.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>' }}"
    "{% elif think_in_prompt is defined and think_in_prompt %}{{ '<think>' }}{% endif %}"
    "{% endif %}"
)

# Gains applied on top of a 1/sqrt(fan_in) init. With plain init a random 4-layer model collapses
# onto one token within a few steps; larger projections and a sharper lm_head keep the argmax
# dependent on the context, so greedy decoding wanders over many tokens.
_LINEAR_GAIN = 2.0
_LM_HEAD_GAIN = 6.0


def make_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    num_layers: int = 4,
    num_files: int = 3,
    seed: int = 0,
    hidden_size: int = 64,
    vocab_size: int = 512,
    heads: tuple[int, int] = (NUM_ATTENTION_HEADS, NUM_KV_HEADS),
    thinking: bool = False,
) -> Path:
    """Write a tiny mlx-lm model of `arch` ("llama" or "qwen3") into `out_dir` and return it.

    Deterministic for a given set of arguments. Weights are float32 and split over `num_files`
    safetensors files by contiguous layer ranges: embeddings live in the first file, the final
    norm and lm_head in the last. `num_files=1` writes a single `model.safetensors` and no index.
    `heads` is (attention heads, key/value heads). A `thinking` model's vocabulary has `<think>`/`</think>` and its
    chat template Qwen3's `enable_thinking` switch.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if not 1 <= num_files <= num_layers:
        raise ValueError(f"num_files must be in [1, num_layers={num_layers}], got {num_files}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    if hidden_size % heads[0] or heads[0] % heads[1]:
        raise ValueError(f"hidden_size must be a multiple of {heads[0]} heads, a multiple of {heads[1]} kv heads")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = _write_tokenizer(out_dir, vocab_size, SPECIAL_TOKENS + (THINK_TOKENS if thinking else ()))
    config = _model_config(arch, num_layers, hidden_size, vocab_size, token_ids, heads)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            # A list, as in Qwen and Llama 3 repos: callers must handle several stop tokens.
            "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
            "do_sample": False,
        },
    )
    weights = _random_weights(arch, config, seed)
    _write_weights(out_dir, weights, num_layers, num_files)
    return out_dir


def layer_of(weight_name: str) -> int | None:
    """The layer index a weight belongs to (`model.layers.3.mlp...` -> 3), None for the others."""
    parts = weight_name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None


def greedy_token_ids(model: Any, prompt_ids: Sequence[int], max_tokens: int = 30) -> list[int]:
    """Greedy-decode `max_tokens` tokens with an mlx-lm model, ignoring end-of-sequence tokens.

    EOS is ignored on purpose: callers use this to check that the model's output depends on the
    context, which needs a fixed number of steps.
    """
    from mlx_lm.generate import generate_step

    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    steps = generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler)
    return [int(token) for token, _ in steps]


# --------------------------------------------------------------------------- tokenizer


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    from tokenizers.pre_tokenizers import ByteLevel

    mapping: dict[int, str] = {}
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    alphabet = [mapping[b] for b in range(256)]
    # The library's own alphabet is the source of truth; the ordering above only fixes the ids.
    assert set(alphabet) == set(ByteLevel.alphabet())
    return alphabet


def _merges(count: int) -> list[tuple[str, str]]:
    """`count` deterministic BPE merges of single letters: space+letter first, then letter pairs."""
    space = "Ġ"  # the byte-level stand-in for " "
    letters = string.ascii_lowercase
    frequent = "etaoinshrdlucmfwypvbgkjqxz"  # English letter frequency, so common pairs come first
    candidates = [(space, c) for c in frequent]
    candidates += [(a, b) for a in frequent for b in frequent]
    candidates += [(a.upper(), b) for a in letters for b in frequent]
    if count > len(candidates):
        raise ValueError(f"vocab_size too large for the tiny tokenizer (max {MIN_VOCAB_SIZE + len(candidates)})")
    return candidates[:count]


def _write_tokenizer(out_dir: Path, vocab_size: int, added: Sequence[str] = SPECIAL_TOKENS) -> dict[str, int]:
    """Write tokenizer.json / tokenizer_config.json; returns the added tokens' ids. `added` starts with
    SPECIAL_TOKENS; a thinking model's adds the think markers, which are added tokens but not special ones, as in
    Qwen3's vocabulary (decoding keeps them in the text); a vision model's adds its image markers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_level_alphabet()
    merges = _merges(vocab_size - len(alphabet) - len(added))
    vocab: dict[str, int] = {symbol: i for i, symbol in enumerate(alphabet)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    # Special tokens take the last ids, as in Qwen's vocabulary.
    special_ids = {token: len(vocab) + i for i, token in enumerate(added)}
    vocab.update(special_ids)
    assert len(vocab) == vocab_size

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [token for token in added if token not in THINK_TOKENS]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    thinking = THINK_TOKENS[0] in added
    if thinking:
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    config: dict[str, Any] = {}
    if thinking:
        # As transformers writes it: what a card derived from this file reads the think markers from.
        config["added_tokens_decoder"] = {
            str(token_id): {"content": token, "special": token in SPECIAL_TOKENS, "normalized": False}
            for token, token_id in special_ids.items()
        }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            "chat_template": THINKING_TEMPLATE if thinking else CHATML_TEMPLATE,
            **config,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    return special_ids


# --------------------------------------------------------------------------- model


def _model_config(
    arch: str,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    token_ids: dict[str, int],
    heads: tuple[int, int] = (NUM_ATTENTION_HEADS, NUM_KV_HEADS),
) -> dict[str, Any]:
    head_dim = hidden_size // heads[0]
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_attention_heads": heads[0],
        "num_key_value_heads": heads[1],
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    return config


def build_model(config: dict[str, Any]) -> Any:
    """An mlx-lm model instance for `config`, from mlx-lm's own model classes."""
    from jetshard_worker.engines.mlx.shard import model_classes

    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config))


def _random_weights(arch: str, config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    # The names and shapes come from mlx-lm's own model class, so they match what mlx_lm.load() expects.
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(build_model(config).parameters())}
    return seeded_weights(shapes, f"{seed}:{arch}")


def seeded_weights(shapes: dict[str, tuple[int, ...]], seed: str) -> dict[str, np.ndarray]:
    """float32 values for weights of these names and shapes, from numpy seeded per weight name: reproducible
    across mlx versions and independent of the order in which a model class creates its parameters."""
    weights: dict[str, np.ndarray] = {}
    for name, shape in sorted(shapes.items()):
        name_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
        rng = np.random.default_rng(name_seed)
        if re.search(r"norm\d*\.weight$", name):
            # Norm gains around 1 (not exactly 1, so norms differ between seeds too).
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.02 * rng.standard_normal(shape)
        elif name.endswith(("embed_tokens.weight", "position_embedding.weight")):
            value = rng.standard_normal(shape)
        else:
            gain = _LM_HEAD_GAIN if name.endswith("lm_head.weight") else _LINEAR_GAIN
            value = rng.standard_normal(shape) * (gain / np.sqrt(np.prod(shape[1:])))
        weights[name] = value.astype(np.float32)
    return weights


def _write_weights(out_dir: Path, weights: dict[str, np.ndarray], num_layers: int, num_files: int) -> None:
    metadata = {"format": "mlx"}
    if num_files == 1:
        mx.save_safetensors(str(out_dir / "model.safetensors"), _to_mx(weights), metadata=metadata)
        return

    # Contiguous layer ranges per file, as even as possible.
    layer_file = {
        layer: file_index
        for file_index, layers in enumerate(np.array_split(np.arange(num_layers), num_files))
        for layer in layers.tolist()
    }
    names = [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    per_file: list[dict[str, np.ndarray]] = [{} for _ in range(num_files)]
    for name, value in weights.items():
        layer = layer_of(name)
        if layer is not None:
            file_index = layer_file[layer]
        elif name.startswith("model.embed_tokens."):
            file_index = 0
        else:  # final norm and lm_head
            file_index = num_files - 1
        per_file[file_index][name] = value

    weight_map: dict[str, str] = {}
    for file_name, tensors in zip(names, per_file, strict=True):
        mx.save_safetensors(str(out_dir / file_name), _to_mx(tensors), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, file_name))
    total_size = sum(value.nbytes for value in weights.values())
    _write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _to_mx(weights: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {name: mx.array(value) for name, value in sorted(weights.items())}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


LONG_STORY = [{"role": "user", "content": "Tell me a long story about the sea."}]
"""A chat prompt that the tiny models, greedy, answer at length (the endless model without end)."""


def endless_model(out_dir: Path) -> Path:
    """A tiny model whose greedy decoding ends only at its (long) context: the lm_head rows of its end-of-sequence
    tokens are zero, so their logit (0) stays below the largest of the others'."""
    path = make_tiny_model(out_dir, num_files=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**16}))
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    weights_file = str(path / "model.safetensors")
    weights = mx.load(weights_file)
    head = np.array(weights["lm_head.weight"])
    head[eos] = 0
    mx.save_safetensors(weights_file, {**weights, "lm_head.weight": mx.array(head)}, metadata={"format": "mlx"})
    return path


THOUGHT_TOKENS = ("Ġh", "m", "Ġo", "k")
"""What the thinking model reasons, token by token: " hm ok"."""
ANSWER_TOKENS = ("Ġy", "es")
"""What it answers after its reasoning: " yes"."""
THOUGHT, ANSWER = "hm ok", "yes"
"""The reasoning and the answer a client sees: the whitespace around the markers is not part of either."""


def thinking_model(out_dir: Path) -> Path:
    """A tiny thinking model whose greedy output follows a script wherever the prompt leaves it: after a generation
    prompt (its last token a newline) it writes `<think>`, THOUGHT, `</think>`, ANSWER and ends; after a prompt that
    closed the reasoning (`enable_thinking` false) or a forced `</think>`, only the answer.

    Its layers add nothing to the residual stream (their output projections are zero), so the last hidden state is
    the last token's embedding, and its lm_head row for each scripted token is the embedding of the token before:
    the next token is the script's (any other token repeats itself)."""
    path = make_tiny_model(out_dir, num_layers=2, num_files=1, seed=11, thinking=True)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    script = ["Ċ", "<think>", *THOUGHT_TOKENS, "</think>", *ANSWER_TOKENS, "<|im_end|>"]
    ids = [vocab[token] for token in script]
    weights_file = str(path / "model.safetensors")
    weights = {name: np.array(value) for name, value in mx.load(weights_file).items()}
    embeddings = weights["model.embed_tokens.weight"]
    head = embeddings.copy()  # every token predicts itself...
    head[ids[0]] = 0
    for before, token in itertools.pairwise(ids):
        head[token] = embeddings[before]  # ...but a scripted one is predicted by the token before it
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
        elif name.endswith("norm.weight"):
            weights[name] = np.ones_like(weights[name])
    weights["lm_head.weight"] = head * _LM_HEAD_GAIN
    mx.save_safetensors(weights_file, _to_mx(weights), metadata={"format": "mlx"})
    return path
