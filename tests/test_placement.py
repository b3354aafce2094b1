"""Placement: which nodes hold which layers. Pure; no NATS."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from helpers.cards import tiny_card
from jetshard_schema.ids import NodeId
from jetshard_schema.placement import PlacementError, place, required_memory_bytes, split_layers
from jetshard_schema.state import Node
from jetshard_schema.types import NodeProfile

GiB = 2**30
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


def node(name: str, available_gib: float) -> Node:
    return Node(
        node_id=NodeId(name),
        session_id="s",
        profile=NodeProfile(
            hostname=name,
            os="Linux",
            cpu_cores=8,
            memory_total_bytes=128 * GiB,
            memory_available_bytes=int(available_gib * GiB),
        ),
    )


def sizes(ranges: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in ranges]


def test_required_memory_is_weights_plus_headroom_plus_kv_cache() -> None:
    kv = 2 * 32 * 8 * 128 * 4096 * 2
    assert required_memory_bytes(CARD) == int(4 * GiB * 1.1) + kv


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
    placement = place(CARD, [node("small", 2), node("big", 40), node("mid", 10)])
    assert [(s.node_id, s.rank, s.start_layer, s.end_layer) for s in placement.shards] == [("big", 0, 0, 32)]
    assert placement.required_bytes == required_memory_bytes(CARD)


def test_min_nodes_spreads_layers_by_available_memory() -> None:
    placement = place(CARD, [node("a", 30), node("b", 10), node("c", 1)], min_nodes=2)
    assert [s.node_id for s in placement.shards] == ["a", "b"]
    assert [s.end_layer - s.start_layer for s in placement.shards] == [24, 8]


def test_several_nodes_when_none_holds_the_model_alone() -> None:
    placement = place(CARD, [node("a", 3), node("b", 3), node("c", 3)])
    assert len(placement.shards) == 2
    assert [s.rank for s in placement.shards] == [0, 1]
    assert placement.shards[-1].end_layer == 32


def test_not_enough_memory_says_how_much_is_needed_and_what_to_do() -> None:
    with pytest.raises(PlacementError) as raised:
        place(CARD, [node("a", 1), node("b", 1)])
    message = str(raised.value)
    assert "acme/m needs" in message
    assert "GiB" in message and "2.00 GiB available" in message
    assert "add nodes" in message


def test_explicit_node_ids_keep_their_order_and_ranks() -> None:
    nodes = [node("a", 30), node("b", 10), node("c", 10)]
    placement = place(CARD, nodes, node_ids=[NodeId("c"), NodeId("a")])
    assert [(s.node_id, s.rank) for s in placement.shards] == [("c", 0), ("a", 1)]
    assert [s.end_layer - s.start_layer for s in placement.shards] == [9, 23]


def test_explicit_node_ids_must_fit_the_model() -> None:
    with pytest.raises(PlacementError, match="needs"):
        place(CARD, [node("a", 30), node("b", 1)], node_ids=[NodeId("b")])


@pytest.mark.parametrize(
    ("node_ids", "min_nodes", "match"),
    [
        (["a", "x"], 1, "unknown node"),
        (["a", "a"], 1, "listed twice"),
        (["a"], 2, "only 1 available"),
        (None, 0, "at least 1"),
        (None, 4, "only 3 available"),
    ],
)
def test_bad_requests_are_refused(node_ids: list[str] | None, min_nodes: int, match: str) -> None:
    nodes = [node("a", 30), node("b", 10), node("c", 10)]
    with pytest.raises(PlacementError, match=match):
        place(CARD, nodes, node_ids=[NodeId(n) for n in node_ids] if node_ids else None, min_nodes=min_nodes)


def test_more_nodes_than_layers() -> None:
    tiny = msgspec.structs.replace(CARD, num_layers=2, storage_size_bytes=1)
    with pytest.raises(PlacementError, match="fewer than"):
        place(tiny, [node("a", 1), node("b", 1), node("c", 1)], min_nodes=3)
