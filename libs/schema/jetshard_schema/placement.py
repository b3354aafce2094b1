"""Placement: which nodes hold which layers of an instance, in which dtype. Pure; tested without NATS.

Memory a model needs on the cluster = its weights + a KV-cache headroom: the KV cache of one full context
(2 · layers · kv heads · head dim · context · 2 bytes, 4 where the layers compute in float32) for each of the
`max_batch` rows that decode together, the instance's prefix-cache budget, plus 10 % of the weights for
activations and allocator slack. Weights count at their checkpoint size, or at 4 (2) bytes a parameter when a
shard converts them to float32 (bfloat16, float16). Each node gets a layer range proportional to the layers its
available memory holds in its shard's dtype (largest remainder, at least one layer each); together the nodes
must hold every layer. A node's available memory is where its runners compute: the first GPU's free memory on a
CUDA node (one GPU a node for now), the system's available memory elsewhere (on Apple silicon that is the GPU's
too: the memory is unified).

A node's available memory is what it last reported less what the shards placed on it will take and that report
does not show taken (not loaded yet, or loaded since): instances placed in one burst are each sized against
what the ones before them left, not all against the same free memory. Each shard records its share of the
requirement.

A tensor-parallel instance (`ServingSettings.parallelism`) spans exactly `min_nodes` nodes (or the nodes named),
each holding its slice of every layer: an equal share of the requirement (weights, KV cache, prefix cache and
headroom alike), except the embedding and head, which each node holds whole (see `tensor_share_bytes`); each
node must have its share on its own. Its attention heads and key/value heads must divide by
the node count, and mlx-lm must split its architecture.

`WeightsDtype.AUTO` is resolved here, once per shard, into the dtype the shard keeps, so one pipeline may mix
them: float32 on a node that computes on its CPU with a fast BLAS (which multiplies float32 several times faster
than MLX's quantized kernels; with the reference BLAS float32 is slower than they are) when the float32 weights
fit the chosen nodes; bfloat16 (float16 before Ampere) for a full-precision checkpoint on an NVIDIA GPU, as
vLLM's `--dtype auto` does; the checkpoint's own dtype otherwise. The nodes are chosen as the checkpoint's
dtype needs them: float32 never adds a node (a network hop per token). A tensor-parallel instance's ranks sum
their partial results, so they all hold one dtype: float32 only if every node is such a CPU.

One engine serves an instance (`ServingSettings.engine`), chosen here when the request leaves it open: the
fastest engine every node used runs (`NodeProfile.engines`) for a format the card has (`ModelCard.formats`).
llama.cpp first where every candidate node computes on its CPU (upstream's kernels are several times MLX's CPU
path there), MLX first on Apple silicon and NVIDIA; the other engine where the first cannot place the model.
llama.cpp serves a pipeline in the GGUF's own quantization, from one node or across several through its RPC
backend: it needs the GGUF's size, its KV cache (f16 K and V for each slot's context, `llama_cpp_slot_context`),
the prompt cache and a compute buffer; across nodes each holds its layers' share of the GGUF and of the KV cache,
and a compute buffer of its own, the leader (the first rank) the prompt cache too. The MLX accounting above is
MLX's alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import msgspec
from msgspec.structs import replace

from jetshard_schema.card_from_config import TENSOR_PARALLEL_ARCHITECTURES
from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.ids import NodeId
from jetshard_schema.models import find_card
from jetshard_schema.state import Instance, Node, State, freed_by, report_shows
from jetshard_schema.types import (
    KV_GROUP_SIZES,
    MAX_NODES,
    DownloadStatus,
    Engine,
    KvCacheType,
    NodeProfile,
    Parallelism,
    ServingSettings,
    ShardAssignment,
    WeightsDtype,
    engine_format,
    kv_group_size,
)

ACTIVATION_HEADROOM = 0.10
HALF_BYTES = 2
FLOAT32_BYTES = 4
UNQUANTIZED_BITS = 16
"""Checkpoints without quantization whose dtype the card does not name are taken as 16-bit (bf16/fp16)."""
NARROWED = (WeightsDtype.BFLOAT16, WeightsDtype.FLOAT16)
DRAFT_VOCABULARY_SLACK = 128
"""How many tokens a draft's vocabulary may differ by from its model's (padding): llama.cpp's own bound."""
LLAMA_CPP_SLOT_CONTEXT = 4096
"""The most tokens of context one llama-server slot holds: its KV cache is allocated whole at start, for every
slot, so a model's full context (128k for many) would take tens of GiB a slot."""
LLAMA_CPP_UBATCH = 512
"""llama-server's physical batch: its compute buffer holds the logits of this many tokens at once."""
LLAMA_CPP_COMPUTE_SLACK_BYTES = 64 * 2**20
"""The rest of llama.cpp's compute buffer (activations of one micro-batch; flash attention keeps no score
matrix), with room to spare for small models."""


class PlacementError(ValueError):
    """The model cannot be placed; the message says why, for a person."""


class ModelUnavailable(PlacementError):
    """The nodes that could hold the model cannot get its files (offline, and it is not on their disks)."""


class InvalidPlacement(PlacementError):
    """The request is wrong whatever the nodes' memory: a node it names is unknown or named twice, fewer than one
    node; the client has to change it, not wait for room."""


class NotEnoughNodes(PlacementError):
    """The placement asks for more nodes than there are (that can get the model's files)."""


class UnsplittableModel(InvalidPlacement):
    """The model cannot be split across that many tensor-parallel nodes (its heads, or its architecture)."""


class EngineMismatch(InvalidPlacement):
    """The engine cannot serve the request whatever the nodes: the card has no weights in its format, or the
    request asks what the engine does not do (tensor parallelism or a converted dtype on llama.cpp)."""


class EngineUnavailable(PlacementError):
    """No node (or not every node named) runs the engine now: llama.cpp's build may not be done yet."""


class Placement(msgspec.Struct, frozen=True):
    shards: tuple[ShardAssignment, ...]
    required_bytes: int
    serving: ServingSettings
    """The requested settings with `weights` resolved: the dtype every shard holds, or AUTO where they differ
    (each shard names its own)."""


def _full_precision(card: ModelCard) -> bool:
    return card.quantization is None and card.checkpoint_dtype == "float32"


def parameter_count(card: ModelCard) -> int:
    """Parameters: the card's count where it has one, else estimated from the checkpoint's size: a quantized weight
    takes `bits` plus its share of its group's 16-bit scale and bias (MLX's affine quantization)."""
    if card.parameter_count:
        return card.parameter_count
    q = card.quantization
    if q is not None:
        bits = q.bits + 2 * 16 / q.group_size
    else:
        bits = 8 * FLOAT32_BYTES if _full_precision(card) else UNQUANTIZED_BITS
    return int(card.storage_size_bytes * 8 / bits)


def weights_bytes(card: ModelCard, weights: WeightsDtype) -> int:
    if weights is WeightsDtype.NATIVE:
        return card.storage_size_bytes
    if weights is WeightsDtype.FLOAT32:
        return parameter_count(card) * FLOAT32_BYTES
    if weights in NARROWED:
        return parameter_count(card) * HALF_BYTES
    raise ValueError("weights_bytes needs a concrete dtype; place() resolves AUTO")


def kv_cache_bytes(
    card: ModelCard, weights: WeightsDtype = WeightsDtype.NATIVE, kv_cache_type: KvCacheType = KvCacheType.AUTO
) -> int:
    """The KV cache of one row holding a full context on MLX, in the dtype the layers compute in (float32 with
    float32 weights, converted or a full-precision checkpoint's own; 16 bits otherwise), or quantized to
    `kv_cache_type`'s bits with a scale and a bias of that dtype for each group of `kv_group_size` values."""
    head_dim = _head_dim(card)
    wide = weights is WeightsDtype.FLOAT32 or (weights is WeightsDtype.NATIVE and _full_precision(card))
    computed_bits = 8 * (FLOAT32_BYTES if wide else HALF_BYTES)
    quantized, group = kv_cache_type.quantized_bits, kv_group_size(head_dim)
    bits = computed_bits if quantized is None or group is None else quantized + 2 * computed_bits / group
    values = 2 * card.num_layers * card.num_key_value_heads * head_dim * card.context_length
    return math.ceil(values * bits / 8)


def _head_dim(card: ModelCard) -> int:
    return card.hidden_size // card.num_attention_heads


def _mlx_quantizes_kv(card: ModelCard) -> bool:
    """Whether MLX can store `card`'s KV cache quantized: its heads' width is a multiple of a group size."""
    return kv_group_size(_head_dim(card)) is not None


def llama_cpp_slot_context(card: ModelCard) -> int:
    """The context each llama-server slot holds: the model's, at most `LLAMA_CPP_SLOT_CONTEXT`. The runner starts
    llama-server with `-c` this times `max_batch` and `-np max_batch`, so that placement's accounting holds."""
    return max(1, min(card.context_length, LLAMA_CPP_SLOT_CONTEXT))


def served_context(card: ModelCard, engine: Engine) -> int:
    """The context a request gets from an instance of `card` on `engine`: the model's on MLX, a slot's on llama.cpp."""
    return llama_cpp_slot_context(card) if engine is Engine.LLAMA_CPP else card.context_length


def llama_cpp_kv_cache_bytes(
    card: ModelCard, slots: int, kv_cache_type: KvCacheType = KvCacheType.AUTO, slot_context: int | None = None
) -> int:
    """llama.cpp's KV cache for `slots` slots of `slot_context` tokens (by default `llama_cpp_slot_context`):
    keys and values of `kv_cache_type`'s bits each."""
    head_dim = _head_dim(card)
    context = llama_cpp_slot_context(card) if slot_context is None else slot_context
    values = 2 * card.num_layers * card.num_key_value_heads * head_dim * context * slots
    return math.ceil(values * kv_cache_type.bits / 8)


def llama_cpp_draft_bytes(card: ModelCard, draft: ModelCard | None, serving: ServingSettings) -> int:
    """What the model that drafts for `card` takes beside it on the instance's leader: its GGUF, a KV cache for
    the same slots and context as the model's (llama-server gives the draft the model's context), and its own
    compute buffer. 0 without one."""
    if draft is None:
        return 0
    kv_cache = llama_cpp_kv_cache_bytes(draft, serving.max_batch, serving.kv_cache_type, llama_cpp_slot_context(card))
    return draft.storage_size_bytes + kv_cache + llama_cpp_compute_bytes(draft)


def llama_cpp_compute_bytes(card: ModelCard) -> int:
    return LLAMA_CPP_UBATCH * card.vocab_size * FLOAT32_BYTES + LLAMA_CPP_COMPUTE_SLACK_BYTES


def required_memory_bytes(card: ModelCard, serving: ServingSettings, draft: ModelCard | None = None) -> int:
    """The whole model's requirement under `serving`, on the engine it names (MLX when it names none), with the
    model that drafts for it (`serving.draft`'s card) where it has one."""
    if serving.engine is Engine.LLAMA_CPP:
        # The GGUF as it is on disk (llama.cpp maps it whole), each slot's KV cache, the prompt cache llama-server
        # keeps in host memory (`--cache-ram`, sized by prefix_cache_bytes), its compute buffer, and the draft's.
        kv_cache = llama_cpp_kv_cache_bytes(card, serving.max_batch, serving.kv_cache_type)
        drafting = llama_cpp_draft_bytes(card, draft, serving)
        return (
            card.storage_size_bytes + kv_cache + serving.prefix_cache_bytes + llama_cpp_compute_bytes(card) + drafting
        )
    weights = weights_bytes(card, serving.weights)
    kv_caches = kv_cache_bytes(card, serving.weights, serving.kv_cache_type) * serving.max_batch
    kv_caches += serving.prefix_cache_bytes
    return int(weights * (1 + ACTIVATION_HEADROOM)) + kv_caches + mlx_draft_bytes(draft, serving)


def mlx_draft_bytes(draft: ModelCard | None, serving: ServingSettings) -> int:
    """What the model that drafts takes on an MLX instance's leader: its weights as stored, with their activations'
    headroom, and a full-precision KV cache of a full context for each row (it drafts for every row)."""
    if draft is None:
        return 0
    weights = weights_bytes(draft, WeightsDtype.NATIVE)
    return int(weights * (1 + ACTIVATION_HEADROOM)) + kv_cache_bytes(draft) * serving.max_batch


def split_layers(num_layers: int, weights: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` ranges proportional to `weights` (largest remainder), at least one layer each."""
    if not weights:
        raise PlacementError("no nodes to place on")
    if num_layers < len(weights):
        raise PlacementError(f"the model has {num_layers} layers, fewer than the {len(weights)} nodes requested")
    total = sum(weights)
    if total <= 0:
        raise PlacementError("the nodes report no available memory")
    # Reserve one layer per node first, then share the rest proportionally.
    spare = num_layers - len(weights)
    exact = [spare * w / total for w in weights]
    counts = [1 + int(x) for x in exact]
    leftover = num_layers - sum(counts)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[:leftover]:
        counts[i] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def compute_memory_bytes(profile: NodeProfile) -> int:
    """The free memory a node's shards are held in: its GPU's on a CUDA node, its system's otherwise."""
    gpu = profile.compute_gpu()
    return profile.memory_available_bytes if gpu is None else gpu.memory_free_bytes


def device_of(profile: NodeProfile) -> str:
    """The device a node's shards run on, for a person: "cuda:0 (NVIDIA H200)", "metal" or "cpu"."""
    gpu = profile.compute_gpu()
    return profile.accelerator if gpu is None else f"cuda:0 ({gpu.name})"


def _float32_is_faster(nodes: Sequence[Node]) -> bool:
    """Whether every node computes on its CPU with a fast BLAS, which multiplies float32 faster than quantized."""
    return all(_fast_cpu(n.profile) for n in nodes)


def _fast_cpu(profile: NodeProfile) -> bool:
    return profile.accelerator == "cpu" and profile.fast_blas


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _checkpoint_weights(card: ModelCard, profile: NodeProfile) -> WeightsDtype:
    """AUTO's dtype on one node before float32 is tried: the checkpoint's own, but 16 bits for a full-precision
    checkpoint on an NVIDIA GPU (bfloat16 from Ampere, compute capability 8.0, on; float16 before)."""
    gpu = profile.compute_gpu()
    if gpu is None or not _full_precision(card):
        return WeightsDtype.NATIVE
    major = gpu.compute_capability.partition(".")[0]
    return WeightsDtype.BFLOAT16 if major.isdigit() and int(major) >= 8 else WeightsDtype.FLOAT16


def _widened(profile: NodeProfile, weights: WeightsDtype) -> WeightsDtype:
    return WeightsDtype.FLOAT32 if _fast_cpu(profile) else weights


class _Sizing:
    """What each dtype costs a layer of `card` under `serving`, and so how many layers a node's memory holds."""

    def __init__(self, card: ModelCard, serving: ServingSettings) -> None:
        self.card, self.serving = card, serving
        self._required: dict[WeightsDtype, int] = {}

    def required(self, weights: WeightsDtype) -> int:
        """The whole model's requirement, were every shard in `weights`."""
        if weights not in self._required:
            resolved = msgspec.structs.replace(self.serving, weights=weights)
            # Never 0, which `layers_held` divides by: a card holds a layer, a head at least one unit wide and a
            # token of context, so its KV cache takes some bytes.
            self._required[weights] = required_memory_bytes(self.card, resolved)
        return self._required[weights]

    def layers_held(self, node: Node, weights: WeightsDtype) -> float:
        return compute_memory_bytes(node.profile) * self.card.num_layers / self.required(weights)

    def shortfall(self, nodes: Sequence[Node], dtypes: Sequence[WeightsDtype]) -> str:
        """Why `nodes` holding `dtypes` cannot take the model, for a person."""
        card, serving = self.card, self.serving
        available = sum(compute_memory_bytes(n.profile) for n in nodes)
        what = f"plus KV-cache headroom for {serving.max_batch} row(s) and a prefix cache of "
        what += f"{_gib(serving.prefix_cache_bytes)}"
        if len(set(dtypes)) == 1:
            weights = dtypes[0]
            needs = (
                f"{_gib(self.required(weights))} (weights {_gib(weights_bytes(card, weights))} as {weights}, {what})"
            )
            has = f"have {_gib(available)} available"
        else:
            held = sum(self.layers_held(n, d) for n, d in zip(nodes, dtypes, strict=True))
            each = ", ".join(f"{n.node_id} as {d}" for n, d in zip(nodes, dtypes, strict=True))
            needs = f"{card.num_layers} layers ({each}, {what})"
            has = f"have {_gib(available)} available, enough for {held:.1f} of them"
        return (
            f"{card.model_id} needs {needs} but the {len(nodes)} node(s) {has}; "
            "add nodes, lower max_batch or prefix_cache_bytes, or choose a smaller model"
        )


def place(
    card: ModelCard,
    nodes: Sequence[Node],
    node_ids: Sequence[NodeId] | None = None,
    min_nodes: int = 1,
    serving: ServingSettings = ServingSettings(),
    draft: ModelCard | None = None,
    as_default: bool = False,
) -> Placement:
    """Choose nodes, layer ranges and each shard's weights dtype for `card` (and room on its leader for `draft`,
    the card of the model `serving.draft` names); raise PlacementError with an actionable reason. `as_default`:
    `serving` is an API's default for every model, not asked of this one, so an engine that cannot draft or
    quantize its KV cache (MLX) serves without, rather than refusing."""
    known = {node.node_id: node for node in nodes}
    if node_ids is not None:
        if not node_ids:
            raise InvalidPlacement("node_ids names no node: name one at least, or leave it out for placement to choose")
        twice = [n for n, count in Counter(node_ids).items() if count > 1]
        if twice:
            raise InvalidPlacement(f"node_ids lists {_some(twice)} more than once: each node holds one rank")
        missing = [n for n in node_ids if n not in known]
        if missing:
            raise InvalidPlacement(f"unknown node(s): {_some(missing)}; see GET /nodes")
        chosen = [known[n] for n in node_ids]
    else:
        chosen = sorted(nodes, key=lambda n: (-compute_memory_bytes(n.profile), n.node_id))
    if min_nodes < 1:
        raise InvalidPlacement("min_nodes must be at least 1")
    named = node_ids is not None
    engines = [serving.engine] if serving.engine is not None else _engines_by_speed(chosen)
    refusals: list[PlacementError] = []
    no_format: list[PlacementError] = []
    no_room: list[PlacementError] = []
    for engine in engines:
        asked, drafting = serving, draft
        if as_default and draft is not None and engine_format(engine) not in draft.formats:
            asked, drafting = msgspec.structs.replace(asked, draft=None), None
        if as_default and engine is Engine.MLX and not _mlx_quantizes_kv(card):
            asked = msgspec.structs.replace(asked, kv_cache_type=KvCacheType.AUTO)
        refusal = _engine_refusal(engine, card, chosen, named, min_nodes, asked) or _draft_refusal(engine, drafting)
        if refusal is not None:
            (refusals if engine_format(engine) in card.formats else no_format).append(refusal)
            continue
        # On the nodes named, or on those of `chosen` that run the engine.
        on_engine = msgspec.structs.replace(asked, engine=engine)
        runs = chosen if named else [n for n in chosen if engine in n.profile.engines]
        try:
            if engine is Engine.LLAMA_CPP:
                return _place_llama_cpp(card, runs, named, min_nodes, on_engine, drafting)
            return _with_draft_on_leader(_place_mlx(card, runs, named, min_nodes, on_engine), runs, drafting)
        except PlacementError as error:
            no_room.append(error)
    # The reason to act on: that of the fastest engine that could serve the model as asked but did not fit it,
    # else that of the fastest engine for a format the card has, else the fastest engine's.
    raise (no_room or refusals or no_format)[0]


def _engines_by_speed(nodes: Sequence[Node]) -> list[Engine]:
    """The engines to try, fastest first on `nodes`: llama.cpp where they all compute on their CPUs, MLX on Apple
    silicon and NVIDIA GPUs."""
    if nodes and all(n.profile.accelerator == "cpu" for n in nodes):
        return [Engine.LLAMA_CPP, Engine.MLX]
    return [Engine.MLX, Engine.LLAMA_CPP]


def _draft_refusal(engine: Engine, draft: ModelCard | None) -> PlacementError | None:
    """Why `engine` cannot draft with `draft`'s model; None if it can (or there is none)."""
    wanted = engine_format(engine)
    if draft is None or wanted in draft.formats:
        return None
    return EngineMismatch(
        f"draft {draft.model_id} has no {wanted} weights, which {engine} drafts with (it has "
        f"{', '.join(draft.formats)}): name another draft, or import it as {wanted}"
    )


def _engine_refusal(
    engine: Engine, card: ModelCard, chosen: Sequence[Node], named: bool, min_nodes: int, serving: ServingSettings
) -> PlacementError | None:
    """Why `engine` cannot serve `card` as asked, on the nodes named (`named`) or on any of `chosen`; None if it
    can (memory aside)."""
    wanted = engine_format(engine)
    if wanted not in card.formats:
        return EngineMismatch(
            f"{card.model_id} has no {wanted} weights, which {engine} serves (it has {', '.join(card.formats)}): "
            f"leave engine out for placement to choose, or import the model as {wanted}"
        )
    quantized = serving.kv_cache_type is not KvCacheType.AUTO
    if engine is Engine.MLX and quantized and not _mlx_quantizes_kv(card):
        return EngineMismatch(
            f"kv_cache_type {serving.kv_cache_type} on MLX quantizes each head's keys and values in groups of "
            f"{' or '.join(map(str, KV_GROUP_SIZES))}, and {card.model_id}'s heads are {_head_dim(card)} wide: "
            "leave kv_cache_type out, or use engine llama.cpp"
        )
    if engine is Engine.LLAMA_CPP:
        if serving.parallelism is Parallelism.TENSOR:
            return EngineMismatch(
                "llama.cpp serves an instance as a pipeline; tensor parallelism is MLX's: "
                "leave parallelism out, or use engine mlx"
            )
        if serving.weights is WeightsDtype.FLOAT32 or serving.weights in NARROWED:
            return EngineMismatch(
                f"llama.cpp holds the GGUF's own quantization ({card.file_type or 'as stored'}); weights "
                f"{serving.weights} applies to MLX only: leave weights out (or native), or use engine mlx"
            )
    lacking = [n.node_id for n in chosen if engine not in n.profile.engines]
    if named and lacking:
        return EngineUnavailable(
            f"{_some(lacking)} {'does' if len(lacking) == 1 else 'do'} not run {engine}{_not_yet(engine)}: "
            "name nodes that do (GET /nodes lists each node's engines), or leave engine out"
        )
    if chosen and len(lacking) == len(chosen):
        return EngineUnavailable(
            f"no node runs {engine}{_not_yet(engine)}; "
            f"nodes run {', '.join(sorted({e for n in chosen for e in n.profile.engines}))}"
        )
    return None


def _pipeline_shards(
    chosen: Sequence[Node],
    ranges: Sequence[tuple[int, int]],
    weights: Sequence[WeightsDtype],
    memory_bytes: Sequence[int],
) -> tuple[ShardAssignment, ...]:
    """A pipeline in the order of `chosen`: each node's rank, its layer range, dtype and memory, one per node."""
    return tuple(
        ShardAssignment(
            node_id=node.node_id, rank=rank, start_layer=start, end_layer=end, memory_bytes=memory, weights=dtype
        )
        for rank, (node, (start, end), dtype, memory) in enumerate(
            zip(chosen, ranges, weights, memory_bytes, strict=True)
        )
    )


def _not_yet(engine: Engine) -> str:
    return " (yet: its build may still be running)" if engine is Engine.LLAMA_CPP else ""


def _place_llama_cpp(
    card: ModelCard,
    chosen: Sequence[Node],
    named: bool,
    min_nodes: int,
    serving: ServingSettings,
    draft: ModelCard | None,
) -> Placement:
    """The nodes named, or the fewest (at least `min_nodes`) with the most memory, hold every layer in the GGUF's own
    quantization. The first is the leader: it runs llama-server, keeps the token embedding and the first layers,
    and reaches the others' layers through llama.cpp's RPC backend, in rank order (the last holds the output)."""
    serving = msgspec.structs.replace(serving, weights=WeightsDtype.NATIVE)
    if len(chosen) < min_nodes:
        raise NotEnoughNodes(f"{min_nodes} node(s) requested but only {len(chosen)} run llama.cpp")
    if not named:
        chosen = sorted(chosen, key=lambda n: (-llama_cpp_memory_bytes(n.profile), n.node_id))
    sizing = _LlamaCppSizing(card, serving, draft)
    if not named:
        count, held = 0, 0.0
        for count, node in enumerate(chosen, start=1):
            held += sizing.layers_held(node, leader=count == 1)
            if count >= min_nodes and held >= card.num_layers:
                break
        chosen = chosen[:count]
    if len(chosen) > card.num_layers:
        raise PlacementError(f"{card.model_id} has {card.num_layers} layers, fewer than the {len(chosen)} nodes")
    held_by = [sizing.layers_held(node, leader=rank == 0) for rank, node in enumerate(chosen)]
    if sum(held_by) < card.num_layers or min(held_by) < 1:
        raise PlacementError(sizing.shortfall(chosen, named))
    # Layers in proportion to what each node holds (in thousandths of a layer: integer weights for split_layers).
    ranges = split_layers(card.num_layers, [max(1, int(held * 1000)) for held in held_by])
    shards = _pipeline_shards(
        chosen,
        ranges,
        [WeightsDtype.NATIVE] * len(chosen),
        [
            sizing.shard_bytes(end - start, leader=rank == 0, nodes=len(chosen))
            for rank, (start, end) in enumerate(ranges)
        ],
    )
    return Placement(shards=shards, required_bytes=sum(s.memory_bytes for s in shards), serving=serving)


class _LlamaCppSizing:
    """What llama.cpp takes on each node of an instance: a share of the GGUF and of every slot's KV cache for each
    layer the node holds, a compute buffer on every node, and the prompt cache (`--cache-ram`) and the model that
    drafts on the leader. One node holding every layer takes exactly `required_memory_bytes`."""

    def __init__(self, card: ModelCard, serving: ServingSettings, draft: ModelCard | None) -> None:
        self.card, self.serving, self.draft = card, serving, draft
        self.kv_cache = llama_cpp_kv_cache_bytes(card, serving.max_batch, serving.kv_cache_type)
        self.layer_bytes = (card.storage_size_bytes + self.kv_cache) / card.num_layers
        self.compute = llama_cpp_compute_bytes(card)
        self.drafting = llama_cpp_draft_bytes(card, draft, serving)

    def overhead(self, leader: bool) -> int:
        return self.compute + (self.serving.prefix_cache_bytes + self.drafting if leader else 0)

    def layers_held(self, node: Node, leader: bool) -> float:
        return max(0, llama_cpp_memory_bytes(node.profile) - self.overhead(leader)) / self.layer_bytes

    def shard_bytes(self, layers: int, leader: bool, nodes: int) -> int:
        if nodes == 1:
            return required_memory_bytes(self.card, self.serving, self.draft)
        return int(layers * self.layer_bytes) + self.overhead(leader)

    def shortfall(self, chosen: Sequence[Node], named: bool) -> str:
        card, serving, draft = self.card, self.serving, self.draft
        drafting = f", {_gib(self.drafting)} for {draft.model_id} to draft on the leader" if draft else ""
        needs = (
            f"{card.model_id} on llama.cpp needs {_gib(required_memory_bytes(card, serving, draft))} (the GGUF "
            f"{_gib(card.storage_size_bytes)}{f' as {card.file_type}' if card.file_type else ''}, a KV cache of "
            f"{_gib(self.kv_cache)} for {serving.max_batch} slot(s) of {llama_cpp_slot_context(card)} tokens, a "
            f"prompt cache of {_gib(serving.prefix_cache_bytes)}{drafting} and {_gib(self.compute)} to compute on "
            "each node)"
        )
        if len(chosen) == 1:
            which = "" if named else ", the most of any node that runs llama.cpp"
            has = f"{chosen[0].node_id} has {_gib(llama_cpp_memory_bytes(chosen[0].profile))} available{which}"
        else:
            available = sum(llama_cpp_memory_bytes(n.profile) for n in chosen)
            which = "" if named else " that run llama.cpp"
            has = f"the {len(chosen)} node(s){which} have {_gib(available)} available"
        return (
            f"{needs} but {has}; add nodes, lower max_batch or prefix_cache_bytes, free memory, or choose a smaller "
            "model"
        )


def llama_cpp_memory_bytes(profile: NodeProfile) -> int:
    """The memory llama.cpp computes in on a node: the system's (its builds are CPU builds, on every node)."""
    return profile.memory_available_bytes


def _place_mlx(
    card: ModelCard, chosen: Sequence[Node], named: bool, min_nodes: int, serving: ServingSettings
) -> Placement:
    if serving.parallelism is Parallelism.TENSOR:
        refusal = tensor_split_refusal(card, len(chosen) if named else min_nodes)
        if refusal is not None:
            raise UnsplittableModel(refusal)
    if len(chosen) < min_nodes:
        raise NotEnoughNodes(f"{min_nodes} node(s) requested but only {len(chosen)} available")
    if serving.parallelism is Parallelism.TENSOR:
        return _place_tensor_parallel(card, chosen if named else chosen[:min_nodes], serving)

    sizing = _Sizing(card, serving)
    auto = serving.weights is WeightsDtype.AUTO
    dtypes = [_checkpoint_weights(card, n.profile) if auto else serving.weights for n in chosen]
    if not named:
        # The fewest nodes (at least min_nodes) whose memory holds every layer: fewer hops per token.
        count, held = 0, 0.0
        for count, (node, weights) in enumerate(zip(chosen, dtypes, strict=True), start=1):
            held += sizing.layers_held(node, weights)
            if count >= min_nodes and held >= card.num_layers:
                break
        chosen, dtypes = chosen[:count], dtypes[:count]

    def holds_all(weights: Sequence[WeightsDtype]) -> bool:
        held = sum(sizing.layers_held(n, w) for n, w in zip(chosen, weights, strict=True))
        return held >= card.num_layers

    if not holds_all(dtypes):
        raise PlacementError(sizing.shortfall(chosen, dtypes))
    if auto:
        widened = [_widened(n.profile, w) for n, w in zip(chosen, dtypes, strict=True)]
        if widened != dtypes and holds_all(widened):
            dtypes = widened
    # In proportion to the layers each node holds; integers, so a uniform dtype splits exactly by memory.
    widest = max(sizing.required(w) for w in dtypes)
    shares = [
        compute_memory_bytes(n.profile) * widest // sizing.required(w) for n, w in zip(chosen, dtypes, strict=True)
    ]
    ranges = split_layers(card.num_layers, shares)
    shards = _pipeline_shards(
        chosen,
        ranges,
        dtypes,
        [sizing.required(w) * (end - start) // card.num_layers for w, (start, end) in zip(dtypes, ranges, strict=True)],
    )
    layers_in: Counter[WeightsDtype] = Counter()
    for shard, weights in zip(shards, dtypes, strict=True):
        layers_in[weights] += shard.end_layer - shard.start_layer
    required = sum(sizing.required(w) * layers // card.num_layers for w, layers in layers_in.items())
    common = dtypes[0] if len(layers_in) == 1 else WeightsDtype.AUTO
    return Placement(shards=shards, required_bytes=required, serving=msgspec.structs.replace(serving, weights=common))


def _with_draft_on_leader(placement: Placement, nodes: Sequence[Node], draft: ModelCard | None) -> Placement:
    """An MLX placement with room on its leader (the last rank) for the model that drafts, where it has one."""
    drafting = mlx_draft_bytes(draft, placement.serving)
    if not drafting:
        return placement
    assert draft is not None
    *rest, leader = placement.shards
    node = next(n for n in nodes if n.node_id == leader.node_id)
    needs = leader.memory_bytes + drafting
    if compute_memory_bytes(node.profile) < needs:
        raise PlacementError(
            f"{node.node_id} leads the instance and holds {_gib(leader.memory_bytes)} of it, with "
            f"{_gib(compute_memory_bytes(node.profile))} available: the draft {draft.model_id} needs "
            f"{_gib(drafting)} more there; name a smaller draft, lower max_batch, or draft with ngram"
        )
    shards = (*rest, msgspec.structs.replace(leader, memory_bytes=needs))
    return msgspec.structs.replace(placement, shards=shards, required_bytes=placement.required_bytes + drafting)


def _some(node_ids: Sequence[str], shown: int = 3) -> str:
    """The first few of `node_ids`, for a message: a request may name thousands."""
    more = f" and {len(node_ids) - shown} more" if len(node_ids) > shown else ""
    return ", ".join(node_ids[:shown]) + more


def tensor_split_refusal(card: ModelCard, nodes: int) -> str | None:
    """Why `card`'s model cannot be split across `nodes` tensor-parallel nodes, for a person; None if it can."""
    if card.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        return (
            f"{card.model_id} ({card.architecture}) cannot be split across tensor-parallel nodes; architectures that "
            f"can: {', '.join(sorted(TENSOR_PARALLEL_ARCHITECTURES))}. Place it as a pipeline"
        )
    heads, kv_heads = card.num_attention_heads, card.num_key_value_heads
    if heads % nodes or kv_heads % nodes:
        # Only counts a request may ask for: a card's head counts are untrusted (a Hub repo's config.json), and
        # trying each up to a trillion of them would stall the single writer.
        counts = [n for n in range(1, min(heads, kv_heads, MAX_NODES) + 1) if heads % n == 0 and kv_heads % n == 0]
        return (
            f"{card.model_id} has {heads} attention heads and {kv_heads} key/value heads, which do not both divide "
            f"by {nodes} nodes; tensor parallelism splits them evenly: place it on {' or '.join(map(str, counts))} "
            "node(s), or as a pipeline"
        )
    return None


def tensor_share_bytes(card: ModelCard, serving: ServingSettings, ranks: int) -> int:
    """What each of `ranks` tensor-parallel nodes needs: its share of the requirement, plus the embedding and head
    it holds whole rather than a share of (counted on every node: only the last holds the head, but a tied one is
    the embedding itself, which a card does not tell apart)."""
    required = required_memory_bytes(card, serving)
    per_parameter = weights_bytes(card, serving.weights) / max(parameter_count(card), 1)
    whole = min(int(2 * card.vocab_size * card.hidden_size * per_parameter), required)
    return whole + -(-(required - whole) // ranks)


def _place_tensor_parallel(card: ModelCard, chosen: Sequence[Node], serving: ServingSettings) -> Placement:
    """Every node of `chosen`, in order, holds its slice of every layer: an equal share of the requirement."""
    ranks = len(chosen)
    resolved = serving
    if serving.weights is WeightsDtype.AUTO:
        # One dtype for all: a full-precision checkpoint narrows only if every node is a GPU that narrows it alike.
        alike = {_checkpoint_weights(card, n.profile) for n in chosen}
        resolved = msgspec.structs.replace(serving, weights=alike.pop() if len(alike) == 1 else WeightsDtype.NATIVE)
    share = tensor_share_bytes(card, resolved, ranks)
    short = [n for n in chosen if compute_memory_bytes(n.profile) < share]
    if short:
        raise PlacementError(
            f"{card.model_id} split across {ranks} node(s) needs {_gib(share)} on each (its share of the weights as "
            f"{resolved.weights}, of the KV-cache headroom for {resolved.max_batch} row(s) and of a prefix cache of "
            f"{_gib(resolved.prefix_cache_bytes)}) but "
            + ", ".join(f"{n.node_id} has {_gib(compute_memory_bytes(n.profile))}" for n in short)
            + " available; use more or bigger nodes, lower max_batch or prefix_cache_bytes, or choose a smaller model"
        )
    if serving.weights is WeightsDtype.AUTO and _float32_is_faster(chosen):
        dequantized = msgspec.structs.replace(serving, weights=WeightsDtype.FLOAT32)
        widened = tensor_share_bytes(card, dequantized, ranks)
        if all(compute_memory_bytes(n.profile) >= widened for n in chosen):
            resolved, share = dequantized, widened
    shards = tuple(
        ShardAssignment(
            node_id=node.node_id,
            rank=rank,
            start_layer=0,
            end_layer=card.num_layers,
            memory_bytes=share,
            tensor_rank=rank,
            weights=resolved.weights,
        )
        for rank, node in enumerate(chosen)
    )
    return Placement(shards=shards, required_bytes=share * ranks, serving=resolved)


def cannot_fetch(state: State, card: ModelCard) -> set[NodeId]:
    """Nodes that could not get `card`'s files: offline (no Hub), the model not complete on their disks, by their
    last storage report or by a download (an import) State saw complete since, and no node of the cluster serving
    it to copy from (an offline node still copies from its peers). (A packaged GGUF is placed or converted on the
    node itself, which needs no network; so is an MLX form of a GGUF a node holds.)"""
    if card.source is ModelSource.GGUF_PACKAGE:
        return set()
    if any(card.model_id in s.available_models and s.file_server is not None for s in state.node_storage.values()):
        return set()

    def holds(node_id: NodeId) -> bool:
        download = state.download(node_id, card.model_id)
        return download is not None and download.progress.status is DownloadStatus.COMPLETED

    return {
        node_id
        for node_id, storage in state.node_storage.items()
        if storage.offline and card.model_id not in storage.available_models and not holds(node_id)
    }


def pending_bytes(state: State) -> Counter[NodeId]:
    """Per node, what the shards placed there will take and its last report does not show taken: those of
    instances not loaded yet, and of those that loaded after the report (a node re-reports only when its
    memory moved by a few percent, which one small instance may never make it)."""
    pending: Counter[NodeId] = Counter()
    for instance in state.instances.values():
        if instance.failed:
            continue
        for shard in instance.shards:
            node = state.nodes.get(shard.node_id)
            if node is not None and report_shows(node, instance):
                continue
            pending[shard.node_id] += shard.memory_bytes
    return pending


def _less_pending(node: Node, pending: int) -> Node:
    return replace(node, profile=node.profile.with_compute_freed(-pending))


def place_in(
    state: State,
    card: ModelCard,
    node_ids: Sequence[NodeId] | None = None,
    min_nodes: int = 1,
    serving: ServingSettings = ServingSettings(),
    as_default: bool = False,
) -> Placement:
    """`place` on the nodes of `state` that can get the model's files (and those of the model that drafts for it),
    with the memory that shards placed but not loaded will take counted as taken; ModelUnavailable when no node
    can get the files. `as_default` as for `place`; a default draft model that cannot draft for this one is left
    out too."""
    try:
        draft = draft_card(state, card, serving)
    except PlacementError:
        if not as_default:
            raise
        serving, draft = msgspec.structs.replace(serving, draft=None), None
    excluded = cannot_fetch(state, card) | (cannot_fetch(state, draft) if draft else set())
    offline_named = sorted(excluded & set(node_ids or ()))
    usable = [node for node in state.nodes.values() if node.node_id not in excluded]
    if offline_named or (state.nodes and not usable):
        offline = offline_named or sorted(excluded & set(state.nodes))
        raise ModelUnavailable(
            f"{card.model_id} is not in any model directory of {', '.join(offline)}, which "
            f"{'is' if len(offline) == 1 else 'are'} offline (no downloads): put the model there, or start "
            "the downloader without --offline"
        )
    pending = pending_bytes(state)
    nodes = [_less_pending(node, pending[node.node_id]) for node in usable]
    return place(card, nodes, node_ids, min_nodes, serving, draft, as_default)


def draft_card(state: State, card: ModelCard, serving: ServingSettings) -> ModelCard | None:
    """The card of the model `serving.draft` names to draft for `card`, if it names one; InvalidPlacement when it
    cannot: unknown, the model itself, or of another vocabulary size (whether the engine can load it, `place` asks).
    (That the tokens themselves match, llama-server checks as it loads both: a runner that fails says so.)"""
    model_id = serving.draft_model
    if model_id is None:
        return None
    if model_id == card.model_id:
        raise InvalidPlacement(
            f"draft {model_id} is the model itself: name a smaller model with the same tokenizer, or ngram"
        )
    draft = find_card(state, model_id)
    if draft is None:
        raise InvalidPlacement(
            f"draft {model_id} is not a known model: add it first (POST /models), or see GET /models"
        )
    if abs(draft.vocab_size - card.vocab_size) > DRAFT_VOCABULARY_SLACK:
        raise InvalidPlacement(
            f"draft {model_id} has a vocabulary of {draft.vocab_size} tokens and {card.model_id} one of "
            f"{card.vocab_size}: a model that drafts shares the model's tokenizer (see the card's draft_model)"
        )
    return draft


def faster_engine(state: State, instance: Instance, card: ModelCard) -> Engine | None:
    """The engine `instance` would move to: the fastest one every node of its own runs now, when placement chose
    its engine, that is another, and it can serve the instance as asked there, memory aside. Cheap (no
    placement): it runs at every task's end, to find the instances worth placing again (`faster_placement`)."""
    if not instance.engine_chosen or instance.requested is None:
        return None
    nodes = [state.nodes[s.node_id] for s in instance.shards if s.node_id in state.nodes]
    if len(nodes) < len(instance.shards):
        return None  # a node is gone: its loss replaces the instance
    fastest = _engines_by_speed(nodes)[0]
    if fastest is instance.engine or any(fastest not in n.profile.engines for n in nodes):
        return None
    requested = instance.requested
    draft = None if requested.draft_model is None else find_card(state, requested.draft_model)
    if (_engine_refusal(fastest, card, nodes, True, 1, requested) or _draft_refusal(fastest, draft)) is not None:
        return None  # asked for what the faster engine does not do (tensor parallelism, a converted dtype)
    return fastest


def faster_placement(state: State, instance: Instance, card: ModelCard) -> Placement | None:
    """Where `instance` would move now that its nodes run an engine they did not (llama.cpp, once built): its
    placement as asked (`Instance.requested`), on its own nodes, were it not there. None when placement chose
    its engine and would choose the same again, when the request named the engine, or when the faster engine
    cannot take it (tensor parallelism on llama.cpp, too little memory)."""
    if faster_engine(state, instance, card) is None or instance.requested is None:
        return None
    node_ids = [s.node_id for s in instance.shards]
    try:
        # As asked, where the engine takes it: the settings were checked when the instance was placed.
        placement = place_in(without(state, [instance]), card, node_ids, serving=instance.requested, as_default=True)
    except PlacementError:
        return None
    return placement if placement.serving.engine is not instance.engine else None


def without(state: State, gone: Sequence[Instance]) -> State:
    """`state` as if the `gone` instances were gone: their shards no longer pending, and the memory the nodes'
    reports show them taking free again (`state.freed_by`)."""
    for instance in gone:
        state = replace(state, nodes=freed_by(state, instance))
    leaving = {instance.instance_id for instance in gone}
    instances = {k: i for k, i in state.instances.items() if k not in leaving}
    return replace(state, instances=instances)
