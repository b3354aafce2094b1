"""Placement: which nodes hold which layers of an instance. Pure; tested without NATS.

Memory a model needs on the cluster = its weights + a KV-cache headroom: the fp16 KV cache of one full
context (2 · layers · kv heads · head dim · context · 2 bytes) plus 10 % of the weights for activations
and allocator slack. Each node gets a layer range proportional to its available memory (largest
remainder, at least one layer each); together the nodes must hold the whole requirement.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.ids import NodeId
from jetshard_schema.state import Node, State
from jetshard_schema.types import ShardAssignment

ACTIVATION_HEADROOM = 0.10
KV_BYTES_PER_VALUE = 2


class PlacementError(ValueError):
    """The model cannot be placed; the message says why, for a person."""


class ModelUnavailable(PlacementError):
    """The nodes that could hold the model cannot get its files (offline, and it is not on their disks)."""


class Placement(msgspec.Struct, frozen=True):
    shards: tuple[ShardAssignment, ...]
    required_bytes: int


def required_memory_bytes(card: ModelCard) -> int:
    head_dim = card.hidden_size // max(card.num_attention_heads, 1)
    kv_cache = 2 * card.num_layers * card.num_key_value_heads * head_dim * card.context_length * KV_BYTES_PER_VALUE
    return int(card.storage_size_bytes * (1 + ACTIVATION_HEADROOM)) + kv_cache


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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def place(
    card: ModelCard,
    nodes: Sequence[Node],
    node_ids: Sequence[NodeId] | None = None,
    min_nodes: int = 1,
) -> Placement:
    """Choose nodes and layer ranges for `card`; raise PlacementError with an actionable reason."""
    known = {node.node_id: node for node in nodes}
    if node_ids:
        missing = [n for n in node_ids if n not in known]
        if missing:
            raise PlacementError(f"unknown node(s): {', '.join(missing)}; see GET /nodes")
        if len(set(node_ids)) != len(node_ids):
            raise PlacementError("a node is listed twice")
        chosen = [known[n] for n in node_ids]
    else:
        chosen = sorted(nodes, key=lambda n: (-n.profile.memory_available_bytes, n.node_id))
    if min_nodes < 1:
        raise PlacementError("min_nodes must be at least 1")
    if len(chosen) < min_nodes:
        raise PlacementError(f"{min_nodes} node(s) requested but only {len(chosen)} available")

    required = required_memory_bytes(card)
    if not node_ids:
        # The fewest nodes (at least min_nodes) whose memory covers the model: fewer hops per token.
        count, held = 0, 0
        for count, node in enumerate(chosen, start=1):
            held += node.profile.memory_available_bytes
            if count >= min_nodes and held >= required:
                break
        chosen = chosen[:count]
    available = sum(n.profile.memory_available_bytes for n in chosen)
    if available < required:
        raise PlacementError(
            f"{card.model_id} needs {_gib(required)} (weights {_gib(card.storage_size_bytes)} plus KV-cache "
            f"headroom) but the {len(chosen)} node(s) have {_gib(available)} available; add nodes or "
            "choose a smaller model"
        )
    ranges = split_layers(card.num_layers, [n.profile.memory_available_bytes for n in chosen])
    shards = tuple(
        ShardAssignment(node_id=node.node_id, rank=rank, start_layer=start, end_layer=end)
        for rank, (node, (start, end)) in enumerate(zip(chosen, ranges, strict=True))
    )
    return Placement(shards=shards, required_bytes=required)


def cannot_fetch(state: State, card: ModelCard) -> set[NodeId]:
    """Nodes that could not get `card`'s files: offline, and the model is not complete on their disks.
    (A packaged GGUF is converted on the node itself, which needs no network.)"""
    if card.source is ModelSource.GGUF_PACKAGE:
        return set()
    return {
        node_id
        for node_id, storage in state.node_storage.items()
        if storage.offline and card.model_id not in storage.available_models
    }


def place_in(state: State, card: ModelCard, node_ids: Sequence[NodeId] | None = None, min_nodes: int = 1) -> Placement:
    """`place` on the nodes of `state` that can get the model's files; ModelUnavailable when none can."""
    excluded = cannot_fetch(state, card)
    offline_named = sorted(excluded & set(node_ids or ()))
    usable = [node for node in state.nodes.values() if node.node_id not in excluded]
    if offline_named or (state.nodes and not usable):
        offline = offline_named or sorted(excluded & set(state.nodes))
        raise ModelUnavailable(
            f"{card.model_id} is not in any model directory of {', '.join(offline)}, which "
            f"{'is' if len(offline) == 1 else 'are'} offline (no downloads): put the model there, or start "
            "the downloader without --offline"
        )
    return place(card, usable, node_ids, min_nodes)
