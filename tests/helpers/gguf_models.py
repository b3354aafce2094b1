"""Tiny but loadable GGUF models written with gguf-py, and llama.cpp's own tools to quantize and serve them.

A generated file holds every tensor llama.cpp's loader requires for its architecture (`llama`, `qwen3`, `gemma3`),
seeded random weights (float16 matrices, float32 norms, as `convert_hf_to_gguf.py` writes them) and a real
tokenizer: the byte-level BPE vocabulary, merges and chat template of the demo SmolLM2 GGUF, which is always
installed. The qwen3 model gets Qwen3's own chat template (tools, `<think>` reasoning) and its tags as added tokens,
so a thinking model exists for tests. Matrices are 256 wide (or multiples of it), the block size of llama.cpp's
K-quants, so `llama-quantize` can make a real Q4_K_M of any of them.

The benchmark's Llama-3.2-1B-shaped model (bench/gguf_models.py) is written by the same `write_gguf`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import socket
import struct
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
from jetshard_worker.engines.llamacpp.probe import ready_build


def llama_cpp_bin_dir() -> Path:
    """The directory holding `llama-server` and `llama-quantize`: the build the workers run (`ready_build`, found
    through JETSHARD_LLAMA_CPP_CACHE, which `bash tests/run` sets)."""
    build = ready_build()
    if build is None:
        raise FileNotFoundError(
            "no llama.cpp build passed its probe on this machine: `bash tests/run` builds one "
            "(or `jetshard engines build llama.cpp`, then set JETSHARD_LLAMA_CPP_CACHE to its cache)"
        )
    return build.build.bin_dir


def llama_cpp_tool(name: str) -> Path:
    """The path of llama.cpp tool `name`; FileNotFoundError naming where it was looked for if the build lacks it."""
    path = llama_cpp_bin_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in {path.parent}")
    return path


# ------------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """An architecture's hyperparameters, as its GGUF metadata states them."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    rope_freq_base: float
    rms_eps: float


TINY_SHAPES = {
    # Llama: head_dim * heads == hidden, grouped-query attention.
    "llama": Shape("llama", 2, 256, 4, 2, 64, 512, 4096, 10000.0, 1e-5),
    # Qwen3: head_dim * heads != hidden (as in Qwen3-0.6B: 16 x 128 on 1024), so `key_length` must be read.
    "qwen3": Shape("qwen3", 2, 256, 4, 2, 128, 512, 4096, 1_000_000.0, 1e-6),
    # Gemma3-1B's layout: one key/value head.
    "gemma3": Shape("gemma3", 2, 256, 4, 1, 64, 512, 4096, 1_000_000.0, 1e-6),
}
TINY_ARCHS = tuple(TINY_SHAPES)

# Gemma3: local layers attend over a window; one layer in `_GEMMA3_SWA_PATTERN` is global (Gemma3 has 1 in 6; with 2
# layers, 1 in 2 keeps one of each). 512 is Gemma3-1B's window.
_GEMMA3_SLIDING_WINDOW = 512
_GEMMA3_SWA_PATTERN = 2
_GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0

QWEN3_CHAT_TEMPLATE = (Path(__file__).with_name("qwen3_chat_template.jinja")).read_text()
"""Qwen3-0.6B's chat template, as llama.cpp's tree keeps it (models/templates/Qwen-Qwen3-0.6B.jinja)."""
QWEN3_OPEN_THINKING_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}",
)
"""Qwen3's template whose generation prompt opens the reasoning (`<think>\\n`) unless `enable_thinking` is false, as
Qwen3-Thinking-2507's and DeepSeek-R1's do: llama.cpp takes all a model writes up to `</think>` as reasoning, so even
random weights, which never write the markers, give their output as reasoning."""
assert QWEN3_OPEN_THINKING_TEMPLATE != QWEN3_CHAT_TEMPLATE, "Qwen3's template no longer ends as expected"
QWEN3_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Qwen3's tags, added tokens that are not special (rendered in the output), as in Qwen3's own vocabulary."""


# ---------------------------------------------------------------------------------------------- tokenizer


@functools.cache
def demo_tokenizer() -> dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The demo GGUF's `tokenizer.*` metadata (chat template included): key -> (value, type, array item type)."""
    from jetshard_downloader.gguf import find_packaged_gguf

    reader = gguf.GGUFReader(find_packaged_gguf())
    out: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            item_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            out[key] = (field.contents(), field.types[0], item_type)
    return out


def _add_tokenizer(
    writer: gguf.GGUFWriter,
    added: Sequence[str],
    added_type: gguf.TokenType,
    vocab_size: int | None,
    chat_template: str | None,
) -> int:
    """Write the demo tokenizer with `added` tokens appended (of `added_type`), padded with filler tokens up to
    `vocab_size` if given, and `chat_template` instead of the demo's if given; returns the vocabulary size."""
    tokenizer = dict(demo_tokenizer())
    if chat_template is not None:
        tokenizer["tokenizer.chat_template"] = (chat_template, gguf.GGUFValueType.STRING, None)
    tokens = [*tokenizer["tokenizer.ggml.tokens"][0], *added]
    types = [*tokenizer["tokenizer.ggml.token_type"][0], *[int(added_type)] * len(added)]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokens)} tokens")
        # Normal tokens, not control ones as Llama 3 reserves: random weights pick filler tokens most of the time, and
        # a control token renders as nothing, so a stream would have tokens but no text to time. No merge makes
        # them, so no prompt contains them.
        padding = range(vocab_size - len(tokens))
        tokens += [f"<filler_{i}>" for i in padding]
        types += [int(gguf.TokenType.NORMAL)] * len(padding)
    tokenizer["tokenizer.ggml.tokens"] = (tokens, *tokenizer["tokenizer.ggml.tokens"][1:])
    tokenizer["tokenizer.ggml.token_type"] = (types, *tokenizer["tokenizer.ggml.token_type"][1:])
    for key, (value, value_type, item_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    return len(tokens)


# ------------------------------------------------------------------------------------------------ tensors


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    """numpy order: (rows, columns), i.e. (out, in) for a projection; GGUF stores the reverse."""

    @property
    def is_norm(self) -> bool:
        return len(self.shape) == 1


def _tensors(shape: Shape, vocab_size: int) -> list[_Tensor]:
    """What llama.cpp's `load_arch_tensors` requires for `shape.arch` (src/models/<arch>.cpp), in file order. The
    output projection is tied to the embedding (no `output.weight`), as in SmolLM2, Qwen3-0.6B, Gemma3 and
    Llama-3.2-1B."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors = [_Tensor("token_embd.weight", (vocab_size, h))]
    for i in range(shape.layers):
        layer = [
            _Tensor(f"blk.{i}.attn_norm.weight", (h,)),
            _Tensor(f"blk.{i}.attn_q.weight", (q, h)),
            _Tensor(f"blk.{i}.attn_k.weight", (kv, h)),
            _Tensor(f"blk.{i}.attn_v.weight", (kv, h)),
            _Tensor(f"blk.{i}.attn_output.weight", (h, q)),
            _Tensor(f"blk.{i}.ffn_norm.weight", (h,)),
            _Tensor(f"blk.{i}.ffn_gate.weight", (shape.ffn, h)),
            _Tensor(f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
            _Tensor(f"blk.{i}.ffn_down.weight", (h, shape.ffn)),
        ]
        if shape.arch in ("qwen3", "gemma3"):
            layer += [
                _Tensor(f"blk.{i}.attn_q_norm.weight", (shape.head_dim,)),
                _Tensor(f"blk.{i}.attn_k_norm.weight", (shape.head_dim,)),
            ]
        if shape.arch == "gemma3":
            layer += [
                _Tensor(f"blk.{i}.post_attention_norm.weight", (h,)),
                _Tensor(f"blk.{i}.post_ffw_norm.weight", (h,)),
            ]
        tensors += layer
    tensors.append(_Tensor("output_norm.weight", (h,)))
    return tensors


# Standard deviations of the random weights. Embedding rows large enough that the tied output projection gives
# logits spread over a few units (not a flat distribution), projections 1/sqrt(fan_in) so activations stay O(1).
_EMBEDDING_STD = 0.25


def _weights(tensor: _Tensor, rng: np.random.Generator) -> np.ndarray:
    if tensor.is_norm:
        # Gemma's norms scale by (1 + w); its converter stores 1 + w, so 1.0 is the neutral norm for every arch.
        return np.ones(tensor.shape, dtype=np.float32)
    std = _EMBEDDING_STD if tensor.name == "token_embd.weight" else tensor.shape[1] ** -0.5
    values = rng.standard_normal(tensor.shape, dtype=np.float32)
    values *= std
    return values.astype(np.float16)


# ------------------------------------------------------------------------------------------------ writing


def write_gguf(
    path: Path,
    shape: Shape,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    name: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a float16 GGUF model of `shape` with seeded random weights and the demo tokenizer to `path`.

    `vocab_size`: pad the vocabulary with filler tokens up to this size (the 49152-token SmolLM2
    vocabulary otherwise, plus Qwen3's tags for qwen3). `chat_template`: instead of the architecture's own (Qwen3's
    for qwen3, the demo's otherwise). Tensors are generated and written one at a time, so a
    model larger than memory can be written. Written to a temporary name, then renamed: no half file remains.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    arch = shape.arch
    writer = gguf.GGUFWriter(partial, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or f"jetshard tiny {arch}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if arch == "gemma3":
        writer.add_sliding_window(_GEMMA3_SLIDING_WINDOW)
        writer.add_sliding_window_pattern(_GEMMA3_SWA_PATTERN)
        writer.add_rope_freq_base_swa(_GEMMA3_ROPE_FREQ_BASE_SWA)
    if arch == "qwen3":
        template = chat_template or QWEN3_CHAT_TEMPLATE
        vocab = _add_tokenizer(writer, QWEN3_ADDED_TOKENS, gguf.TokenType.USER_DEFINED, vocab_size, template)
    else:
        vocab = _add_tokenizer(writer, (), gguf.TokenType.NORMAL, vocab_size, chat_template)
    writer.add_vocab_size(vocab)

    tensors = _tensors(shape, vocab)
    for tensor in tensors:
        dtype = np.dtype(np.float32 if tensor.is_norm else np.float16)
        writer.add_tensor_info(tensor.name, tensor.shape, dtype, int(np.prod(tensor.shape)) * dtype.itemsize)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for tensor in tensors:
            writer.write_tensor_data(_weights(tensor, rng))
        writer.close()
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, chat_template: str | None = None) -> Path:
    """A tiny float16 GGUF of `arch` (one of TINY_ARCHS): 2 layers, hidden 256, ~28 MB (most of it the embedding)."""
    if arch not in TINY_SHAPES:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    return write_gguf(path, TINY_SHAPES[arch], seed=seed, chat_template=chat_template)


def quantize(source: Path, target: Path, file_type: str) -> Path:
    """`llama-quantize source target file_type` ("Q4_K_M", "Q4_0", "Q8_0"...), through a temporary name."""
    partial = target.with_name(target.name + ".partial")
    command = [str(llama_cpp_tool("llama-quantize")), str(source), str(partial), file_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize {file_type} of {source} failed:\n{done.stdout[-2000:]}{done.stderr}")
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def scalar_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's scalar and string metadata (arrays skipped). gguf-py's reader takes seconds on a file whose
    vocabulary has 10^5 tokens (a numpy view per string); this walk takes milliseconds."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        offset = 24  # magic, version, tensor count, metadata count
        metadata: dict[str, Any] = {}

        def read(fmt: str) -> Any:
            nonlocal offset
            value = struct.unpack_from(fmt, data, offset)[0]
            offset += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal offset
            length = read("<Q")
            offset += length
            return bytes(data[offset - length : offset]).decode()

        for _ in range(struct.unpack_from("<Q", data, 16)[0]):
            key = string()
            value_type = read("<I")
            if value_type == _ARRAY:
                item_type, length = read("<I"), read("<Q")
                if item_type == _STRING:
                    for _ in range(length):
                        string()
                else:
                    offset += struct.calcsize(_SCALAR_FORMATS[item_type]) * length
            else:
                metadata[key] = string() if value_type == _STRING else read(_SCALAR_FORMATS[value_type])
        return metadata


def file_type_of(path: Path) -> str:
    """The GGUF's `general.file_type` by llama.cpp's name without its prefix: "Q4_K_M", "F16", "Q4_0"..."""
    file_type = gguf.LlamaFileType(scalar_metadata(path)["general.file_type"])
    return file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")


# ---------------------------------------------------------------------------------------- image projector


@dataclass(frozen=True)
class ProjectorShape:
    """A LLaVA-style image projector (llama.cpp's `mlp` projector type, tools/mtmd/models/llava.cpp): a CLIP vision
    tower of `layers` pre-norm blocks over `patch`-pixel patches of an `image`-pixel square, then a two-layer MLP
    into the text model's embedding. llama.cpp's LLaVA graph reads the second-to-last block's output, so an image
    becomes (image / patch)^2 embeddings, one per patch."""

    image: int
    patch: int
    hidden: int
    heads: int
    ffn: int
    layers: int
    text_hidden: int
    """The text model's embedding width: llama.cpp refuses a projector whose output is another."""

    @property
    def image_tokens(self) -> int:
        return (self.image // self.patch) ** 2


TINY_PROJECTOR = ProjectorShape(
    image=32, patch=8, hidden=64, heads=2, ffn=128, layers=2, text_hidden=TINY_SHAPES["llama"].hidden
)
"""Pairs with the tiny llama: 16 embeddings an image. The feed-forward width is not the hidden width: llama.cpp takes
a block whose down projection outputs `ffn` wide for an old converter's swapped up/down, and swaps them back."""


def _projector_tensors(shape: ProjectorShape) -> list[_Tensor]:
    """What llama.cpp's clip loader requires for an `mlp` projector (clip.cpp `load_tensors`), in numpy order."""
    e, f = shape.hidden, shape.ffn
    tensors = [
        _Tensor("v.patch_embd.weight", (e, 3, shape.patch, shape.patch)),
        _Tensor("v.position_embd.weight", (shape.image_tokens, e)),
    ]
    for i in range(shape.layers):
        block = f"v.blk.{i}"
        tensors += [
            _Tensor(f"{block}.ln1.weight", (e,)),
            _Tensor(f"{block}.ln1.bias", (e,)),
            *(
                _Tensor(f"{block}.attn_{p}.{kind}", (e, e) if kind == "weight" else (e,))
                for p in "qkv"
                for kind in ("weight", "bias")
            ),
            _Tensor(f"{block}.attn_out.weight", (e, e)),
            _Tensor(f"{block}.attn_out.bias", (e,)),
            _Tensor(f"{block}.ln2.weight", (e,)),
            _Tensor(f"{block}.ln2.bias", (e,)),
            _Tensor(f"{block}.ffn_up.weight", (f, e)),
            _Tensor(f"{block}.ffn_up.bias", (f,)),
            _Tensor(f"{block}.ffn_down.weight", (e, f)),
            _Tensor(f"{block}.ffn_down.bias", (e,)),
        ]
    t = shape.text_hidden
    tensors += [
        _Tensor("mm.0.weight", (t, e)),
        _Tensor("mm.0.bias", (t,)),
        _Tensor("mm.2.weight", (t, t)),
        _Tensor("mm.2.bias", (t,)),
    ]
    return tensors


def _projector_weights(tensor: _Tensor, rng: np.random.Generator) -> np.ndarray:
    """Norm weights 1 and biases 0 (float32), matrices and the patch kernel random over 1/sqrt(fan_in) (float16)."""
    if tensor.is_norm:
        fill = 1.0 if tensor.name.endswith(("ln1.weight", "ln2.weight")) else 0.0
        return np.full(tensor.shape, fill, dtype=np.float32)
    values = rng.standard_normal(tensor.shape, dtype=np.float32)
    values *= int(np.prod(tensor.shape[1:])) ** -0.5
    return values.astype(np.float16)


def write_tiny_projector(path: Path, shape: ProjectorShape = TINY_PROJECTOR, seed: int = 0) -> Path:
    """Write a random LLaVA-style image projector (`mmproj`) that llama.cpp loads with `--mmproj` beside a text
    model whose embedding is `shape.text_hidden` wide: the tiny llama for `TINY_PROJECTOR`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name("jetshard tiny projector")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", shape.image)
    writer.add_uint32("clip.vision.patch_size", shape.patch)
    writer.add_uint32("clip.vision.embedding_length", shape.hidden)
    writer.add_uint32("clip.vision.feed_forward_length", shape.ffn)
    writer.add_uint32("clip.vision.block_count", shape.layers)
    writer.add_uint32("clip.vision.projection_dim", shape.text_hidden)
    writer.add_uint32("clip.vision.attention.head_count", shape.heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    # CLIP's normalisation, as LLaVA's converter writes it.
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    rng = np.random.default_rng(seed)
    for tensor in _projector_tensors(shape):
        writer.add_tensor(tensor.name, _projector_weights(tensor, rng))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------------------- llama-server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def llama_server(
    model: Path, log_path: Path, *args: str, ready_timeout_s: float = 120
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Upstream `llama-server` on 127.0.0.1 and a free port serving `model` with `args` (e.g. "-c", "512", "-np",
    "2"); yields (base URL, process) once `/health` answers 200, stops it afterwards. Its output goes to `log_path`,
    quoted in the error if it exits or is not ready in time."""
    port = _free_port()
    command = [str(llama_cpp_tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        server = subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {server.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                log_tail = log_path.read_text(errors="replace")[-3000:]
                raise TimeoutError(f"llama-server not ready in {ready_timeout_s:.0f} s:\n{log_tail}")
            time.sleep(0.1)
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
