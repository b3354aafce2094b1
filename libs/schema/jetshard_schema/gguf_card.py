"""A model card read from a GGUF file's header: what llama.cpp will load, never its tensors.

Every value comes from the metadata llama.cpp itself reads (`general.architecture`, `<arch>.block_count`, ...), so
the card of any GGUF llama.cpp loads is exact: its layers, heads, context, size, quantization (`general.file_type`)
and chat template. MLX holds fewer of them: `mlx_convertible` says which (today's converter's rules), and the card
of any other lists `gguf` alone among its formats: llama.cpp serves it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from jetshard_schema.cards import (
    MAX_NAME_LENGTH,
    ModelCapability,
    ModelCard,
    ModelFormat,
    ModelSource,
    Quantization,
    printable,
)
from jetshard_schema.gguf_header import GGML_TYPES, ArrayInfo, GgufHeader, MetadataValue
from jetshard_schema.ids import ModelId, parse_model_id

LLAMA_CPP_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "arctic",
        "arwkv7",
        "baichuan",
        "bailingmoe",
        "bailingmoe2",
        "bailingmoe3",
        "bert",
        "bitnet",
        "bloom",
        "chameleon",
        "chatglm",
        "codeshell",
        "cogvlm",
        "cohere2",
        "cohere2moe",
        "command-r",
        "dbrx",
        "deci",
        "deepseek",
        "deepseek2",
        "deepseek2-ocr",
        "deepseek32",
        "deepseek4",
        "dflash",
        "dots1",
        "dots3note",
        "dream",
        "eagle3",
        "ernie4_5",
        "ernie4_5-moe",
        "eurobert",
        "exaone",
        "exaone-moe",
        "exaone4",
        "falcon",
        "falcon-h1",
        "gemma",
        "gemma-embedding",
        "gemma2",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4-assistant",
        "glm-dsa",
        "glm4",
        "glm4moe",
        "glm5-next",
        "gpt-oss",
        "gpt2",
        "gptj",
        "gptneox",
        "granite",
        "granite_swa",
        "granitehybrid",
        "granitemoe",
        "graniteswitch",
        "grok",
        "grovemoe",
        "hrm_text",
        "hunyuan-dense",
        "hunyuan-moe",
        "hunyuan_vl",
        "hy_v3",
        "hy_v4",
        "internlm2",
        "jais",
        "jais2",
        "jamba",
        "jina-bert-v2",
        "jina-bert-v3",
        "kimi-k3",
        "kimi-linear",
        "laguna",
        "lfm2",
        "lfm2moe",
        "llada",
        "llada-moe",
        "llama",
        "llama-embed",
        "llama4",
        "maincoder",
        "mamba",
        "mamba2",
        "maple",
        "mellum",
        "mimo2",
        "minicpm",
        "minicpm3",
        "minimax-01",
        "minimax-m2",
        "minimax-m3",
        "mistral3",
        "mistral4",
        "modern-bert",
        "mpt",
        "muse-glimmer",
        "nanbeige",
        "nemotron",
        "nemotron_h",
        "nemotron_h_moe",
        "neo-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "olmo",
        "olmo2",
        "olmoe",
        "openelm",
        "orion",
        "paddleocr",
        "pangu-embedded",
        "phi2",
        "phi3",
        "phimoe",
        "plamo",
        "plamo2",
        "plamo3",
        "plm",
        "pockettts",
        "qwen",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen35",
        "qwen35moe",
        "qwen3moe",
        "qwen3next",
        "qwen3tts",
        "qwen3vl",
        "qwen3vlmoe",
        "qwen4exp",
        "refact",
        "rnd1",
        "rwkv6",
        "rwkv6qwen2",
        "rwkv7",
        "seed_oss",
        "smallthinker",
        "smollm3",
        "spark2_5",
        "stablelm",
        "starcoder",
        "starcoder2",
        "step35",
        "t5",
        "t5encoder",
        "talkie",
        "wavtokenizer-dec",
        "xverse",
    }
)
"""The architectures llama.cpp loads: the values of `LLM_ARCH_NAMES` in src/llama-arch.cpp of the llama.cpp tree that
llama-cpp-python 0.3.36 vendors (the pinned build), less `clip` (a projector, not a model) and `(unknown)`. Update
it with the pin."""

FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}
"""`general.file_type` -> its name: `enum llama_ftype` (LLAMA_FTYPE_MOSTLY_*) in include/llama.h of the same tree."""

# What today's GGUF -> MLX converter (jetshard_downloader.gguf) converts: the llama architecture, with a byte-level
# BPE tokenizer whose split it knows, whole rotary embeddings without llama3-style scaling, and tensors mlx reads
# without dequantizing through gguflib (which fails on K-quants: "gguf_tensor_to_f16 failed").
MLX_ARCHITECTURE = "llama"
DIGITS_THEN_GPT2_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
"""`tokenizer.ggml.pre` names whose llama.cpp split is "each digit alone, then the GPT-2 regex"."""
GPT2_ONLY_PRE = frozenset({"default", "gpt-2", "gpt2"})
"""`tokenizer.ggml.pre` names whose split is the plain GPT-2 regex."""
MLX_CONVERTED_TENSOR_TYPES = frozenset({0, 1, 2, 3, 8})  # F32, F16, Q4_0, Q4_1, Q8_0
_MLX_QUANTIZATION = {2: Quantization(bits=4, group_size=32), 3: Quantization(bits=4, group_size=32)}
_MLX_QUANTIZATION[7] = Quantization(bits=8, group_size=32)
"""The MLX quantization a converted file has, by `general.file_type` (32-weight blocks become groups of 32)."""
_CHECKPOINT_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

THINK_MARKERS = ("<think>", "<|think|>", "<|channel|>analysis", "<longcat_think>", "<|think:start|>", "<seed:think>")
"""Texts whose presence in a chat template says the model reasons before it answers (Qwen3, DeepSeek-R1, gpt-oss's
analysis channel, ...)."""
_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""llama.cpp's split files: `<prefix>-00001-of-00003.gguf` (`llama_split_path`)."""

PROJECTOR_ARCHITECTURE = "clip"
"""What llama.cpp's projector files (mmproj) name as their general.architecture."""


@dataclass(frozen=True)
class HubGgufRef:
    """Which files of a Hub repo a `hub-gguf` card's model is: its `source_ref`, `<repo>:<file>` or, for a model
    that sees, `<repo>:<file>:<projector file>`. A repo id has no `:`; a file name that does is refused where
    the card is made (`check_hub_gguf_file`), so the text reads back unambiguously."""

    repo: ModelId
    file: str
    """The GGUF (a split model's first part), its path in the repo."""
    mmproj: str = ""
    """The projector (mmproj) file, for a model that sees; empty otherwise."""

    def __str__(self) -> str:
        return f"{self.repo}:{self.file}" + (f":{self.mmproj}" if self.mmproj else "")

    @classmethod
    def parse(cls, source_ref: str) -> HubGgufRef:
        """The ref a card's `source_ref` holds; ValueError naming what is wrong."""
        repo, _, files = source_ref.partition(":")
        file, _, mmproj = files.partition(":")
        if not file or ":" in mmproj:
            raise ValueError(f"source_ref {source_ref[:200]!r} is not '<repo>:<file>' or '<repo>:<file>:<mmproj>'")
        return cls(parse_model_id(repo), file, mmproj)


def check_hub_gguf_file(name: str) -> str:
    """`name` as a file of a Hub repo that a `HubGgufRef` can hold; ValueError otherwise."""
    if not name or len(name) > MAX_NAME_LENGTH or ":" in name:
        raise ValueError(f"a GGUF file's path in its repo must be 1 to {MAX_NAME_LENGTH} characters without ':'")
    if not name.isprintable() or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(
            f"{name[:80]!r} is not a file's path in a repo: its parts are names separated by single '/', no '.' "
            f"or '..' parts, no control characters"
        )
    return name


class UnsupportedGguf(ValueError):
    """A GGUF file that is well formed but not one llama.cpp loads as a model (or one jetshard can describe)."""


def split_count(header: GgufHeader) -> int:
    """How many files the model is split into (`split.count`; 1 for a single file)."""
    count = header.integer("split.count")
    return count if count is not None and count > 1 else 1


def split_part_names(first_name: str, count: int) -> list[str]:
    """The names of all `count` parts of a split model whose first part is `first_name`; ValueError where that
    name is not llama.cpp's name of a first part."""
    match = SPLIT_NAME.match(first_name)
    if match is None or int(match["part"]) != 1 or int(match["count"]) != count:
        raise UnsupportedGguf(
            f"{first_name} is one of {count} parts of a split model (split.count); name its first part, "
            f"<name>-00001-of-{count:05d}.gguf, with all the parts beside it"
        )
    return [f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _largest(value: MetadataValue | None) -> int | None:
    """A count that some architectures store per layer (an array): the largest, which bounds every layer's."""
    if isinstance(value, ArrayInfo):
        numbers = [int(v) for v in value.items or () if isinstance(v, int | float)]
        return max(numbers) if numbers else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def mlx_convertible(header: GgufHeader) -> bool:
    """Whether today's GGUF -> MLX converter converts this file (the rules in its module, checked on the header)."""
    arch = header.text("general.architecture")
    if arch != MLX_ARCHITECTURE or split_count(header) > 1:
        return False
    if header.text("tokenizer.ggml.model") != "gpt2":
        return False
    if (header.text("tokenizer.ggml.pre") or "default") not in DIGITS_THEN_GPT2_PRE | GPT2_ONLY_PRE:
        return False
    if not header.tensor_types <= MLX_CONVERTED_TENSOR_TYPES:
        return False
    if any(t.name == "rope_freqs.weight" for t in header.tensors):
        return False
    heads = _largest(header.metadata.get(f"{arch}.attention.head_count")) or 1
    hidden = header.integer(f"{arch}.embedding_length") or 0
    head_dim = header.integer(f"{arch}.attention.key_length") or hidden // max(heads, 1)
    if (header.integer(f"{arch}.rope.dimension_count") or head_dim) != head_dim:
        return False
    return (header.text(f"{arch}.rope.scaling.type") or "none") in ("none", "linear")


def capabilities_of(chat_template: str, *, vision: bool) -> tuple[ModelCapability, ...]:
    """What the model does, from its chat template (tools, think markers) and whether a projector comes with it.
    Embeddings: llama.cpp pools the last hidden states of any model."""
    capabilities = [ModelCapability.COMPLETION]
    if _TOOLS_IN_TEMPLATE.search(chat_template):
        capabilities.append(ModelCapability.TOOLS)
    if any(marker in chat_template for marker in THINK_MARKERS):
        capabilities.append(ModelCapability.THINKING)
    if vision:
        capabilities.append(ModelCapability.VISION)
    capabilities.append(ModelCapability.EMBEDDING)
    return tuple(capabilities)


def _parameter_count(parts: Sequence[GgufHeader], file_sizes_bytes: Sequence[int]) -> int:
    """The model's parameters, counted from its tensors. A part lists only its own: where the first part of a split
    model is all that was read (on the Hub), its parameters per byte of weights, over every part's bytes."""
    count = split_count(parts[0])
    elements = sum(t.elements for part in parts for t in part.tensors)
    if len(parts) == count:
        return elements
    read_bytes = sum(t.size_bytes for t in parts[0].tensors)
    return elements * sum(file_sizes_bytes[:count]) // read_bytes if read_bytes else 0


def card_from_gguf(
    model_id: str,
    header: GgufHeader,
    *,
    file_sizes_bytes: Sequence[int],
    source: ModelSource,
    source_ref: str,
    source_sha256: str = "",
    has_mmproj: bool = False,
    other_parts: Sequence[GgufHeader] = (),
) -> ModelCard:
    """The card of the model whose (first) GGUF file has `header`; `file_sizes_bytes` are the exact sizes of all its
    files (every part of a split model, then the projector); `other_parts`: the headers of a split model's other
    parts, where they were read. Raises UnsupportedGguf (a ValueError) naming what is missing or what llama.cpp
    does not load."""
    arch = header.text("general.architecture")
    if not arch:
        raise UnsupportedGguf("it has no general.architecture: not a model llama.cpp loads")
    if arch not in LLAMA_CPP_ARCHITECTURES:
        raise UnsupportedGguf(
            f"its architecture {arch[:80]!r} is not one llama.cpp knows (general.architecture); "
            "it loads llama, qwen3, gemma3, phi3, mistral3, gpt-oss and the others in its src/llama-arch.cpp"
        )

    def required(key: str) -> int:
        raw = header.metadata.get(f"{arch}.{key}")
        if raw is None:
            raise UnsupportedGguf(f"its metadata lacks {arch}.{key}, which llama.cpp needs to load a {arch} model")
        value = _largest(raw)
        if value is None or value < 1:
            shown = "an array" if isinstance(raw, ArrayInfo) else repr(raw)[:40]
            raise UnsupportedGguf(
                f"its {arch}.{key} is {shown}, where llama.cpp needs a positive whole number to load a {arch} model"
            )
        return value

    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab_size = header.integer(f"{arch}.vocab_size") or (tokens.length if isinstance(tokens, ArrayInfo) else None)
    if not vocab_size:
        raise UnsupportedGguf(f"its metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    # State-space and recurrent layers (mamba, rwkv) have no attention heads: one head stands for their state,
    # which is small, in the memory a placement counts.
    heads = max(_largest(header.metadata.get(f"{arch}.attention.head_count")) or 1, 1)
    kv_heads = max(_largest(header.metadata.get(f"{arch}.attention.head_count_kv")) or heads, 1)
    file_type_number = header.integer("general.file_type")
    file_type = FILE_TYPES.get(file_type_number, "") if file_type_number is not None else ""
    if not file_type and header.tensor_types:
        # Older files lack general.file_type: the type of most of their weights names them.
        largest = max(header.tensors, key=lambda t: t.size_bytes)
        file_type = GGML_TYPES[largest.ggml_type][0]
    chat_template = header.text("tokenizer.chat_template") or ""
    # The converter writes no projector: a model that sees is llama.cpp's alone.
    convertible = mlx_convertible(header) and not has_mmproj
    formats = (ModelFormat.GGUF, ModelFormat.MLX) if convertible else (ModelFormat.GGUF,)
    # Control characters never reach a terminal or page that shows the name (a file can hold any).
    name = printable(header.text("general.name") or "") or model_id.split("/", 1)[-1]
    num_layers, hidden_size = required("block_count"), required("embedding_length")
    context_length = required("context_length")
    try:
        return ModelCard(
            model_id=ModelId(model_id),
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=min(kv_heads, heads),
            vocab_size=vocab_size,
            architecture=arch,
            storage_size_bytes=sum(file_sizes_bytes),
            context_length=context_length,
            capabilities=capabilities_of(chat_template, vision=has_mmproj),
            quantization=_MLX_QUANTIZATION.get(file_type_number or -1) if convertible else None,
            parameter_count=_parameter_count([header, *other_parts], file_sizes_bytes),
            checkpoint_dtype=_CHECKPOINT_DTYPES.get(file_type_number or -1, ""),
            is_custom=True,
            source=source,
            source_ref=source_ref,
            source_sha256=source_sha256,
            formats=formats,
            file_type=file_type,
            display_name=name[:MAX_NAME_LENGTH],
        )
    except ValueError as error:  # a value beyond a card's bounds (`ModelCard.__post_init__`)
        raise UnsupportedGguf(f"its metadata describes no model jetshard can place: {error}") from error
