"""State: everything the cluster knows, as a pure fold of the event stream.

`apply(state, event, seq)` never mutates: it returns a new State sharing what did not change. Only tasks
in flight are kept (a finished task lives on in the event history, not in State), so State stays small.
Each event type has its own small applier below, registered with `_fold` by the type it takes.
"""

from __future__ import annotations

import functools

import msgspec
from msgspec.structs import replace

from jetshard_schema import events
from jetshard_schema.cards import ModelCard, StorageBytes
from jetshard_schema.ids import (
    InstanceId,
    ModelId,
    NodeId,
    TaskId,
    ValidImportId,
    ValidInstanceId,
    ValidModelId,
    ValidNodeId,
    ValidSessionId,
    ValidTaskId,
)
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    DownloadStatus,
    Endpoint,
    Engine,
    ImportProgress,
    ImportStatus,
    InstanceStatus,
    NodeProfile,
    NodeStorage,
    RunnerReport,
    RunnerStatus,
    ServingSettings,
    ShardAssignment,
    TaskRef,
    engine_format,
)


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    session_id: ValidSessionId
    profile: NodeProfile
    profile_seq: int = 0
    """The event sequence at which `profile` was recorded: memory that runners took after it is not in it."""


class Download(msgspec.Struct, frozen=True, kw_only=True):
    node_id: ValidNodeId
    model_id: ValidModelId
    progress: DownloadProgress
    deleting: bool = False


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: ValidInstanceId
    model_id: ValidModelId
    shards: tuple[ShardAssignment, ...]
    serving: ServingSettings = ServingSettings()
    """As placement resolved it: the engine and weights dtype its runners use (no engine in placements recorded
    before engines: MLX)."""
    requested: ServingSettings | None = None
    """As its placement was asked for (`InstancePlaced.requested`); None before engines."""
    generation: int = 0
    """Bumped on every whole-instance restart; endpoints and runner reports belong to one generation."""
    restart_attempt: int = 0
    not_before_ms: int = 0
    endpoints: dict[int, Endpoint] = {}
    runners: dict[int, RunnerReport] = {}
    failed: bool = False
    failed_reason: str = ""
    """Why the instance failed, or why it last restarted."""
    failed_at_ms: int = 0
    ready_seq: int = 0
    """The event sequence at which every runner of this generation was ready (0: not ready)."""
    task_ms: float = 0.0
    """Its measured pace: a moving average of its tasks' time from start to finish (0 until one finished)."""
    keep_alive_ms: int = KEEP_LOADED
    """How long it stays loaded with nothing to do (`KEEP_LOADED`: until removed)."""
    idle_since_ms: int = 0
    """When it was placed, became ready, or its latest task ended (the sequencer's clock): idle from then if no
    task is in flight."""

    def unloads_at_ms(self, busy: bool) -> int | None:
        """When it unloads if nothing comes for it: None while `busy` (tasks in flight), loading, or kept loaded."""
        if busy or not self.ready_seq or self.keep_alive_ms == KEEP_LOADED:
            return None
        return self.idle_since_ms + self.keep_alive_ms

    def shard_for(self, node_id: NodeId) -> ShardAssignment | None:
        return next((s for s in self.shards if s.node_id == node_id), None)

    @property
    def num_layers(self) -> int:
        return self.shards[-1].end_layer

    @property
    def engine(self) -> Engine:
        return self.serving.engine or Engine.MLX

    @property
    def engine_chosen(self) -> bool:
        """Whether placement chose its engine (the request left it open): it may move to a faster one."""
        return self.requested is not None and self.requested.engine is None

    @property
    def leader_node(self) -> NodeId:
        """The node whose runner reads the instance's requests and publishes their output: the last rank's on MLX
        (its pipeline's steps start and end there), the first rank's on llama.cpp (its llama-server keeps the token
        embedding and reaches the other ranks' layers through llama.cpp's RPC backend)."""
        return self.shards[self.leader_rank].node_id

    @property
    def leader_rank(self) -> int:
        return 0 if self.engine is Engine.LLAMA_CPP else len(self.shards) - 1


class Task(msgspec.Struct, frozen=True, kw_only=True):
    ref: TaskRef
    """Which task, for which model, and whose (State never holds prompts)."""
    instance_id: ValidInstanceId
    assigned_seq: int = 0
    """The event sequence of its assignment: tasks start in this order."""
    generation: int = 0
    """The instance generation the task was assigned to; a restart drops the task."""
    started: bool = False
    started_at_ms: int = 0
    prompt_tokens: int = 0

    @property
    def task_id(self) -> TaskId:
        return self.ref.task_id


class ModelImport(msgspec.Struct, frozen=True, kw_only=True):
    """The latest import of a model file (`ImportModelFile`): on which node, from where, and how it went."""

    import_id: ValidImportId
    node_id: ValidNodeId
    model_id: ValidModelId
    path: str
    progress: ImportProgress


class State(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int = 0
    """Stream sequence of the last event applied."""
    last_command_seq: int = 0
    """Stream sequence (in JETSHARD_COMMANDS) of the last command whose events are applied."""
    nodes: dict[ValidNodeId, Node] = {}
    node_storage: dict[ValidNodeId, NodeStorage] = {}
    custom_cards: dict[ValidModelId, ModelCard] = {}
    measured_sizes: dict[ValidModelId, StorageBytes] = {}
    downloads: dict[ValidNodeId, dict[ValidModelId, Download]] = {}
    instances: dict[ValidInstanceId, Instance] = {}
    tasks: dict[ValidTaskId, Task] = {}
    imports: dict[ValidModelId, ModelImport] = {}
    """The latest import of each model id, kept until the next one (or the card's deletion)."""
    default_keep_alive_ms: int | None = None
    """How long instances placed for requests stay loaded once idle (`SetDefaultKeepAlive`); None: each API's
    own `--model-keep-alive-s`."""

    def download(self, node_id: NodeId, model_id: ModelId) -> Download | None:
        return self.downloads.get(node_id, {}).get(model_id)

    def unstarted_tasks(self, instance_id: InstanceId, generation: int) -> list[Task]:
        """Tasks assigned to one generation of an instance that its leader has not started, oldest first."""
        waiting = [
            t
            for t in self.tasks.values()
            if t.instance_id == instance_id and t.generation == generation and not t.started
        ]
        return sorted(waiting, key=lambda t: t.assigned_seq)


def _with(mapping: dict, key, value) -> dict:  # type: ignore[type-arg]
    return {**mapping, key: value}


def _without(mapping: dict, key) -> dict:  # type: ignore[type-arg]
    return {k: v for k, v in mapping.items() if k != key}


class EventOutOfOrderError(RuntimeError):
    """An event was offered at a stream sequence other than the one after the last applied: applying it
    would fold a history with a gap or a repeat into State."""


def _check_next(state: State, seq: int) -> None:
    if seq != state.last_seq + 1:
        raise EventOutOfOrderError(f"event at sequence {seq} does not follow the last applied, {state.last_seq}")


def apply(state: State, event: events.Event, seq: int, command_seq: int = 0) -> State:
    """Fold one event (stored at stream sequence `seq`, from the command at `command_seq`) into State.

    Raises EventOutOfOrderError unless `seq` follows `state.last_seq`: JetStream's sequences have no gap
    (the events stream denies deletes), so any other `seq` is a bug in the caller."""
    _check_next(state, seq)
    state = replace(state, last_seq=seq, last_command_seq=max(state.last_command_seq, command_seq))
    return _fold(event, state)


def skip(state: State, seq: int) -> State:
    """Pass over the event at `seq` without folding it (its type is from a newer version), keeping the order."""
    _check_next(state, seq)
    return replace(state, last_seq=seq)


@functools.singledispatch
def _fold(event: events.Event, state: State) -> State:
    raise TypeError(f"no applier for {type(event).__name__}")


@_fold.register
def _command_rejected(event: events.CommandRejected, state: State) -> State:
    return state


# --- nodes -------------------------------------------------------------------------------------------------


@_fold.register
def _node_joined(event: events.NodeJoined, state: State) -> State:
    node = Node(node_id=event.node_id, session_id=event.session_id, profile=event.profile, profile_seq=state.last_seq)
    return replace(state, nodes=_with(state.nodes, event.node_id, node))


@_fold.register
def _node_updated(event: events.NodeUpdated, state: State) -> State:
    known = state.nodes.get(event.node_id)
    if known is None:
        return state
    updated = replace(known, profile=event.profile, profile_seq=state.last_seq)
    return replace(state, nodes=_with(state.nodes, event.node_id, updated))


@_fold.register
def _node_storage_updated(event: events.NodeStorageUpdated, state: State) -> State:
    return replace(state, node_storage=_with(state.node_storage, event.node_id, event.storage))


@_fold.register
def _node_lost(event: events.NodeLost, state: State) -> State:
    return replace(
        state,
        nodes=_without(state.nodes, event.node_id),
        node_storage=_without(state.node_storage, event.node_id),
        downloads=_without(state.downloads, event.node_id),
    )


# --- model cards -------------------------------------------------------------------------------------------


@_fold.register
def _custom_model_card_added(event: events.CustomModelCardAdded, state: State) -> State:
    return replace(state, custom_cards=_with(state.custom_cards, event.card.model_id, event.card))


@_fold.register
def _custom_model_card_deleted(event: events.CustomModelCardDeleted, state: State) -> State:
    # Its downloads' records go with it: nothing can be done with a download of a model the cluster does not know
    # (the files stay on disk, and are found again if the card is added back).
    downloads = {node_id: _without(per_node, event.model_id) for node_id, per_node in state.downloads.items()}
    return replace(
        state,
        custom_cards=_without(state.custom_cards, event.model_id),
        downloads=downloads,
        imports=_without(state.imports, event.model_id),
    )


@_fold.register
def _model_import_requested(event: events.ModelImportRequested, state: State) -> State:
    record = ModelImport(
        import_id=event.import_id,
        node_id=event.node_id,
        model_id=event.model_id,
        path=event.path,
        progress=ImportProgress(status=ImportStatus.ONGOING),
    )
    return replace(state, imports=_with(state.imports, event.model_id, record))


FAILED_IMPORTS_KEPT = 16
"""Failed imports State keeps, the latest: one is news for whoever imported, and as its model id is whatever the
client named, State would otherwise grow with every failed attempt (no card comes of it to delete)."""


@_fold.register
def _model_import_progressed(event: events.ModelImportProgressed, state: State) -> State:
    known = state.imports.get(event.model_id)
    if known is None or known.import_id != event.import_id:
        return state  # an attempt a newer import replaced
    imports = {**_without(state.imports, event.model_id), event.model_id: replace(known, progress=event.progress)}
    failed = [model_id for model_id, record in imports.items() if record.progress.status is ImportStatus.FAILED]
    forgotten = set(failed[:-FAILED_IMPORTS_KEPT])
    return replace(state, imports={model_id: r for model_id, r in imports.items() if model_id not in forgotten})


@_fold.register
def _model_size_measured(event: events.ModelSizeMeasured, state: State) -> State:
    return replace(state, measured_sizes=_with(state.measured_sizes, event.model_id, event.storage_size_bytes))


# --- downloads ---------------------------------------------------------------------------------------------


def _set_download(state: State, download: Download) -> State:
    per_node = _with(state.downloads.get(download.node_id, {}), download.model_id, download)
    return replace(state, downloads=_with(state.downloads, download.node_id, per_node))


def _known_download(state: State, node_id: ValidNodeId, model_id: ValidModelId) -> Download:
    """The download State holds, or a pending one of no layers for a report that came before its request."""
    known = state.download(node_id, model_id)
    if known is None:
        return Download(node_id=node_id, model_id=model_id, progress=DownloadProgress(status=DownloadStatus.PENDING))
    return known


def _update_progress(state: State, node_id: ValidNodeId, model_id: ValidModelId, **changes: object) -> State:
    known = _known_download(state, node_id, model_id)
    return _set_download(state, replace(known, progress=replace(known.progress, **changes)))


@_fold.register
def _download_requested(event: events.DownloadRequested, state: State) -> State:
    known = state.download(event.node_id, event.model_id)
    if (
        known is not None
        and known.progress.status is DownloadStatus.COMPLETED
        and known.progress.start_layer <= event.start_layer
        and event.end_layer <= known.progress.end_layer
    ):
        return state
    progress = DownloadProgress(status=DownloadStatus.PENDING, start_layer=event.start_layer, end_layer=event.end_layer)
    return _set_download(state, Download(node_id=event.node_id, model_id=event.model_id, progress=progress))


@_fold.register
def _download_progressed(event: events.DownloadProgressed, state: State) -> State:
    known = _known_download(state, event.node_id, event.model_id)
    progress = replace(
        event.progress,
        start_layer=known.progress.start_layer,
        end_layer=known.progress.end_layer,
        read_only=known.progress.read_only,
        directory=event.progress.directory or known.progress.directory,
    )
    return _set_download(state, replace(known, progress=progress))


@_fold.register
def _download_completed(event: events.DownloadCompleted, state: State) -> State:
    return _set_download(state, Download(node_id=event.node_id, model_id=event.model_id, progress=event.progress))


@_fold.register
def _download_failed(event: events.DownloadFailed, state: State) -> State:
    return _update_progress(
        state,
        event.node_id,
        event.model_id,
        status=DownloadStatus.FAILED,
        reason=event.reason,
        speed_bytes_per_s=0.0,
        eta_s=None,
    )


@_fold.register
def _download_cancelled(event: events.DownloadCancelled, state: State) -> State:
    return _update_progress(
        state, event.node_id, event.model_id, status=DownloadStatus.CANCELLED, speed_bytes_per_s=0.0, eta_s=None
    )


@_fold.register
def _download_delete_requested(event: events.DownloadDeleteRequested, state: State) -> State:
    return _set_download(state, replace(_known_download(state, event.node_id, event.model_id), deleting=True))


@_fold.register
def _download_deleted(event: events.DownloadDeleted, state: State) -> State:
    per_node = _without(state.downloads.get(event.node_id, {}), event.model_id)
    return replace(state, downloads=_with(state.downloads, event.node_id, per_node))


# --- instances and runners ---------------------------------------------------------------------------------


def _update_instance(state: State, instance_id: InstanceId, **changes: object) -> State:
    instance = state.instances.get(instance_id)
    if instance is None:
        return state
    return replace(state, instances=_with(state.instances, instance_id, replace(instance, **changes)))


def _without_tasks_of(state: State, instance_id: InstanceId) -> State:
    return replace(state, tasks={k: t for k, t in state.tasks.items() if t.instance_id != instance_id})


def _of_generation(state: State, instance_id: InstanceId, generation: int) -> Instance | None:
    """The instance if `generation` is its current one: a runner's report of an earlier one is stale."""
    instance = state.instances.get(instance_id)
    return instance if instance is not None and instance.generation == generation else None


@_fold.register
def _instance_placed(event: events.InstancePlaced, state: State) -> State:
    instance = Instance(
        instance_id=event.instance_id,
        model_id=event.model_id,
        shards=event.shards,
        serving=event.serving,
        requested=event.requested,
        keep_alive_ms=event.keep_alive_ms,
        idle_since_ms=event.at_ms,
    )
    return replace(state, instances=_with(state.instances, event.instance_id, instance))


@_fold.register
def _default_keep_alive_set(event: events.DefaultKeepAliveSet, state: State) -> State:
    return replace(state, default_keep_alive_ms=event.keep_alive_ms)


@_fold.register
def _instance_keep_alive_set(event: events.InstanceKeepAliveSet, state: State) -> State:
    if event.instance_id not in state.instances:
        return state
    return _update_instance(state, event.instance_id, keep_alive_ms=event.keep_alive_ms, idle_since_ms=event.at_ms)


@_fold.register
def _instance_chosen(event: events.InstanceChosen, state: State) -> State:
    return state


@_fold.register
def _instance_deleted(event: events.InstanceDeleted, state: State) -> State:
    deleted = state.instances.get(event.instance_id)
    nodes = state.nodes if deleted is None else freed_by(state, deleted)
    remaining = replace(state, nodes=nodes, instances=_without(state.instances, event.instance_id))
    return _without_tasks_of(remaining, event.instance_id)


def freed_by(state: State, instance: Instance) -> dict[ValidNodeId, Node]:
    """The nodes with what their reports show `instance` taking given back, as it leaves: placement may use it at
    once, before each node reports again once the runner has stopped. Those that reported before it was ready
    showed (part of) it as free already, and placement counted it as pending instead."""
    nodes = dict(state.nodes)
    for shard in instance.shards:
        node = nodes.get(shard.node_id)
        if node is not None and report_shows(node, instance):
            nodes[shard.node_id] = replace(node, profile=node.profile.with_compute_freed(shard.memory_bytes))
    return nodes


def report_shows(node: Node, instance: Instance) -> bool:
    """Whether the node's last recorded report came once `instance` was loaded, and so shows its memory taken
    (until one does, placement counts the instance's memory as still to come)."""
    return bool(instance.ready_seq) and node.profile_seq > instance.ready_seq


@_fold.register
def _runner_endpoint_reported(event: events.RunnerEndpointReported, state: State) -> State:
    reporting = _of_generation(state, event.instance_id, event.generation)
    if reporting is None:
        return state
    endpoints = _with(reporting.endpoints, event.rank, event.endpoint)
    return _update_instance(state, event.instance_id, endpoints=endpoints)


@_fold.register
def _runner_status_changed(event: events.RunnerStatusChanged, state: State) -> State:
    changing = _of_generation(state, event.instance_id, event.generation)
    if changing is None:
        return state
    runners = _with(changing.runners, event.runner.rank, event.runner)
    loaded = all(
        runners.get(s.rank) is not None and runners[s.rank].status is RunnerStatus.READY for s in changing.shards
    )
    ready_seq = (changing.ready_seq or state.last_seq) if loaded else 0
    # Its keep-alive counts from when it could first serve: a model that took longer to load than its keep-alive
    # must not unload before the request that placed it has run.
    idle_since_ms = changing.idle_since_ms
    if loaded and not changing.ready_seq:
        idle_since_ms = max(idle_since_ms, event.at_ms)
    return _update_instance(state, event.instance_id, runners=runners, ready_seq=ready_seq, idle_since_ms=idle_since_ms)


@_fold.register
def _instance_restarting(event: events.InstanceRestarting, state: State) -> State:
    restarted = _update_instance(
        state,
        event.instance_id,
        generation=event.generation,
        restart_attempt=event.attempt,
        not_before_ms=event.not_before_ms,
        endpoints={},
        runners={},
        ready_seq=0,
        failed_reason=event.reason,
    )
    return _without_tasks_of(restarted, event.instance_id)


@_fold.register
def _instance_failed(event: events.InstanceFailed, state: State) -> State:
    failed = _update_instance(
        state,
        event.instance_id,
        failed=True,
        failed_reason=event.reason,
        failed_at_ms=event.at_ms,
        endpoints={},
        runners={},
        ready_seq=0,
    )
    return _without_tasks_of(failed, event.instance_id)


# --- tasks -------------------------------------------------------------------------------------------------


@_fold.register
def _task_assigned(event: events.TaskAssigned, state: State) -> State:
    task = Task(ref=event.task, instance_id=event.instance_id, generation=event.generation, assigned_seq=state.last_seq)
    state = replace(state, tasks=_with(state.tasks, event.task.task_id, task))
    if event.task.keep_alive_ms is None or event.instance_id not in state.instances:
        return state
    return _update_instance(state, event.instance_id, keep_alive_ms=event.task.keep_alive_ms)


@_fold.register
def _task_started(event: events.TaskStarted, state: State) -> State:
    in_flight = state.tasks.get(event.task_id)
    if in_flight is None:
        return state
    started = replace(in_flight, started=True, started_at_ms=event.at_ms, prompt_tokens=event.prompt_tokens)
    return replace(state, tasks=_with(state.tasks, event.task_id, started))


PACE_WEIGHT = 0.2
"""The weight of the latest task in an instance's measured pace: the last few tasks decide it."""


@_fold.register
def _task_finished(event: events.TaskFinished, state: State) -> State:
    task = state.tasks.get(event.task_id)
    state = _ended(state, event.task_id, event.at_ms)
    instance = state.instances.get(task.instance_id) if task is not None else None
    if task is None or instance is None or not task.started_at_ms or event.at_ms < task.started_at_ms:
        return state  # not started, or recorded before events carried their times: nothing to measure
    took_ms = event.at_ms - task.started_at_ms
    pace = took_ms if not instance.task_ms else (1 - PACE_WEIGHT) * instance.task_ms + PACE_WEIGHT * took_ms
    return _update_instance(state, instance.instance_id, task_ms=pace)


@_fold.register
def _task_cancelled(event: events.TaskCancelled, state: State) -> State:
    return _ended(state, event.task_id, event.at_ms)


def _ended(state: State, task_id: TaskId, at_ms: int) -> State:
    """`state` without the task, its instance idle from `at_ms` on if nothing else is in flight for it."""
    task = state.tasks.get(task_id)
    state = replace(state, tasks=_without(state.tasks, task_id))
    instance = state.instances.get(task.instance_id) if task is not None else None
    if instance is None or at_ms <= instance.idle_since_ms:
        return state
    return _update_instance(state, instance.instance_id, idle_since_ms=at_ms)


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
        if download is None or not download.progress.holds(engine_format(instance.serving.engine)):
            return InstanceStatus.DOWNLOADING
    return InstanceStatus.WAITING


def ready_instances(state: State, model_id: ModelId | None = None) -> list[Instance]:
    """The instances of `model_id` (of every model if None) that can take a task now, in instance id order: the
    ones the API waits for and the sequencer assigns tasks to."""
    return sorted(
        (
            i
            for i in state.instances.values()
            if model_id in (None, i.model_id) and instance_status(state, i) is InstanceStatus.READY
        ),
        key=lambda i: i.instance_id,
    )


def ready_models(state: State) -> set[ModelId]:
    """The models that can take a task now, as lists and error messages name them."""
    return {i.model_id for i in ready_instances(state)}
