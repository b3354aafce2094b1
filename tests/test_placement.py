"""Placement: which nodes hold which layers. Pure; no NATS."""

from __future__ import annotations

import functools
import itertools
import re

import msgspec
import pytest
from helpers.cards import tiny_card
from helpers.states import GiB, profile
from jetshard_schema.cards import MAX_HIDDEN_SIZE, ModelCard, ModelFormat, Quantization
from jetshard_schema.ids import InstanceId, NodeId
from jetshard_schema.placement import (
    LLAMA_CPP_SLOT_CONTEXT,
    EngineMismatch,
    EngineUnavailable,
    InvalidPlacement,
    NotEnoughNodes,
    Placement,
    PlacementError,
    UnsplittableModel,
    device_of,
    kv_cache_bytes,
    llama_cpp_compute_bytes,
    llama_cpp_draft_bytes,
    llama_cpp_slot_context,
    mlx_draft_bytes,
    parameter_count,
    place,
    place_in,
    required_memory_bytes,
    split_layers,
    tensor_share_bytes,
    weights_bytes,
    without,
)
from jetshard_schema.state import Instance, Node, State
from jetshard_schema.types import Engine, GpuInfo, KvCacheType, Parallelism, ServingSettings, WeightsDtype
from msgspec.structs import replace

CARD = tiny_card(
    "acme/m",
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    storage_size_bytes=4 * GiB,
    context_length=4096,
)


ONE_ROW = ServingSettings(max_batch=1, weights=WeightsDtype.NATIVE, prefix_cache_bytes=0)
"""The layer-split tests count the checkpoint's weights and one context, as placement did before batching
and prefix caches."""
place_one_row = functools.partial(place, serving=ONE_ROW)


def node(name: str, available_gib: float, accelerator: str = "cpu", fast_blas: bool = True) -> Node:
    return Node(
        node_id=NodeId(name),
        session_id="s",
        profile=profile(available_gib, 128, hostname=name, cpu_cores=8, accelerator=accelerator, fast_blas=fast_blas),
    )


def gpu_node(name: str, system_gib: float, gpu_free_gib: float, accelerator: str = "cuda") -> Node:
    """A node with an NVIDIA GPU, given as data (no GPU here): its runners compute on it with mlx's CUDA build
    (`accelerator="cuda"`), or on the CPU without it."""
    h200 = GpuInfo(
        name="NVIDIA H200",
        memory_total_bytes=140 * GiB,
        memory_free_bytes=int(gpu_free_gib * GiB),
        compute_capability="9.0",
        driver="580.65",
    )
    plain = node(name, system_gib, accelerator=accelerator)
    return msgspec.structs.replace(plain, profile=msgspec.structs.replace(plain.profile, gpus=(h200,)))


def sizes(ranges: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in ranges]


def test_required_memory_is_weights_plus_headroom_plus_kv_cache() -> None:
    kv = 2 * 32 * 8 * 128 * 4096 * 2
    assert required_memory_bytes(CARD, ONE_ROW) == int(4 * GiB * 1.1) + kv


@pytest.mark.parametrize(
    ("layers", "weights", "expected"),
    [
        (10, [1, 1], [5, 5]),
        (10, [3, 1], [7, 3]),
        (32, [16, 8, 8], [16, 8, 8]),
        (10, [1, 1, 1], [4, 3, 3]),  # largest remainder; ties go to the earlier node
        (11, [5, 3, 2], [5, 3, 3]),  # exact 5+3+2 of 8 spare after one each: remainders .0/.4/.6
        (4, [1000, 1, 1], [2, 1, 1]),  # at least one layer each, however little memory
        (3, [1, 1, 1], [1, 1, 1]),
    ],
)
def test_split_is_proportional_contiguous_and_complete(layers: int, weights: list[int], expected: list[int]) -> None:
    ranges = split_layers(layers, weights)
    assert sizes(ranges) == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize(("layers", "weights"), [(2, [1, 1, 1]), (4, []), (4, [0, 0])])
def test_split_refuses_impossible_requests(layers: int, weights: list[int]) -> None:
    with pytest.raises(PlacementError):
        split_layers(layers, weights)


def test_the_fewest_nodes_that_hold_the_model_are_chosen_biggest_first() -> None:
    placement = place_one_row(CARD, [node("small", 2), node("big", 40), node("mid", 10)])
    assert [(s.node_id, s.rank, s.start_layer, s.end_layer) for s in placement.shards] == [("big", 0, 0, 32)]
    assert placement.required_bytes == required_memory_bytes(CARD, ONE_ROW)


def test_min_nodes_spreads_layers_by_available_memory() -> None:
    placement = place_one_row(CARD, [node("a", 30), node("b", 10), node("c", 1)], min_nodes=2)
    assert [s.node_id for s in placement.shards] == ["a", "b"]
    assert [s.end_layer - s.start_layer for s in placement.shards] == [24, 8]


def test_several_nodes_when_none_holds_the_model_alone() -> None:
    placement = place_one_row(CARD, [node("a", 3), node("b", 3), node("c", 3)])
    assert len(placement.shards) == 2
    assert [s.rank for s in placement.shards] == [0, 1]
    assert placement.shards[-1].end_layer == 32


def test_not_enough_memory_says_how_much_is_needed_and_what_to_do() -> None:
    with pytest.raises(PlacementError) as raised:
        place_one_row(CARD, [node("a", 1), node("b", 1)])
    message = str(raised.value)
    assert "acme/m needs" in message
    assert "GiB" in message and "2.00 GiB available" in message
    assert "add nodes" in message


def test_explicit_node_ids_keep_their_order_and_ranks() -> None:
    nodes = [node("a", 30), node("b", 10), node("c", 10)]
    placement = place_one_row(CARD, nodes, node_ids=[NodeId("c"), NodeId("a")])
    assert [(s.node_id, s.rank) for s in placement.shards] == [("c", 0), ("a", 1)]
    assert [s.end_layer - s.start_layer for s in placement.shards] == [9, 23]


def test_explicit_node_ids_must_fit_the_model() -> None:
    with pytest.raises(PlacementError, match="needs"):
        place_one_row(CARD, [node("a", 30), node("b", 1)], node_ids=[NodeId("b")])


@pytest.mark.parametrize(
    ("node_ids", "min_nodes", "match"),
    [
        (["a", "x"], 1, "unknown node"),
        (["a", "a"], 1, "lists a more than once"),
        (["x"] * 5000, 1, "^node_ids lists x more than once"),  # not 5000 unknown nodes
        ([f"x{n}" for n in range(5000)], 1, r"^unknown node\(s\): x0, x1, x2 and 4997 more; see GET /nodes$"),
        ([], 1, "node_ids names no node"),  # not "choose for me", which leaving node_ids out means
        (None, 0, "at least 1"),
    ],
)
@pytest.mark.parametrize("parallelism", list(Parallelism))
def test_bad_requests_are_refused_as_the_clients_to_fix(
    node_ids: list[str] | None, min_nodes: int, match: str, parallelism: Parallelism
) -> None:
    """Not as a lack of memory: no amount of it would place them."""
    nodes = [node("a", 30), node("b", 10), node("c", 10)]
    named = None if node_ids is None else [NodeId(n) for n in node_ids]
    with pytest.raises(InvalidPlacement, match=match):
        place(CARD, nodes, node_ids=named, min_nodes=min_nodes, serving=replace(ONE_ROW, parallelism=parallelism))


@pytest.mark.parametrize(
    ("node_ids", "min_nodes", "match"), [(["a"], 2, "only 1 available"), (None, 4, "only 3 available")]
)
def test_too_few_nodes_are_refused(node_ids: list[str] | None, min_nodes: int, match: str) -> None:
    """As too few nodes, not as too little memory: adding memory to the nodes there are would not place it."""
    nodes = [node("a", 30), node("b", 10), node("c", 10)]
    with pytest.raises(NotEnoughNodes, match=match):
        place_one_row(CARD, nodes, node_ids=[NodeId(n) for n in node_ids] if node_ids else None, min_nodes=min_nodes)


def test_more_nodes_than_layers() -> None:
    tiny = msgspec.structs.replace(CARD, num_layers=2, storage_size_bytes=1)
    with pytest.raises(PlacementError, match="fewer than"):
        place_one_row(tiny, [node("a", 1), node("b", 1), node("c", 1)], min_nodes=3)


# --- what serving costs: float32 weights, KV cache for max_batch rows, and AUTO's choice ------------------

Q4_CARD = msgspec.structs.replace(
    CARD,
    model_id="acme/m-q4",
    storage_size_bytes=int(4.5 * GiB),
    quantization=Quantization(bits=4, group_size=64),
)
"""8 Gi parameters at 4 bits plus a 16-bit scale and bias per 64 (4.5 bits a weight): 32 GiB as float32."""


def test_parameters_are_derived_from_storage_and_quantization() -> None:
    assert parameter_count(Q4_CARD) == 8 * GiB
    assert weights_bytes(Q4_CARD, WeightsDtype.FLOAT32) == 32 * GiB
    assert weights_bytes(Q4_CARD, WeightsDtype.NATIVE) == int(4.5 * GiB)
    # Unquantized checkpoints count as 16-bit: float32 doubles them.
    assert weights_bytes(CARD, WeightsDtype.FLOAT32) == 8 * GiB
    with pytest.raises(ValueError, match="concrete dtype"):
        weights_bytes(CARD, WeightsDtype.AUTO)


def test_kv_cache_is_counted_for_every_row_of_the_batch_and_the_prefix_cache() -> None:
    serving = ServingSettings(max_batch=8, weights=WeightsDtype.FLOAT32, prefix_cache_bytes=0)
    assert kv_cache_bytes(CARD) == 2 * 32 * 8 * 128 * 4096 * 2
    assert kv_cache_bytes(CARD, WeightsDtype.FLOAT32) == 2 * kv_cache_bytes(CARD)  # float32 activations
    assert required_memory_bytes(CARD, serving) == int(8 * GiB * 1.1) + 8 * kv_cache_bytes(CARD, WeightsDtype.FLOAT32)
    with_prefixes = msgspec.structs.replace(serving, prefix_cache_bytes=GiB)
    assert required_memory_bytes(CARD, with_prefixes) == required_memory_bytes(CARD, serving) + GiB


def test_an_8b_model_that_fits_one_row_does_not_fit_a_batch_of_eight() -> None:
    llama_8b = msgspec.structs.replace(
        CARD, model_id="acme/llama-8b", vocab_size=128256, storage_size_bytes=16 * GiB, context_length=8192
    )
    place(llama_8b, [node("a", 24)], serving=ONE_ROW)
    with pytest.raises(PlacementError, match=r"KV-cache headroom for 8 row\(s\)") as raised:
        place(llama_8b, [node("a", 24)], serving=ServingSettings(max_batch=8, weights=WeightsDtype.NATIVE))
    assert "lower max_batch" in str(raised.value)
    assert "prefix cache of 0.50 GiB" in str(raised.value)


def test_auto_dequantizes_on_cpu_nodes_when_float32_fits() -> None:
    placement = place(Q4_CARD, [node("a", 40)], serving=ServingSettings(max_batch=2, prefix_cache_bytes=0))
    assert placement.serving == ServingSettings(
        max_batch=2, prefix_cache_bytes=0, weights=WeightsDtype.FLOAT32, engine=Engine.MLX
    )
    assert placement.required_bytes == int(32 * GiB * 1.1) + 2 * kv_cache_bytes(Q4_CARD, WeightsDtype.FLOAT32)


def test_auto_keeps_the_checkpoint_dtype_when_float32_does_not_fit() -> None:
    placement = place(Q4_CARD, [node("a", 30), node("b", 30)], serving=ServingSettings(max_batch=2))
    # One node holds the 4-bit model; AUTO does not add a second (a hop per token) to dequantize.
    assert [s.node_id for s in placement.shards] == ["a"]
    assert placement.serving.weights is WeightsDtype.NATIVE
    assert placement.required_bytes == required_memory_bytes(Q4_CARD, placement.serving)


def shard_dtypes(placement: Placement) -> list[tuple[str, WeightsDtype | None]]:
    return [(s.node_id, s.weights) for s in placement.shards]


def test_auto_keeps_the_checkpoint_dtype_on_a_cpu_without_a_fast_blas() -> None:
    # The reference BLAS multiplies float32 slower than MLX's quantized kernels run: each node computes in what
    # is fastest on it, and the pipeline carries both.
    slow = place(Q4_CARD, [node("a", 40), node("b", 40, fast_blas=False)], min_nodes=2)
    assert shard_dtypes(slow) == [("a", WeightsDtype.FLOAT32), ("b", WeightsDtype.NATIVE)]
    assert slow.serving.weights is WeightsDtype.AUTO  # the shards differ: each names its own
    # The float32 shard takes 4 bytes a parameter and a float32 KV cache: fewer layers for the same memory.
    a, b = slow.shards
    assert a.end_layer - a.start_layer < b.end_layer - b.start_layer
    assert a.memory_bytes <= 40 * GiB
    for shard in slow.shards:
        assert shard.weights is not None
        whole = required_memory_bytes(Q4_CARD, replace(ServingSettings(), weights=shard.weights))
        assert shard.memory_bytes == whole * (shard.end_layer - shard.start_layer) // 32
    assert slow.required_bytes == a.memory_bytes + b.memory_bytes


def test_auto_keeps_the_checkpoint_dtype_on_an_accelerator_and_widens_the_cpu_beside_it() -> None:
    nodes = [node("a", 40), node("gpu", 40, accelerator="cuda")]
    two_rows = ServingSettings(max_batch=2)
    mixed = place(Q4_CARD, nodes, node_ids=[NodeId("a"), NodeId("gpu")], serving=two_rows)
    assert shard_dtypes(mixed) == [("a", WeightsDtype.FLOAT32), ("gpu", WeightsDtype.NATIVE)]
    assert place(Q4_CARD, [node("mac", 64, accelerator="metal")]).serving.weights is WeightsDtype.NATIVE
    assert place(Q4_CARD, nodes, node_ids=[NodeId("a")], serving=two_rows).serving.weights is WeightsDtype.FLOAT32
    # Where float32 would not fit beside the GPU's share, every shard keeps the checkpoint's dtype.
    tight = place(
        Q4_CARD, [node("a", 4), gpu_node("gpu", 4, 4)], node_ids=[NodeId("a"), NodeId("gpu")], serving=two_rows
    )
    assert shard_dtypes(tight) == [("a", WeightsDtype.NATIVE), ("gpu", WeightsDtype.NATIVE)]
    assert tight.serving.weights is WeightsDtype.NATIVE


FULL_PRECISION = tiny_card("acme/f32", num_layers=32, storage_size_bytes=32 * GiB, context_length=4096)
FULL_PRECISION = replace(FULL_PRECISION, checkpoint_dtype="float32")
"""8 Gi parameters stored as float32."""


def test_a_full_precision_checkpoint_is_held_in_16_bits_on_a_gpu() -> None:
    assert parameter_count(FULL_PRECISION) == 8 * GiB
    assert weights_bytes(FULL_PRECISION, WeightsDtype.BFLOAT16) == 16 * GiB
    # Its own dtype computes in float32, and so does its KV cache.
    assert kv_cache_bytes(FULL_PRECISION, WeightsDtype.NATIVE) == kv_cache_bytes(FULL_PRECISION, WeightsDtype.FLOAT32)
    assert kv_cache_bytes(FULL_PRECISION, WeightsDtype.BFLOAT16) * 2 == kv_cache_bytes(FULL_PRECISION)
    # 24 GiB free on the GPU: 35 GiB of float32 would not fit, 17.6 GiB of bfloat16 does.
    one_row = replace(ONE_ROW, weights=WeightsDtype.AUTO)
    hopper = place(FULL_PRECISION, [gpu_node("gpu", system_gib=8, gpu_free_gib=24)], serving=one_row)
    assert shard_dtypes(hopper) == [("gpu", WeightsDtype.BFLOAT16)]
    assert hopper.required_bytes == int(16 * GiB * 1.1) + kv_cache_bytes(FULL_PRECISION, WeightsDtype.BFLOAT16)
    # Before Ampere (compute capability 8.0) a GPU has no bfloat16: float16.
    turing = gpu_node("t4", system_gib=8, gpu_free_gib=24)
    gpus = (replace(turing.profile.gpus[0], name="Tesla T4", compute_capability="7.5"),)
    turing = replace(turing, profile=replace(turing.profile, gpus=gpus))
    assert shard_dtypes(place(FULL_PRECISION, [turing], serving=one_row)) == [("t4", WeightsDtype.FLOAT16)]
    # An explicit choice is kept: native float32 does not fit that GPU.
    with pytest.raises(PlacementError, match=r"weights 32.00 GiB as native"):
        place_one_row(FULL_PRECISION, [gpu_node("gpu", 8, 24)])


def test_a_pipeline_that_mixes_dtypes_says_how_many_layers_its_nodes_hold() -> None:
    with pytest.raises(PlacementError, match=r"32 layers \(cpu as native, gpu as bfloat16.*enough for \d+\.\d of them"):
        place(FULL_PRECISION, [gpu_node("gpu", 4, 8), node("cpu", 8, fast_blas=False)], min_nodes=2)


def test_an_explicit_choice_is_kept_and_counted() -> None:
    native = place(Q4_CARD, [node("a", 40)], serving=ServingSettings(weights=WeightsDtype.NATIVE))
    assert native.serving.weights is WeightsDtype.NATIVE
    float32 = place(Q4_CARD, [node("a", 38), node("b", 38)], serving=ServingSettings(weights=WeightsDtype.FLOAT32))
    assert float32.serving.weights is WeightsDtype.FLOAT32
    assert len(float32.shards) == 2  # 35.2 GiB of weights and 8 rows of 512 MiB: 39.2 GiB
    with pytest.raises(PlacementError, match=r"weights 32.00 GiB as float32"):
        place(Q4_CARD, [node("a", 30)], serving=ServingSettings(weights=WeightsDtype.FLOAT32))


def test_a_cuda_node_holds_its_shards_in_gpu_memory() -> None:
    # 20 GiB free on the GPU, 100 GiB in the system: a model of 30 GiB does not fit the GPU alone.
    big = tiny_card("acme/big", num_layers=32, storage_size_bytes=27 * GiB, context_length=4096)
    with pytest.raises(PlacementError, match=r"have 20.00 GiB available"):
        place_one_row(big, [gpu_node("gpu", system_gib=100, gpu_free_gib=20)])
    # 60 GiB free on the GPU with 8 GiB of system memory: it holds the model alone, in its native weights.
    placed = place(big, [gpu_node("gpu", system_gib=8, gpu_free_gib=60)], serving=ServingSettings(max_batch=1))
    assert [s.node_id for s in placed.shards] == ["gpu"]
    assert placed.serving.weights is WeightsDtype.NATIVE
    # The same GPU under mlx's CPU build computes nothing: the node counts its system memory.
    with pytest.raises(PlacementError, match=r"have 8.00 GiB available"):
        place_one_row(big, [gpu_node("gpu", system_gib=8, gpu_free_gib=60, accelerator="cpu")])


def test_a_pipeline_of_a_gpu_and_a_cpu_node_splits_by_the_memory_each_computes_in() -> None:
    nodes = [gpu_node("gpu", system_gib=4, gpu_free_gib=30), node("cpu", 10)]
    placed = place_one_row(CARD, nodes, min_nodes=2)
    assert [(s.node_id, s.end_layer - s.start_layer) for s in placed.shards] == [("gpu", 24), ("cpu", 8)]
    assert [device_of(n.profile) for n in nodes] == ["cuda:0 (NVIDIA H200)", "cpu"]
    assert device_of(node("mac", 64, accelerator="metal").profile) == "metal"


def test_shards_placed_on_a_gpu_count_against_its_memory_until_loaded() -> None:
    gpu = gpu_node("gpu", system_gib=100, gpu_free_gib=8)
    state = State(nodes={gpu.node_id: gpu})
    first = place_in(state, CARD, serving=ONE_ROW)
    unloaded = Instance(
        instance_id=InstanceId("i1"), model_id=CARD.model_id, shards=first.shards, serving=first.serving
    )
    # The GPU reports 8 GiB free, the first instance will take ~4.9 of them: a second does not fit beside it, and
    # the system's 100 GiB are not offered instead.
    with pytest.raises(PlacementError, match=r"have 3.\d\d GiB available"):
        place_in(msgspec.structs.replace(state, instances={unloaded.instance_id: unloaded}), CARD, serving=ONE_ROW)


def test_an_instance_thought_gone_frees_at_most_the_memory_its_node_has() -> None:
    """Placement reserves more than an instance ends up holding (a prompt cache not yet filled): a node that reports
    what is left of its 8 GiB after it loaded does not gain more than 8 GiB once the instance is counted as gone
    (to make room for another model, or to move it to a faster engine)."""
    small = replace(node("small", 6), profile=replace(node("small", 6).profile, memory_total_bytes=8 * GiB))
    placed = place_in(State(nodes={small.node_id: small}), CARD, serving=ONE_ROW)
    assert placed.required_bytes > 2 * GiB  # more than the 2 GiB the node's report shows it taking
    loaded = Instance(
        instance_id=InstanceId("i1"), model_id=CARD.model_id, shards=placed.shards, serving=placed.serving, ready_seq=1
    )
    reported = replace(small, profile_seq=2)
    state = State(nodes={small.node_id: reported}, instances={loaded.instance_id: loaded})
    assert without(state, [loaded]).nodes[small.node_id].profile.memory_available_bytes == 8 * GiB


# --------------------------------------------------------------------------- tensor parallelism

TENSOR = ServingSettings(max_batch=1, weights=WeightsDtype.NATIVE, prefix_cache_bytes=0, parallelism=Parallelism.TENSOR)


def test_a_tensor_parallel_instance_spans_exactly_min_nodes_each_holding_a_slice_of_every_layer() -> None:
    nodes = [node("small", 3), node("big", 40), node("mid", 10)]
    placement = place(CARD, nodes, min_nodes=2, serving=TENSOR)

    # Biggest first, and two of them although one would hold the whole model.
    assert [(s.node_id, s.rank, s.tensor_rank, s.start_layer, s.end_layer) for s in placement.shards] == [
        ("big", 0, 0, 0, 32),
        ("mid", 1, 1, 0, 32),
    ]
    share = tensor_share_bytes(CARD, TENSOR, 2)
    assert [s.memory_bytes for s in placement.shards] == [share, share]
    assert placement.serving.parallelism is Parallelism.TENSOR
    # A pipeline on the same nodes keeps whole layers and no tensor rank.
    assert [s.tensor_rank for s in place(CARD, nodes, min_nodes=2, serving=ONE_ROW).shards] == [None, None]


def test_a_tensor_ranks_share_is_its_slice_of_the_layers_and_kv_cache_plus_the_whole_embedding_and_head() -> None:
    embedding_and_head = 2 * 32000 * 4096 * 2  # 16-bit weights: 4 GiB for 2G parameters
    required = required_memory_bytes(CARD, TENSOR)
    assert tensor_share_bytes(CARD, TENSOR, 1) == required
    assert tensor_share_bytes(CARD, TENSOR, 4) == embedding_and_head + -(-(required - embedding_and_head) // 4)
    # Four shares hold more than the whole model: the embedding and head four times.
    assert 4 * tensor_share_bytes(CARD, TENSOR, 4) - required == pytest.approx(3 * embedding_and_head, abs=4)


def test_named_nodes_are_the_tensor_ranks_in_their_order() -> None:
    nodes = [node("a", 10), node("b", 10), node("c", 10), node("d", 10)]
    placement = place(CARD, nodes, node_ids=[NodeId("d"), NodeId("a"), NodeId("c"), NodeId("b")], serving=TENSOR)
    assert [(s.node_id, s.tensor_rank) for s in placement.shards] == [("d", 0), ("a", 1), ("c", 2), ("b", 3)]


def test_each_tensor_rank_must_hold_its_share_on_its_own() -> None:
    # Together 12 GiB hold the ~4.9 GiB model, but an even split asks ~2.5 GiB of the 1 GiB node.
    with pytest.raises(PlacementError, match=r"needs 2.\d\d GiB on each .* but small has 1.00 GiB available"):
        place(CARD, [node("big", 11), node("small", 1)], min_nodes=2, serving=TENSOR)


def test_heads_that_do_not_divide_by_the_node_count_are_refused_naming_them() -> None:
    demo = tiny_card("acme/demo", num_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    nodes = [node("a", 10), node("b", 10), node("c", 10)]
    with pytest.raises(UnsplittableModel) as refused:
        place(demo, nodes, min_nodes=2, serving=TENSOR)
    assert str(refused.value) == (
        "acme/demo has 9 attention heads and 3 key/value heads, which do not both divide by 2 nodes; tensor "
        "parallelism splits them evenly: place it on 1 or 3 node(s), or as a pipeline"
    )
    assert [s.tensor_rank for s in place(demo, nodes, min_nodes=3, serving=TENSOR).shards] == [0, 1, 2]


@pytest.mark.timeout(10)
def test_a_card_with_the_most_heads_is_refused_at_once() -> None:
    """A card's head counts come from a Hub repo's config.json: the counts the refusal offers stop at the most nodes
    a request may name, rather than trying every count up to the heads."""
    most = MAX_HIDDEN_SIZE
    huge = tiny_card("acme/huge", hidden_size=most, num_attention_heads=most, num_key_value_heads=most)
    with pytest.raises(UnsplittableModel, match=r"divide by 3 nodes; .*: place it on 1 or 2 or 4 or 8 or 16 or"):
        place(huge, [node("a", 10), node("b", 10), node("c", 10)], min_nodes=3, serving=TENSOR)


def test_an_architecture_mlx_lm_does_not_split_is_refused() -> None:
    gemma = tiny_card("acme/gemma", architecture="gemma")
    with pytest.raises(UnsplittableModel, match=r"\(gemma\) cannot be split across tensor-parallel nodes"):
        place(gemma, [node("a", 10), node("b", 10)], min_nodes=2, serving=TENSOR)


def test_auto_dequantizes_tensor_ranks_only_when_each_holds_its_float32_share() -> None:
    auto = msgspec.structs.replace(TENSOR, weights=WeightsDtype.AUTO)
    roomy = place(CARD, [node("a", 40), node("b", 40)], min_nodes=2, serving=auto)
    assert roomy.serving.weights is WeightsDtype.FLOAT32
    assert roomy.shards[0].memory_bytes == tensor_share_bytes(CARD, roomy.serving, 2)
    # A float32 share (~4.9 GiB) fits the pair's total but not the small node: the checkpoint's dtype is kept.
    tight = place(CARD, [node("a", 40), node("b", 4)], min_nodes=2, serving=auto)
    assert tight.serving.weights is WeightsDtype.NATIVE
    assert {s.weights for s in roomy.shards} == {WeightsDtype.FLOAT32}
    assert {s.weights for s in tight.shards} == {WeightsDtype.NATIVE}


def test_tensor_ranks_hold_one_dtype_narrowing_a_full_precision_checkpoint_only_on_gpus_alike() -> None:
    auto = msgspec.structs.replace(TENSOR, weights=WeightsDtype.AUTO)
    gpus = place(FULL_PRECISION, [gpu_node("a", 4, 40), gpu_node("b", 4, 40)], min_nodes=2, serving=auto)
    assert [s.weights for s in gpus.shards] == [WeightsDtype.BFLOAT16, WeightsDtype.BFLOAT16]
    # Beside a CPU without a fast BLAS the ranks keep the checkpoint's float32: partial sums must agree in dtype.
    mixed = place(FULL_PRECISION, [gpu_node("a", 4, 40), node("b", 40, fast_blas=False)], min_nodes=2, serving=auto)
    assert [s.weights for s in mixed.shards] == [WeightsDtype.NATIVE, WeightsDtype.NATIVE]


# --- engines -----------------------------------------------------------------------------------------------

BOTH = (Engine.MLX, Engine.LLAMA_CPP)
GGUF_AND_MLX = replace(Q4_CARD, model_id="acme/m-gguf", formats=(ModelFormat.GGUF, ModelFormat.MLX), file_type="Q4_0")
GGUF_ONLY = replace(GGUF_AND_MLX, model_id="acme/m-k", formats=(ModelFormat.GGUF,), file_type="Q4_K_M")
SMALL_ROWS = ServingSettings(max_batch=2, prefix_cache_bytes=0)


def running(engines: tuple[Engine, ...], *nodes: Node) -> list[Node]:
    return [replace(n, profile=replace(n.profile, engines=engines)) for n in nodes]


def test_placement_chooses_the_fastest_engine_the_nodes_run_for_a_format_the_card_has() -> None:
    on_cpu = place(GGUF_AND_MLX, running(BOTH, node("a", 64), node("b", 64)), serving=SMALL_ROWS)
    assert on_cpu.serving.engine is Engine.LLAMA_CPP
    assert on_cpu.serving.weights is WeightsDtype.NATIVE  # the GGUF's own quantization, never float32
    [shard] = on_cpu.shards
    assert (shard.start_layer, shard.end_layer, shard.weights) == (0, 32, WeightsDtype.NATIVE)
    # Before llama.cpp is built the same node serves it on MLX, exactly as it did before engines.
    before = place(GGUF_AND_MLX, [node("a", 64)], serving=SMALL_ROWS)
    assert before == replace(place(Q4_CARD, [node("a", 64)], serving=SMALL_ROWS), serving=before.serving)
    assert before.serving.engine is Engine.MLX and before.serving.weights is WeightsDtype.FLOAT32
    # Apple silicon and NVIDIA: MLX, when the card has the MLX format; a card with only a GGUF needs llama.cpp.
    for fast in (node("m", 64, accelerator="metal"), gpu_node("g", 64, 64)):
        assert place(GGUF_AND_MLX, running(BOTH, fast), serving=SMALL_ROWS).serving.engine is Engine.MLX
        assert place(GGUF_ONLY, running(BOTH, fast), serving=SMALL_ROWS).serving.engine is Engine.LLAMA_CPP
    assert place(Q4_CARD, running(BOTH, node("a", 64)), serving=SMALL_ROWS).serving.engine is Engine.MLX
    with pytest.raises(EngineUnavailable, match=r"no node runs llama\.cpp \(yet"):
        place(GGUF_ONLY, [node("a", 64)], serving=SMALL_ROWS)


def most_slots(card: ModelCard, nodes: list[Node], kv_cache_type: KvCacheType) -> int:
    """The largest `max_batch` that placement fits on `nodes` with `kv_cache_type`."""
    fitted = 0
    for slots in range(1, 257):
        serving = ServingSettings(max_batch=slots, prefix_cache_bytes=0, kv_cache_type=kv_cache_type)
        try:
            place(card, nodes, serving=serving)
        except PlacementError:
            break
        fitted = slots
    return fitted


def test_a_quantized_kv_cache_fits_about_twice_or_four_times_the_slots_in_the_same_memory() -> None:
    nodes = running(BOTH, node("a", 12))
    as_computed = most_slots(GGUF_ONLY, nodes, KvCacheType.AUTO)
    assert as_computed >= 4
    assert most_slots(GGUF_ONLY, nodes, KvCacheType.Q8_0) >= 1.8 * as_computed
    assert most_slots(GGUF_ONLY, nodes, KvCacheType.Q4_0) >= 3.2 * as_computed
    # The placement's own estimate says so too: the same slots need less.
    q8 = ServingSettings(max_batch=4, prefix_cache_bytes=0, kv_cache_type=KvCacheType.Q8_0)
    sixteen_bit = place(GGUF_ONLY, nodes, serving=replace(q8, kv_cache_type=KvCacheType.AUTO))
    assert place(GGUF_ONLY, nodes, serving=q8).required_bytes < sixteen_bit.required_bytes
    # MLX quantizes its cache too, with a 16-bit scale and bias a group of 64 (8.5 bits on a GPU or Apple silicon,
    # where it computes in 16 bits), where each head's width is a multiple of 32.
    metal = [node("m", 12, accelerator="metal")]
    mlx_as_computed = most_slots(Q4_CARD, metal, KvCacheType.AUTO)
    assert mlx_as_computed >= 4
    assert most_slots(Q4_CARD, metal, KvCacheType.Q8_0) >= 1.8 * mlx_as_computed
    assert most_slots(Q4_CARD, metal, KvCacheType.Q4_0) >= 3.2 * mlx_as_computed
    on_mlx = place(GGUF_AND_MLX, nodes, serving=replace(q8, engine=Engine.MLX))
    assert (on_mlx.serving.engine, on_mlx.serving.kv_cache_type) == (Engine.MLX, KvCacheType.Q8_0)
    with pytest.raises(EngineMismatch, match=r"groups of 64 or 32, and acme/narrow's heads are 16 wide"):
        place(NARROW_HEADS, metal, serving=q8)


NARROW_HEADS = replace(Q4_CARD, model_id="acme/narrow", num_attention_heads=256)
"""Heads 16 values wide: too narrow for a group of MLX's quantization."""


DRAFT = replace(GGUF_ONLY, model_id="acme/m-draft", num_layers=4, hidden_size=512, storage_size_bytes=200 * 2**20)
OTHER_VOCABULARY = replace(DRAFT, model_id="acme/other-draft", vocab_size=GGUF_AND_MLX.vocab_size + 129)
"""One token more than llama.cpp's slack: another tokenizer."""


def test_a_model_that_drafts_is_counted_on_the_leader_and_must_be_a_known_gguf_other_than_the_model() -> None:
    nodes = running(BOTH, node("a", 4), node("b", 3))
    drafting = replace(SMALL_ROWS, draft=DRAFT.model_id)
    state = State(nodes={n.node_id: n for n in nodes}, custom_cards={DRAFT.model_id: DRAFT})
    plain = place_in(state, GGUF_AND_MLX, serving=SMALL_ROWS)
    drafted = place_in(state, GGUF_AND_MLX, serving=drafting)
    assert drafted.serving.engine is Engine.LLAMA_CPP and drafted.serving.draft == DRAFT.model_id
    # The draft's GGUF, its KV cache for the model's slots and context, and its compute buffer: on the leader.
    extra = llama_cpp_draft_bytes(GGUF_AND_MLX, DRAFT, drafted.serving)
    assert extra > DRAFT.storage_size_bytes + llama_cpp_compute_bytes(DRAFT)
    assert drafted.required_bytes == plain.required_bytes + extra
    assert [s.end_layer for s in drafted.shards] == [s.end_layer for s in plain.shards]
    leader, other = plain.shards
    assert [s.memory_bytes for s in drafted.shards] == [leader.memory_bytes + extra, other.memory_bytes]
    one_node = running(BOTH, node("big", 64))
    alone = place(GGUF_ONLY, one_node, serving=drafting, draft=DRAFT)
    assert alone.required_bytes == required_memory_bytes(GGUF_ONLY, alone.serving) + extra
    # Unknown, the model itself, without the weights its engine drafts with, or of another tokenizer: refused,
    # saying what to do.
    on_llama_cpp = replace(drafting, engine=Engine.LLAMA_CPP)
    refusals = [
        (replace(drafting, draft="acme/nothing"), InvalidPlacement, "draft acme/nothing is not a known model"),
        (replace(drafting, draft=GGUF_AND_MLX.model_id), InvalidPlacement, "is the model itself"),
        (replace(on_llama_cpp, draft=Q4_CARD.model_id), EngineMismatch, "has no gguf weights, which llama.cpp drafts"),
        (replace(drafting, draft=OTHER_VOCABULARY.model_id), InvalidPlacement, "has a vocabulary of 32129 tokens"),
        (replace(drafting, engine=Engine.MLX), EngineMismatch, "acme/m-draft has no mlx weights, which mlx drafts"),
    ]
    more = {Q4_CARD.model_id: Q4_CARD, OTHER_VOCABULARY.model_id: OTHER_VOCABULARY}
    with_mlx_card = replace(state, custom_cards={**state.custom_cards, **more})
    for serving, refusal, says in refusals:
        with pytest.raises(refusal, match=re.escape(says)):
            place_in(with_mlx_card, GGUF_AND_MLX, serving=serving)


MLX_DRAFT = replace(Q4_CARD, model_id="acme/m-q4-draft", num_layers=2, storage_size_bytes=300 * 2**20)


def test_an_mlx_draft_model_is_counted_on_the_leader_the_last_rank() -> None:
    """MLX runs the draft on the instance's leader, its last rank: its weights, their activations' headroom and a
    KV cache a row. Where placement chooses the engine, it takes the one whose weights the draft has."""
    nodes = running((Engine.MLX,), node("a", 5), node("b", 3))
    state = State(nodes={n.node_id: n for n in nodes}, custom_cards={MLX_DRAFT.model_id: MLX_DRAFT})
    drafting = replace(SMALL_ROWS, draft=MLX_DRAFT.model_id)
    plain = place_in(state, Q4_CARD, serving=SMALL_ROWS)
    drafted = place_in(state, Q4_CARD, serving=drafting)
    extra = mlx_draft_bytes(MLX_DRAFT, drafted.serving)
    assert extra > MLX_DRAFT.storage_size_bytes + MLX_DRAFT.num_layers * SMALL_ROWS.max_batch
    assert (drafted.serving.engine, drafted.serving.draft) == (Engine.MLX, MLX_DRAFT.model_id)
    assert [s.end_layer for s in drafted.shards] == [s.end_layer for s in plain.shards]
    first, leader = plain.shards
    assert [s.memory_bytes for s in drafted.shards] == [first.memory_bytes, leader.memory_bytes + extra]
    assert drafted.required_bytes == plain.required_bytes + extra
    alone = place(Q4_CARD, running((Engine.MLX,), node("big", 64)), serving=drafting, draft=MLX_DRAFT)
    assert alone.required_bytes == required_memory_bytes(Q4_CARD, alone.serving, MLX_DRAFT)
    # A leader without room for the draft beside its layers: refused, saying how much more it needs.
    native = replace(SMALL_ROWS, weights=WeightsDtype.NATIVE, engine=Engine.MLX)
    snug = running((Engine.MLX,), node("one", (required_memory_bytes(Q4_CARD, native) + extra // 2) / GiB))
    place(Q4_CARD, snug, serving=native)
    with pytest.raises(PlacementError, match=r"the draft acme/m-q4-draft needs 0\.\d\d GiB more there"):
        place(Q4_CARD, snug, serving=replace(native, draft=MLX_DRAFT.model_id), draft=MLX_DRAFT)
    # A model both engines serve drafts on MLX with a draft that has only MLX weights, on llama.cpp with a GGUF.
    both = State(nodes={n.node_id: n for n in running(BOTH, node("c", 16))}, custom_cards=state.custom_cards)
    assert place_in(both, GGUF_AND_MLX, serving=drafting).serving.engine is Engine.MLX


def test_an_apis_default_drafting_and_kv_cache_apply_where_the_model_can_take_them() -> None:
    """`jetshard api --draft ... --kv-cache-type q8_0` places every model a request asks for: one that only MLX
    serves without a draft model it has no MLX weights for (and with its KV cache as computed where its heads are too
    narrow to quantize), one that the default draft cannot draft for without it; asked of it by name, refused."""
    nodes = running(BOTH, node("a", 16))
    defaults = replace(SMALL_ROWS, draft="ngram", kv_cache_type=KvCacheType.Q8_0)
    state = State(nodes={n.node_id: n for n in nodes}, custom_cards={DRAFT.model_id: DRAFT})
    mlx_only = place_in(state, Q4_CARD, serving=defaults, as_default=True)
    assert mlx_only.serving.engine is Engine.MLX
    assert (mlx_only.serving.draft, mlx_only.serving.kv_cache_type) == ("ngram", KvCacheType.Q8_0)
    assert place_in(state, Q4_CARD, serving=defaults).serving == mlx_only.serving
    narrow = place_in(state, NARROW_HEADS, serving=defaults, as_default=True)
    assert (narrow.serving.engine, narrow.serving.kv_cache_type) == (Engine.MLX, KvCacheType.AUTO)
    by_model = place_in(state, Q4_CARD, serving=replace(defaults, draft=DRAFT.model_id), as_default=True)
    assert (by_model.serving.engine, by_model.serving.draft) == (Engine.MLX, None)
    with pytest.raises(EngineMismatch, match="acme/m-draft has no mlx weights, which mlx drafts with"):
        place_in(state, Q4_CARD, serving=replace(defaults, draft=DRAFT.model_id))
    # A GGUF on a CPU node: llama.cpp takes both.
    gguf = place_in(state, GGUF_AND_MLX, serving=defaults, as_default=True)
    assert (gguf.serving.engine, gguf.serving.draft, gguf.serving.kv_cache_type) == (
        Engine.LLAMA_CPP,
        "ngram",
        KvCacheType.Q8_0,
    )
    # A default draft model of another vocabulary (or the model itself) is left out for that model alone.
    other = replace(defaults, draft=OTHER_VOCABULARY.model_id)
    with_other = replace(state, custom_cards={**state.custom_cards, OTHER_VOCABULARY.model_id: OTHER_VOCABULARY})
    without_draft = place_in(with_other, GGUF_AND_MLX, serving=other, as_default=True)
    assert without_draft.serving.draft is None and without_draft.serving.engine is Engine.LLAMA_CPP
    with pytest.raises(InvalidPlacement, match="has a vocabulary of"):
        place_in(with_other, GGUF_AND_MLX, serving=other)
    drafted = place_in(with_other, GGUF_AND_MLX, serving=replace(defaults, draft=DRAFT.model_id), as_default=True)
    assert drafted.serving.draft == DRAFT.model_id


def test_llama_cpp_goes_to_the_node_with_most_memory_that_runs_it() -> None:
    nodes = [*running(BOTH, node("a", 20)), node("big", 60)]  # "big" has no llama.cpp yet
    assert [s.node_id for s in place(GGUF_AND_MLX, nodes, serving=SMALL_ROWS).shards] == ["a"]


def test_a_gguf_no_node_holds_is_split_across_llama_cpp_nodes_by_memory_the_leader_first() -> None:
    # 4.5 GiB of GGUF (32 layers) fits no single node; llama.cpp splits it over the fewest that hold it.
    nodes = running(BOTH, node("small", 1.5), node("a", 3.5), node("b", 2.5))
    split = place(GGUF_AND_MLX, nodes, serving=SMALL_ROWS)
    assert split.serving.engine is Engine.LLAMA_CPP
    assert [s.node_id for s in split.shards] == ["a", "b"]  # most memory first: the leader
    assert [s.rank for s in split.shards] == [0, 1]
    assert (split.shards[0].start_layer, split.shards[-1].end_layer) == (0, 32)
    assert split.shards[0].end_layer == split.shards[1].start_layer
    assert split.shards[0].end_layer > 16  # in proportion to memory: a holds more than b
    assert all(s.weights is WeightsDtype.NATIVE for s in split.shards)
    assert split.required_bytes == sum(s.memory_bytes for s in split.shards)
    # Each shard fits its node, and the pair together takes about the whole GGUF plus a compute buffer each.
    for shard in split.shards:
        assert shard.memory_bytes <= next(n for n in nodes if n.node_id == shard.node_id).profile.memory_available_bytes
    one_node = required_memory_bytes(GGUF_AND_MLX, replace(SMALL_ROWS, engine=Engine.LLAMA_CPP))
    assert one_node < split.required_bytes <= one_node + llama_cpp_compute_bytes(GGUF_AND_MLX) + 1
    # The instance's leader is its first rank on llama.cpp (its last on MLX).
    instance = Instance(instance_id="i", model_id=GGUF_AND_MLX.model_id, shards=split.shards, serving=split.serving)
    assert instance.leader_node == "a"
    mlx = replace(instance, serving=replace(split.serving, engine=Engine.MLX))
    assert mlx.leader_node == "b"
    # Asked for, it splits a model that one node holds too; the nodes named are taken in their order.
    roomy = running(BOTH, node("a", 64), node("b", 64), node("c", 64))
    assert len(place(GGUF_AND_MLX, roomy, min_nodes=3, serving=SMALL_ROWS).shards) == 3
    named = place(GGUF_AND_MLX, roomy, [NodeId("c"), NodeId("a")], serving=SMALL_ROWS)
    assert [s.node_id for s in named.shards] == ["c", "a"] and named.serving.engine is Engine.LLAMA_CPP
    # Too big for all of them together: why, and what to do.
    with pytest.raises(PlacementError, match=r"but the 3 node\(s\) that run llama\.cpp have 4\.50 GiB available; add"):
        place(GGUF_ONLY, running(BOTH, node("a", 1.5), node("b", 1.5), node("c", 1.5)), serving=SMALL_ROWS)


def test_a_mixed_cluster_places_each_instance_on_nodes_of_one_engine_and_says_why_when_none_can() -> None:
    mac = running((Engine.MLX,), node("mac", 64, accelerator="metal"))
    cpus = running(BOTH, node("a", 3.5), node("b", 3.5))
    # The GGUF-only model goes to the llama.cpp nodes, across both: never to the Mac that has room but not the engine.
    gguf = place(GGUF_ONLY, [*mac, *cpus], serving=SMALL_ROWS)
    assert gguf.serving.engine is Engine.LLAMA_CPP and {s.node_id for s in gguf.shards} == {"a", "b"}
    # A model in both formats asked across all three: one engine every node runs, MLX.
    both = place(GGUF_AND_MLX, [*mac, *cpus], [NodeId("mac"), NodeId("a"), NodeId("b")], serving=SMALL_ROWS)
    assert both.serving.engine is Engine.MLX and len(both.shards) == 3
    # Only the Mac has the memory for a GGUF-only model it cannot run.
    with pytest.raises(PlacementError, match=r"needs .* but the 2 node\(s\) that run llama\.cpp have 3\.00 GiB"):
        place(GGUF_ONLY, [*mac, *running(BOTH, node("a", 1.5), node("b", 1.5))], serving=SMALL_ROWS)
    with pytest.raises(EngineUnavailable, match=r"^mac does not run llama\.cpp"):
        place(GGUF_ONLY, [*mac, *cpus], [NodeId("mac"), NodeId("a")], serving=SMALL_ROWS)


def test_an_engine_asked_for_that_cannot_serve_is_refused_naming_it() -> None:
    nodes = running(BOTH, node("a", 64), node("b", 64))
    llama_cpp = replace(SMALL_ROWS, engine=Engine.LLAMA_CPP)
    with pytest.raises(EngineMismatch, match=r"no gguf weights, which llama\.cpp serves \(it has mlx\)"):
        place(Q4_CARD, nodes, serving=llama_cpp)
    with pytest.raises(EngineMismatch, match=r"no mlx weights, which mlx serves \(it has gguf\)"):
        place(GGUF_ONLY, nodes, serving=replace(SMALL_ROWS, engine=Engine.MLX))
    with pytest.raises(EngineUnavailable, match=r"^plain does not run llama\.cpp"):
        place(GGUF_AND_MLX, [*nodes, node("plain", 64)], [NodeId("plain")], serving=llama_cpp)
    with pytest.raises(EngineMismatch, match=r"llama\.cpp serves an instance as a pipeline"):
        place(GGUF_AND_MLX, nodes, serving=replace(llama_cpp, parallelism=Parallelism.TENSOR))
    with pytest.raises(EngineMismatch, match=r"own quantization \(Q4_0\); weights float32 applies to MLX only"):
        place(GGUF_AND_MLX, nodes, serving=replace(llama_cpp, weights=WeightsDtype.FLOAT32))
    # Left to placement, what llama.cpp cannot do goes to MLX.
    assert place(GGUF_AND_MLX, nodes, min_nodes=2, serving=SMALL_ROWS).serving.engine is Engine.LLAMA_CPP
    tensor = replace(SMALL_ROWS, parallelism=Parallelism.TENSOR)
    assert place(GGUF_AND_MLX, nodes, min_nodes=2, serving=tensor).serving.engine is Engine.MLX
    float32 = replace(SMALL_ROWS, weights=WeightsDtype.FLOAT32)
    assert place(GGUF_AND_MLX, nodes, serving=float32).serving.engine is Engine.MLX
    named = place(GGUF_AND_MLX, nodes, [NodeId("b")], serving=llama_cpp)
    assert [s.node_id for s in named.shards] == ["b"] and named.serving.engine is Engine.LLAMA_CPP


def test_llama_cpp_needs_the_gguf_its_kv_cache_for_each_slot_and_a_compute_buffer() -> None:
    long_context = replace(GGUF_AND_MLX, context_length=131072)
    assert llama_cpp_slot_context(long_context) == LLAMA_CPP_SLOT_CONTEXT == 4096
    assert llama_cpp_slot_context(replace(long_context, context_length=2048)) == 2048
    serving = ServingSettings(max_batch=4, prefix_cache_bytes=GiB, engine=Engine.LLAMA_CPP)
    kv = 2 * 32 * 8 * 128 * 4096 * 4 * 2  # K and V, layers, kv heads, head dim, context per slot, slots, f16
    compute = llama_cpp_compute_bytes(long_context)
    assert compute == 512 * 32000 * 4 + 64 * 2**20
    required = int(4.5 * GiB) + kv + GiB + compute
    assert required_memory_bytes(long_context, serving) == required
    placement = place(long_context, running(BOTH, node("a", 12)), serving=serving)
    assert placement.required_bytes == placement.shards[0].memory_bytes == required
    with pytest.raises(PlacementError) as raised:
        place(long_context, running(BOTH, node("a", 7)), serving=serving)
    message = str(raised.value)
    assert "on llama.cpp needs 7.62 GiB" in message and "a KV cache of 2.00 GiB for 4 slot(s) of 4096 tokens" in message
    assert "a has 7.00 GiB available" in message and "lower max_batch" in message
    # MLX's accounting is its own: the same settings on MLX count its full context and float32 weights.
    assert required_memory_bytes(long_context, replace(serving, engine=Engine.MLX, weights=WeightsDtype.NATIVE)) == (
        int(4.5 * GiB * 1.1) + 4 * kv_cache_bytes(long_context) + GiB
    )
