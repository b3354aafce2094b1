"""Commands: requests anyone may publish under `jetshard.cmd.>`; the sequencer turns them into events.

Names are imperative. What a node observes (its profile, download progress, runner status) is a command
too, named `Report…`: the nodes report, the sequencer records.
"""

from __future__ import annotations

import msgspec

from jetshard_schema.cards import ModelCard
from jetshard_schema.ids import ValidInstanceId, ValidModelId, ValidNodeId, ValidSessionId, ValidTaskId
from jetshard_schema.subjects import command_subject
from jetshard_schema.types import (
    DownloadProgress,
    Endpoint,
    NodeProfile,
    NodeStorage,
    RunnerReport,
    ServingSettings,
    TaskOutcome,
    TaskRef,
    Usage,
)


class _Command(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    @property
    def subject(self) -> str:
        return command_subject(type(self).__name__)


# --- nodes -------------------------------------------------------------------------------------------------


class ReportNodeProfile(_Command, frozen=True):
    node_id: ValidNodeId
    session_id: ValidSessionId
    """New on every start of the node's worker: a new session of a known node is a re-join."""
    profile: NodeProfile


class ReportNodeStorage(_Command, frozen=True):
    node_id: ValidNodeId
    storage: NodeStorage


class ExpireNode(_Command, frozen=True):
    """The sequencer's own observation that a node's liveness key lapsed."""

    node_id: ValidNodeId
    session_id: ValidSessionId


# --- model cards -------------------------------------------------------------------------------------------


class AddCustomModelCard(_Command, frozen=True):
    card: ModelCard


class DeleteCustomModelCard(_Command, frozen=True):
    model_id: ValidModelId


class ReportModelSize(_Command, frozen=True):
    """The real total size of a model's weights, measured from its file list."""

    model_id: ValidModelId
    storage_size_bytes: int


# --- downloads ---------------------------------------------------------------------------------------------


class StartDownload(_Command, frozen=True):
    model_id: ValidModelId
    node_id: ValidNodeId
    start_layer: int | None = None
    end_layer: int | None = None


class CancelDownload(_Command, frozen=True):
    model_id: ValidModelId
    node_id: ValidNodeId


class DeleteDownload(_Command, frozen=True):
    model_id: ValidModelId
    node_id: ValidNodeId


class ReportDownloadProgress(_Command, frozen=True):
    model_id: ValidModelId
    node_id: ValidNodeId
    progress: DownloadProgress


class ReportDownloadDeleted(_Command, frozen=True):
    model_id: ValidModelId
    node_id: ValidNodeId
    directories: tuple[str, ...] = ()


# --- instances and runners ---------------------------------------------------------------------------------


class PlaceInstance(_Command, frozen=True):
    instance_id: ValidInstanceId
    model_id: ValidModelId
    node_ids: tuple[ValidNodeId, ...] | None = None
    min_nodes: int = 1
    serving: ServingSettings = ServingSettings()


class EnsureInstance(_Command, frozen=True):
    """Auto-placement: place an instance of the model as `instance_id` unless one is alive (placed, loading or
    ready), in which case the answer names that one. Decided by the single writer, so any number of concurrent
    first requests, on any number of APIs, place one instance between them."""

    instance_id: ValidInstanceId
    model_id: ValidModelId
    serving: ServingSettings = ServingSettings()


class ForgetInstance(_Command, frozen=True):
    """The sequencer's own: a failed instance's retention ran out; its history stays in the event stream."""

    instance_id: ValidInstanceId


class DeleteInstance(_Command, frozen=True):
    instance_id: ValidInstanceId


class ReportRunnerEndpoint(_Command, frozen=True):
    instance_id: ValidInstanceId
    generation: int
    node_id: ValidNodeId
    rank: int
    endpoint: Endpoint


class ReportRunnerStatus(_Command, frozen=True):
    instance_id: ValidInstanceId
    generation: int
    runner: RunnerReport


# --- tasks -------------------------------------------------------------------------------------------------


class SubmitTask(_Command, frozen=True):
    task: TaskRef
    start_within_ms: int | None = None
    """How long the requester waits for the task to start: a task that could not start in that time at its
    instance's measured pace is refused (`queue_full`) instead of queued to time out."""


class ExpireRequester(_Command, frozen=True):
    """The sequencer's own observation that an API session's liveness key lapsed: its tasks have no reader."""

    session_id: ValidSessionId


class CancelTask(_Command, frozen=True):
    task_id: ValidTaskId
    reason: str = "cancelled by the client"


class ReportTaskStarted(_Command, frozen=True):
    task_id: ValidTaskId
    instance_id: ValidInstanceId
    prompt_tokens: int


class ReportTaskFinished(_Command, frozen=True):
    task_id: ValidTaskId
    instance_id: ValidInstanceId
    outcome: TaskOutcome
    usage: Usage
    error: str = ""
    last_chunk_index: int = 0
    """The index of the task's last chunk (the one with its finish reason or error)."""


Command = (
    ReportNodeProfile
    | ReportNodeStorage
    | ExpireNode
    | AddCustomModelCard
    | DeleteCustomModelCard
    | ReportModelSize
    | StartDownload
    | CancelDownload
    | DeleteDownload
    | ReportDownloadProgress
    | ReportDownloadDeleted
    | PlaceInstance
    | EnsureInstance
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
