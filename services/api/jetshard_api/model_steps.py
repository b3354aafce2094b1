"""Steps the routes that manage models and instances share (the cluster routes, Ollama's pull, show and delete):
checking a model id and a keep-alive, placing an instance, previewing a placement, getting a model's files onto
the nodes that would serve it and deleting them again; and the answer of every DELETE.

Route modules call down into this one and never into each other, so a request flows one way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec
from jetshard_schema import commands
from jetshard_schema.cards import ModelCapability, ModelCard
from jetshard_schema.ids import ModelId, NodeId, new_instance_id, parse_model_id, parse_name
from jetshard_schema.models import find_card
from jetshard_schema.placement import (
    EngineMismatch,
    EngineUnavailable,
    InvalidPlacement,
    ModelUnavailable,
    NotEnoughNodes,
    Placement,
    PlacementError,
    UnsplittableModel,
    place_in,
)
from jetshard_schema.state import Instance, State, ready_instances
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    DownloadStatus,
    Engine,
    RejectCode,
    ServingSettings,
    keep_alive_ms,
)

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ApiError, refused_as_bad_request
from jetshard_api.hub import fetch_card


class Deleted(msgspec.Struct, frozen=True):
    deleted: str


def checked_keep_alive(seconds: float | None, param: str = "keep_alive_s") -> int:
    """A request's keep-alive in seconds as the cluster's (None or negative: kept loaded), or a 400 naming
    `param`."""
    if seconds is None:
        return KEEP_LOADED
    with refused_as_bad_request("invalid_request", param):
        return keep_alive_ms(seconds)


def checked_model_id(value: str, param: str = "model_id") -> ModelId:
    """`value` as a model id, or a 400 naming `param`, the request field it came from."""
    with refused_as_bad_request("invalid_model_id", param):
        return parse_model_id(value)


def checked_name(value: str, param: str) -> str:
    """`value` as a node, instance or task id, or a 400 naming `param`, the path part it came from."""
    with refused_as_bad_request("invalid_id", param):
        return parse_name(value, param.replace("_", " "))


def can_think(state: State, model_id: ModelId) -> bool:
    """Whether the model's card says it thinks; an unknown model passes, for its own error to come later."""
    card = find_card(state, model_id)
    return card is None or ModelCapability.THINKING in card.capabilities


def engines_serving(state: State) -> dict[ModelId, list[Engine]]:
    """Per model with a ready instance, the engines its ready instances run on."""
    serving: dict[ModelId, list[Engine]] = {}
    for instance in ready_instances(state):
        engines = serving.setdefault(instance.model_id, [])
        if instance.engine not in engines:
            engines.append(instance.engine)
    return serving


async def place_instance(
    cluster: Cluster,
    model_id: ModelId,
    serving: ServingSettings,
    node_ids: tuple[NodeId, ...] | None = None,
    min_nodes: int = 1,
    keep_alive_ms: int = KEEP_LOADED,
) -> Instance:
    instance_id = new_instance_id()
    await cluster.submit(
        commands.PlaceInstance(
            instance_id=instance_id,
            model_id=model_id,
            node_ids=node_ids,
            min_nodes=min_nodes,
            serving=serving,
            keep_alive_ms=keep_alive_ms,
        )
    )
    return cluster.state.instances[instance_id]


def preview_placement(state: State, card: ModelCard, serving: ServingSettings, min_nodes: int = 1) -> Placement:
    """The placement that would be chosen now, without placing anything; 400 when the request is wrong whatever
    the nodes, 503 when no node can get the model's files, 409 when they have too little memory."""
    try:
        return place_in(state, card, None, min_nodes, serving)
    except ModelUnavailable as error:
        raise ApiError(503, str(error), "model_unavailable") from error
    except UnsplittableModel as error:
        raise ApiError(400, str(error), "invalid_parallelism", "parallelism") from error
    except EngineMismatch as error:
        raise ApiError(400, str(error), "invalid_engine", "engine") from error
    except InvalidPlacement as error:  # as the sequencer refuses it (`RejectCode.INVALID`)
        raise ApiError(400, str(error), str(RejectCode.INVALID)) from error
    except EngineUnavailable as error:
        raise ApiError(409, str(error), "engine_unavailable", "engine") from error
    except NotEnoughNodes as error:
        raise ApiError(409, str(error), "not_enough_nodes", "min_nodes") from error
    except PlacementError as error:
        raise ApiError(409, str(error), "insufficient_memory") from error


async def start_pull(cluster: Cluster, model_id: ModelId, serving: ServingSettings) -> list[NodeId]:
    """Make `model_id` ready to place: add its card from the Hub if the cluster has none, then start downloading
    the layers that placing it now would put on each node. The nodes downloading, in the placement's order."""
    card = find_card(cluster.state, model_id) or await _added_card(cluster, model_id)
    shards = preview_placement(cluster.state, card, serving).shards
    for shard in shards:
        await cluster.submit(
            commands.StartDownload(
                model_id=model_id, node_id=shard.node_id, start_layer=shard.start_layer, end_layer=shard.end_layer
            )
        )
    return [shard.node_id for shard in shards]


async def _added_card(cluster: Cluster, model_id: ModelId) -> ModelCard:
    card = await asyncio.to_thread(fetch_card, model_id)
    try:
        await cluster.submit(commands.AddCustomModelCard(card=card))
    except ApiError as error:
        if error.code != "already_exists":  # added meanwhile by another request
            raise
    return find_card(cluster.state, model_id) or card


async def pulling(
    cluster: Cluster, model_id: ModelId, nodes: list[NodeId], every_s: float
) -> AsyncIterator[tuple[NodeId, DownloadProgress]]:
    """Each node's download of `model_id`, node by node, again whenever one moves (and every `every_s`), until
    every one completed; ApiError when one fails, is cancelled or deleted."""

    def downloads(state: State) -> list[DownloadProgress | None]:
        return [d.progress if (d := state.download(node, model_id)) else None for node in nodes]

    while True:
        current = downloads(cluster.state)
        for node, progress in zip(nodes, current, strict=True):
            if progress is None or progress.status in (DownloadStatus.FAILED, DownloadStatus.CANCELLED):
                why = "it was deleted" if progress is None else progress.reason or str(progress.status)
                raise ApiError(502, f"downloading {model_id} to node {node} failed: {why}", "download_failed")
            yield node, progress
        if all(p is not None and p.status is DownloadStatus.COMPLETED for p in current):
            return
        await _moved(cluster, downloads, current, every_s)


async def _moved(
    cluster: Cluster, downloads: Callable[[State], list[DownloadProgress | None]], seen: object, within_s: float
) -> None:
    """Until the downloads differ from `seen`, or `within_s` passed."""
    with contextlib.suppress(TimeoutError):
        await cluster.wait_until(lambda s: downloads(s) != seen, within_s)


async def until_pulled(cluster: Cluster, model_id: ModelId, nodes: list[NodeId], every_s: float) -> None:
    async for _ in pulling(cluster, model_id, nodes, every_s):
        pass


async def delete_everywhere(cluster: Cluster, model_id: ModelId) -> bool:
    """Delete `model_id`'s files from every node (409 while an instance uses them, or from a read-only
    directory), then its card if it is a custom one (a pulled model's); False when there was neither."""
    state = cluster.state
    nodes = sorted(node for node, per_node in state.downloads.items() if model_id in per_node)
    custom = model_id in state.custom_cards
    if not nodes and not custom:
        return False
    for node in nodes:
        await cluster.submit(commands.DeleteDownload(model_id=model_id, node_id=node))
    with contextlib.suppress(TimeoutError):
        await cluster.wait_until(
            lambda s: all(s.download(n, model_id) is None for n in nodes), cluster.command_timeout_s
        )
    if custom:
        await cluster.submit(commands.DeleteCustomModelCard(model_id=model_id))
    return True
