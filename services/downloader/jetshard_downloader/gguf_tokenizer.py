"""Rebuild a Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) from GGUF metadata.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported: that is what the
SmolLM2 demo model uses, and a wrong pre-tokenizer silently changes token ids, so every other kind is
refused with a ValueError rather than approximated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from jetshard_schema.gguf_card import DIGITS_THEN_GPT2_PRE, GPT2_ONLY_PRE
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (enum llama_token_type / gguf TokenType).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6


def to_python(value: Any) -> Any:
    """mx.load returns GGUF scalars and numeric arrays as mx.array, strings and string arrays as str/list."""
    if isinstance(value, mx.array):
        return value.tolist()
    return value


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata lacks {key!r}, which is needed to build the tokenizer")
    return to_python(metadata[key])


def _optional_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    if key not in metadata:
        return None
    token_id = int(to_python(metadata[key]))
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"GGUF metadata {key}={token_id} is outside the vocabulary (size {vocab_size})")
    return token_id


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    # DIGITS_THEN_GPT2_PRE's split, "each digit alone, then the GPT-2 regex", is exactly what Hugging Face writes as
    # Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]; GPT2_ONLY_PRE's is the GPT-2 regex alone.
    # The card of a GGUF file says MLX can hold it from the same sets.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in GPT2_ONLY_PRE:
        return byte_level
    supported = sorted(DIGITS_THEN_GPT2_PRE | GPT2_ONLY_PRE)
    raise ValueError(
        f"GGUF tokenizer.ggml.pre={pre!r} is not supported (its split regex is unknown here); "
        f"supported: {', '.join(supported)}"
    )


def build_tokenizer(metadata: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """Return the `tokenizers` object and the tokenizer_config.json content for GGUF `metadata`."""
    kind = _required(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE ('gpt2') is")
    tokens: Sequence[str] = _required(metadata, "tokenizer.ggml.tokens")
    merges_raw: Sequence[str] = _required(metadata, "tokenizer.ggml.merges")
    n = len(tokens)
    token_types: list[int] = (
        list(to_python(metadata["tokenizer.ggml.token_type"]))
        if "tokenizer.ggml.token_type" in metadata
        else [TOKEN_NORMAL] * n
    )
    if len(token_types) != n:
        raise ValueError(f"GGUF has {n} tokens but {len(token_types)} token types")
    pre = str(to_python(metadata.get("tokenizer.ggml.pre", "default")))

    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != n:
        raise ValueError(f"GGUF vocabulary has duplicate tokens ({n - len(vocab)} duplicates)")
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(merges_raw):
        # Byte-level pieces never contain a literal space (it is mapped to 'Ġ'), so one space splits a pair.
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF merge #{i} {merge!r} is not two space-separated pieces")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False matches what Hugging Face ships for GPT-2 style tokenizers; it only affects offsets.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens are matched before BPE and skipped by skip_special_tokens; user-defined tokens are
    # matched before BPE too but are ordinary text when decoding.
    added = [
        AddedToken(tokens[i], special=token_types[i] == TOKEN_CONTROL, normalized=False)
        for i in range(n)
        if token_types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tok.add_tokens(added)
    for token in added:
        if tok.token_to_id(token.content) != vocab[token.content]:
            raise ValueError(f"added token {token.content!r} did not keep its GGUF id {vocab[token.content]}")

    def name(key: str) -> str | None:
        token_id = _optional_id(metadata, key, n)
        return None if token_id is None else tokens[token_id]

    config: dict[str, Any] = {
        # The generic class: named classes (GPT2Tokenizer, ...) may rebuild their own pre-tokenizer in
        # transformers 5 instead of using tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(to_python(metadata.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(to_python(metadata.get("tokenizer.ggml.add_eos_token", False))),
        "add_prefix_space": bool(to_python(metadata.get("tokenizer.ggml.add_space_prefix", False))),
        "additional_special_tokens": [t.content for t in added if t.special],
        "added_tokens_decoder": {
            str(vocab[t.content]): {
                "content": t.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t.special,
            }
            for t in added
        },
    }
    for field, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ):
        if (content := name(key)) is not None:
            config[field] = content
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(to_python(metadata["tokenizer.chat_template"]))
    return tok, config


def write_tokenizer(metadata: Mapping[str, Any], out_dir: Path, *, context_length: int | None = None) -> None:
    """Write tokenizer.json and tokenizer_config.json for GGUF `metadata` into `out_dir`."""
    tok, config = build_tokenizer(metadata)
    if context_length is not None:
        config["model_max_length"] = context_length
    # Written from Python, not with `tok.save`: a failed write then raises OSError with its errno (the Rust
    # side raises a bare Exception), so a full disk is recognised as one.
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
