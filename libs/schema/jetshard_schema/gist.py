"""One readable line per event: what `jetshard events` prints and the dashboard's event log shows.

The gist names the ids and the figures a person looks for, and leaves out what would flood a terminal (a
card's every field, a runner's list of loaded tensors); `jetshard events --json` has the whole envelope.
"""

from __future__ import annotations

import functools

from jetshard_schema import events
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    DownloadStatus,
    ImportStatus,
    NodeProfile,
    RunnerReport,
    ShardAssignment,
)

REASON_CHARS = 160
"""A reason is cut here: a traceback's last line is what a person needs from a one-line log."""


@functools.singledispatch
def gist(event: events.Event) -> str:
    """The event as one line, without its type name (the caller shows that apart). Each event type has a
    function below, registered by the type (or the union of types) it takes."""
    raise TypeError(f"no gist for {type(event).__name__}")


def size(n_bytes: float) -> str:
    """Bytes in the largest decimal unit that keeps the figure at least 1 (`1.5 GB`), as disks and the Hub
    count them: the one way every command and the dashboard show a size."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n_bytes) < 1000:
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.1f} TB"


def short(reason: str) -> str:
    """A reason on one line, cut to REASON_CHARS: of several lines (a traceback), the last says what failed."""
    lines = [line for line in reason.splitlines() if line.strip()]
    line = " ".join(lines[-1].split()) if lines else ""
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 1] + "…"


def layers(start: int, end: int) -> str:
    return f"layers [{start}, {end})"


def shard_layers(shard: ShardAssignment) -> str:
    """What a shard holds, for a person: "[0, 12)", or "[0, 24) tensor rank 1" for a slice of every layer."""
    held = f"[{shard.start_layer}, {shard.end_layer})"
    return held if shard.tensor_rank is None else f"{held} tensor rank {shard.tensor_rank}"


def _profile(profile: NodeProfile) -> str:
    memory = f"{size(profile.memory_available_bytes)} free of {size(profile.memory_total_bytes)}"
    return f"{profile.hostname}, {profile.accelerator}, {profile.cpu_cores} cores, {memory}"


def _progress(progress: DownloadProgress) -> str:
    figures = f"{size(progress.bytes_done)} of {size(progress.bytes_total)}"
    if progress.status is DownloadStatus.ONGOING and progress.speed_bytes_per_s:
        figures += f" at {size(progress.speed_bytes_per_s)}/s"
    if progress.attempt:
        figures += f", retry {progress.attempt} of {progress.max_attempts}"
    return figures


def _runner(runner: RunnerReport) -> str:
    text = f"{runner.node_id} rank {runner.rank} {runner.status}"
    if runner.layers_total and runner.layers_loaded < runner.layers_total:
        text += f" ({runner.layers_loaded}/{runner.layers_total} layers)"
    if runner.weights_dtype:
        text += f", weights {runner.weights_dtype}"
    if runner.counters is not None:
        text += f", {runner.counters.tokens} tokens served, {runner.counters.prefix_hits} prefix hits"
    return text + (f": {short(runner.reason)}" if runner.reason else "")


@gist.register
def _command_rejected(event: events.CommandRejected) -> str:
    return f"{event.command_type} refused ({event.code}): {short(event.reason)}"


@gist.register
def _node_joined(event: events.NodeJoined) -> str:
    return f"{event.node_id} joined: {_profile(event.profile)}"


@gist.register
def _node_updated(event: events.NodeUpdated) -> str:
    return f"{event.node_id}: {_profile(event.profile)}"


@gist.register
def _node_storage_updated(event: events.NodeStorageUpdated) -> str:
    storage = event.storage
    free = sum(d.free_bytes for d in storage.model_dirs if not d.read_only)
    dirs, models = len(storage.model_dirs), len(storage.available_models)
    text = f"{event.node_id}: {dirs} model dir{'s' * (dirs != 1)}, {size(free)} free to write"
    text += f", {models} model{'s' * (models != 1)} on disk"
    return text + (", offline" if storage.offline else "")


@gist.register
def _node_lost(event: events.NodeLost) -> str:
    return f"{event.node_id} lost: {short(event.reason)}"


@gist.register
def _card_added(event: events.CustomModelCardAdded) -> str:
    card = event.card
    return f"{card.model_id}: {card.architecture}, {card.num_layers} layers, {size(card.storage_size_bytes)}"


@gist.register
def _card_deleted(event: events.CustomModelCardDeleted) -> str:
    return str(event.model_id)


@gist.register
def _size_measured(event: events.ModelSizeMeasured) -> str:
    return f"{event.model_id}: {size(event.storage_size_bytes)}"


@gist.register
def _import_requested(event: events.ModelImportRequested) -> str:
    return f"{event.model_id} on {event.node_id} from {short(event.path)}"


@gist.register
def _import_progressed(event: events.ModelImportProgressed) -> str:
    progress = event.progress
    if progress.status is ImportStatus.FAILED:
        return f"{event.model_id} on {event.node_id}: failed: {short(progress.reason)}"
    if progress.status is ImportStatus.COMPLETED:
        return f"{event.model_id} on {event.node_id}: {size(progress.bytes_total)} in {progress.directory}"
    return f"{event.model_id} on {event.node_id}: {size(progress.bytes_done)} of {size(progress.bytes_total)}"


@gist.register
def _download_requested(event: events.DownloadRequested) -> str:
    return f"{event.model_id} on {event.node_id}, {layers(event.start_layer, event.end_layer)}"


@gist.register
def _download_progressed(event: events.DownloadProgressed) -> str:
    return f"{event.model_id} on {event.node_id}: {_progress(event.progress)}"


@gist.register
def _download_completed(event: events.DownloadCompleted) -> str:
    return f"{event.model_id} on {event.node_id}: {size(event.progress.bytes_total)} in {event.progress.directory}"


@gist.register
def _download_failed(event: events.DownloadFailed) -> str:
    return f"{event.model_id} on {event.node_id}: {short(event.reason)}"


@gist.register
def _which_download(event: events.DownloadCancelled | events.DownloadDeleteRequested | events.DownloadDeleted) -> str:
    return f"{event.model_id} on {event.node_id}"


@gist.register
def _instance_placed(event: events.InstancePlaced) -> str:
    shards = ", ".join(f"{s.node_id} layers {shard_layers(s)}" for s in event.shards)
    engine = event.serving.engine or "mlx"
    return f"{event.instance_id} of {event.model_id} on {shards}; {engine}, max batch {event.serving.max_batch}"


@gist.register
def _keep_alive_set(event: events.InstanceKeepAliveSet) -> str:
    return f"{event.instance_id} stays loaded {keep_alive(event.keep_alive_ms)}"


@gist.register
def _default_keep_alive_set(event: events.DefaultKeepAliveSet) -> str:
    if event.keep_alive_ms is None:
        return "instances placed for requests stay loaded as each API says"
    return f"instances placed for requests stay loaded {keep_alive(event.keep_alive_ms)}"


def keep_alive(keep_alive_ms: int) -> str:
    """A keep-alive for a person: "until removed", or how long once idle."""
    if keep_alive_ms == KEEP_LOADED:
        return "until removed"
    return f"{keep_alive_ms / 1000:g} s once idle"


@gist.register
def _instance_chosen(event: events.InstanceChosen) -> str:
    return f"{event.instance_id} serves {event.model_id}: it was placed already"


@gist.register
def _endpoint_reported(event: events.RunnerEndpointReported) -> str:
    return f"{event.instance_id} rank {event.rank} on {event.node_id} at {event.endpoint.host}:{event.endpoint.port}"


@gist.register
def _runner_status(event: events.RunnerStatusChanged) -> str:
    return f"{event.instance_id}: {_runner(event.runner)}"


@gist.register
def _instance_restarting(event: events.InstanceRestarting) -> str:
    return f"{event.instance_id} attempt {event.attempt}: {short(event.reason)}"


@gist.register
def _instance_ended(event: events.InstanceDeleted | events.InstanceFailed) -> str:
    return f"{event.instance_id}: {short(event.reason)}"


@gist.register
def _task_assigned(event: events.TaskAssigned) -> str:
    return f"{event.task.task_id} ({event.task.kind}, {event.task.model_id}) to {event.instance_id}"


@gist.register
def _task_started(event: events.TaskStarted) -> str:
    return f"{event.task_id}: {event.prompt_tokens} prompt tokens"


@gist.register
def _task_finished(event: events.TaskFinished) -> str:
    text = f"{event.task_id} {event.outcome}: {event.usage.prompt_tokens} prompt, "
    text += f"{event.usage.completion_tokens} completion tokens"
    return text + (f": {short(event.error)}" if event.error else "")


@gist.register
def _task_cancelled(event: events.TaskCancelled) -> str:
    return f"{event.task_id}: {short(event.reason)}"
