"""Request and response bodies of the Ollama-compatible routes, and the translation of a request into a
TaskRequest.

The sampling options `temperature`, `top_p`, `top_k`, `min_p`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty` and `repeat_last_n` (the penalties' window) are applied. Those that would change the output
and have no counterpart here (`typical_p`, `mirostat`…) are accepted at their neutral values only and refused
otherwise: Ollama's clients send no option they were not asked for, so a request that sets one wants it. Options
about resources and loading (`num_ctx`, `num_gpu`, `num_thread`, `use_mmap`…) are accepted and have no effect:
the cluster sizes its instances itself, and every model runs with its whole context. Option names Ollama does not
know are ignored, as Ollama ignores them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec
from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.placement import parameter_count
from jetshard_schema.sampling import documented_defaults
from jetshard_schema.types import (
    ChatMessage,
    SamplingParams,
    TaskKind,
    TaskOutcome,
    TaskRequest,
    ToolCall,
    Tools,
)

from jetshard_api.dialects import checks
from jetshard_api.dialects.checks import requested_model_id
from jetshard_api.dialects.openai.types import TokenLogprobBody
from jetshard_api.errors import ApiError
from jetshard_api.images import base64_image, check_images

OLLAMA_VERSION = "0.12.0"
"""The Ollama version `/api/version` reports: one whose API these routes follow, so that clients which check
the version before using a feature (structured outputs, tool calls, `/api/embed`) use it."""
LATEST = ":latest"
NO_TIME = "1970-01-01T00:00:00Z"
"""When a model was modified: the cluster does not record it."""
NEVER = "9999-12-31T23:59:59Z"
"""When a model kept loaded unloads: not before someone removes its instance."""

NEUTRAL_OPTIONS: dict[str, float] = {
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
}
"""Sampling options this cluster does not apply, at the values that make them do nothing. Their companions
(`penalize_newline`, which recent Ollama ignores too, `mirostat_tau`, `mirostat_eta`) do nothing without them,
and `num_keep` only matters when a prompt overflows the context, which is an error here."""
UNTIL_CONTEXT_ENDS = (-1, -2)
"""`num_predict` values meaning no limit (-1) and fill the context (-2): both end with the context here."""


def ollama_name(model_id: ModelId) -> str:
    return model_id + LATEST


def model_id_of(name: str, param: str = "model") -> ModelId:
    """A model id from an Ollama model name: `org/name` or `org/name:latest`. Other tags name nothing here."""
    base, colon, tag = name.partition(":")
    model_id = requested_model_id(base, param)
    if colon and tag != "latest":
        message = f"model {model_id!r} not found with that tag: this cluster serves only the tag 'latest'"
        raise ApiError(404, message, "model_not_found", param)
    return model_id


def _rfc3339(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def now() -> str:
    """RFC 3339 with the sub-second digits, as Ollama's `created_at`."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# --- requests ----------------------------------------------------------------------------------------------


Integer = int | Annotated[float, msgspec.Meta(ge=-(2**63), le=2**63)]
"""An integer option as Ollama reads one: any JSON number, cut to its whole part (5.9 is 5), never a string; a
float as far as Go's int64 reaches (no infinity)."""


def _whole(value: Integer | None) -> int | None:
    return None if value is None else int(value)


class Options(msgspec.Struct, frozen=True, kw_only=True):
    """Ollama's model options (the `ollama` client's `Options`, and `min_p`)."""

    numa: bool | None = None
    num_ctx: Integer | None = None
    num_batch: Integer | None = None
    num_gpu: Integer | None = None
    main_gpu: Integer | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: Integer | None = None
    num_keep: Integer | None = None
    seed: Integer | None = None
    num_predict: Integer | None = None
    top_k: Integer | None = None
    top_p: float | None = None
    min_p: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: Integer | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: Integer | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    stop: list[str] | None = None


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat and a generation both take."""

    model: str
    stream: bool = True
    """Ollama streams unless told not to."""
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    """How long the model stays loaded once idle: seconds, or a duration ("5m"); 0 unloads it after this answer,
    negative keeps it loaded; left out, as it was."""
    think: bool | str | None = None
    """A thinking model's reasoning on (true, or an effort: low, medium, high) or off (false); left out, the
    model's own default. The reasoning comes back as `thinking`, apart from the answer."""
    logprobs: bool | None = None
    top_logprobs: int | None = None


class FunctionCallBody(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None


class ToolCallBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    function: FunctionCallBody
    id: str | None = None


class MessageBody(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None
    """Accepted and left out of the prompt: chat templates drop earlier turns' reasoning."""


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


class ToolDefinition(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatRequest(GenerationRequest, frozen=True, kw_only=True):
    messages: list[MessageBody] = []
    """None: load the model and answer `done_reason: load`."""
    tools: list[ToolDefinition] | None = None


class GenerateRequest(GenerationRequest, frozen=True, kw_only=True):
    prompt: str = ""
    """Empty: load the model and answer `done_reason: load`."""
    system: str | None = None
    raw: bool = False
    """The prompt goes to the model as it is, without the chat template (nor `system`, as in Ollama)."""
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class EmbedRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[str] = ""
    """Left out or empty: the model is loaded and no vector comes back."""
    truncate: bool = True
    """No input is cut here: one longer than the model's context is an error whatever this says."""
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: float | str | None = None


class EmbeddingsRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The legacy `/api/embeddings`."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None


class ModelRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request about one model (`/api/delete`); older clients say `name`."""

    model: str = ""
    name: str = ""

    @property
    def model_name(self) -> str:
        if not (self.model or self.name):
            raise checks.invalid("model", "model is required")
        return self.model or self.name


class ShowRequest(ModelRequest, frozen=True, kw_only=True):
    verbose: bool = False
    """Accepted: Ollama adds the tokenizer's vocabulary to `model_info`, which the cluster does not hold here."""


class PullRequest(ModelRequest, frozen=True, kw_only=True):
    stream: bool = True
    insecure: bool = False


# --- translation ---------------------------------------------------------------------------------------------


def sampling(options: Options | None, context_length: int | None) -> SamplingParams:
    """The options' sampling values, checked; `context_length` is the model's, for `num_predict` -1 and -2."""
    options = options or Options()
    for name, neutral in NEUTRAL_OPTIONS.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise checks.unsupported(f"options.{name}", f"other than {neutral}")
    max_tokens = _whole(options.num_predict)
    if max_tokens in UNTIL_CONTEXT_ENDS:
        max_tokens = context_length
    elif max_tokens is not None and max_tokens < 1:
        raise checks.invalid("options.num_predict", "options.num_predict must be at least 1, or -1 or -2")
    names = {k: f"options.{k}" for k in checks.SAMPLING_FIELDS} | {
        "max_tokens": "options.num_predict",
        "repetition_penalty": "options.repeat_penalty",
    }
    return checks.sampling(
        max_tokens=max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=None if options.seed == -1 else _whole(options.seed),  # Ollama's -1: a random seed
        stop=options.stop,
        top_k=_whole(options.top_k),
        min_p=options.min_p,
        repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repeat_last_n=_whole(options.repeat_last_n),
        names=names,
    )


def output_schema(format: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`format`: "json" for any JSON object, or a JSON Schema; "" or absent for free text."""
    if format is None or format == "":
        return None
    if format == "json":
        return {"type": "object"}
    if isinstance(format, str):
        raise checks.invalid("format", 'format must be "json" or a JSON Schema object')
    return checks.output_schema(format, "format")


def _common(
    task_id: TaskId, model_id: ModelId, request: GenerationRequest, context_length: int | None
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "model_id": model_id,
        "sampling": sampling(request.options, context_length),
        "output_schema": output_schema(request.format),
        "top_logprobs": checks.top_logprobs(bool(request.logprobs), request.top_logprobs),
        "chat_template_kwargs": _thinking(request.think),
    }


THINK_EFFORTS = ("low", "medium", "high")


def thinks(request: GenerationRequest) -> bool:
    return request.think not in (None, False)


def _thinking(think: bool | str | None) -> dict[str, Any]:
    if isinstance(think, str) and think not in THINK_EFFORTS:
        raise checks.invalid("think", f"think must be true, false or one of {', '.join(THINK_EFFORTS)}")
    switch = None if think is None else think is not False
    return checks.template_kwargs(None, thinking=switch, effort=think if isinstance(think, str) else None)


def chat_task(task_id: TaskId, model_id: ModelId, request: ChatRequest, context_length: int | None) -> TaskRequest:
    common = _common(task_id, model_id, request, context_length)
    functions = [(t.function.name, t.function.description, t.function.parameters) for t in request.tools or ()]
    tools: Tools | None = checks.tools(functions)  # Ollama has no tool_choice: the model decides
    conversation = messages(request.messages)
    check_images(conversation)
    return TaskRequest(
        kind=TaskKind.CHAT,
        messages=conversation,
        tools=tools,
        continue_final_message=checks.continued(conversation),
        **common,
    )


def messages(bodies: list[MessageBody]) -> tuple[ChatMessage, ...]:
    """The conversation. Ollama's calls carry no ids (newer clients may send one): each call gets one, and a
    `tool` message answers the first unanswered call of the turn before with its `tool_name`."""
    converted: list[ChatMessage] = []
    unanswered: list[ToolCall] = []
    for i, body in enumerate(bodies):
        param = f"messages[{i}]"
        if body.role not in ("system", "user", "assistant", "tool"):
            raise checks.invalid(f"{param}.role", f"{param}.role must be system, user, assistant or tool")
        calls = tuple(
            ToolCall(id=c.id or f"call_{i}_{k}", name=c.function.name, arguments=json.dumps(c.function.arguments))
            for k, c in enumerate(body.tool_calls or ())
        )
        if calls and body.role != "assistant":
            raise checks.invalid(f"{param}.tool_calls", f"{param}: only assistant messages carry tool_calls")
        if body.role == "assistant":
            unanswered = list(calls)
        call_id = body.tool_call_id
        if body.role == "tool" and call_id is None:
            answered = next((c for c in unanswered if body.tool_name in (None, c.name)), None)
            if answered is not None:
                unanswered.remove(answered)
                call_id = answered.id
        converted.append(
            ChatMessage(
                role=body.role,
                content=body.content or "",
                images=_images(body.images, f"{param}.images"),
                tool_calls=calls,
                tool_call_id=call_id,
                name=body.tool_name if body.role == "tool" else None,
            )
        )
    return tuple(converted)


def generate_task(
    task_id: TaskId, model_id: ModelId, request: GenerateRequest, context_length: int | None
) -> TaskRequest:
    """A chat turn (`system`, then the prompt as the user's message) through the model's template, or with
    `raw` the prompt as it is, as a completion."""
    for name in ("suffix", "template", "context"):
        if getattr(request, name):
            raise checks.unsupported(name)
    common = _common(task_id, model_id, request, context_length)
    if request.raw:
        if request.images:
            raise checks.unsupported("images", "with raw (a raw prompt has no place for them)")
        return TaskRequest(kind=TaskKind.COMPLETION, prompt=request.prompt, **common)
    turn = [ChatMessage(role="system", content=request.system)] if request.system else []
    turn.append(ChatMessage(role="user", content=request.prompt, images=_images(request.images, "images")))
    check_images(turn, "images")
    return TaskRequest(kind=TaskKind.CHAT, messages=tuple(turn), **common)


def _images(images: list[str] | None, param: str) -> tuple[bytes, ...]:
    """Ollama's images: base64 files."""
    return tuple(base64_image(image, f"{param}[{k}]") for k, image in enumerate(images or ()))


def embed_task(task_id: TaskId, model_id: ModelId, inputs: str | list[str]) -> TaskRequest:
    return TaskRequest(
        task_id=task_id, model_id=model_id, kind=TaskKind.EMBEDDING, inputs=checks.embedding_inputs(inputs)
    )


def shortened(vector: tuple[float, ...], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalised again, as Ollama shortens an embedding."""
    if dimensions is None:
        return list(vector)
    if not 1 <= dimensions <= len(vector):
        raise checks.invalid("dimensions", f"dimensions must be between 1 and {len(vector)}")
    head = vector[:dimensions]
    norm = sum(v * v for v in head) ** 0.5 or 1.0
    return [v / norm for v in head]


# --- responses ------------------------------------------------------------------------------------------------


class OllamaError(msgspec.Struct, frozen=True):
    error: str


class AssistantMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallBody] | None = None


def tool_call_bodies(calls: list[ToolCall] | tuple[ToolCall, ...], first_index: int = 0) -> list[ToolCallBody]:
    """Calls with their arguments as an object, as Ollama gives them."""
    return [
        ToolCallBody(
            id=call.id,
            function=FunctionCallBody(name=call.name, arguments=_arguments(call.arguments), index=first_index + i),
        )
        for i, call in enumerate(calls)
    ]


def _arguments(text: str) -> dict[str, Any]:
    """The runner's parser gives every call's arguments as a JSON object's text."""
    arguments: dict[str, Any] = json.loads(text)
    return arguments


def done_reason(outcome: TaskOutcome | None) -> str:
    """Ollama says `stop` for an answer that ends with tool calls too."""
    return "length" if outcome is TaskOutcome.LENGTH else "stop"


class _Answer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What every line of `/api/chat` and `/api/generate` says: the counts and durations (nanoseconds) on
    the last (`done`) only."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[TokenLogprobBody] | None = None


class ChatAnswer(_Answer, frozen=True, kw_only=True, omit_defaults=True):
    message: AssistantMessage


class GenerateAnswer(_Answer, frozen=True, kw_only=True, omit_defaults=True):
    response: str
    thinking: str | None = None


class EmbedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingAnswer(msgspec.Struct, frozen=True):
    embedding: list[float]


class Progress(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A line of `/api/pull`."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class Version(msgspec.Struct, frozen=True):
    version: str


class ModelDetails(msgspec.Struct, frozen=True, kw_only=True):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str

    @classmethod
    def of(cls, card: ModelCard) -> ModelDetails:
        gguf = card.source in (ModelSource.GGUF_PACKAGE, ModelSource.LOCAL_GGUF, ModelSource.HUB_GGUF)
        q = card.quantization
        return cls(
            format="gguf" if gguf else "safetensors",
            family=card.architecture,
            families=[card.architecture],
            parameter_size=_count(parameter_count(card)),
            # A GGUF's own type (Q4_K_M), as Ollama names it; else the MLX quantization's bits.
            quantization_level=card.file_type or (f"Q{q.bits}" if q else "unquantized"),
        )


def _count(n: int) -> str:
    """Ollama's form: 8.0B, 494.03M."""
    if n >= 10**9:
        return f"{n / 10**9:.1f}B"
    if n >= 10**6:
        return f"{n / 10**6:.2f}M"
    return f"{n / 10**3:.2f}K"


def file_sha256(card: ModelCard) -> str | msgspec.UnsetType:
    """The sha256 of the file the card was made from, where the card records it: a GGUF's (the first part's, when
    split), from the Hub's LFS record or the package's, which the download checks. A Hub repository's files have no
    one hash (each node's manifest holds theirs): no digest then, which Ollama's clients take (their `digest` is
    optional), rather than an invented one."""
    return card.source_sha256 or msgspec.UNSET


class ListedModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str | msgspec.UnsetType = msgspec.UNSET
    details: ModelDetails

    @classmethod
    def of(cls, card: ModelCard) -> ListedModel:
        name = ollama_name(card.model_id)
        return cls(
            name=name,
            model=name,
            modified_at=NO_TIME,
            size=card.storage_size_bytes,
            digest=file_sha256(card),
            details=ModelDetails.of(card),
        )


class ModelList(msgspec.Struct, frozen=True):
    models: list[ListedModel]


class RunningModel(ListedModel, frozen=True, kw_only=True):
    expires_at: str = NEVER
    size_vram: int
    context_length: int

    @classmethod
    def running(cls, card: ModelCard, unloads_at_ms: int | None, context_length: int) -> RunningModel:
        """`context_length`: what its instance serves (a llama.cpp slot's may be less than the model's)."""
        listed = msgspec.structs.asdict(ListedModel.of(card))
        expires_at = NEVER if unloads_at_ms is None else _rfc3339(unloads_at_ms)
        return cls(**listed, expires_at=expires_at, size_vram=card.storage_size_bytes, context_length=context_length)


class RunningList(msgspec.Struct, frozen=True):
    models: list[RunningModel]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    modelfile: str
    parameters: str
    details: ModelDetails
    model_info: dict[str, str | int]
    capabilities: list[str]
    modified_at: str = NO_TIME
    license: str = ""

    @classmethod
    def of(cls, card: ModelCard) -> ModelInfo:
        defaults = documented_defaults(card.generation)
        parameters = "\n".join(
            f"{name} {value}"
            for name, value in (
                ("temperature", defaults.temperature),
                ("top_p", defaults.top_p),
                ("num_predict", defaults.max_tokens),
                ("num_ctx", card.context_length),
            )
        )
        modelfile = "\n".join(
            [f"# Served by jetshard from {card.source}", f"FROM {card.model_id}"]
            + [f"PARAMETER {line}" for line in parameters.splitlines()]
        )
        arch = card.architecture
        info: dict[str, str | int] = {
            "general.architecture": arch,
            "general.basename": card.model_id.split("/")[1],
            "general.parameter_count": parameter_count(card),
            f"{arch}.context_length": card.context_length,
            f"{arch}.embedding_length": card.hidden_size,
            f"{arch}.block_count": card.num_layers,
            f"{arch}.attention.head_count": card.num_attention_heads,
            f"{arch}.attention.head_count_kv": card.num_key_value_heads,
            f"{arch}.vocab_size": card.vocab_size,
        }
        return cls(
            modelfile=modelfile,
            parameters=parameters,
            details=ModelDetails.of(card),
            model_info=info,
            capabilities=[str(capability) for capability in card.capabilities],
        )
