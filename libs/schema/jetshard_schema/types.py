"""Value types shared by commands, events and State."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from jetshard_schema.ids import (
    MODEL_ID_MAX_LENGTH,
    ModelId,
    ValidModelId,
    ValidNodeId,
    ValidSessionId,
    ValidTaskId,
    parse_model_id,
)


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One NVIDIA GPU of a node, as NVML reports it."""

    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: str
    """`major.minor`, e.g. "9.0" for Hopper."""
    driver: str


class Engine(enum.StrEnum):
    """What computes an instance's tokens: one engine per instance."""

    MLX = "mlx"
    """MLX (mlx-lm): MLX directories; Metal on Apple silicon, CUDA on NVIDIA, a reference path on x86 CPUs."""
    LLAMA_CPP = "llama.cpp"
    """Upstream llama.cpp (`llama-server`, one per instance): GGUF files, fastest on CPUs."""


class ModelFormat(enum.StrEnum):
    """A form of a model's weights a node can get, and the engine that loads it."""

    MLX = "mlx"
    """An MLX directory (safetensors, MLX quantization), from the Hub or converted from a GGUF MLX can hold."""
    GGUF = "gguf"
    """One GGUF file, as llama.cpp loads it."""


def engine_format(engine: Engine | None) -> ModelFormat:
    """The form of the weights `engine` loads; None (placements recorded before engines) is MLX."""
    return ModelFormat.GGUF if engine is Engine.LLAMA_CPP else ModelFormat.MLX


class NodeProfile(msgspec.Struct, frozen=True, kw_only=True):
    hostname: str
    os: str
    cpu_cores: int
    memory_total_bytes: int
    memory_available_bytes: int
    accelerator: str = "cpu"
    """Where the node's runners compute: "cpu", "metal" (Apple silicon) or "cuda" (mlx's CUDA build on an
    NVIDIA GPU, the first of `gpus`)."""
    fast_blas: bool = False
    """A CPU node's runners multiply float32 with an optimised BLAS that runs on this processor: only then
    are float32 weights faster there than the checkpoint's quantized ones."""
    gpus: tuple[GpuInfo, ...] = ()
    """The node's NVIDIA GPUs, whatever its runners compute on (none where there is no NVIDIA driver)."""
    engines: tuple[Engine, ...] = (Engine.MLX,)
    """The engines the node's runners can run now: llama.cpp once its build is ready on the node."""

    def compute_gpu(self) -> GpuInfo | None:
        """The GPU a CUDA node's runners compute on: the first (one GPU a node for now)."""
        return self.gpus[0] if self.accelerator == "cuda" and self.gpus else None

    def with_compute_freed(self, freed_bytes: int) -> NodeProfile:
        """This profile with `freed_bytes` more free in the memory shards are held in (its GPU's on a CUDA node,
        its system's otherwise; taken when negative), never below none nor past all of it: what leaves may hold
        less than placement reserved for it."""
        gpu = self.compute_gpu()
        if gpu is None:
            free = min(self.memory_total_bytes, max(0, self.memory_available_bytes + freed_bytes))
            return msgspec.structs.replace(self, memory_available_bytes=free)
        free = min(gpu.memory_total_bytes, max(0, gpu.memory_free_bytes + freed_bytes))
        return msgspec.structs.replace(
            self, gpus=(msgspec.structs.replace(gpu, memory_free_bytes=free), *self.gpus[1:])
        )


class ModelDirInfo(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    read_only: bool
    free_bytes: int
    total_bytes: int


class FileServer(msgspec.Struct, frozen=True, kw_only=True):
    """Where a node's downloader serves the model files it holds completely to the cluster's other downloaders
    (HTTP/1.1 over mutual TLS 1.3), and the certificate its session presents there and as a client."""

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    certificate_pem: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CERTIFICATE_CHARS)]
    """A node reports only its own storage (NATS permissions), so the cluster's identities vouch for it: peers pin
    it, and its server admits only the certificates other nodes' storage reports name."""


class NodeStorage(msgspec.Struct, frozen=True, kw_only=True):
    """What a node's downloader sees on its disks."""

    model_dirs: tuple[ModelDirInfo, ...] = ()
    offline: bool = False
    """The downloader makes no network call: it can serve only `available_models` (and packaged GGUFs)."""
    available_models: tuple[ValidModelId, ...] = ()
    """Models complete (every layer) in one of the node's directories."""
    file_server: FileServer | None = None
    """Where other nodes copy `available_models` from; None from a downloader before node-to-node copies."""


class WeightsDtype(enum.StrEnum):
    """The dtype a runner holds its weights in."""

    AUTO = "auto"
    """float32 on a CPU when the node's memory allows (a fast BLAS multiplies it several times faster than
    quantized kernels there); the checkpoint's own dtype elsewhere."""
    NATIVE = "native"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class KvCacheType(enum.StrEnum):
    """What an instance stores its KV cache as, in llama.cpp's names (`--cache-type-k`, `--cache-type-v`)."""

    AUTO = "auto"
    """The dtype the layers compute in: 16 bits on llama.cpp."""
    Q8_0 = "q8_0"
    """Blocks of 32 8-bit values with a 16-bit scale, 8.5 bits a value: about half of 16 bits' memory, so about
    twice the slots or context in the same memory."""
    Q4_0 = "q4_0"
    """Blocks of 32 4-bit values with a 16-bit scale, 4.5 bits a value: about a quarter."""

    @property
    def bits(self) -> float:
        """Bits one cached value takes, on llama.cpp."""
        return {KvCacheType.AUTO: 16.0, KvCacheType.Q8_0: 8.5, KvCacheType.Q4_0: 4.5}[self]

    @property
    def quantized_bits(self) -> int | None:
        """Bits of each quantized value, before its group's scale and bias (MLX); None for AUTO."""
        return {KvCacheType.AUTO: None, KvCacheType.Q8_0: 8, KvCacheType.Q4_0: 4}[self]


KV_GROUP_SIZES = (64, 32)
"""The groups of values an MLX quantized KV cache gives one scale and bias, widest first: mlx's quantization takes
these, and a head's width must be a multiple of one."""


def kv_group_size(head_dim: int) -> int | None:
    """The widest of `KV_GROUP_SIZES` that divides heads `head_dim` values wide; None where none does."""
    return next((size for size in KV_GROUP_SIZES if head_dim % size == 0), None)


class Drafting(enum.StrEnum):
    """How an instance drafts tokens for its model to check several at a time (speculative decoding): the answer
    is the one it gives without drafting (greedy: token for token; sampled: the same distribution)."""

    NGRAM = "ngram"
    """Prompt lookup: the tokens that followed the last few generated ones where they stand earlier in the
    prompt or the answer, so no second model; it pays where an answer repeats its prompt (a code edit)."""


DraftSetting = Annotated[str, msgspec.Meta(max_length=MODEL_ID_MAX_LENGTH)]
"""`serving.draft`: "ngram" (`Drafting.NGRAM`), or the id of a model that drafts (a small one with the same
tokenizer), run beside the model on the instance's leader (`ServingSettings` checks which)."""


class Parallelism(enum.StrEnum):
    """How an instance splits its model over its nodes."""

    PIPELINE = "pipeline"
    """Each node holds a contiguous range of whole layers; a token crosses every node once per step. The
    default: it needs one network hop per node and token."""
    TENSOR = "tensor"
    """Each node holds its slice of every layer and every node runs every step, summing each layer's attention
    and MLP outputs over the nodes: two all-reduces per layer and token, so it lowers one stream's latency only
    on fast, well-linked nodes."""


MAX_NODES = 4096
MAX_CERTIFICATE_CHARS = 4096
"""A peer certificate's PEM (a self-signed Ed25519 or P-256 certificate takes under 1,000)."""
MinNodes = Annotated[int, msgspec.Meta(ge=1, le=MAX_NODES)]
"""How many nodes an instance spans at least."""
NodeIds = Annotated[tuple[ValidNodeId, ...], msgspec.Meta(min_length=1, max_length=MAX_NODES)]
"""The nodes a placement names, in rank order: at least one (leaving them out lets placement choose), and no more
than a cluster may have."""
MaxBatch = Annotated[int, msgspec.Meta(ge=1, le=256)]
MaxQueued = Annotated[int, msgspec.Meta(ge=0, le=100_000)]
PrefixCacheBytes = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""Tokens of one task (a prompt's, an answer's): no model's context comes near the bound, and a node's report of
more, or of fewer than none, is malformed."""
KEEP_LOADED = -1
"""A keep-alive that never unloads: the instance stays until it is removed (Ollama's negative `keep_alive`)."""
MAX_KEEP_ALIVE_MS = 366 * 24 * 3600 * 1000
KeepAliveMs = Annotated[int, msgspec.Meta(ge=KEEP_LOADED, le=MAX_KEEP_ALIVE_MS)]
"""How long an instance stays loaded with nothing to do, in ms (0: it unloads as soon as it is idle), or
`KEEP_LOADED`; at most a year."""


def keep_alive_ms(seconds: float) -> int:
    """A keep-alive in seconds as a `KeepAliveMs`: negative keeps the instance loaded; ValueError past a year (or
    not a number)."""
    if seconds != seconds:
        raise ValueError("a keep-alive must be a number of seconds, not NaN")
    if seconds < 0:
        return KEEP_LOADED
    if seconds * 1000 > MAX_KEEP_ALIVE_MS:
        raise ValueError(f"a keep-alive of {seconds:g} s is longer than a year; a negative one keeps the model loaded")
    return round(seconds * 1000)


"""Named, so that a request setting some of an instance's `ServingSettings` checks the same bounds."""


class ServingSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How an instance serves: chosen at placement, kept in State, read by its runners and by the API."""

    max_batch: Annotated[MaxBatch, msgspec.Meta(description="tasks of one instance that decode together")] = 8
    """In one step; placement reserves KV cache for this many rows."""
    max_queued: Annotated[
        MaxQueued,
        msgspec.Meta(description="tasks of one instance that may wait beyond --max-batch; past that, requests get 429"),
    ] = 64
    """The sequencer refuses a task past that."""
    prefix_cache_bytes: Annotated[
        PrefixCacheBytes,
        msgspec.Meta(description="bytes of prompt KV caches an instance keeps for prompts that start alike (0: none)"),
    ] = 512 * 2**20
    """For later prompts that start alike: a conversation's next turn, a shared system prompt."""
    weights: WeightsDtype = WeightsDtype.AUTO
    parallelism: Parallelism = Parallelism.PIPELINE
    engine: Engine | None = None
    """None asks placement to choose (the fastest engine every chosen node runs for a format the card has);
    a placement records its choice."""
    kv_cache_type: Annotated[
        KvCacheType,
        msgspec.Meta(
            description="what an instance stores its KV cache as: auto (the dtype it computes in), or q8_0 / q4_0 "
            "(about a half / a quarter of 16 bits' memory, so more slots and longer contexts fit)"
        ),
    ] = KvCacheType.AUTO
    """Placement sizes the KV cache by it; llama.cpp stores keys and values so (with flash attention, which a
    quantized V cache needs), and MLX in as many bits with a scale and bias for each group of 64 or 32 values."""
    draft: Annotated[
        DraftSetting | None,
        msgspec.Meta(
            description="speculative decoding (the same answers, faster): ngram drafts from the prompt and the answer "
            "so far (where they repeat the prompt), a model id drafts with that small model of the same tokenizer "
            "(on the instance's leader; llama.cpp only); none by default"
        ),
    ] = None

    def __post_init__(self) -> None:
        # Here rather than as a pattern on the field: the message says what a draft may be, wherever a setting is
        # decoded (a body, a flag, a command).
        if self.draft is not None and self.draft != Drafting.NGRAM:
            try:
                parse_model_id(self.draft)
            except ValueError as error:
                raise ValueError(f"draft must be ngram or the id of a model (org/name): {error}") from None

    @property
    def draft_model(self) -> ModelId | None:
        """The model that drafts, where `draft` names one."""
        return None if self.draft is None or self.draft == Drafting.NGRAM else ModelId(self.draft)


class ShardAssignment(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    rank: int
    start_layer: int
    """First layer of the shard; layer ranges are `[start_layer, end_layer)`, 0-based."""
    end_layer: int
    memory_bytes: int = 0
    """What the shard will take on its node once loaded (its weights in its dtype, its share of the KV cache for
    `max_batch` rows, of the prefix cache and of the activation headroom): placement counts it against the node
    until the shard's runner is ready and the node's own report includes it."""
    tensor_rank: int | None = None
    """In a tensor-parallel instance, which slice of every layer the shard holds (its layer range is the whole
    model); None in a pipeline, whose shards hold their layers whole."""
    weights: WeightsDtype | None = None
    """What this shard holds its weights as (never AUTO): a pipeline's ranks may differ, float32 on a CPU with a
    fast BLAS beside the checkpoint's dtype on a GPU (a tensor-parallel instance's ranks sum their partial results,
    so they all hold one). None in placements recorded before shards had their own: the instance's
    `serving.weights` then."""

    def weights_in(self, serving: ServingSettings) -> WeightsDtype:
        return serving.weights if self.weights is None else self.weights


class DownloadStatus(enum.StrEnum):
    PENDING = "pending"
    ONGOING = "ongoing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RunnerStatus(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class ImportStatus(enum.StrEnum):
    ONGOING = "ongoing"
    COMPLETED = "completed"
    FAILED = "failed"


class ImportProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Where one import of a model file stands on its node, as its downloader reports it."""

    status: ImportStatus
    bytes_done: int = 0
    bytes_total: int = 0
    directory: str = ""
    """The model directory it was written to, once completed."""
    reason: str = ""
    """Why it failed, for a person."""


class DownloadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Where one node's download of one model stands: what its downloader reports, and State records."""

    status: DownloadStatus
    start_layer: int = 0
    """The layers downloaded are `[start_layer, end_layer)`, 0-based."""
    end_layer: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    speed_bytes_per_s: float = 0.0
    eta_s: float | None = None
    directory: str = ""
    read_only: bool = False
    reason: str = ""
    """Why it failed; while retrying, why the last attempt failed; once a cancelled download has stopped on
    its node, that it did (cancelled says only that it was asked to)."""
    attempt: int = 0
    """0 for the first attempt; n for the n-th retry after an error mid-transfer, of at most `max_attempts`."""
    max_attempts: int = 0
    source: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Where the bytes come from: "hub", or the id of the node they are copied from; "" where nothing is fetched
    (found on disk, converted) or from a downloader before node-to-node copies."""
    formats: tuple[ModelFormat, ...] = ()
    """Completed: the forms of the weights complete in `directory` for the layers (one directory holds a GGUF and
    the MLX directory converted from it); otherwise the form being made. () in records from before formats,
    which were all MLX."""

    def holds(self, form: ModelFormat) -> bool:
        """Whether the weights are complete in `directory` in `form` (what a runner of an engine loads)."""
        return self.status is DownloadStatus.COMPLETED and form in (self.formats or (ModelFormat.MLX,))


class ServingCounters(msgspec.Struct, frozen=True, kw_only=True):
    """What an instance's leader has served since it started; reported now and then, never per request."""

    tokens: int = 0
    max_rows: int = 0
    """The most tasks one decode step carried."""
    prefix_hits: int = 0
    """Tasks whose prompt started from a saved prefix cache."""
    prefix_hit_tokens: int = 0
    """Prompt tokens those tasks did not prefill."""
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0
    drafted_tokens: int = 0
    """Tokens drafted for the model to check (`serving.draft`)."""
    accepted_tokens: int = 0
    """Of those, the ones it kept: their share is the drafting's acceptance rate."""


class RunnerReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank's runner last said about itself: its worker reports it, State records it per rank."""

    node_id: ValidNodeId
    rank: int
    worker_session: str
    """The session of the worker that started the runner: a restarted worker's runners are new ones."""
    status: RunnerStatus
    layers_loaded: int = 0
    layers_total: int = 0
    reason: str = ""
    loaded_tensors: tuple[str, ...] = ()
    weights_dtype: str = ""
    """What a ready runner holds its weights as (`float32`, `bfloat16`, `4-bit affine`...)."""
    counters: ServingCounters | None = None
    """The leader's, once it serves."""


class Endpoint(msgspec.Struct, frozen=True):
    """Where a rank's runner listens for the instance's other ranks (MLX's ring; llama.cpp's RPC backend)."""

    host: str
    port: int
    certificate_pem: Annotated[str, msgspec.Meta(max_length=MAX_CERTIFICATE_CHARS)] = ""
    """The certificate its worker session presents on the tunnels between the instance's ranks, which accept only
    the peers whose certificates the instance's endpoints name (a node reports only its own endpoints: NATS
    permissions and `handlers.misaddressed`). Empty from a worker before tunnels: no peer connects to it."""


class InstanceStatus(enum.StrEnum):
    DOWNLOADING = "downloading"
    WAITING = "waiting"
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"


class RejectCode(enum.StrEnum):
    """Why a command was refused; the API maps each to an HTTP status."""

    INVALID = "invalid"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    ALREADY_EXISTS = "already_exists"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    NOT_ENOUGH_NODES = "not_enough_nodes"
    """A placement asks for more nodes than the cluster has (that can get the model's files)."""
    NO_CAPACITY = "no_capacity"
    MODEL_UNAVAILABLE = "model_unavailable"
    """The model's files cannot be had where it would run (offline nodes without it)."""
    FORBIDDEN = "forbidden"
    """The sender may not say this: a node's report about another node, or a command on a subject that is not
    its type's (NATS lets each identity publish on its own subjects only)."""
    QUEUE_FULL = "queue_full"
    """Every instance of the model has `max_batch + max_queued` tasks, or a new one could not start within the
    requester's deadline at the instance's measured pace; the rejection says when to retry."""


MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs`."""
MAX_EMBEDDING_INPUTS = 256
TOKEN_ID_LIMIT = 2**31
"""Token ids a request may give are below this: what the engine's int32 token arrays hold (vocabularies are far
smaller; the model's own bounds them where it runs)."""
MAX_IMAGES = 8
"""Images one request may carry, over all its messages."""
MAX_IMAGE_BYTES = 4 * 2**20
"""The images of one request together, as encoded files: the request travels in one NATS message (8 MiB, its
JSON carrying them in base64), and each image is decoded and encoded again by the vision model's processor."""


class TaskKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call the model made: in an answer, or earlier in the conversation it is given."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI carries them (a model may write JSON that does not parse)."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    """system, user, assistant or tool."""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant turn's calls."""
    tool_call_id: str | None = None
    """A tool turn's answer to this call."""
    name: str | None = None
    """A tool turn's function."""
    images: tuple[bytes, ...] = ()
    """The turn's images as encoded files (PNG, JPEG, GIF, WebP), shown to the model before its text, in order;
    only a card with `vision` takes them."""


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})
    """Its arguments' JSON Schema."""


class ToolChoice(enum.StrEnum):
    AUTO = "auto"
    """The model decides; its output is parsed for calls."""
    NONE = "none"
    """No call: the tools are left out of the prompt."""
    REQUIRED = "required"
    """At least one call: the output is constrained to calls."""
    FUNCTION = "function"
    """A call of `Tools.function`, constrained."""


class Tools(msgspec.Struct, frozen=True, kw_only=True):
    """The tools a chat may call, and how."""

    functions: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    function: str | None = None
    """The function `choice` FUNCTION names."""
    parallel: bool = True
    """Several calls in one answer."""


MAX_REPETITION_PENALTY = 10.0
"""The largest repetition penalty. Useful ones are 1 to 2 (transformers' docs suggest 1.2, Ollama's default is 1.1);
at 10 a repeated token's logit is a tenth of what it was, which already forbids any repetition, so a larger value
is a mistake (a percentage, say) that deserves an error rather than an answer that can repeat no token."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """A request's sampling values; None leaves the value to the model (`jetshard_schema.sampling`)."""

    # Bounds on the wire: a request read back from JETSHARD_TASKS is untrusted input to the engine, whose
    # PRNG refuses a seed outside 64 bits.
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Below 2**64 too (the engine checks: msgspec bounds stop at 64-bit signed)."""
    stop: tuple[str, ...] = ()
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Sample among the k most likely tokens only; 0 cuts nothing."""
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    """Sample among the tokens at least this share as likely as the most likely one; 0 cuts nothing."""
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    """Divides the logit of each token already in the prompt or the answer (multiplies it where it is negative),
    as transformers, vLLM and llama.cpp do; 1 is none."""
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    """Subtracted from the logit of each token the answer holds already (OpenAI's); 0 is none."""
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    """Subtracted from a token's logit once for each time the answer holds it (OpenAI's); 0 is none."""
    repeat_last_n: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """The penalties look at the last this many tokens only (Ollama's and llama.cpp's window; 0 turns them off);
    None: at all of them."""


CHAT_TEMPLATE_ARGUMENTS = frozenset(
    {
        "self",
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""The arguments of transformers' `apply_chat_template` (and of the `render_jinja_template` it calls with the
conversations) that the rendering sets itself: a request's `chat_template_kwargs` may set none of them."""


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]


class TaskRequest(msgspec.Struct, frozen=True, kw_only=True):
    task_id: ValidTaskId
    model_id: ValidModelId
    kind: TaskKind
    messages: tuple[ChatMessage, ...] = ()
    prompt: str = ""
    """A completion's prompt."""
    inputs: Annotated[tuple[str | tuple[TokenId, ...], ...], msgspec.Meta(max_length=MAX_EMBEDDING_INPUTS)] = ()
    """An embedding task's inputs, one vector each: a text, or token ids embedded as they are (not tokenized)."""
    sampling: SamplingParams = SamplingParams()
    keep_alive_ms: KeepAliveMs | None = None
    """How long its instance stays loaded once idle, from this task on (Ollama's `keep_alive`); None: the
    instance's own. It travels to the sequencer in the task's `TaskRef`."""
    tools: Tools | None = None
    output_schema: dict[str, Any] | None = None
    """JSON Schema every choice's output must match (constrained decoding); `{"type": "object"}` for any object."""
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Report each token's log-probability and this many alternatives; None reports none."""
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    """Choices generated from the prompt (rows of one batch, one prefill shared through the prefix cache)."""
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Values the chat template reads besides the conversation (`enable_thinking`, `reasoning_effort`...), as
    vLLM's `chat_template_kwargs`; each dialect's thinking switch becomes `enable_thinking` here."""
    thinking_budget: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """The most tokens a thinking model may reason for: reaching it ends the reasoning with the model's end
    marker, and the answer follows."""
    continue_final_message: bool = False
    """The answer continues the conversation's last message, an assistant's (Anthropic's prefill, Ollama's trailing
    assistant message, vLLM's `continue_final_message`), instead of opening a new turn after it."""


class TaskRef(msgspec.Struct, frozen=True, kw_only=True):
    """A task as commands, events and State know it. The request itself (prompt, sampling) is user data: before
    it submits the task, its API stores it in JETSHARD_TASKS under the node of the leader of the instance it names
    (the only node that may read it), for the task retention only, never in a permanent log."""

    task_id: ValidTaskId
    model_id: ValidModelId
    kind: TaskKind
    requester: ValidSessionId | None = None
    """The session of the API holding the task's client: when its liveness lapses, nobody is left to read the
    task's output and the sequencer cancels it."""
    keep_alive_ms: KeepAliveMs | None = None
    """How long the instance serving it stays loaded once idle, from now on (Ollama's per-request `keep_alive`);
    None leaves the instance's own."""


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """A generated token's log-probability under the model (before temperature and constraints), and the
    most likely alternatives at its place."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: TokenCount
    completion_tokens: TokenCount
    reasoning_tokens: TokenCount = 0
    """The completion tokens a thinking model reasoned with, its think markers included."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TaskOutcome(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"
    ERROR = "error"


class PromptProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far a long prompt is processed, before its task's output starts."""

    done_tokens: int
    total_tokens: int


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of a task's output on `jetshard.chunks.<node id>.<task id>`; `index` runs 0, 1, 2… with no gap."""

    task_id: ValidTaskId
    index: int
    choice: int = 0
    """Which of the task's `n` choices (or embedding inputs) this piece belongs to."""
    text: str = ""
    """Answer text."""
    reasoning: str = ""
    """Text a thinking model wrote between its think markers (the markers left out), before `text`."""
    token_count: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `text`, when the task asked for them."""
    embedding: tuple[float, ...] = ()
    finish_reason: TaskOutcome | None = None
    """Why this choice ended."""
    stop_sequence: str | None = None
    """The request's stop string that ended this choice, where one did (its `finish_reason` is stop)."""
    usage: Usage | None = None
    """On the task's last chunk only: it ends the output."""
    error: str | None = None
    error_code: str | None = None
    prompt_progress: PromptProgress | None = None
    """A chunk of a long prompt's progress carries nothing else: the API shows it to a client that waits."""
