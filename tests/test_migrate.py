"""Moving a one-machine cluster's history into a clustered JetStream (`jetshard.up.migrate`).

Real parts: a standalone nats-server whose history a real sequencer wrote (cards added, a snapshot taken,
then two commands accepted while the sequencer was stopped), and a three-server JetStream cluster with R3
streams as the target.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from helpers.cards import tiny_card
from helpers.harness import Processes, until
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_bus.snapshots import load_snapshot
from jetshard_schema import subjects
from jetshard_schema.commands import AddCustomModelCard
from jetshard_schema.state import State
from nats.js.api import Header
from test_nats_cluster import start_nats_cluster

from jetshard.commands.inspect import fetch_state
from jetshard.up.migrate import (
    PUBLISH_HEADER_PREFIXES,
    MigrationError,
    MigrationReport,
    StoreInUseError,
    migrate_standalone_store,
)
from jetshard.up.natsserver import NatsServer, start_nats_server

pytestmark = pytest.mark.timeout(120)

CARDS = 60
PENDING = 2


@dataclass
class Migrated:
    old_store: Path
    target: NatsOptions
    report: MigrationReport
    progress: list[tuple[int, int]]
    source_events: list[tuple[str, bytes, dict[str, str]]]
    source_state: State
    source_tasks_last_seq: int
    target_state: State
    processes: Processes


def card_command(name: str) -> AddCustomModelCard:
    return AddCustomModelCard(card=tiny_card(f"migrate/{name}"))


def _as_written(message: tuple[str, bytes, dict[str, str]]) -> tuple[str, bytes, dict[str, str]]:
    """A stored message without the headers saying how it was published (its conditions, its batch)."""
    subject, data, headers = message
    return subject, data, {k: v for k, v in headers.items() if not k.startswith(PUBLISH_HEADER_PREFIXES)}


async def stored(js: Any, stream: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """Every message of `stream` from sequence 1 (raises if one is missing): subject, data, headers."""
    info = await js.stream_info(stream)
    messages = [await js.get_msg(stream, seq) for seq in range(1, info.state.last_seq + 1)]
    return [(m.subject, m.data, m.headers or {}) for m in messages]


async def write_history(url: str, processes: Processes) -> tuple[list[tuple[str, bytes, dict[str, str]]], int]:
    """A sequencer's history with a snapshot in it, plus commands it never saw; its events and the tasks
    stream's last sequence."""
    client, js = await connect(NatsOptions(servers=(url,)), "test-history")
    try:
        sequencer = processes.start("sequencer", "sequencer", "--nats", url, "--snapshot-every", "20")
        # All at once: the sequencer handles several per round and appends their events as an atomic batch.
        await asyncio.gather(*(publish_command(js, card_command(f"c{n}")) for n in range(CARDS)))
        store = await js.object_store(subjects.SNAPSHOT_BUCKET)
        await until(lambda: _events_at_least(js, CARDS), 60, "the sequencer to sequence every command")
        await until(
            lambda: store.get(subjects.SNAPSHOT_OBJECT),
            30,
            "a snapshot",
            retry_on=(nats.js.errors.ObjectNotFoundError,),
        )
        processes.kill(sequencer, signal.SIGTERM)
        for n in range(PENDING):
            await publish_command(js, card_command(f"pending{n}"))
        # A task request (a prompt) of the old history: it must not travel, and its number not be reused.
        await js.publish(subjects.task_subject("node-a", "inst-a", "old-task"), b"a user's prompt")
        tasks = await js.stream_info(subjects.TASKS_STREAM)
        return await stored(js, subjects.EVENTS_STREAM), tasks.state.last_seq
    finally:
        await client.close()


async def _events_at_least(js: Any, count: int) -> bool:
    return bool((await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq >= count)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Migrated]:
    root = tmp_path_factory.mktemp("migrate")
    (root / "logs").mkdir()
    processes = Processes(root / "logs")
    old = start_nats_server(root / "old", port=-1, log_file=root / "logs" / "old-nats.log")
    cluster: list[NatsServer] = []
    try:
        source_events, tasks_last_seq = asyncio.run(write_history(old.url, processes))
        source_state = asyncio.run(fetch_state(NatsOptions(servers=(old.url,))))
        old.stop()
        cluster = start_nats_cluster(root / "cluster")
        target = NatsOptions(servers=tuple(s.url for s in cluster), replicas=3)
        progress: list[tuple[int, int]] = []
        report = migrate_standalone_store(
            root / "old" / "jetstream", target, lambda copied, total: progress.append((copied, total))
        )
        assert report is not None
        yield Migrated(
            old_store=root / "old" / "jetstream",
            target=target,
            report=report,
            progress=progress,
            source_events=source_events,
            source_state=source_state,
            source_tasks_last_seq=tasks_last_seq,
            target_state=asyncio.run(fetch_state(target)),
            processes=processes,
        )
    finally:
        processes.stop_all()
        old.stop()
        for server in cluster:
            server.stop()


async def test_every_event_keeps_its_sequence_subject_data_and_headers(migrated: Migrated) -> None:
    client, js = await connect(migrated.target, "test-reader", declare_streams=False)
    try:
        copied = await stored(js, subjects.EVENTS_STREAM)
    finally:
        await client.close()
    assert len(migrated.source_events) >= CARDS
    # The sequencer appended some in atomic batches (headers saying so): each copy is appended on its own,
    # following the one before it.
    assert any(Header.BATCH_COMMIT.value in headers for _, _, headers in migrated.source_events)
    for seq, (_, _, headers) in enumerate(copied[: len(migrated.source_events)], 1):
        assert headers[subjects.EXPECTED_LAST_SEQUENCE_HEADER] == str(seq - 1)
    assert [_as_written(e) for e in copied[: len(migrated.source_events)]] == list(
        map(_as_written, migrated.source_events)
    )
    assert migrated.report.events == len(migrated.source_events)
    assert migrated.report.pending_commands == PENDING
    total = len(migrated.source_events) + PENDING
    assert migrated.progress[-1] == (total, total)


def test_the_target_folds_to_the_same_state_from_a_snapshot_at_the_head(migrated: Migrated) -> None:
    assert len(migrated.source_state.custom_cards) == CARDS
    assert migrated.target_state == migrated.source_state
    assert migrated.report.snapshot_seq == migrated.source_state.last_seq == len(migrated.source_events)

    async def snapshot() -> State:
        client, js = await connect(migrated.target, "test-reader", declare_streams=False)
        try:
            return await load_snapshot(js)
        finally:
            await client.close()

    assert asyncio.run(snapshot()) == migrated.source_state


async def test_commands_accepted_while_stopped_are_sequenced_by_the_new_cluster(migrated: Migrated) -> None:
    urls = [arg for url in migrated.target.servers for arg in ("--nats", url)]
    migrated.processes.start("target-sequencer", "sequencer", *urls, "--replicas", "3")
    client, js = await connect(migrated.target, "test-commands", declare_streams=False)
    try:
        # A new command after the carried ones: numbered below the old stream's last, it would be skipped as
        # handled.
        _, new_seq = await publish_command(js, card_command("after-migration"))
        assert new_seq == migrated.source_state.last_command_seq + PENDING + 1
        task = await js.publish(subjects.task_subject("node-a", "inst-a", "new-task"), b"a new prompt")
        assert task.seq == migrated.source_tasks_last_seq + 1
        expected = {f"migrate/pending{n}" for n in range(PENDING)} | {"migrate/after-migration"}
        state = State()

        async def sequenced() -> bool:
            nonlocal state
            state = await fetch_state(migrated.target)
            return expected <= set(state.custom_cards)

        await until(sequenced, 60, lambda: f"the carried commands' cards; has {sorted(state.custom_cards)[-3:]}")
        assert len(state.custom_cards) == CARDS + PENDING + 1
    finally:
        await client.close()


def test_the_old_store_is_kept_aside_and_a_second_run_does_nothing(migrated: Migrated) -> None:
    backup = migrated.report.backup_dir
    assert backup is not None and backup.parent == migrated.old_store.parent
    assert backup.name.startswith("jetstream.standalone-")
    assert (backup / "jetstream" / "$G" / "streams" / subjects.EVENTS_STREAM).is_dir()
    assert not migrated.old_store.exists()
    assert migrate_standalone_store(migrated.old_store, migrated.target) is None


def test_a_target_with_a_history_of_its_own_is_refused_and_nothing_moves(migrated: Migrated) -> None:
    backup = migrated.report.backup_dir
    assert backup is not None
    with pytest.raises(MigrationError, match="already holds a history"):
        migrate_standalone_store(backup, migrated.target)
    assert sorted(p.name for p in backup.parent.iterdir() if p.name.startswith("jetstream")) == [backup.name]


def test_a_store_a_running_server_uses_is_refused_and_stays(tmp_path: Path) -> None:
    server = start_nats_server(tmp_path / "nats", port=-1)
    try:
        asyncio.run(_publish_one_command(server.url))
        store = tmp_path / "nats" / "jetstream"
        with pytest.raises(StoreInUseError, match=f"pid {server.process.pid}"):
            migrate_standalone_store(store, NatsOptions(servers=(server.url,)))
        assert store.is_dir()
        assert [p.name for p in store.parent.iterdir() if p.name.startswith("jetstream")] == ["jetstream"]
    finally:
        server.stop()


async def _publish_one_command(url: str) -> None:
    client, js = await connect(NatsOptions(servers=(url,)), "test-busy")
    try:
        await publish_command(js, card_command("busy"))
    finally:
        await client.close()
