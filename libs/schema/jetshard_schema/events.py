"""Events: facts, in past tense, appended by the sequencer alone under `jetshard.evt.>`.

On the wire each event travels in an `EventEnvelope` that records the command it came from, so a
sequencer taking over knows which commands already have their outcome.
"""

from __future__ import annotations

import msgspec

from jetshard_schema.cards import ModelCard, StorageBytes
from jetshard_schema.ids import (
    ValidCommandId,
    ValidImportId,
    ValidInstanceId,
    ValidModelId,
    ValidNodeId,
    ValidSessionId,
    ValidTaskId,
)
from jetshard_schema.subjects import event_subject
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    Endpoint,
    ImportProgress,
    NodeProfile,
    NodeStorage,
    RejectCode,
    RunnerReport,
    ServingSettings,
    ShardAssignment,
    TaskOutcome,
    TaskRef,
    Usage,
)


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    @property
    def subject(self) -> str:
        return event_subject(type(self).__name__)


class CommandRejected(_Event, frozen=True):
    command_type: str
    code: RejectCode
    reason: str
    """What went wrong and what to do about it, for a person."""
    retry_after_s: int | None = None
    """When a retry may succeed (a full queue): the API's `Retry-After`."""


# --- nodes -------------------------------------------------------------------------------------------------


class NodeJoined(_Event, frozen=True):
    node_id: ValidNodeId
    session_id: ValidSessionId
    profile: NodeProfile


class NodeUpdated(_Event, frozen=True):
    node_id: ValidNodeId
    profile: NodeProfile


class NodeStorageUpdated(_Event, frozen=True):
    node_id: ValidNodeId
    storage: NodeStorage


class NodeLost(_Event, frozen=True):
    node_id: ValidNodeId
    reason: str


# --- model cards -------------------------------------------------------------------------------------------


class CustomModelCardAdded(_Event, frozen=True):
    card: ModelCard


class CustomModelCardDeleted(_Event, frozen=True):
    model_id: ValidModelId


class ModelImportRequested(_Event, frozen=True):
    import_id: ValidImportId
    node_id: ValidNodeId
    model_id: ValidModelId
    path: str
    mmproj_path: str = ""
    replace: bool = False


class ModelImportProgressed(_Event, frozen=True):
    """An import went on, completed or failed (a completed one's card comes as `CustomModelCardAdded`)."""

    import_id: ValidImportId
    node_id: ValidNodeId
    model_id: ValidModelId
    progress: ImportProgress


class ModelSizeMeasured(_Event, frozen=True):
    model_id: ValidModelId
    storage_size_bytes: StorageBytes


# --- downloads ---------------------------------------------------------------------------------------------


class _DownloadEvent(_Event, frozen=True):
    """About one node's download of one model: State keeps downloads by node, then model."""

    node_id: ValidNodeId
    model_id: ValidModelId


class DownloadRequested(_DownloadEvent, frozen=True):
    start_layer: int
    end_layer: int


class DownloadProgressed(_DownloadEvent, frozen=True):
    """Still pending or ongoing. State keeps the requested layer range and the directory already known."""

    progress: DownloadProgress


class DownloadCompleted(_DownloadEvent, frozen=True):
    progress: DownloadProgress


class DownloadFailed(_DownloadEvent, frozen=True):
    reason: str


class DownloadCancelled(_DownloadEvent, frozen=True):
    """Asked to stop: the node's downloader stops it, and its report says once it has."""


class DownloadDeleteRequested(_DownloadEvent, frozen=True):
    """The model's files on the node are to be deleted: State marks the download as deleting."""


class DownloadDeleted(_DownloadEvent, frozen=True):
    """The node's downloader deleted the files: State forgets the download."""


# --- instances and runners ---------------------------------------------------------------------------------


class InstancePlaced(_Event, frozen=True):
    instance_id: ValidInstanceId
    model_id: ValidModelId
    shards: tuple[ShardAssignment, ...]
    serving: ServingSettings = ServingSettings()
    """As placement resolved it: the engine and weights dtype the runners use."""
    requested: ServingSettings | None = None
    """As the placement was asked for, before placement resolved it (an engine left open, `weights` AUTO): an
    instance whose engine placement chose moves to a faster one when its nodes gain it. None in events recorded
    before engines."""
    keep_alive_ms: int = KEEP_LOADED
    """How long it stays loaded once idle (`KEEP_LOADED`: until removed)."""
    at_ms: int = 0
    """When it was placed (the sequencer's clock): it is idle from then until its first task."""


class DefaultKeepAliveSet(_Event, frozen=True):
    keep_alive_ms: int | None
    """None: each API's own."""


class InstanceKeepAliveSet(_Event, frozen=True):
    instance_id: ValidInstanceId
    keep_alive_ms: int
    at_ms: int
    """From when the instance counts as idle, if it has no task."""


class InstanceChosen(_Event, frozen=True):
    """The answer to an `EnsureInstance` when an instance of the model is alive already: that one serves."""

    instance_id: ValidInstanceId
    model_id: ValidModelId


class InstanceDeleted(_Event, frozen=True):
    instance_id: ValidInstanceId
    reason: str


class _GenerationEvent(_Event, frozen=True):
    """About one generation of an instance's runners (a whole-instance restart begins the next)."""

    instance_id: ValidInstanceId
    generation: int


class RunnerEndpointReported(_GenerationEvent, frozen=True):
    node_id: ValidNodeId
    rank: int
    endpoint: Endpoint


class RunnerStatusChanged(_GenerationEvent, frozen=True):
    runner: RunnerReport
    at_ms: int = 0
    """The sequencer's clock: when the last rank is ready, the instance is idle from then (0 in records from before
    this field)."""


class InstanceRestarting(_GenerationEvent, frozen=True):
    """Every rank stops; runners start again for `generation` no earlier than `not_before_ms`."""

    attempt: int
    not_before_ms: int
    reason: str


class InstanceFailed(_Event, frozen=True):
    instance_id: ValidInstanceId
    reason: str
    at_ms: int = 0
    """When it failed (the sequencer's clock): State keeps a failed instance for a retention after this."""


# --- tasks -------------------------------------------------------------------------------------------------


class TaskAssigned(_Event, frozen=True):
    task: TaskRef
    instance_id: ValidInstanceId
    generation: int


class TaskStarted(_Event, frozen=True):
    task_id: ValidTaskId
    prompt_tokens: int
    at_ms: int = 0
    """When its start was recorded (the sequencer's clock), for the instance's measured pace."""


class TaskFinished(_Event, frozen=True):
    task_id: ValidTaskId
    outcome: TaskOutcome
    usage: Usage
    error: str = ""
    last_chunk_index: int = 0
    """The index of the task's last chunk: chunks travel apart from events, so a client that has not seen
    that chunk yet knows more are on their way."""
    at_ms: int = 0
    """When its end was recorded (the sequencer's clock), for the instance's measured pace."""


class TaskCancelled(_Event, frozen=True):
    task_id: ValidTaskId
    reason: str
    at_ms: int = 0
    """When it was cancelled (the sequencer's clock): its instance is idle from then, if nothing else runs."""


Event = (
    CommandRejected
    | NodeJoined
    | NodeUpdated
    | NodeStorageUpdated
    | NodeLost
    | CustomModelCardAdded
    | CustomModelCardDeleted
    | ModelSizeMeasured
    | ModelImportRequested
    | ModelImportProgressed
    | DownloadRequested
    | DownloadProgressed
    | DownloadCompleted
    | DownloadFailed
    | DownloadCancelled
    | DownloadDeleteRequested
    | DownloadDeleted
    | InstancePlaced
    | InstanceChosen
    | InstanceKeepAliveSet
    | DefaultKeepAliveSet
    | InstanceDeleted
    | RunnerEndpointReported
    | RunnerStatusChanged
    | InstanceRestarting
    | InstanceFailed
    | TaskAssigned
    | TaskStarted
    | TaskFinished
    | TaskCancelled
)


class _Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """Where an event stands: `index`/`count`: its place among its command's events."""

    command_id: ValidCommandId
    command_seq: int
    """Stream sequence of the command in JETSHARD_COMMANDS; a new leader resumes after the last one."""
    index: int
    count: int
    at_ms: int


class EventEnvelope(_Envelope, frozen=True, kw_only=True):
    """What is stored in JETSHARD_EVENTS."""

    event: Event


class RawEventEnvelope(_Envelope, frozen=True, kw_only=True):
    """The envelope with its event left undecoded, so an event type from a newer version can be skipped."""

    event: msgspec.Raw
