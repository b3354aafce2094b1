"""Steps the routes share: checking a model id, placing an instance, waiting for a model to be ready, getting
a model's files onto the nodes that would serve it and deleting them again; and the answer of every DELETE.

Route modules call down into this one and never into each other, so a request flows one way.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable

import msgspec
from jetshard_schema import commands
from jetshard_schema.cards import ModelCapability, ModelCard
from jetshard_schema.events import InstanceChosen, InstancePlaced
from jetshard_schema.ids import MODEL_ID_MAX_LENGTH, InstanceId, ModelId, NodeId, new_instance_id, parse_model_id
from jetshard_schema.models import find_card
from jetshard_schema.placement import (
    EngineMismatch,
    EngineUnavailable,
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
    ModelFormat,
    ServingSettings,
    TaskRequest,
    keep_alive_ms,
)

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ApiError
from jetshard_api.hub import fetch_card
from jetshard_api.images import has_images
from jetshard_api.settings import InferenceSettings


class Deleted(msgspec.Struct, frozen=True):
    deleted: str


def default_keep_alive_ms(state: State, settings: InferenceSettings) -> int:
    """How long an instance placed for a request stays loaded once idle: the cluster's setting (the dashboard's,
    `PUT /settings`), else this API's `--model-keep-alive-s`."""
    if state.default_keep_alive_ms is not None:
        return state.default_keep_alive_ms
    return keep_alive_ms(settings.model_keep_alive_s)


def checked_keep_alive(seconds: float | None, param: str = "keep_alive_s") -> int:
    """A request's keep-alive in seconds as the cluster's (None or negative: kept loaded), or a 400 naming
    `param`."""
    if seconds is None:
        return KEEP_LOADED
    try:
        return keep_alive_ms(seconds)
    except ValueError as error:
        raise ApiError(400, str(error), "invalid_request", param) from error


def checked_model_id(value: str, param: str = "model_id") -> ModelId:
    """`value` as a model id, or a 400 naming `param`, the request field it came from."""
    try:
        return parse_model_id(value)
    except ValueError as error:
        raise ApiError(400, str(error), "invalid_model_id", param) from error


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
"""What another server's model names look like (`gpt-4o`, `claude-sonnet-4-5`, `llama3:8b`,
`hf.co/org/repo:Q4_K_M`): a name this cluster cannot have, not an attack."""


def requested_model_id(value: str, param: str = "model") -> ModelId:
    """The model an inference request names (every dialect's `model`). A name that cannot be one of this cluster's
    models, as clients send that were made for another server (`gpt-3.5-turbo`, `llama3`), is a 404
    `model_not_found`, which is what OpenAI, Anthropic and Ollama answer for a model they do not have; only a
    hostile value (a path, control characters, an overlong string) is a 400 `invalid_model_id`."""
    try:
        return parse_model_id(value)
    except ValueError as error:
        hostile = len(value) > MODEL_ID_MAX_LENGTH or not _MODEL_NAME.fullmatch(value) or ".." in value or "//" in value
        if hostile:
            raise ApiError(400, str(error), "invalid_model_id", param) from error
        raise ApiError(
            404, f"model {value!r} not found: this cluster's models are named 'org/name'", "model_not_found", param
        ) from error


def can_think(state: State, model_id: ModelId) -> bool:
    """Whether the model's card says it thinks; an unknown model passes, for its own error to come later."""
    card = find_card(state, model_id)
    return card is None or ModelCapability.THINKING in card.capabilities


def ready_models(state: State) -> set[ModelId]:
    """The models that can take a task now, as lists and error messages name them."""
    return {i.model_id for i in ready_instances(state)}


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
    """The placement that would be chosen now, without placing anything; 503 when no node can get the
    model's files, 409 when they have too little memory."""
    try:
        return place_in(state, card, None, min_nodes, serving)
    except ModelUnavailable as error:
        raise ApiError(503, str(error), "model_unavailable") from error
    except UnsplittableModel as error:
        raise ApiError(400, str(error), "invalid_parallelism", "parallelism") from error
    except EngineMismatch as error:
        raise ApiError(400, str(error), "invalid_engine", "engine") from error
    except EngineUnavailable as error:
        raise ApiError(409, str(error), "engine_unavailable", "engine") from error
    except NotEnoughNodes as error:
        raise ApiError(409, str(error), "not_enough_nodes", "min_nodes") from error
    except PlacementError as error:
        raise ApiError(409, str(error), "insufficient_memory") from error


def check_inputs(state: State, task: TaskRequest, images_param: str = "messages") -> None:
    """A 400 naming `images_param`, the request field that carries the images, for images sent to a model whose
    card says it takes none (it would see only their placeholders)."""
    if not has_images(task):
        return
    card = find_card(state, task.model_id)
    if card is not None and not card.vision:
        raise ApiError(
            400, f"{task.model_id} takes no images: {_why_blind(card)}", "model_takes_no_images", images_param
        )


def _why_blind(card: ModelCard) -> str:
    """Why a model without vision takes no images. A GGUF model sees on llama.cpp only through the projector file
    that is added with it (a text GGUF and a vision one look alike otherwise): say so, and how to add one."""
    if ModelFormat.GGUF not in card.formats:
        return "it is not a vision model"
    return (
        "it has no image projector (mmproj), through which llama.cpp sees images; a GGUF model that sees is added "
        "with its projector: `jetshard models import-gguf FILE --mmproj PROJECTOR`, or `mmproj_file` beside "
        "`gguf_file` for a Hub repo"
    )


async def ensure_ready(cluster: Cluster, model_id: ModelId, settings: InferenceSettings) -> None:
    """Place an instance of `model_id` if none is alive (auto-place), then wait until one is ready."""
    coming = await ensure_placed(cluster, model_id, settings)
    if coming:
        await wait_ready(cluster, model_id, coming, settings)


async def ensure_placed(cluster: Cluster, model_id: ModelId, settings: InferenceSettings) -> frozenset[InstanceId]:
    """The instances of `model_id` on their way to ready (none: one is ready now). With auto-place and none
    alive, the sequencer places one, or names the one that a concurrent request placed first. Raises ApiError
    (404, or placement refused) before any streaming starts."""
    state = cluster.state
    if ready_instances(state, model_id):
        return frozenset()
    if find_card(state, model_id) is None:
        raise ApiError(
            404,
            f"unknown model {model_id}; ready models: {sorted(ready_models(state)) or 'none'}",
            "model_not_found",
            "model",
        )
    alive = frozenset(i.instance_id for i in state.instances.values() if i.model_id == model_id and not i.failed)
    if alive:
        return alive
    if not settings.auto_place:
        raise ApiError(
            404,
            f"{model_id} has no instance and auto-placement is off; ready models: "
            f"{sorted(ready_models(state)) or 'none'}",
            "model_not_found",
            "model",
        )
    events = await cluster.submit(
        commands.EnsureInstance(
            instance_id=new_instance_id(),
            model_id=model_id,
            serving=settings.serving,
            keep_alive_ms=default_keep_alive_ms(state, settings),
        )
    )
    return frozenset(e.instance_id for e in events if isinstance(e, InstancePlaced | InstanceChosen))


async def wait_ready(
    cluster: Cluster, model_id: ModelId, coming: frozenset[InstanceId], settings: InferenceSettings
) -> None:
    """Until an instance of `model_id` is ready; 503 as soon as every instance in `coming` failed or left and none
    took its place (the sequencer replaces an instance in the command that removes it: one moved to a faster
    engine, one whose node was lost)."""

    def ready_or_hopeless(s: State) -> bool:
        if ready_instances(s, model_id):
            return True
        return not any(i.model_id == model_id and not i.failed for i in s.instances.values())

    try:
        state = await cluster.wait_until(ready_or_hopeless, settings.ready_timeout_s)
    except TimeoutError as error:
        raise ApiError(
            504, f"{model_id} did not become ready in {settings.ready_timeout_s:.0f} s", "instance_timeout"
        ) from error
    if not ready_instances(state, model_id):
        failed = [state.instances[i].failed_reason for i in sorted(coming) if i in state.instances]
        raise ApiError(
            503, f"{model_id} is unavailable: {'; '.join(failed) or 'its instance was removed'}", "model_unavailable"
        )


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
