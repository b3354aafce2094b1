"""State: everything the cluster knows, as a pure fold of the event stream.

`apply(state, event, seq)` never mutates: it returns a new State sharing what did not change. Only tasks
in flight are kept (a finished task lives on in the event history, not in State), so State stays small.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from jetshard_schema.cards import ModelCard
from jetshard_schema.events import (
    CommandRejected,
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadCancelled,
    DownloadCompleted,
    DownloadDeleted,
    DownloadDeleteRequested,
    DownloadFailed,
    DownloadProgressed,
    DownloadRequested,
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstancePlaced,
    InstanceRestarting,
    ModelSizeMeasured,
    NodeJoined,
    NodeLost,
    NodeStorageUpdated,
    NodeUpdated,
    RunnerEndpointReported,
    RunnerStatusChanged,
    TaskAssigned,
    TaskCancelled,
    TaskFinished,
    TaskStarted,
)
from jetshard_schema.ids import (
    InstanceId,
    ModelId,
    NodeId,
    TaskId,
    ValidInstanceId,
    ValidModelId,
    ValidNodeId,
    ValidSessionId,
    ValidTaskId,
)
from jetshard_schema.types import (
    DownloadStatus,
    InstanceStatus,
    NodeProfile,
    NodeStorage,
    RunnerStatus,
    ShardAssignment,
    TaskRef,
)


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    session_id: ValidSessionId
    profile: NodeProfile


class Download(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    model_id: ValidModelId
    status: DownloadStatus
    start_layer: int
    end_layer: int
    bytes_done: int = 0
    bytes_total: int = 0
    speed_bytes_per_s: float = 0.0
    eta_s: float | None = None
    directory: str = ""
    read_only: bool = False
    reason: str = ""
    attempt: int = 0
    """Retries so far after errors mid-transfer, of at most `max_attempts`."""
    max_attempts: int = 0
    deleting: bool = False


class Endpoint(msgspec.Struct, frozen=True):
    host: str
    port: int


class Runner(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    rank: int
    worker_session: str
    status: RunnerStatus
    layers_loaded: int = 0
    layers_total: int = 0
    reason: str = ""
    loaded_tensors: tuple[str, ...] = ()


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: ValidInstanceId
    model_id: ValidModelId
    shards: tuple[ShardAssignment, ...]
    generation: int = 0
    """Bumped on every whole-instance restart; endpoints and runner reports belong to one generation."""
    restart_attempt: int = 0
    not_before_ms: int = 0
    endpoints: dict[int, Endpoint] = {}
    runners: dict[int, Runner] = {}
    failed: bool = False
    failed_reason: str = ""
    """Why the instance failed, or why it last restarted."""

    def shard_for(self, node_id: NodeId) -> ShardAssignment | None:
        return next((s for s in self.shards if s.node_id == node_id), None)

    @property
    def num_layers(self) -> int:
        return self.shards[-1].end_layer


class Task(msgspec.Struct, frozen=True, kw_only=True):
    ref: TaskRef
    """Which task, for which model, and where its request is (State never holds prompts)."""
    instance_id: ValidInstanceId
    generation: int = 0
    """The instance generation the task was assigned to; a restart drops the task."""
    started: bool = False
    prompt_tokens: int = 0

    @property
    def task_id(self) -> TaskId:
        return self.ref.task_id


class State(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int = 0
    """Stream sequence of the last event applied."""
    last_command_seq: int = 0
    """Stream sequence (in JETSHARD_COMMANDS) of the last command whose events are applied."""
    nodes: dict[ValidNodeId, Node] = {}
    node_storage: dict[ValidNodeId, NodeStorage] = {}
    custom_cards: dict[ValidModelId, ModelCard] = {}
    measured_sizes: dict[ValidModelId, int] = {}
    downloads: dict[ValidNodeId, dict[ValidModelId, Download]] = {}
    instances: dict[ValidInstanceId, Instance] = {}
    tasks: dict[ValidTaskId, Task] = {}

    def download(self, node_id: NodeId, model_id: ModelId) -> Download | None:
        return self.downloads.get(node_id, {}).get(model_id)

    def unstarted_tasks(self, instance_id: InstanceId, generation: int) -> list[Task]:
        """Tasks assigned to one generation of an instance that its leader has not started, oldest first."""
        waiting = [
            t
            for t in self.tasks.values()
            if t.instance_id == instance_id and t.generation == generation and not t.started
        ]
        return sorted(waiting, key=lambda t: t.ref.request_seq)


def _with(mapping: dict, key, value) -> dict:  # type: ignore[type-arg]
    return {**mapping, key: value}


def _without(mapping: dict, key) -> dict:  # type: ignore[type-arg]
    return {k: v for k, v in mapping.items() if k != key}


def _set_download(state: State, download: Download) -> State:
    per_node = _with(state.downloads.get(download.node_id, {}), download.model_id, download)
    return replace(state, downloads=_with(state.downloads, download.node_id, per_node))


def _update_download(state: State, node_id: NodeId, model_id: ModelId, **changes: object) -> State:
    current = state.download(node_id, model_id)
    if current is None:
        current = Download(
            node_id=node_id, model_id=model_id, status=DownloadStatus.PENDING, start_layer=0, end_layer=0
        )
    return _set_download(state, replace(current, **changes))


def _update_instance(state: State, instance_id: InstanceId, **changes: object) -> State:
    instance = state.instances.get(instance_id)
    if instance is None:
        return state
    return replace(state, instances=_with(state.instances, instance_id, replace(instance, **changes)))


def apply(state: State, event: Event, seq: int, command_seq: int = 0) -> State:
    """Fold one event (stored at stream sequence `seq`, from the command at `command_seq`) into State."""
    state = replace(state, last_seq=seq, last_command_seq=max(state.last_command_seq, command_seq))
    match event:
        case CommandRejected():
            return state
        case NodeJoined(node_id=node_id, session_id=session_id, profile=profile):
            node = Node(node_id=node_id, session_id=session_id, profile=profile)
            return replace(state, nodes=_with(state.nodes, node_id, node))
        case NodeUpdated(node_id=node_id, profile=profile):
            known = state.nodes.get(node_id)
            if known is None:
                return state
            return replace(state, nodes=_with(state.nodes, node_id, replace(known, profile=profile)))
        case NodeStorageUpdated(node_id=node_id, storage=storage):
            return replace(state, node_storage=_with(state.node_storage, node_id, storage))
        case NodeLost(node_id=node_id):
            return replace(
                state,
                nodes=_without(state.nodes, node_id),
                node_storage=_without(state.node_storage, node_id),
                downloads=_without(state.downloads, node_id),
            )
        case CustomModelCardAdded(card=card):
            return replace(state, custom_cards=_with(state.custom_cards, card.model_id, card))
        case CustomModelCardDeleted(model_id=model_id):
            return replace(state, custom_cards=_without(state.custom_cards, model_id))
        case ModelSizeMeasured(model_id=model_id, storage_size_bytes=size):
            return replace(state, measured_sizes=_with(state.measured_sizes, model_id, size))
        case DownloadRequested(node_id=node_id, model_id=model_id, start_layer=start, end_layer=end):
            existing = state.download(node_id, model_id)
            if (
                existing is not None
                and existing.status is DownloadStatus.COMPLETED
                and (existing.start_layer <= start and end <= existing.end_layer)
            ):
                return state
            return _set_download(
                state,
                Download(
                    node_id=node_id,
                    model_id=model_id,
                    status=DownloadStatus.PENDING,
                    start_layer=start,
                    end_layer=end,
                ),
            )
        case DownloadProgressed(node_id=node_id, model_id=model_id, pending=pending) as progressed:
            return _update_download(
                state,
                node_id,
                model_id,
                status=DownloadStatus.PENDING if pending else DownloadStatus.ONGOING,
                bytes_done=progressed.bytes_done,
                bytes_total=progressed.bytes_total,
                speed_bytes_per_s=progressed.speed_bytes_per_s,
                eta_s=progressed.eta_s,
                directory=progressed.directory
                or (existing.directory if (existing := state.download(node_id, model_id)) else ""),
                reason=progressed.reason,
                attempt=progressed.attempt,
                max_attempts=progressed.max_attempts,
            )
        case DownloadCompleted(node_id=node_id, model_id=model_id) as completed:
            return _set_download(
                state,
                Download(
                    node_id=node_id,
                    model_id=model_id,
                    status=DownloadStatus.COMPLETED,
                    start_layer=completed.start_layer,
                    end_layer=completed.end_layer,
                    bytes_done=completed.bytes_total,
                    bytes_total=completed.bytes_total,
                    directory=completed.directory,
                    read_only=completed.read_only,
                ),
            )
        case DownloadFailed(node_id=node_id, model_id=model_id, reason=reason):
            return _update_download(
                state, node_id, model_id, status=DownloadStatus.FAILED, reason=reason, speed_bytes_per_s=0.0, eta_s=None
            )
        case DownloadCancelled(node_id=node_id, model_id=model_id):
            return _update_download(
                state, node_id, model_id, status=DownloadStatus.CANCELLED, speed_bytes_per_s=0.0, eta_s=None
            )
        case DownloadDeleteRequested(node_id=node_id, model_id=model_id):
            return _update_download(state, node_id, model_id, deleting=True)
        case DownloadDeleted(node_id=node_id, model_id=model_id):
            per_node = _without(state.downloads.get(node_id, {}), model_id)
            return replace(state, downloads=_with(state.downloads, node_id, per_node))
        case InstancePlaced(instance_id=instance_id, model_id=model_id, shards=shards):
            instance = Instance(instance_id=instance_id, model_id=model_id, shards=shards)
            return replace(state, instances=_with(state.instances, instance_id, instance))
        case InstanceDeleted(instance_id=instance_id):
            return replace(
                state,
                instances=_without(state.instances, instance_id),
                tasks={k: t for k, t in state.tasks.items() if t.instance_id != instance_id},
            )
        case RunnerEndpointReported(instance_id=instance_id, generation=generation) as reported:
            reporting = state.instances.get(instance_id)
            if reporting is None or reporting.generation != generation:
                return state
            endpoints = _with(reporting.endpoints, reported.rank, Endpoint(reported.host, reported.port))
            return _update_instance(state, instance_id, endpoints=endpoints)
        case RunnerStatusChanged(instance_id=instance_id, generation=generation) as changed:
            changing = state.instances.get(instance_id)
            if changing is None or changing.generation != generation:
                return state
            runner = Runner(
                node_id=changed.node_id,
                rank=changed.rank,
                worker_session=changed.worker_session,
                status=changed.status,
                layers_loaded=changed.layers_loaded,
                layers_total=changed.layers_total,
                reason=changed.reason,
                loaded_tensors=changed.loaded_tensors,
            )
            return _update_instance(state, instance_id, runners=_with(changing.runners, changed.rank, runner))
        case InstanceRestarting(instance_id=instance_id) as restarting:
            return replace(
                _update_instance(
                    state,
                    instance_id,
                    generation=restarting.generation,
                    restart_attempt=restarting.attempt,
                    not_before_ms=restarting.not_before_ms,
                    endpoints={},
                    runners={},
                    failed_reason=restarting.reason,
                ),
                tasks={k: t for k, t in state.tasks.items() if t.instance_id != instance_id},
            )
        case InstanceFailed(instance_id=instance_id, reason=reason):
            return replace(
                _update_instance(state, instance_id, failed=True, failed_reason=reason, endpoints={}, runners={}),
                tasks={k: t for k, t in state.tasks.items() if t.instance_id != instance_id},
            )
        case TaskAssigned(task=ref, instance_id=instance_id, generation=generation):
            task = Task(ref=ref, instance_id=instance_id, generation=generation)
            return replace(state, tasks=_with(state.tasks, ref.task_id, task))
        case TaskStarted(task_id=task_id, prompt_tokens=prompt_tokens):
            in_flight = state.tasks.get(task_id)
            if in_flight is None:
                return state
            started = replace(in_flight, started=True, prompt_tokens=prompt_tokens)
            return replace(state, tasks=_with(state.tasks, task_id, started))
        case TaskFinished(task_id=task_id) | TaskCancelled(task_id=task_id):
            return replace(state, tasks=_without(state.tasks, task_id))
    return state


def instance_status(state: State, instance: Instance) -> InstanceStatus:
    """The instance as a user sees it: the least advanced of its shards decides."""
    if instance.failed:
        return InstanceStatus.FAILED
    runners = [instance.runners.get(shard.rank) for shard in instance.shards]
    if all(r is not None and r.status is RunnerStatus.READY for r in runners):
        return InstanceStatus.READY
    if any(r is not None and r.status is RunnerStatus.LOADING for r in runners):
        return InstanceStatus.LOADING
    if instance.restart_attempt and not instance.runners:
        return InstanceStatus.RESTARTING
    for shard in instance.shards:
        download = state.download(shard.node_id, instance.model_id)
        if download is None or download.status is not DownloadStatus.COMPLETED:
            return InstanceStatus.DOWNLOADING
    return InstanceStatus.WAITING
