"""Moving a one-machine cluster's history into a clustered JetStream (`jetshard up --lan`).

A standalone nats-server's streams are orphaned when the same store is started in clustered mode, so the
history is copied, with the cluster stopped, from a temporary standalone server on the old store into the
running clustered one. Every stream whose sequence numbers State holds keeps its numbering:

* JETSHARD_EVENTS, the history State is folded from, is copied whole: every message at the same sequence
  with its subject, data and headers (`Nats-Msg-Id` kept), each appended with `Nats-Expected-Last-Sequence`,
  and the copy's last sequence and count are checked at the end.
* JETSHARD_COMMANDS: the commands the sequencer has not turned into events yet (after
  `State.last_command_seq`: acked by JetStream, so promised to the user, and exactly those the next sequencer
  would read) are carried over at their sequences; the handled ones are not (they live on as their events).
  The copy's numbering continues the old stream's either way: the sequencer starts reading after
  `State.last_command_seq`, and would skip as handled any new command numbered below it.
* JETSHARD_TASKS (task requests, the prompts) is not copied: user data kept only for a task's start, and no
  task runs while the cluster is stopped. Its numbering continues too: State refers to a request by its
  sequence, and a task from the old history must never find a new user's prompt at its number.
* A snapshot of State at the last event is written to the new snapshot store, naming the new events
  stream (a snapshot names the stream incarnation it was folded from): followers start at the head.
* The leader lease and the liveness buckets are not moved: they are ephemeral by design, and the services
  renew them when they start.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import nats.js.errors
import psutil
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.options import NatsOptions
from jetshard_bus.snapshots import save_snapshot, stream_created
from jetshard_schema import subjects
from nats.js import JetStreamContext
from nats.js.api import PubAck

from jetshard.up.auth import ADMIN, ensure_identity, server_authorization
from jetshard.up.natsserver import start_nats_server

log = logging.getLogger(__name__)

COPY_WINDOW = 512
"""Messages read and appended per round trip (appends are pipelined, then their acks awaited)."""
APPEND_ACK_TIMEOUT_S = 15.0
"""nats-py may never resolve a refused expected-sequence append: an ack this late counts as a refusal."""
FOLD_TIMEOUT_S = 600.0
"""Folding the old history into State before copying: as long as a service's start may take."""
PUBLISH_HEADER_PREFIXES = ("Nats-Expected-", "Nats-Batch-")
"""How the original was published (its conditions, checked against the old stream; the atomic batch it was part
of), which the server keeps with each message: each copy is published on its own, with conditions of its own."""


class MigrationError(RuntimeError):
    pass


class StoreInUseError(MigrationError):
    pass


@dataclass(frozen=True)
class MigrationReport:
    events: int
    """Events copied: the target's events are 1..events."""
    pending_commands: int
    """Commands accepted but not yet sequenced, carried over for the target's sequencer."""
    snapshot_seq: int
    """The event the target's snapshot covers; 0 when there were no events."""
    backup_dir: Path | None = None
    """Where the old store was moved (kept, never deleted); None when only `copy_history` ran."""


async def copy_history(
    source: NatsOptions, target: NatsOptions, progress: Callable[[int, int], None] | None = None
) -> MigrationReport:
    """Copy jetshard's history from `source` to `target` (both as an identity that may declare and purge
    streams: admin), declaring the target's streams with `target.replicas`. Refuses a target that holds any
    history of its own. `progress(copied, total)` is called as messages are copied."""
    source_client, source_js = await connect(source, "jetshard migrate (source)", wait_for_server=False)
    try:
        target_client, target_js = await connect(target, "jetshard migrate (target)", wait_for_server=False)
        try:
            return await _copy(source_js, target_js, progress or (lambda copied, total: None))
        finally:
            await target_client.close()
    finally:
        await source_client.close()


async def _copy(
    source: JetStreamContext, target: JetStreamContext, progress: Callable[[int, int], None]
) -> MigrationReport:
    for stream in (subjects.EVENTS_STREAM, subjects.COMMANDS_STREAM, subjects.TASKS_STREAM):
        held = (await target.stream_info(stream)).state.last_seq
        if held:
            raise MigrationError(
                f"the target already holds a history ({stream} is at sequence {held}); two histories are never "
                "interleaved. If it is a half-done migration, delete the target's JetStream store and run it again"
            )
    events = (await source.stream_info(subjects.EVENTS_STREAM)).state
    if events.messages != events.last_seq:
        raise MigrationError(
            f"the old {subjects.EVENTS_STREAM} has gaps ({events.messages} events up to sequence {events.last_seq}); "
            "its sequences cannot be kept"
        )
    follower = StateFollower(source)
    await follower.start(FOLD_TIMEOUT_S)
    await follower.stop()
    state = follower.state
    commands = (await source.stream_info(subjects.COMMANDS_STREAM)).state
    first_pending = max(state.last_command_seq + 1, commands.first_seq)
    tasks = (await source.stream_info(subjects.TASKS_STREAM)).state
    pending = max(commands.last_seq - first_pending + 1, 0)
    total = events.last_seq + pending
    copied = 0

    def copied_more(count: int) -> None:
        nonlocal copied
        copied += count
        progress(copied, total)

    await _copy_messages(source, target, subjects.EVENTS_STREAM, 1, events.last_seq, copied_more)
    await _copy_messages(source, target, subjects.COMMANDS_STREAM, first_pending, commands.last_seq, copied_more)
    await _copy_messages(source, target, subjects.TASKS_STREAM, tasks.last_seq + 1, tasks.last_seq, copied_more)
    copy = (await target.stream_info(subjects.EVENTS_STREAM)).state
    if (copy.last_seq, copy.messages) != (events.last_seq, events.messages):
        raise MigrationError(
            f"the copy of {subjects.EVENTS_STREAM} holds {copy.messages} events up to sequence {copy.last_seq}, "
            f"the original {events.messages} up to {events.last_seq}"
        )
    if state.last_seq:
        created = stream_created(await target.stream_info(subjects.EVENTS_STREAM))
        await save_snapshot(target, state, created)
    log.info("copied %d events and %d pending commands; snapshot at event %d", copy.last_seq, pending, state.last_seq)
    return MigrationReport(events=copy.last_seq, pending_commands=pending, snapshot_seq=state.last_seq)


async def _copy_messages(
    source: JetStreamContext,
    target: JetStreamContext,
    stream: str,
    first_seq: int,
    last_seq: int,
    copied: Callable[[int], None],
) -> None:
    """Copy `stream`'s messages `first_seq`..`last_seq` to the same sequences of the (empty) target stream,
    whose numbering then continues after `last_seq` even when there is nothing to copy."""
    if first_seq > 1:
        await target.purge_stream(stream, seq=first_seq)  # on an empty stream: the next message gets first_seq
    copied_ids: set[str] = set()
    for start in range(first_seq, last_seq + 1, COPY_WINDOW):
        seqs = range(start, min(start + COPY_WINDOW, last_seq + 1))
        try:
            messages = await asyncio.gather(*(source.get_msg(stream, seq) for seq in seqs))
        except nats.js.errors.NotFoundError as error:
            raise MigrationError(f"the old {stream} lacks a message between {seqs[0]} and {seqs[-1]}") from error
        acks = []
        for seq, message in zip(seqs, messages, strict=True):
            if message.subject is None:
                raise MigrationError(f"the NATS server returned {stream} message {seq} without its subject")
            headers = {k: v for k, v in (message.headers or {}).items() if not k.startswith(PUBLISH_HEADER_PREFIXES)}
            msg_id = headers.get(subjects.MSG_ID_HEADER)
            if msg_id is not None and msg_id in copied_ids:
                # Stored twice in the old stream, beyond its dedupe window; here within it, the second copy
                # would be dropped and every later sequence shifted. Its id has done its work long ago.
                del headers[subjects.MSG_ID_HEADER]
            elif msg_id is not None:
                copied_ids.add(msg_id)
            headers[subjects.EXPECTED_LAST_SEQUENCE_HEADER] = str(seq - 1)
            acks.append(await target.publish_async(message.subject, message.data or b"", headers=headers))
        try:
            results = await asyncio.wait_for(asyncio.gather(*acks, return_exceptions=True), APPEND_ACK_TIMEOUT_S)
        except TimeoutError as error:
            raise MigrationError(f"the target did not acknowledge copies of {stream} {seqs[0]}..{seqs[-1]}") from error
        for seq, result in zip(seqs, results, strict=True):
            if not isinstance(result, PubAck) or result.seq != seq or result.duplicate:
                raise MigrationError(f"copying {stream} message {seq} failed: {result!r}")
        copied(len(seqs))


def migrate_standalone_store(
    store_dir: Path,
    target: NatsOptions,
    progress: Callable[[int, int], None] | None = None,
    log_file: Path | None = None,
) -> MigrationReport | None:
    """Copy the history in the standalone JetStream store `store_dir` (the `store_dir` of a nats-server
    configuration: `<data dir>/nats/jetstream` for `jetshard up`) to `target`, then move the store aside to
    `<store_dir>.standalone-<time>`, kept as a backup. None, doing nothing, when there is no store there (it
    was migrated already). The target's server must keep its store elsewhere.

    Raises StoreInUseError if a nats-server has the store open, MigrationError if the target holds a history
    of its own; the store stays where it was unless the copy succeeded.
    """
    if not store_dir.is_dir():
        return None
    users = _servers_using(store_dir)
    if users:
        raise StoreInUseError(
            f"{store_dir} is in use by nats-server (pid {', '.join(map(str, users))}); stop `jetshard up` "
            "(or that server) first: a store must not be read by two servers"
        )
    with tempfile.TemporaryDirectory(prefix="jetshard-migrate-") as scratch:
        scratch_dir = Path(scratch)
        # The temporary server admits only a one-off admin: other local users could otherwise write to it
        # while it runs.
        admin = ensure_identity(scratch_dir / "creds", ADMIN)
        server_dir = scratch_dir / "server"
        server_dir.mkdir()
        (server_dir / "jetstream").symlink_to(store_dir.resolve(), target_is_directory=True)
        server = start_nats_server(server_dir, port=-1, log_file=log_file, authorization=server_authorization([admin]))
        try:
            source = NatsOptions(servers=(server.url,), nkey_file=str(admin.seed_file))
            report = asyncio.run(copy_history(source, target, progress))
        finally:
            server.stop()
    backup = store_dir.with_name(f"{store_dir.name}.standalone-{time.strftime('%Y%m%d-%H%M%S')}")
    store_dir.rename(backup)
    log.info("moved the standalone store %s aside to %s", store_dir, backup)
    return replace(report, backup_dir=backup)


def _servers_using(store_dir: Path) -> list[int]:
    """Pids of the nats-servers holding a file of `store_dir` open (a server keeps each stream's last block
    open; nats-server takes no lock of its own)."""
    store = store_dir.resolve()
    users = []
    for process in psutil.process_iter(["name"]):
        if not (process.info["name"] or "").startswith("nats-server"):
            continue
        try:
            if any(Path(f.path).is_relative_to(store) for f in process.open_files()):
                users.append(process.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return users
