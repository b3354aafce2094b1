"""Commands: requests published under `jetshard.cmd.>`; the sequencer turns them into events.

Names are imperative. What a node observes (its profile, download progress, runner status) is a command
too, named `Report…`: the nodes report, the sequencer records.

Each type has one sender, and its subject says who sent it (`subjects.command_subject`): a user's command
comes through an API, a node's report names its node, the sequencer's own observations its role. NATS lets
each identity publish on its own subjects only, and the sequencer refuses a command whose body does not
belong on the subject it came on: a node's identity can speak for that node, and for nothing else.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from jetshard_schema.cards import MAX_SOURCE_REF_LENGTH, ModelCard, StorageBytes
from jetshard_schema.ids import (
    NodeId,
    ValidImportId,
    ValidInstanceId,
    ValidModelId,
    ValidNodeId,
    ValidSessionId,
    ValidTaskId,
)
from jetshard_schema.subjects import (
    API_SENDER,
    DOWNLOADER_SENDER,
    SEQUENCER_SENDER,
    WORKER_SENDER,
    command_subject,
)
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    Endpoint,
    ImportProgress,
    KeepAliveMs,
    MinNodes,
    NodeIds,
    NodeProfile,
    NodeStorage,
    RunnerReport,
    ServingSettings,
    TaskOutcome,
    TaskRef,
    TokenCount,
    Usage,
)


class _Command(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    """A user's command, which an API publishes."""

    sender: ClassVar[str] = API_SENDER

    @property
    def sender_node(self) -> NodeId | None:
        """The node whose report this is; None for commands of the cluster's own roles."""
        return None

    @property
    def subject(self) -> str:
        return command_subject(type(self).__name__, self.sender, self.sender_node)


class _SequencerCommand(_Command, frozen=True):
    """An observation of the sequencer's own (a lapsed key, a retention passed), sent to itself."""

    sender: ClassVar[str] = SEQUENCER_SENDER


class _NodeReport(_Command, frozen=True):
    """What a node's service reports about that node."""

    node_id: ValidNodeId

    @property
    def sender_node(self) -> NodeId:
        return self.node_id


class _WorkerReport(_NodeReport, frozen=True):
    sender: ClassVar[str] = WORKER_SENDER


class _DownloaderReport(_NodeReport, frozen=True):
    sender: ClassVar[str] = DOWNLOADER_SENDER


# --- nodes -------------------------------------------------------------------------------------------------


class ReportNodeProfile(_WorkerReport, frozen=True):
    session_id: ValidSessionId
    """New on every start of the node's worker: a new session of a known node is a re-join."""
    profile: NodeProfile


class ReportNodeStorage(_DownloaderReport, frozen=True):
    storage: NodeStorage


class ExpireNode(_SequencerCommand, frozen=True):
    """The sequencer's own observation that a node's liveness key lapsed."""

    node_id: ValidNodeId
    session_id: ValidSessionId


# --- model cards -------------------------------------------------------------------------------------------


class AddCustomModelCard(_Command, frozen=True):
    card: ModelCard


class DeleteCustomModelCard(_Command, frozen=True):
    model_id: ValidModelId


class ReportModelSize(_DownloaderReport, frozen=True):
    """The real total size of a model's weights, measured from its file list."""

    model_id: ValidModelId
    storage_size_bytes: StorageBytes


NodePath = Annotated[str, msgspec.Meta(max_length=MAX_SOURCE_REF_LENGTH)]
"""A file's path on a node, as long as a card's `source_ref` may be."""


class ImportModelFile(_Command, frozen=True):
    """Make a GGUF file on a node a model: that node's downloader reads its card from the header and puts it in one
    of its model directories (`model.gguf`, with `mmproj.gguf` when a projector is named)."""

    import_id: ValidImportId
    """Names this attempt: its record in State says how it went."""
    node_id: ValidNodeId
    model_id: ValidModelId
    path: Annotated[NodePath, msgspec.Meta(min_length=1)]
    """An absolute path on that node (a split model: its first part, the others beside it)."""
    mmproj_path: NodePath = ""
    replace: bool = False
    """Replace a copy already stored under this id (atomically: the old one stays until the new one is in)."""


class ReportModelImport(_DownloaderReport, frozen=True):
    """How an import on this node goes; a completed one carries the card read from the file."""

    import_id: ValidImportId
    model_id: ValidModelId
    progress: ImportProgress
    card: ModelCard | None = None


# --- downloads ---------------------------------------------------------------------------------------------


class _DownloadCommand(_Command, frozen=True):
    """A user's command about one node's download of one model."""

    model_id: ValidModelId
    node_id: ValidNodeId


class StartDownload(_DownloadCommand, frozen=True):
    start_layer: int | None = None
    end_layer: int | None = None


class CancelDownload(_DownloadCommand, frozen=True):
    """Stop a pending or ongoing download."""


class DeleteDownload(_DownloadCommand, frozen=True):
    """Delete the model's files on the node: never from a read-only directory, nor while an instance uses them."""


class ReportDownloadProgress(_DownloaderReport, frozen=True):
    model_id: ValidModelId
    progress: DownloadProgress


class ReportDownloadDeleted(_DownloaderReport, frozen=True):
    model_id: ValidModelId
    directories: tuple[str, ...] = ()


# --- instances and runners ---------------------------------------------------------------------------------


class PlaceInstance(_Command, frozen=True):
    instance_id: ValidInstanceId
    model_id: ValidModelId
    node_ids: NodeIds | None = None
    """None: placement chooses."""
    min_nodes: MinNodes = 1
    serving: ServingSettings = ServingSettings()
    keep_alive_ms: KeepAliveMs = KEEP_LOADED
    """How long it stays loaded once idle; placed by hand, it stays until removed unless this says otherwise."""


class EnsureInstance(_Command, frozen=True):
    """Auto-placement: place an instance of the model as `instance_id` unless one is alive (placed, loading or
    ready), in which case the answer names that one. Decided by the single writer, so any number of concurrent
    first requests, on any number of APIs, place one instance between them."""

    instance_id: ValidInstanceId
    model_id: ValidModelId
    serving: ServingSettings = ServingSettings()
    keep_alive_ms: KeepAliveMs = KEEP_LOADED
    """How long an instance placed for it stays loaded once idle (the API's default keep-alive)."""


class SetInstanceKeepAlive(_Command, frozen=True):
    """How long the instance stays loaded once idle, from now on (0: unload it as soon as it is idle)."""

    instance_id: ValidInstanceId
    keep_alive_ms: KeepAliveMs


class SetDefaultKeepAlive(_Command, frozen=True):
    """How long instances placed for requests from now on stay loaded once idle, on every API of the cluster;
    None: each API's own `--model-keep-alive-s`."""

    keep_alive_ms: KeepAliveMs | None


class UnloadIdleInstance(_SequencerCommand, frozen=True):
    """The sequencer's own observation that an instance has been idle past its keep-alive."""

    instance_id: ValidInstanceId


class ForgetInstance(_SequencerCommand, frozen=True):
    """The sequencer's own: a failed instance's retention ran out; its history stays in the event stream."""

    instance_id: ValidInstanceId


class DeleteInstance(_Command, frozen=True):
    instance_id: ValidInstanceId


class ReportRunnerEndpoint(_WorkerReport, frozen=True):
    instance_id: ValidInstanceId
    generation: int
    rank: int
    endpoint: Endpoint


class ReportRunnerStatus(_Command, frozen=True):
    sender: ClassVar[str] = WORKER_SENDER
    instance_id: ValidInstanceId
    generation: int
    runner: RunnerReport

    @property
    def sender_node(self) -> NodeId:
        return self.runner.node_id


# --- tasks -------------------------------------------------------------------------------------------------


class SubmitTask(_Command, frozen=True):
    task: TaskRef
    instance_id: ValidInstanceId
    """The instance its API stored the request for (under that instance's leader node): the sequencer assigns
    the task there, or refuses it (`no_capacity`) when that instance cannot take it but another could."""
    start_within_ms: int | None = None
    """How long the requester waits for the task to start: a task that could not start in that time at its
    instance's measured pace is refused (`queue_full`) instead of queued to time out."""


class ExpireRequester(_SequencerCommand, frozen=True):
    """The sequencer's own observation that an API session's liveness key lapsed: its tasks have no reader."""

    session_id: ValidSessionId


class CancelTask(_Command, frozen=True):
    task_id: ValidTaskId
    reason: str = "cancelled by the client"


class ReportTaskStarted(_WorkerReport, frozen=True):
    task_id: ValidTaskId
    instance_id: ValidInstanceId
    prompt_tokens: TokenCount


class ReportTaskFinished(_WorkerReport, frozen=True):
    task_id: ValidTaskId
    instance_id: ValidInstanceId
    outcome: TaskOutcome
    usage: Usage
    error: str = ""
    last_chunk_index: TokenCount = 0
    """The index of the task's last chunk (the one with its finish reason or error): a chunk carries a token or
    more, so there are no more chunks than tokens."""


Command = (
    ReportNodeProfile
    | ReportNodeStorage
    | ExpireNode
    | AddCustomModelCard
    | DeleteCustomModelCard
    | ReportModelSize
    | ImportModelFile
    | ReportModelImport
    | StartDownload
    | CancelDownload
    | DeleteDownload
    | ReportDownloadProgress
    | ReportDownloadDeleted
    | PlaceInstance
    | EnsureInstance
    | SetInstanceKeepAlive
    | SetDefaultKeepAlive
    | UnloadIdleInstance
    | ForgetInstance
    | DeleteInstance
    | ReportRunnerEndpoint
    | ReportRunnerStatus
    | SubmitTask
    | ExpireRequester
    | CancelTask
    | ReportTaskStarted
    | ReportTaskFinished
)
