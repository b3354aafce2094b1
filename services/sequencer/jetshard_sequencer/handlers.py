"""Command handlers: pure functions of (State, Command, context) → events. Tested without NATS.

A handler never raises for a bad command: it returns a `CommandRejected` with a reason a person can act
on. The same inputs always give the same events, so a command redelivered after a crash is harmless.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any

import msgspec
from jetshard_schema import commands, events
from jetshard_schema.admission import Refused, admit
from jetshard_schema.card_from_config import SUPPORTED_ARCHITECTURES
from jetshard_schema.cards import VISION_ARCHITECTURES, ModelCard, ModelFormat, ModelSource, printable
from jetshard_schema.gguf_card import LLAMA_CPP_ARCHITECTURES
from jetshard_schema.ids import CommandId, InstanceId, ModelId, NodeId
from jetshard_schema.models import find_card, is_builtin
from jetshard_schema.placement import (
    EngineUnavailable,
    InvalidPlacement,
    ModelUnavailable,
    NotEnoughNodes,
    Placement,
    PlacementError,
    faster_engine,
    faster_placement,
    place_in,
    without,
)
from jetshard_schema.state import Instance, State, apply, instance_status, report_shows
from jetshard_schema.types import (
    KEEP_LOADED,
    DownloadProgress,
    DownloadStatus,
    ImportStatus,
    InstanceStatus,
    NodeProfile,
    NodeStorage,
    Parallelism,
    RejectCode,
    RunnerStatus,
    ServingSettings,
)
from msgspec.structs import replace


class Context(msgspec.Struct, frozen=True):
    command_id: CommandId
    now_ms: int
    max_restarts: int = 3
    restart_backoff_ms: int = 1000


AVAILABLE_MEMORY_CHANGE = 0.05
"""A node's available memory, or a GPU's free memory, must move by this share of its total before NodeUpdated
is worth an event."""
FREE_SPACE_CHANGE_BYTES = 256 * 2**20


def _reject(
    command: commands.Command, code: RejectCode, reason: str, retry_after_s: int | None = None
) -> list[events.Event]:
    return [
        events.CommandRejected(
            command_type=type(command).__name__, code=code, reason=reason, retry_after_s=retry_after_s
        )
    ]


def misaddressed(command: commands.Command, subject: str) -> events.CommandRejected | None:
    """Refuse a command that came on another subject than its own. NATS lets each identity publish only on its
    role's subjects (a node's only on those naming the node), so the subject says who sent it; a body that
    belongs elsewhere is someone speaking for another node or role."""
    if subject == command.subject:
        return None
    owner = f"node {command.sender_node}'s {command.sender}" if command.sender_node else f"the {command.sender}"
    return events.CommandRejected(
        command_type=type(command).__name__,
        code=RejectCode.FORBIDDEN,
        reason=f"a {type(command).__name__} is for {owner} to send (on {command.subject}); it came on {subject}",
    )


def handle(state: State, command: commands.Command, ctx: Context) -> list[events.Event]:
    handler: Callable[[State, Any, Context], list[events.Event]] = _HANDLERS[type(command)]
    try:
        return handler(state, command, ctx)
    except ValueError as error:  # parse_model_id and friends: the command itself is malformed
        return _reject(command, RejectCode.INVALID, str(error))


# --- nodes -------------------------------------------------------------------------------------------------


def profile_changed_meaningfully(old: NodeProfile, new: NodeProfile) -> bool:
    fixed = ("hostname", "os", "cpu_cores", "memory_total_bytes", "accelerator", "fast_blas", "engines")
    if any(getattr(old, f) != getattr(new, f) for f in fixed):
        return True
    if _moved_meaningfully(old.memory_available_bytes, new.memory_available_bytes, new.memory_total_bytes):
        return True
    if [replace(g, memory_free_bytes=0) for g in old.gpus] != [replace(g, memory_free_bytes=0) for g in new.gpus]:
        return True
    return any(
        _moved_meaningfully(a.memory_free_bytes, b.memory_free_bytes, b.memory_total_bytes)
        for a, b in zip(old.gpus, new.gpus, strict=True)
    )


def _moved_meaningfully(before_bytes: int, after_bytes: int, total_bytes: int) -> bool:
    return abs(before_bytes - after_bytes) >= AVAILABLE_MEMORY_CHANGE * max(total_bytes, 1)


def storage_changed_meaningfully(old: NodeStorage, new: NodeStorage) -> bool:
    if (old.offline, set(old.available_models)) != (new.offline, set(new.available_models)):
        return True
    if old.file_server != new.file_server:  # a new downloader session: its peers must admit its certificate
        return True
    before, after = old.model_dirs, new.model_dirs
    if [(d.path, d.read_only, d.total_bytes) for d in before] != [(d.path, d.read_only, d.total_bytes) for d in after]:
        return True
    return any(abs(a.free_bytes - b.free_bytes) >= FREE_SPACE_CHANGE_BYTES for a, b in zip(before, after, strict=True))


def _report_node_profile(state: State, command: commands.ReportNodeProfile, ctx: Context) -> list[events.Event]:
    known = state.nodes.get(command.node_id)
    joined = events.NodeJoined(node_id=command.node_id, session_id=command.session_id, profile=command.profile)
    if known is None:
        return [joined]
    on_node = [
        instance.instance_id
        for instance in sorted(state.instances.values(), key=lambda i: i.instance_id)
        if instance.shard_for(command.node_id) is not None and not instance.failed
    ]
    if known.session_id != command.session_id:
        # A new session of a known node is its worker restarted: the runners of the old one died with it (they
        # cannot outlive their worker), so whatever they last reported, READY included, is no longer true.
        reason = f"the worker on {command.node_id} restarted; its runners died with it"
        emitted: list[events.Event] = [
            joined,
            *(_restart_or_fail(state, state.instances[i], reason, ctx) for i in on_node),
        ]
    elif profile_changed_meaningfully(known.profile, command.profile) or any(
        state.instances[i].ready_seq and not report_shows(known, state.instances[i]) for i in on_node
    ):
        # Also the first report since an instance here loaded, however little memory moved: until State holds one,
        # placement counts the instance's memory as still to come (on top of what the last report saw of its
        # loading), and cannot give it back when it unloads to make room.
        emitted = [events.NodeUpdated(node_id=command.node_id, profile=command.profile)]
    else:
        return []
    if known.profile.engines == command.profile.engines:
        return emitted
    return emitted + _engine_moves(_applied(state, emitted), on_node, ctx)


def _applied(state: State, emitted: list[events.Event]) -> State:
    for event in emitted:
        state = apply(state, event, state.last_seq + 1)
    return state


def _engine_moves(state: State, instance_ids: list[InstanceId], ctx: Context) -> list[events.Event]:
    """Move each idle instance of `instance_ids` whose engine placement chose to the faster engine its nodes now
    run (llama.cpp, once built there): delete it and place it again, as a lost node's instances are. One that
    has tasks running or queued moves when its last one ends."""
    emitted: list[events.Event] = []
    for instance_id in instance_ids:
        instance = state.instances.get(instance_id)
        if instance is None or instance.failed or not instance.engine_chosen:
            continue
        if any(task.instance_id == instance_id for task in state.tasks.values()):
            continue
        card = find_card(state, instance.model_id)
        placement = faster_placement(state, instance, card) if card is not None else None
        if placement is None:
            continue
        moved: list[events.Event] = [
            events.InstanceDeleted(
                instance_id=instance_id,
                reason=f"moved to {placement.serving.engine}, which serves it faster on its node(s)",
            ),
            _placed_event(_replacement_id(ctx, instance), instance, placement, ctx),
        ]
        emitted += moved
        state = _applied(state, moved)
    return emitted


def _may_move(state: State, instance_id: InstanceId) -> bool:
    instance = state.instances.get(instance_id)
    card = find_card(state, instance.model_id) if instance is not None else None
    return instance is not None and card is not None and faster_engine(state, instance, card) is not None


def _replacement_id(ctx: Context, replaced: Instance) -> InstanceId:
    digest = hashlib.sha256(f"{ctx.command_id}/{replaced.instance_id}".encode()).hexdigest()[:12]
    return InstanceId(f"inst-{digest}")


def _placed_event(
    instance_id: InstanceId, replaced: Instance, placement: Placement, ctx: Context
) -> events.InstancePlaced:
    return events.InstancePlaced(
        instance_id=instance_id,
        model_id=replaced.model_id,
        shards=placement.shards,
        serving=placement.serving,
        requested=replaced.requested,
        keep_alive_ms=replaced.keep_alive_ms,
        at_ms=ctx.now_ms,
    )


def _report_node_storage(state: State, command: commands.ReportNodeStorage, ctx: Context) -> list[events.Event]:
    known = state.node_storage.get(command.node_id)
    if known is not None and not storage_changed_meaningfully(known, command.storage):
        return []
    return [events.NodeStorageUpdated(node_id=command.node_id, storage=command.storage)]


def _expire_node(state: State, command: commands.ExpireNode, ctx: Context) -> list[events.Event]:
    known = state.nodes.get(command.node_id)
    if known is None or known.session_id != command.session_id:
        return []  # already lost, or it came back with a new session meanwhile
    emitted: list[events.Event] = [events.NodeLost(node_id=command.node_id, reason="its liveness key expired")]
    after = apply(state, emitted[0], state.last_seq + 1)
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if instance.shard_for(command.node_id) is None:
            continue
        reason = f"node {command.node_id} was lost"
        deleted = events.InstanceDeleted(instance_id=instance.instance_id, reason=reason)
        emitted.append(deleted)
        after = apply(after, deleted, after.last_seq + 1)
        replacement = _try_place(after, instance, ctx)
        if replacement is not None:
            emitted.append(replacement)
            after = apply(after, replacement, after.last_seq + 1)
    return emitted


def _try_place(state: State, lost: Instance, ctx: Context) -> events.InstancePlaced | None:
    card = find_card(state, lost.model_id)
    if card is None or not state.nodes:
        return None
    try:
        # The lost instance's settings are already resolved: its replacement keeps the same weights dtype, and a
        # tensor-parallel one as many ranks (its slices are that many). Not the engine placement chose: the nodes
        # left may not run it.
        serving = replace(lost.serving, engine=None) if lost.engine_chosen else lost.serving
        tensor = serving.parallelism is Parallelism.TENSOR
        placement = place_in(state, card, min_nodes=len(lost.shards) if tensor else 1, serving=serving)
    except PlacementError:
        return None
    return _placed_event(_replacement_id(ctx, lost), lost, placement, ctx)


# --- model cards -------------------------------------------------------------------------------------------


def _add_custom_model_card(state: State, command: commands.AddCustomModelCard, ctx: Context) -> list[events.Event]:
    # The card's own fields were checked where it was decoded (`ModelCard.__post_init__`); what is checked here
    # may change between versions (which architectures run), so that a stored card is never refused on replay.
    card = command.card
    if find_card(state, card.model_id) is not None:
        return _reject(command, RejectCode.ALREADY_EXISTS, f"{card.model_id} is already in the catalogue")
    if (why := _unservable(card)) is not None:
        return _reject(command, RejectCode.INVALID, why)
    return [events.CustomModelCardAdded(card=_as_custom(card))]


def _as_custom(card: ModelCard) -> ModelCard:
    """A card as the catalogue keeps one that was added: custom, and its name without control characters, which a
    terminal that shows it would obey."""
    return replace(card, is_custom=True, display_name=printable(card.display_name))


def _unservable(card: ModelCard) -> str | None:
    """Why no engine of this version serves `card`; None when one does. A card MLX can hold needs an architecture
    mlx-lm runs; a GGUF-only one, an architecture llama.cpp loads."""
    servable = (
        SUPPORTED_ARCHITECTURES | VISION_ARCHITECTURES if ModelFormat.MLX in card.formats else LLAMA_CPP_ARCHITECTURES
    )
    if card.architecture in servable:
        return None
    return f"architecture {card.architecture!r} is not supported; supported: {', '.join(sorted(servable))}"


def _import_model_file(state: State, command: commands.ImportModelFile, ctx: Context) -> list[events.Event]:
    if command.node_id not in state.nodes:
        return _reject(command, RejectCode.NOT_FOUND, f"unknown node {command.node_id}; see GET /nodes")
    for what, path in (("path", command.path), ("mmproj_path", command.mmproj_path)):
        if path and not PurePosixPath(path).is_absolute():
            return _reject(command, RejectCode.INVALID, f"{what} must be an absolute path on the node, got {path!r}")
    model_id = command.model_id
    card = find_card(state, model_id)
    # Files imported under another model's id would be served as it.
    if card is not None and card.source is not ModelSource.LOCAL_GGUF:
        origin = card.source_ref or "the Hugging Face Hub"
        return _reject(
            command,
            RejectCode.ALREADY_EXISTS,
            f"{model_id} is already in the catalogue as a {card.source} model ({origin}); choose another id",
        )
    if card is not None and card.source_ref != command.path:
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{model_id} was imported from {card.source_ref}, not {command.path}; remove its card first "
            f"(jetshard models rm {model_id}) or choose another id",
        )
    ongoing = state.imports.get(model_id)
    if ongoing is not None and ongoing.progress.status is ImportStatus.ONGOING:
        return _reject(command, RejectCode.CONFLICT, f"{model_id} is being imported on {ongoing.node_id} already")
    stored = state.download(command.node_id, model_id)
    if stored is not None and stored.progress.status is DownloadStatus.COMPLETED and not command.replace:
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{model_id} is already stored in {stored.progress.directory}; import it with replace (--replace) to "
            "import over it",
        )
    # A replace takes the stored files away (an MLX conversion of them too) from under their runners.
    users = _users(state, model_id, command.node_id) if command.replace else []
    if users:
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{model_id} is in use by instance(s) {', '.join(users)} on {command.node_id}; delete them first",
        )
    return [
        events.ModelImportRequested(
            import_id=command.import_id,
            node_id=command.node_id,
            model_id=model_id,
            path=command.path,
            mmproj_path=command.mmproj_path,
            replace=command.replace,
        )
    ]


def _report_model_import(state: State, command: commands.ReportModelImport, ctx: Context) -> list[events.Event]:
    known = state.imports.get(command.model_id)
    if known is None or (known.import_id, known.node_id) != (command.import_id, command.node_id):
        return []  # an attempt a newer import (or the card's deletion) superseded
    if known.progress.status is not ImportStatus.ONGOING:
        return []  # a report its end overtook (a publish retried), or the end again: an ended import stays ended
    progressed = events.ModelImportProgressed(
        import_id=command.import_id, node_id=command.node_id, model_id=command.model_id, progress=command.progress
    )
    if command.progress.status is not ImportStatus.COMPLETED:
        return [progressed]
    card = command.card
    why = "the report of a completed import carries no card"
    if card is not None:
        why = _unservable(card) or ""
        if (card.model_id, card.source, card.source_ref) != (command.model_id, ModelSource.LOCAL_GGUF, known.path):
            why = f"the card reported for {command.model_id} is not that of its import from {known.path}"
    if card is None or why:
        failed = replace(command.progress, status=ImportStatus.FAILED, reason=why)
        return [replace(progressed, progress=failed)]
    card = _as_custom(card)
    added: list[events.Event] = (
        [] if find_card(state, card.model_id) == card else [events.CustomModelCardAdded(card=card)]
    )
    stored = DownloadProgress(
        status=DownloadStatus.COMPLETED,
        start_layer=0,
        end_layer=card.num_layers,
        bytes_done=command.progress.bytes_total,
        bytes_total=command.progress.bytes_total,
        directory=command.progress.directory,
        formats=(ModelFormat.GGUF,),
    )
    return [
        *added,
        events.DownloadCompleted(node_id=command.node_id, model_id=card.model_id, progress=stored),
        progressed,
    ]


def _delete_custom_model_card(
    state: State, command: commands.DeleteCustomModelCard, ctx: Context
) -> list[events.Event]:
    if is_builtin(command.model_id):
        return _reject(
            command, RejectCode.CONFLICT, f"{command.model_id} is a built-in card; only custom cards can be deleted"
        )
    if command.model_id not in state.custom_cards:
        return _reject(command, RejectCode.NOT_FOUND, f"no custom model card {command.model_id}")
    users = _users(state, command.model_id)
    if users:
        # Its instances need the card (to restart) and its downloads' records (to start their runners).
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{command.model_id} is in use by instance(s) {', '.join(users)}; delete them first",
        )
    return [events.CustomModelCardDeleted(model_id=command.model_id)]


def _users(state: State, model_id: ModelId, node_id: NodeId | None = None) -> list[InstanceId]:
    """The instances that serve `model_id` or draft with it (`serving.draft`), those with a shard on `node_id`
    (that it drafts for: led from there) where one is named. A failed instance uses nothing: its runners are
    gone, it never restarts, and State keeps it only to say why it failed."""
    users = []
    for instance in state.instances.values():
        if instance.failed:
            continue
        if instance.model_id == model_id:
            here = node_id is None or instance.shard_for(node_id) is not None
        else:
            here = instance.serving.draft_model == model_id and node_id in (None, instance.leader_node)
        if here:
            users.append(instance.instance_id)
    return sorted(users)


def _report_model_size(state: State, command: commands.ReportModelSize, ctx: Context) -> list[events.Event]:
    card = find_card(state, command.model_id)
    if card is None or (card.storage_size_bytes == command.storage_size_bytes and not card.storage_size_estimated):
        return []
    return [events.ModelSizeMeasured(model_id=command.model_id, storage_size_bytes=command.storage_size_bytes)]


# --- downloads ---------------------------------------------------------------------------------------------


def _start_download(state: State, command: commands.StartDownload, ctx: Context) -> list[events.Event]:
    card = find_card(state, command.model_id)
    if card is None:
        return _reject(command, RejectCode.NOT_FOUND, f"unknown model {command.model_id}; add it with POST /models")
    if command.node_id not in state.nodes:
        return _reject(command, RejectCode.NOT_FOUND, f"unknown node {command.node_id}; see GET /nodes")
    start = 0 if command.start_layer is None else command.start_layer
    end = card.num_layers if command.end_layer is None else command.end_layer
    if not 0 <= start < end <= card.num_layers:
        return _reject(
            command,
            RejectCode.INVALID,
            f"layer range [{start}, {end}) is not within [0, {card.num_layers}) of {card.model_id}",
        )
    return [
        events.DownloadRequested(node_id=command.node_id, model_id=command.model_id, start_layer=start, end_layer=end)
    ]


def _cancel_download(state: State, command: commands.CancelDownload, ctx: Context) -> list[events.Event]:
    download = state.download(command.node_id, command.model_id)
    if download is None:
        return _reject(command, RejectCode.NOT_FOUND, f"no download of {command.model_id} on {command.node_id}")
    if download.progress.status not in (DownloadStatus.PENDING, DownloadStatus.ONGOING):
        return _reject(command, RejectCode.CONFLICT, f"the download is {download.progress.status}, not in progress")
    return [events.DownloadCancelled(node_id=command.node_id, model_id=command.model_id)]


def _delete_download(state: State, command: commands.DeleteDownload, ctx: Context) -> list[events.Event]:
    download = state.download(command.node_id, command.model_id)
    if download is None:
        return _reject(command, RejectCode.NOT_FOUND, f"{command.model_id} is not on node {command.node_id}")
    if download.progress.read_only:
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{command.model_id} is in the read-only directory {download.progress.directory}; "
            "jetshard never deletes from read-only directories",
        )
    users = _users(state, command.model_id, command.node_id)
    if users:
        return _reject(
            command,
            RejectCode.CONFLICT,
            f"{command.model_id} is in use by instance(s) {', '.join(users)}; delete them first",
        )
    return [events.DownloadDeleteRequested(node_id=command.node_id, model_id=command.model_id)]


def _report_download_progress(
    state: State, command: commands.ReportDownloadProgress, ctx: Context
) -> list[events.Event]:
    node_id, model_id, progress = command.node_id, command.model_id, command.progress
    if find_card(state, model_id) is None:
        return []  # the end of a download whose card was deleted meanwhile: State forgot it with the card
    match progress.status:
        case DownloadStatus.COMPLETED:
            return [events.DownloadCompleted(node_id=node_id, model_id=model_id, progress=progress)]
        case DownloadStatus.FAILED:
            failed: list[events.Event] = [
                events.DownloadFailed(node_id=node_id, model_id=model_id, reason=progress.reason)
            ]
            return failed + [
                events.InstanceFailed(
                    instance_id=instance.instance_id,
                    reason=f"downloading {model_id} to node {node_id} failed: {progress.reason}",
                    at_ms=ctx.now_ms,
                )
                for instance in _waiting_for_files(state, node_id, model_id)
            ]
        case DownloadStatus.CANCELLED:
            if not _cancelled(state, node_id, model_id):
                return []  # the end of an attempt that a newer request (or a shutdown) cut short
            # The downloader stopped the cancelled download: the record says so, and how much it kept.
            return [events.DownloadProgressed(node_id=node_id, model_id=model_id, progress=progress)]
        case _:
            if _cancelled(state, node_id, model_id):
                return []  # a report sent before the downloader saw the cancel; a new request resets it
            return [events.DownloadProgressed(node_id=node_id, model_id=model_id, progress=progress)]


def _cancelled(state: State, node_id: NodeId, model_id: ModelId) -> bool:
    current = state.download(node_id, model_id)
    return current is not None and current.progress.status is DownloadStatus.CANCELLED


def _waiting_for_files(state: State, node_id: NodeId, model_id: ModelId) -> list[Instance]:
    """The instances that need `model_id`'s files on `node_id` (`_users`) and have not loaded yet."""
    return [
        instance
        for instance in (state.instances[i] for i in _users(state, model_id, node_id))
        if instance_status(state, instance) not in (InstanceStatus.READY, InstanceStatus.FAILED)
    ]


def _report_download_deleted(state: State, command: commands.ReportDownloadDeleted, ctx: Context) -> list[events.Event]:
    if state.download(command.node_id, command.model_id) is None:
        return []
    return [events.DownloadDeleted(node_id=command.node_id, model_id=command.model_id)]


# --- instances ---------------------------------------------------------------------------------------------


def _place_instance(state: State, command: commands.PlaceInstance, ctx: Context) -> list[events.Event]:
    if command.instance_id in state.instances:
        return _reject(command, RejectCode.ALREADY_EXISTS, f"instance {command.instance_id} already exists")
    return _placed(state, command, ctx)


def _ensure_instance(state: State, command: commands.EnsureInstance, ctx: Context) -> list[events.Event]:
    alive = sorted(i.instance_id for i in state.instances.values() if i.model_id == command.model_id and not i.failed)
    if alive:
        return [events.InstanceChosen(instance_id=alive[0], model_id=command.model_id)]
    if command.instance_id in state.instances:  # a failed one: every instance id is placed once
        return _reject(command, RejectCode.ALREADY_EXISTS, f"instance {command.instance_id} already exists")
    placed = _placed(state, command, ctx)
    if not isinstance(placed[-1], events.InstancePlaced):
        return placed
    # The new instance replaces the model's failed ones: clients retrying a model that cannot load (its files
    # cannot be fetched) would otherwise leave a failed instance per request in State until their retention.
    replaced = [
        events.InstanceDeleted(instance_id=i.instance_id, reason=f"replaced by {command.instance_id}")
        for i in sorted(state.instances.values(), key=lambda i: i.instance_id)
        if i.model_id == command.model_id and i.failed
    ]
    return [*replaced, *placed]


def _set_instance_keep_alive(state: State, command: commands.SetInstanceKeepAlive, ctx: Context) -> list[events.Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None:
        return _reject(command, RejectCode.NOT_FOUND, f"no instance {command.instance_id}")
    # Idle from now: a keep-alive given to an idle instance counts from when it was given, as Ollama's does.
    at_ms = max(ctx.now_ms, instance.idle_since_ms)
    return [
        events.InstanceKeepAliveSet(instance_id=command.instance_id, keep_alive_ms=command.keep_alive_ms, at_ms=at_ms)
    ]


def _set_default_keep_alive(state: State, command: commands.SetDefaultKeepAlive, ctx: Context) -> list[events.Event]:
    return [events.DefaultKeepAliveSet(keep_alive_ms=command.keep_alive_ms)]


def _unload_idle_instance(state: State, command: commands.UnloadIdleInstance, ctx: Context) -> list[events.Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None or command.instance_id not in idle_past_keep_alive(state, ctx.now_ms):
        return []  # deleted, or busy again, or given a longer keep-alive since the sequencer looked
    idle_s = (ctx.now_ms - instance.idle_since_ms) / 1000
    reason = f"idle for {idle_s:.0f} s, past its keep-alive of {instance.keep_alive_ms / 1000:g} s"
    return [events.InstanceDeleted(instance_id=command.instance_id, reason=reason)]


def idle_past_keep_alive(state: State, now_ms: int) -> list[InstanceId]:
    """The instances to unload (the sequencer sends itself `UnloadIdleInstance` for each): alive, no task in
    flight, and idle for their keep-alive."""
    busy = {task.instance_id for task in state.tasks.values()}
    return sorted(
        i.instance_id
        for i in state.instances.values()
        if not i.failed and (unloads_at := i.unloads_at_ms(i.instance_id in busy)) is not None and unloads_at <= now_ms
    )


def _placed(
    state: State, command: commands.PlaceInstance | commands.EnsureInstance, ctx: Context
) -> list[events.Event]:
    """The instance `command` asks for, placed. An `EnsureInstance` carries the API's default serving settings,
    which apply where this model's engine takes them (`place`'s as_default); a `PlaceInstance` asks them of it."""
    instance_id, model_id, serving = command.instance_id, command.model_id, command.serving
    as_default = isinstance(command, commands.EnsureInstance)
    node_ids, min_nodes = (
        (command.node_ids, command.min_nodes) if isinstance(command, commands.PlaceInstance) else (None, 1)
    )
    card = find_card(state, model_id)
    if card is None:
        return _reject(command, RejectCode.NOT_FOUND, f"unknown model {model_id}; add it with POST /models")
    unloaded: list[events.Event] = []
    try:
        placement = place_in(state, card, node_ids, min_nodes, serving, as_default)
    except ModelUnavailable as error:
        return _reject(command, RejectCode.MODEL_UNAVAILABLE, str(error))
    except InvalidPlacement as error:
        return _reject(command, RejectCode.INVALID, str(error))
    except NotEnoughNodes as error:
        return _reject(command, RejectCode.NOT_ENOUGH_NODES, str(error))
    except EngineUnavailable as error:
        return _reject(command, RejectCode.CONFLICT, str(error))
    except PlacementError as no_room:
        room = _room_made(state, card, node_ids, min_nodes, serving, as_default)
        if room is None:
            return _reject(command, RejectCode.INSUFFICIENT_MEMORY, str(no_room))
        if isinstance(room, str):
            return _reject(command, RejectCode.NO_CAPACITY, room, MAKE_ROOM_RETRY_S)
        victims, placement = room
        unloaded = [
            events.InstanceDeleted(instance_id=victim.instance_id, reason=f"unloaded to make room for {model_id}")
            for victim in victims
        ]
    return [
        *unloaded,
        events.InstancePlaced(
            instance_id=instance_id,
            model_id=model_id,
            shards=placement.shards,
            serving=placement.serving,
            requested=serving,
            keep_alive_ms=command.keep_alive_ms,
            at_ms=ctx.now_ms,
        ),
    ]


MAKE_ROOM_RETRY_S = 5
"""When the memory a model needs is held by instances that are serving: how soon to ask again."""


def _room_made(
    state: State,
    card: ModelCard,
    node_ids: tuple[NodeId, ...] | None,
    min_nodes: int,
    serving: ServingSettings,
    as_default: bool,
) -> tuple[list[Instance], Placement] | str | None:
    """Room for `card` made by unloading idle instances that have a keep-alive, least recently used first (the
    fewest that make room): those instances and the placement. Never one serving or holding queued tasks, nor one
    loading (for the request that placed it), nor one kept loaded until removed. Else why to retry soon, when
    unloading busy instances would make room (they go idle in time); None when nothing would."""
    busy = {task.instance_id for task in state.tasks.values()}
    busy |= {i.instance_id for i in state.instances.values() if not i.ready_seq}
    unloadable = sorted(
        (i for i in state.instances.values() if not i.failed and i.keep_alive_ms != KEEP_LOADED),
        key=lambda i: (i.idle_since_ms, i.instance_id),
    )
    idle = [i for i in unloadable if i.instance_id not in busy]
    for count in range(1, len(idle) + 1):
        try:
            return idle[:count], place_in(without(state, idle[:count]), card, node_ids, min_nodes, serving, as_default)
        except PlacementError:
            continue
    if len(idle) == len(unloadable):
        return None
    try:
        place_in(without(state, unloadable), card, node_ids, min_nodes, serving, as_default)
    except PlacementError:
        return None
    held = sorted(i.instance_id for i in unloadable if i.instance_id in busy)
    return (
        f"{card.model_id} needs the memory of instances that are serving requests or loading for them "
        f"({_some_ids(held)}): they unload once idle; retry in {MAKE_ROOM_RETRY_S} s"
    )


def _some_ids(ids: Sequence[str], shown: int = 3) -> str:
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def _forget_instance(state: State, command: commands.ForgetInstance, ctx: Context) -> list[events.Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None or not instance.failed:
        return []  # deleted meanwhile, or not failed (a stale observation)
    return [events.InstanceDeleted(instance_id=command.instance_id, reason="failed; its retention ran out")]


def past_retention(state: State, now_ms: int, retention_s: float) -> list[InstanceId]:
    """The failed instances to forget (the sequencer sends itself `ForgetInstance` for each): those that failed
    longer than `retention_s` ago, or before failures carried their time."""
    return sorted(
        i.instance_id for i in state.instances.values() if i.failed and now_ms - i.failed_at_ms >= retention_s * 1000
    )


def _delete_instance(state: State, command: commands.DeleteInstance, ctx: Context) -> list[events.Event]:
    if command.instance_id not in state.instances:
        return _reject(command, RejectCode.NOT_FOUND, f"no instance {command.instance_id}")
    return [events.InstanceDeleted(instance_id=command.instance_id, reason="deleted on request")]


def _report_runner_endpoint(state: State, command: commands.ReportRunnerEndpoint, ctx: Context) -> list[events.Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None or instance.generation != command.generation:
        return []
    shard = instance.shard_for(command.node_id)
    if shard is None or shard.rank != command.rank:
        return _reject(command, RejectCode.FORBIDDEN, f"node {command.node_id} holds no rank {command.rank}")
    return [
        events.RunnerEndpointReported(
            instance_id=command.instance_id,
            generation=command.generation,
            node_id=command.node_id,
            rank=command.rank,
            endpoint=command.endpoint,
        )
    ]


def _report_runner_status(state: State, command: commands.ReportRunnerStatus, ctx: Context) -> list[events.Event]:
    instance = state.instances.get(command.instance_id)
    if instance is None or instance.generation != command.generation or instance.failed:
        return []  # a report from a runner of an earlier generation or a deleted instance
    runner = command.runner
    shard = instance.shard_for(runner.node_id)
    if shard is None or shard.rank != runner.rank:
        return _reject(
            command,
            RejectCode.FORBIDDEN,
            f"node {runner.node_id} holds no rank {runner.rank} of {command.instance_id}",
        )
    changed = events.RunnerStatusChanged(
        instance_id=command.instance_id, generation=command.generation, runner=runner, at_ms=ctx.now_ms
    )
    if runner.status not in (RunnerStatus.FAILED, RunnerStatus.STOPPED):
        return [changed]
    reason = runner.reason or f"rank {runner.rank} on {runner.node_id} stopped"
    return [changed, _restart_or_fail(state, instance, reason, ctx)]


def _restart_or_fail(
    state: State, instance: Instance, reason: str, ctx: Context
) -> events.InstanceRestarting | events.InstanceFailed:
    """A runner of `instance` is gone: start a new generation after a back-off that grows with each restart in a
    row (a ready instance starts counting again), or give up after `ctx.max_restarts`."""
    was_ready = instance_status(state, instance) is InstanceStatus.READY
    attempt = 1 if was_ready else instance.restart_attempt + 1
    if attempt > ctx.max_restarts:
        return events.InstanceFailed(
            instance_id=instance.instance_id,
            reason=f"{reason}; gave up after {ctx.max_restarts} restarts",
            at_ms=ctx.now_ms,
        )
    return events.InstanceRestarting(
        instance_id=instance.instance_id,
        generation=instance.generation + 1,
        attempt=attempt,
        not_before_ms=ctx.now_ms + ctx.restart_backoff_ms * 2 ** (attempt - 1),
        reason=reason,
    )


# --- tasks -------------------------------------------------------------------------------------------------


def _submit_task(state: State, command: commands.SubmitTask, ctx: Context) -> list[events.Event]:
    task_ref = command.task
    if task_ref.task_id in state.tasks:
        return _reject(command, RejectCode.ALREADY_EXISTS, f"task {task_ref.task_id} already exists")
    if command.start_within_ms is not None and command.start_within_ms < 0:
        return _reject(command, RejectCode.INVALID, "start_within_ms cannot be negative")
    chosen = admit(state, task_ref.model_id, command.start_within_ms, ctx.now_ms, command.instance_id)
    if chosen is None:
        return _reject(command, RejectCode.NO_CAPACITY, f"no ready instance of {task_ref.model_id}")
    if isinstance(chosen, Refused):
        return _reject(command, RejectCode.QUEUE_FULL, chosen.reason, chosen.retry_after_s)
    if chosen.instance_id != command.instance_id:
        # Its request is stored for the named instance's leader alone: the API stores it again for this one.
        return _reject(
            command,
            RejectCode.NO_CAPACITY,
            f"instance {command.instance_id} cannot take {task_ref.task_id} now; {chosen.instance_id} can",
        )
    return [events.TaskAssigned(task=task_ref, instance_id=chosen.instance_id, generation=chosen.generation)]


def _expire_requester(state: State, command: commands.ExpireRequester, ctx: Context) -> list[events.Event]:
    reason = f"its requester (API session {command.session_id}) is gone: nobody reads its output"
    orphans = sorted(task_id for task_id, task in state.tasks.items() if task.ref.requester == command.session_id)
    return _then_idle_moves(
        state, [events.TaskCancelled(task_id=task_id, reason=reason, at_ms=ctx.now_ms) for task_id in orphans], ctx
    )


def _cancel_task(state: State, command: commands.CancelTask, ctx: Context) -> list[events.Event]:
    task = state.tasks.get(command.task_id)
    if task is None:
        return []  # already finished: nothing left to cancel
    return _then_idle_moves(
        state, [events.TaskCancelled(task_id=command.task_id, reason=command.reason, at_ms=ctx.now_ms)], ctx
    )


def _then_idle_moves(
    state: State, ending: Sequence[events.TaskFinished | events.TaskCancelled], ctx: Context
) -> list[events.Event]:
    """`ending` (tasks that end), then the moves to a faster engine that waited for their instances to be idle.
    This runs at every task's end: State is folded ahead of the sequencer only for an instance that moves now
    (idle once these tasks end, with a faster engine to move to), so that an ordinary end costs no second fold."""
    ended = {event.task_id for event in ending}
    moving = [
        instance_id
        for instance_id in sorted({state.tasks[task_id].instance_id for task_id in ended})
        if _may_move(state, instance_id)
        and not any(t.instance_id == instance_id and t.task_id not in ended for t in state.tasks.values())
    ]
    if not moving:
        return list(ending)
    return [*ending, *_engine_moves(_applied(state, list(ending)), moving, ctx)]


def _not_the_leader(
    state: State, command: commands.ReportTaskStarted | commands.ReportTaskFinished
) -> list[events.Event]:
    """Refuse a report on a task by any node but the one of its instance's leader, which runs it."""
    task = state.tasks[command.task_id]
    instance = state.instances.get(task.instance_id)
    if command.instance_id == task.instance_id and instance is not None and instance.leader_node == command.node_id:
        return []
    return _reject(
        command, RejectCode.FORBIDDEN, f"task {command.task_id} is not run by node {command.node_id}'s runners"
    )


def _report_task_started(state: State, command: commands.ReportTaskStarted, ctx: Context) -> list[events.Event]:
    if command.task_id not in state.tasks:
        return []
    if refused := _not_the_leader(state, command):
        return refused
    return [events.TaskStarted(task_id=command.task_id, prompt_tokens=command.prompt_tokens, at_ms=ctx.now_ms)]


def _report_task_finished(state: State, command: commands.ReportTaskFinished, ctx: Context) -> list[events.Event]:
    if command.task_id not in state.tasks:
        return []
    if refused := _not_the_leader(state, command):
        return refused
    finished = events.TaskFinished(
        task_id=command.task_id,
        outcome=command.outcome,
        usage=command.usage,
        error=command.error,
        last_chunk_index=command.last_chunk_index,
        at_ms=ctx.now_ms,
    )
    return _then_idle_moves(state, [finished], ctx)


_HANDLERS: dict[type, Callable[[State, Any, Context], list[events.Event]]] = {
    commands.ReportNodeProfile: _report_node_profile,
    commands.ReportNodeStorage: _report_node_storage,
    commands.ExpireNode: _expire_node,
    commands.AddCustomModelCard: _add_custom_model_card,
    commands.DeleteCustomModelCard: _delete_custom_model_card,
    commands.ReportModelSize: _report_model_size,
    commands.ImportModelFile: _import_model_file,
    commands.ReportModelImport: _report_model_import,
    commands.StartDownload: _start_download,
    commands.CancelDownload: _cancel_download,
    commands.DeleteDownload: _delete_download,
    commands.ReportDownloadProgress: _report_download_progress,
    commands.ReportDownloadDeleted: _report_download_deleted,
    commands.PlaceInstance: _place_instance,
    commands.EnsureInstance: _ensure_instance,
    commands.SetInstanceKeepAlive: _set_instance_keep_alive,
    commands.SetDefaultKeepAlive: _set_default_keep_alive,
    commands.UnloadIdleInstance: _unload_idle_instance,
    commands.ForgetInstance: _forget_instance,
    commands.DeleteInstance: _delete_instance,
    commands.ReportRunnerEndpoint: _report_runner_endpoint,
    commands.ReportRunnerStatus: _report_runner_status,
    commands.SubmitTask: _submit_task,
    commands.ExpireRequester: _expire_requester,
    commands.CancelTask: _cancel_task,
    commands.ReportTaskStarted: _report_task_started,
    commands.ReportTaskFinished: _report_task_finished,
}
