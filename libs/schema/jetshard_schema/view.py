"""The cluster at a glance: what `jetshard status`, `GET /view` and the dashboard show, derived from State.

A pure function of State and of the live figures runners publish on core NATS (tokens per second, batch
size), which are not in State because they change every step. Small enough to send whole on every change:
nodes with their model directories, every model the cluster knows (its card, and where each node has its
files), instances with each shard's layers and runner, and the tasks in flight. The dashboard renders it as it
comes; it never folds events itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath

import msgspec

from jetshard_schema.cards import ModelCapability, ModelCard
from jetshard_schema.events import EventEnvelope
from jetshard_schema.gist import gist, size
from jetshard_schema.ids import InstanceId, ModelId, NodeId, TaskId
from jetshard_schema.models import all_cards, is_builtin
from jetshard_schema.placement import device_of
from jetshard_schema.state import Download, Instance, ModelImport, State, instance_status
from jetshard_schema.stats import RunnerStats
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    DownloadStatus,
    Engine,
    GpuInfo,
    ImportStatus,
    InstanceStatus,
    ModelDirInfo,
    NodeProfile,
    ServingSettings,
    ShardAssignment,
    TaskKind,
    engine_format,
)


class ShardDescription(ShardAssignment, frozen=True, kw_only=True):
    """A shard and how far it is: its runner's progress once it has one, else its download's."""

    status: str
    leader: bool = False
    """Whether this rank's runner serves the instance's requests (`Instance.leader_node`); on llama.cpp across nodes
    the others serve their layers to it through llama.cpp's RPC backend."""
    worker_session: str | msgspec.UnsetType = msgspec.UNSET
    layers_loaded: int | msgspec.UnsetType = msgspec.UNSET
    layers_total: int | msgspec.UnsetType = msgspec.UNSET
    bytes_done: int | msgspec.UnsetType = msgspec.UNSET
    bytes_total: int | msgspec.UnsetType = msgspec.UNSET
    reason: str | msgspec.UnsetType | None = msgspec.UNSET
    weights_dtype: str | msgspec.UnsetType = msgspec.UNSET
    """What the ready runner holds its weights as."""
    device: str | msgspec.UnsetType = msgspec.UNSET
    """What the shard runs on: "cuda:0 (<GPU name>)", "metal" or "cpu" (unset while its node is gone)."""


class NodeShard(msgspec.Struct, frozen=True, kw_only=True):
    """A shard a node holds, as `GET /nodes` lists it under the node."""

    instance_id: InstanceId
    model_id: ModelId
    engine: Engine
    rank: int
    ranks: int
    start_layer: int
    end_layer: int
    leader: bool


def shards_on(state: State, node_id: NodeId) -> list[NodeShard]:
    """The shards of live instances that `node_id` holds, by instance."""
    return [
        NodeShard(
            instance_id=instance.instance_id,
            model_id=instance.model_id,
            engine=instance.engine,
            rank=shard.rank,
            ranks=len(instance.shards),
            start_layer=shard.start_layer,
            end_layer=shard.end_layer,
            leader=shard.rank == instance.leader_rank,
        )
        for instance in sorted(state.instances.values(), key=lambda i: i.instance_id)
        if not instance.failed
        for shard in instance.shards
        if shard.node_id == node_id
    ]


def unloads_at_ms(state: State, instance: Instance, now_ms: int) -> int | None:
    """When `instance` unloads if nothing more comes for it (its tasks in flight end about now, if any); None
    while it is kept loaded until removed."""
    busy = any(task.instance_id == instance.instance_id for task in state.tasks.values())
    if instance.keep_alive_ms == KEEP_LOADED:
        return None
    return now_ms + instance.keep_alive_ms if busy else instance.unloads_at_ms(busy=False)


def model_unloads_at_ms(state: State, model_id: ModelId, now_ms: int) -> int | None:
    """When the last of `model_id`'s instances unloads if nothing more comes for it; None if one stays."""
    times = [
        unloads_at_ms(state, i, now_ms) for i in state.instances.values() if i.model_id == model_id and not i.failed
    ]
    return None if not times or None in times else max(t for t in times if t is not None)


class InstanceDescription(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: InstanceId
    model_id: ModelId
    status: InstanceStatus
    generation: int
    restart_attempt: int
    reason: str | None
    """Why it failed or last restarted: news only until it is ready again."""
    shards: list[ShardDescription]
    serving: ServingSettings
    engine: Engine
    """What serves it: `serving.engine`, or MLX for an instance placed before engines."""
    engine_chosen: bool
    """Whether placement chose the engine (the request left it open): it moves to a faster one its nodes gain."""
    tasks_in_flight: int
    """Assigned and not finished: running, or queued for a place in a batch."""
    tasks_running: int
    """Of those, the ones its leader has started (prefilling or decoding)."""
    keep_alive_s: float | None
    """How long it stays loaded with nothing to do; None: until removed."""
    unloads_at_ms: int | None
    """When it unloads if nothing more comes for it (its tasks in flight ending now); None: never by itself."""


def _describe_shard(state: State, instance: Instance, shard: ShardAssignment) -> ShardDescription:
    fields = msgspec.structs.asdict(shard)
    fields["leader"] = shard.rank == instance.leader_rank
    node = state.nodes.get(shard.node_id)
    if node is not None:
        fields["device"] = device_of(node.profile)
    runner = instance.runners.get(shard.rank)
    if runner is not None:
        return ShardDescription(
            **fields,
            status=str(runner.status),
            worker_session=runner.worker_session,
            layers_loaded=runner.layers_loaded,
            layers_total=runner.layers_total,
            reason=runner.reason or None,
            weights_dtype=runner.weights_dtype or msgspec.UNSET,
        )
    download = state.download(shard.node_id, instance.model_id)
    progress = download.progress if download else None
    if progress is None or not progress.holds(engine_format(instance.serving.engine)):
        return ShardDescription(
            **fields,
            status="downloading" if progress is None or progress.status is not DownloadStatus.FAILED else "failed",
            bytes_done=progress.bytes_done if progress else 0,
            bytes_total=progress.bytes_total if progress else 0,
            reason=(progress.reason or None) if progress else None,
        )
    return ShardDescription(**fields, status="waiting")


def describe_instance(state: State, instance: Instance, now_ms: int) -> InstanceDescription:
    status = instance_status(state, instance)
    tasks = [t for t in state.tasks.values() if t.instance_id == instance.instance_id]
    return InstanceDescription(
        instance_id=instance.instance_id,
        model_id=instance.model_id,
        status=status,
        generation=instance.generation,
        restart_attempt=instance.restart_attempt,
        reason=(instance.failed_reason or None) if status is not InstanceStatus.READY else None,
        shards=[_describe_shard(state, instance, shard) for shard in instance.shards],
        serving=instance.serving,
        engine=instance.engine,
        engine_chosen=instance.engine_chosen,
        tasks_in_flight=len(tasks),
        tasks_running=sum(1 for t in tasks if t.started),
        keep_alive_s=None if instance.keep_alive_ms == KEEP_LOADED else instance.keep_alive_ms / 1000,
        unloads_at_ms=unloads_at_ms(state, instance, now_ms),
    )


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    hostname: str
    accelerator: str
    fast_blas: bool
    cpu_cores: int
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: tuple[GpuInfo, ...]
    engines: tuple[Engine, ...]
    """The engines its runners can run now (llama.cpp once its build is ready there)."""
    disk_free_bytes: int
    """Free space in the node's writable model directories, together."""
    disk_total_bytes: int
    models_on_disk: int
    offline: bool
    model_dirs: tuple[ModelDirInfo, ...]
    """Where the node keeps models, in the order its downloader looks: read-only ones first."""


class DownloadView(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    status: DownloadStatus
    start_layer: int
    end_layer: int
    bytes_done: int
    bytes_total: int
    speed_bytes_per_s: float
    eta_s: float | None
    directory: str
    """The directory holding the model's files on the node ("" until its downloader has chosen one)."""
    models_dir: str
    """Which of the node's model directories that is in ("" when none of those it reports holds it)."""
    read_only: bool
    """The files are in a read-only directory: the node uses them and never deletes them."""
    reason: str
    source: str = ""
    """Where the bytes come from: "hub", or the node they are copied from."""


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
    model_id: ModelId
    display_name: str
    num_layers: int
    storage_size_bytes: int
    context_length: int
    capabilities: tuple[ModelCapability, ...]
    """What it does: completion, tools, thinking, vision, embedding."""
    quantization_bits: int | None
    file_type: str = ""
    """A GGUF's type as llama.cpp names it (`Q4_K_M`); empty for a Hub repository's files."""
    builtin: bool
    """Its card ships with jetshard; the others were added (`POST /models`) and can be deleted."""
    known: bool
    """It has a card; False for files or an instance left after its custom card was deleted."""
    in_use: bool
    """On some node's disk, placed, or added: what `jetshard status` lists (the page lists these first)."""
    downloads: list[DownloadView]
    """One per node that has or is getting some of its layers."""
    draft_model: ModelId | None = None
    """The smaller model its card pairs it with to draft (`serving.draft`), if any."""


class InstanceView(InstanceDescription, frozen=True, kw_only=True):
    tokens_per_s: float | None = None
    batch_size: int | None = None
    """Both from the leader's latest stats (core NATS, every few seconds); None until it has published any."""
    draft_acceptance: float | None = None
    """Of the tokens its drafting proposed (`serving.draft`), the share the model kept, from the same stats; None
    until it has drafted any."""


class TaskView(msgspec.Struct, frozen=True, kw_only=True):
    task_id: TaskId
    model_id: ModelId
    kind: TaskKind
    instance_id: InstanceId
    status: str
    """`queued` until its instance's leader starts it, then `running`."""
    prompt_tokens: int
    """0 until known: an engine that counts them as it prefills (llama.cpp) gives them with the answer's usage."""


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int
    """The event the view is derived up to."""
    nodes: list[NodeView]
    models: list[ModelView]
    instances: list[InstanceView]
    tasks: list[TaskView]
    imports: list[ModelImport] = []
    """The imports of GGUF files under way, with their bytes so far (`import_progress`)."""


# A view shows the fields its source has under the same name as they are.
_PROFILE_SHOWN = [name for name in NodeView.__struct_fields__ if name in NodeProfile.__struct_fields__]
_PROGRESS_SHOWN = [name for name in DownloadView.__struct_fields__ if name in DownloadProgress.__struct_fields__]


def _node_view(state: State, node_id: NodeId) -> NodeView:
    profile = state.nodes[node_id].profile
    storage = state.node_storage.get(node_id)
    model_dirs = storage.model_dirs if storage else ()
    writable = [d for d in model_dirs if not d.read_only]
    return NodeView(
        node_id=node_id,
        **{name: getattr(profile, name) for name in _PROFILE_SHOWN},
        disk_free_bytes=sum(d.free_bytes for d in writable),
        disk_total_bytes=sum(d.total_bytes for d in writable),
        models_on_disk=len(storage.available_models) if storage else 0,
        offline=storage.offline if storage else False,
        model_dirs=model_dirs,
    )


def _models_dir(state: State, download: Download) -> str:
    storage = state.node_storage.get(download.node_id)
    directory = PurePosixPath(download.progress.directory)
    if storage is None or not directory.is_absolute():
        return ""
    holding = [d.path for d in storage.model_dirs if directory.is_relative_to(d.path)]
    return max(holding, key=len, default="")  # the innermost, should one directory be inside another


def _download_view(state: State, download: Download) -> DownloadView:
    return DownloadView(
        node_id=download.node_id,
        models_dir=_models_dir(state, download),
        **{name: getattr(download.progress, name) for name in _PROGRESS_SHOWN},
    )


def _model_view(model_id: ModelId, card: ModelCard | None, downloads: list[DownloadView], placed: bool) -> ModelView:
    builtin = is_builtin(model_id)
    return ModelView(
        model_id=model_id,
        display_name=card.display_name if card else "",
        num_layers=card.num_layers if card else 0,
        storage_size_bytes=card.storage_size_bytes if card else 0,
        context_length=card.context_length if card else 0,
        capabilities=card.capabilities if card else (),
        quantization_bits=card.quantization.bits if card and card.quantization else None,
        file_type=card.file_type if card else "",
        builtin=builtin,
        known=card is not None,
        in_use=bool(downloads) or placed or not builtin,
        downloads=downloads,
        draft_model=card.draft_model if card else None,
    )


def _model_views(state: State) -> list[ModelView]:
    downloads: dict[ModelId, list[DownloadView]] = {}
    for node_id, per_model in sorted(state.downloads.items()):
        for model_id, download in per_model.items():
            if not download.deleting and node_id in state.nodes:
                downloads.setdefault(model_id, []).append(_download_view(state, download))
    cards = all_cards(state)
    placed = {i.model_id for i in state.instances.values()}
    return [
        _model_view(model_id, cards.get(model_id), downloads.get(model_id, []), model_id in placed)
        for model_id in sorted(set(cards) | set(downloads) | placed)
    ]


def cluster_view(state: State, now_ms: int, loads: Mapping[InstanceId, RunnerStats] | None = None) -> ClusterView:
    """The summary of `state` at `now_ms`, with each instance's tokens per second, batch size and drafting
    acceptance where `loads` has its leader's latest stats."""
    loads = loads or {}
    instances = []
    for instance_id, instance in sorted(state.instances.items()):
        description = msgspec.structs.asdict(describe_instance(state, instance, now_ms))
        load = loads.get(instance_id)
        if load is not None:
            counters = load.counters
            acceptance = counters.accepted_tokens / counters.drafted_tokens if counters.drafted_tokens else None
            description |= {
                "tokens_per_s": load.tokens_per_s,
                "batch_size": load.batch_size,
                "draft_acceptance": acceptance,
            }
        instances.append(InstanceView(**description))
    return ClusterView(
        last_seq=state.last_seq,
        nodes=[_node_view(state, node_id) for node_id in sorted(state.nodes)],
        models=_model_views(state),
        instances=instances,
        tasks=task_views(state),
        imports=[i for _, i in sorted(state.imports.items()) if i.progress.status is ImportStatus.ONGOING],
    )


def import_progress(record: ModelImport) -> str:
    """How far an import is, for a person: `importing 45% of 4.9 GB`."""
    progress = record.progress
    if not progress.bytes_total:
        return "importing"
    return f"importing {100 * progress.bytes_done / progress.bytes_total:.0f}% of {size(progress.bytes_total)}"


def task_views(state: State) -> list[TaskView]:
    """The tasks in flight, oldest first."""
    return [
        TaskView(
            task_id=task.task_id,
            model_id=task.ref.model_id,
            kind=task.ref.kind,
            instance_id=task.instance_id,
            status="running" if task.started else "queued",
            prompt_tokens=task.prompt_tokens,
        )
        for task in sorted(state.tasks.values(), key=lambda t: t.assigned_seq)
    ]


class EventLine(msgspec.Struct, frozen=True, kw_only=True):
    """An event as the dashboard's log and `jetshard events` show it: one line."""

    seq: int
    at_ms: int
    type: str
    gist: str


def event_line(seq: int, envelope: EventEnvelope) -> EventLine:
    event = envelope.event
    return EventLine(seq=seq, at_ms=envelope.at_ms, type=type(event).__name__, gist=gist(event))
