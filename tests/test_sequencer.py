"""The sequencer as a process: exactly-once outcomes, standby takeover, stale leaders, snapshots.

Every test runs real `python -m jetshard sequencer` processes against a nats-server of its own. Deadlines
are generous; the one timing asserted is a takeover within 5 s of a leader's kill -9 (with a 1 s lease).
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time

import msgspec
import nats
import nats.js.errors
import pytest
from helpers.cards import tiny_card
from helpers.harness import until
from helpers.states import envelope_of
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import Liveness, keep_alive
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings, declare, subscribe_events
from jetshard_schema import subjects
from jetshard_schema.cards import ModelCard
from jetshard_schema.codec import decode_command, decode_event, decode_state, encode
from jetshard_schema.commands import AddCustomModelCard, ReportNodeProfile
from jetshard_schema.events import CommandRejected, CustomModelCardAdded, EventEnvelope, NodeJoined
from jetshard_schema.ids import CommandId, NodeId
from jetshard_schema.state import State, apply
from jetshard_schema.types import NodeProfile, RejectCode
from jetshard_sequencer.service import atomic_batch_headers, next_commands
from nats.js.api import AckPolicy, ConsumerConfig

pytestmark = pytest.mark.timeout(120)

PROFILE = NodeProfile(hostname="h", os="Linux", cpu_cores=2, memory_total_bytes=8 << 30, memory_available_bytes=4 << 30)


def card(name: str) -> ModelCard:
    return tiny_card(f"burst/{name}")


def add_card(name: str) -> AddCustomModelCard:
    return AddCustomModelCard(card=card(name))


async def all_events(js) -> list[tuple[int, EventEnvelope | None]]:
    """Every stored event, in order, with its stream sequence (None where it does not decode)."""
    info = await js.stream_info(subjects.EVENTS_STREAM)
    got: list[tuple[int, EventEnvelope | None]] = []

    async def collect(msg) -> None:
        got.append((msg.metadata.sequence.stream, decode_event(msg.data)))

    if info.state.last_seq == 0:
        return got
    subscription = await subscribe_events(js, collect, 1)
    try:
        await until(lambda: len(got) >= info.state.last_seq, 30, "reading the event stream")
    finally:
        await subscription.unsubscribe()
    return got


def assert_gapless(events: list[tuple[int, EventEnvelope | None]]) -> list[EventEnvelope]:
    seqs = [seq for seq, _ in events]
    assert seqs == list(range(1, len(events) + 1)), "the event stream has a gap"
    envelopes = [envelope for _, envelope in events]
    assert all(e is not None for e in envelopes), "an event does not decode"
    return [e for e in envelopes if e is not None]


def outcomes_per_command(envelopes: list[EventEnvelope]) -> dict[CommandId, list[EventEnvelope]]:
    per: dict[CommandId, list[EventEnvelope]] = collections.defaultdict(list)
    for envelope in envelopes:
        per[envelope.command_id].append(envelope)
    return per


async def follow(js) -> StateFollower:
    follower = StateFollower(js)
    await follower.start()
    return follower


def sequencer(processes, name: str, url: str, *extra: str):
    """A sequencer whose id (in the lease and in its consumers' names) is its process's name."""
    return processes.start(name, "sequencer", "--nats", url, "--lease-ttl-s", "1", "--sequencer-id", name, *extra)


async def lease_holder(js) -> str | None:
    """The id of the sequencer holding the leader lease; None while no one does."""
    kv = await js.key_value(subjects.LEADER_BUCKET)
    try:
        entry = await kv.get(subjects.LEADER_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None
    return (entry.value or b"").decode()


async def terms(js, name: str) -> set[str]:
    """`name`'s leadership terms, by their command consumers: a leader reads commands through a consumer of
    its own per term, named after it, made once it has caught up and deleted when the term ends."""
    prefix = f"{subjects.SEQUENCER_DURABLE}-{name}-"
    return {c.name for c in await js.consumers_info(subjects.COMMANDS_STREAM) if c.name.startswith(prefix)}


async def leading(js, name: str, after: frozenset[str] = frozenset(), timeout_s: float = 30) -> frozenset[str]:
    """Wait until `name` holds the lease and reads commands in a term not among `after`; its terms then."""
    current: frozenset[str] = frozenset()

    async def leads() -> bool:
        nonlocal current
        current = frozenset(await terms(js, name))
        return bool(current - after) and await lease_holder(js) == name

    await until(leads, timeout_s, f"{name} to lead")
    return current


async def standby_ready(js) -> None:
    """A standby logs nothing while it waits; it is ready once its State replica's consumer exists (next to
    the test's own follower): from then on it only tries the lease."""

    async def both_consumers_exist() -> bool:
        return (await js.stream_info(subjects.EVENTS_STREAM)).state.consumer_count >= 2

    await until(both_consumers_exist, 30, "the standby's State replica", interval_s=0.1)


async def leader_and_standby(processes, js, url: str):
    """seq1 leading and seq2 standing by; the leader's process."""
    leader = sequencer(processes, "seq1", url)
    await leading(js, "seq1")
    sequencer(processes, "seq2", url)
    await standby_ready(js)
    return leader


async def test_the_same_command_published_twice_gives_one_set_of_events(bus, fresh_nats, processes) -> None:
    _, js = bus
    follower = await follow(js)
    sequencer(processes, "seq1", fresh_nats.url)
    command = add_card("twice")
    command_id, first_seq = await publish_command(js, command, CommandId("cmd-twice"))
    _, second_seq = await publish_command(js, command, CommandId("cmd-twice"))
    assert first_seq == second_seq  # JETSHARD_COMMANDS stored it once (Nats-Msg-Id)
    await follower.wait_until(lambda s: card("twice").model_id in s.custom_cards, 30)
    await publish_command(js, add_card("after"), CommandId("cmd-after"))
    await follower.wait_until(lambda s: card("after").model_id in s.custom_cards, 30)
    per = outcomes_per_command(assert_gapless(await all_events(js)))
    assert [type(e.event) for e in per[command_id]] == [CustomModelCardAdded]
    await follower.stop()


async def test_commands_published_while_no_sequencer_runs_are_applied_once_one_starts(
    bus, fresh_nats, processes
) -> None:
    _, js = bus
    ids = [(await publish_command(js, add_card(f"early-{n}")))[0] for n in range(25)]
    follower = await follow(js)
    assert follower.state.custom_cards == {}
    sequencer(processes, "seq1", fresh_nats.url)
    await follower.wait_until(lambda s: len(s.custom_cards) == 25, 60)
    per = outcomes_per_command(assert_gapless(await all_events(js)))
    assert sorted(per) == sorted(ids)
    assert all(len(events) == 1 for events in per.values())
    await follower.stop()


async def test_a_command_redelivered_after_the_dedupe_window_has_one_outcome(fresh_nats, processes) -> None:
    """Within the dedupe window JetStream drops a repeated `Nats-Msg-Id` (commands and events alike). After
    it, two mechanisms keep one outcome per command:

    * a command *redelivered* (same stream sequence: a leader stored its events, then died before acking
      it) is skipped because its `command_seq` is not above `State.last_command_seq`, which every event
      envelope carries. This test stores such a command and its event by hand, as a leader that died
      before its ack would have, waits past the window, then starts a sequencer: the command comes to
      it again, but its event is not stored twice.
    * a command *republished* with the same id after the window is a new message (a new stream sequence),
      so it is handled again; handlers are idempotent on State for what nodes repeat (the same profile
      report from the same session gives no event), which the second half checks.
    """
    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test", BusTimings(dedupe_window_s=1))
    try:
        command = add_card("dead-leader")
        command_id, command_seq = await publish_command(js, command, CommandId("cmd-dead-leader"))
        added = CustomModelCardAdded(card=msgspec.structs.replace(command.card, is_custom=True))
        envelope = envelope_of(added, command_id, command_seq)
        await js.publish(
            envelope.event.subject,
            encode(envelope),
            headers={subjects.MSG_ID_HEADER: f"{command_id}/0", subjects.EXPECTED_LAST_SEQUENCE_HEADER: "0"},
        )
        await asyncio.sleep(1.5)  # deliberate timing: past the dedupe window of both streams

        sequencer(processes, "seq1", fresh_nats.url)
        await leading(js, "seq1")
        # The sequencer declared the streams with its own (default) window; shorten it again for the rest.
        await declare(js, BusTimings(dedupe_window_s=1))
        info = await js.stream_info(subjects.COMMANDS_STREAM)
        assert info.config.duplicate_window == 1

        follower = await follow(js)
        report = ReportNodeProfile(node_id=NodeId("node-r"), session_id="s1", profile=PROFILE)
        report_id, first = await publish_command(js, report, CommandId("cmd-report"))
        await follower.wait_until(lambda s: "node-r" in s.nodes, 30)
        await asyncio.sleep(1.5)  # deliberate timing: past the dedupe window again
        _, second = await publish_command(js, report, CommandId("cmd-report"))
        assert second > first  # stored again: the window had passed
        _marker_id, _ = await publish_command(js, add_card("marker"))
        await follower.wait_until(lambda s: card("marker").model_id in s.custom_cards, 30)
        per = outcomes_per_command(assert_gapless(await all_events(js)))
        assert [type(e.event) for e in per[command_id]] == [CustomModelCardAdded]
        assert [type(e.event) for e in per[report_id]] == [NodeJoined]
        assert len(per) == 3
        await follower.stop()
    finally:
        await client.close()


@pytest.mark.timeout(180)
async def test_kill_9_of_the_leader_during_a_burst_loses_and_duplicates_nothing(bus, fresh_nats, processes) -> None:
    _, js = bus
    follower = await follow(js)
    leader = await leader_and_standby(processes, js, fresh_nats.url)

    count = 2000
    ids = [CommandId(f"burst-{n}") for n in range(count)]
    acks = [
        await js.publish_async(
            add_card(f"m-{n}").subject, encode(add_card(f"m-{n}")), headers={subjects.MSG_ID_HEADER: ids[n]}
        )
        for n in range(count)
    ]
    await asyncio.gather(*acks)
    await follower.wait_until(lambda s: s.last_seq >= 200, 60)
    processes.kill(leader, signal.SIGKILL)
    killed_at = time.monotonic()
    killed_at_seq = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
    # takeover: from the kill to the first event the new leader appended
    await follower.wait_until(lambda s: s.last_seq > killed_at_seq or s.last_seq >= count, 30)
    takeover_s = time.monotonic() - killed_at
    print(f"\nleader killed at event {killed_at_seq}; events flowed again after {takeover_s:.2f} s")
    assert takeover_s <= 5
    await follower.wait_until(lambda s: len(s.custom_cards) >= count, 60)
    await leading(js, "seq2")

    per = outcomes_per_command(assert_gapless(await all_events(js)))
    assert sorted(per) == sorted(ids)
    duplicated = {cid: [type(e.event).__name__ for e in events] for cid, events in per.items() if len(events) != 1}
    assert duplicated == {}
    assert all(isinstance(events[0].event, CustomModelCardAdded) for events in per.values())
    await follower.stop()


async def test_fetching_commands_leaves_no_request_open_to_take_the_next_one(bus) -> None:
    """The sequencer waits for one command, then takes exactly as many as are pending. A fetch that returns with
    fewer commands than it asked for leaves its request open on the server; the next command then went to that
    spent request and reached the sequencer only when it expired, up to 0.2 s later, on the way of every
    request's first token."""
    _, js = bus
    config = ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=-1)
    commands = await js.pull_subscribe(
        f"{subjects.COMMAND_PREFIX}.>", durable="fetching", stream=subjects.COMMANDS_STREAM, config=config
    )
    assert await next_commands(commands, batch_size=256) == []
    for count in (1, 3, 1):
        # The fetch waits (the server holds its request) when the commands arrive.
        fetching = asyncio.create_task(next_commands(commands, batch_size=256))
        await asyncio.sleep(0.05)
        for n in range(count):
            await publish_command(js, add_card(f"fetched-{count}-{n}"))
        fetched = await fetching
        while len(fetched) < count:  # the rest of a burst that came while the first was taken
            fetched += await next_commands(commands, batch_size=256)
        assert [decode_command(m.data).card.model_id for m in fetched] == [  # type: ignore[union-attr]
            f"burst/fetched-{count}-{n}" for n in range(count)
        ]
        assert (await commands.consumer_info()).num_waiting == 0
        await fetched[-1].ack()


async def test_an_append_with_a_stale_expected_sequence_is_refused(bus) -> None:
    _, js = bus
    envelope = envelope_of(CustomModelCardAdded(card=card("stale")))
    headers = {subjects.EXPECTED_LAST_SEQUENCE_HEADER: "0", subjects.MSG_ID_HEADER: "c/0"}
    await js.publish(envelope.event.subject, encode(envelope), headers=headers)
    with pytest.raises(nats.js.errors.APIError) as raised:
        await js.publish(envelope.event.subject, encode(envelope), headers={**headers, subjects.MSG_ID_HEADER: "d/0"})
    assert raised.value.err_code == 10071


async def test_a_batch_of_appends_following_a_stale_sequence_is_refused_whole(bus) -> None:
    """A leader appends a round's events as one atomic batch, only the first naming the sequence it follows:
    nothing of a stale leader's batch may be stored, not even the events after the first."""
    client, js = bus
    assert (await js.stream_info(subjects.EVENTS_STREAM)).config.allow_atomic

    async def append_batch(name: str, last_seq: int) -> None:
        for position, batch_headers in enumerate(atomic_batch_headers(3, last_seq), 1):
            envelope = EventEnvelope(
                command_id=CommandId(name),
                command_seq=1,
                index=position - 1,
                count=3,
                at_ms=0,
                event=CustomModelCardAdded(card=card(f"{name}-{position}")),
            )
            headers = {subjects.MSG_ID_HEADER: f"{name}/{position}", **batch_headers}
            if position < 3:
                await client.publish(envelope.event.subject, encode(envelope), headers=headers)
            else:
                await asyncio.wait_for(js.publish(envelope.event.subject, encode(envelope), headers=headers), 5)

    await append_batch("leader", 0)
    with pytest.raises(nats.js.errors.APIError) as raised:
        await append_batch("stale", 0)
    assert raised.value.err_code == 10071
    assert [e.command_id for e in assert_gapless(await all_events(js))] == ["leader"] * 3


@pytest.mark.timeout(180)
async def test_a_paused_leader_steps_down_when_it_resumes(bus, fresh_nats, processes) -> None:
    _, js = bus
    follower = await follow(js)
    old = await leader_and_standby(processes, js, fresh_nats.url)
    old_terms = await terms(js, "seq1")

    ids: list[CommandId] = []

    async def publish(n: int) -> None:
        ids.append((await publish_command(js, add_card(f"p-{n}"), CommandId(f"p-{n}")))[0])

    for n in range(20):
        await publish(n)
    await follower.wait_until(lambda s: len(s.custom_cards) >= 20, 30)
    old.send_signal(signal.SIGSTOP)
    try:
        await leading(js, "seq2")  # lease TTL 1 s: the standby takes over
        for n in range(20, 60):
            await publish(n)
        old.send_signal(signal.SIGCONT)
        for n in range(60, 300):  # keep commands coming while the old leader wakes up
            await publish(n)
            await asyncio.sleep(0.005)  # deliberate pacing: commands keep arriving while the old leader wakes
    finally:
        old.send_signal(signal.SIGCONT)

    async def stepped_down() -> bool:
        return old_terms.isdisjoint(await terms(js, "seq1"))

    await until(stepped_down, 30, "the old leader to step down (end its term)")
    await follower.wait_until(lambda s: len(s.custom_cards) >= 300, 60)
    assert old.poll() is None  # it stepped down and waits as a standby, it did not crash
    per = outcomes_per_command(assert_gapless(await all_events(js)))
    assert sorted(per) == sorted(ids)
    assert {cid: len(events) for cid, events in per.items() if len(events) != 1} == {}
    await follower.stop()


async def test_garbage_commands_are_rejected_and_the_sequencer_carries_on(bus, fresh_nats, processes) -> None:
    _client, js = bus
    follower = await follow(js)
    seq = sequencer(processes, "seq1", fresh_nats.url)
    garbage = follower.expect(CommandId("garbage-1"))
    wrong_shape = follower.expect(CommandId("garbage-2"))
    await js.publish("jetshard.cmd.x", b"\x00not json at all", headers={subjects.MSG_ID_HEADER: "garbage-1"})
    await js.publish(
        "jetshard.cmd.x",
        b'{"type": "AddCustomModelCard", "card": {"model_id": 7}}',
        headers={subjects.MSG_ID_HEADER: "garbage-2"},
    )
    for outcome in (await asyncio.wait_for(garbage, 30), await asyncio.wait_for(wrong_shape, 30)):
        assert len(outcome) == 1
        rejected = outcome[0].event
        assert isinstance(rejected, CommandRejected)
        assert rejected.code is RejectCode.INVALID
        assert rejected.command_type == "x"
        assert rejected.reason.startswith("malformed command")
    valid = follower.expect(CommandId("valid"))
    await publish_command(js, add_card("valid"), CommandId("valid"))
    assert isinstance((await asyncio.wait_for(valid, 30))[0].event, CustomModelCardAdded)
    assert seq.poll() is None
    await follower.stop()


async def test_a_new_follower_starts_from_the_snapshot(bus, fresh_nats, processes) -> None:
    _, js = bus
    sequencer(processes, "seq1", fresh_nats.url, "--snapshot-every", "50")
    acks = [
        await js.publish_async(
            add_card(f"s-{n}").subject, encode(add_card(f"s-{n}")), headers={subjects.MSG_ID_HEADER: f"s-{n}"}
        )
        for n in range(120)
    ]
    await asyncio.gather(*acks)
    first = await follow(js)
    await first.wait_until(lambda s: s.last_seq >= 120, 60)
    await first.stop()

    store = await js.object_store(subjects.SNAPSHOT_BUCKET)
    # The sequencer writes it just after the events it covers.
    await until(
        lambda: store.get(subjects.SNAPSHOT_OBJECT),
        30,
        "a snapshot to be written",
        interval_s=0.1,
        retry_on=(nats.js.errors.ObjectNotFoundError,),
    )
    snapshot = decode_state((await store.get(subjects.SNAPSHOT_OBJECT)).data or b"")
    assert 50 <= snapshot.last_seq <= 120

    from_snapshot = await follow(js)
    await from_snapshot.wait_until(lambda s: s.last_seq >= 120, 30)
    await from_snapshot.stop()
    rebuilt = State()
    for seq, envelope in await all_events(js):
        assert envelope is not None
        rebuilt = apply(rebuilt, envelope.event, seq, envelope.command_seq)
    assert from_snapshot.state == rebuilt
    assert len(rebuilt.custom_cards) == 120


async def test_a_failing_node_expiry_ends_the_term_and_the_sequencer_leads_again(bus, fresh_nats, processes) -> None:
    """Node expiry runs beside the command loop for a whole term; when it fails (here the liveness bucket is
    deleted under it, which nats-py reports as every key missing) the leader must neither declare live nodes
    lost nor go on leading without expiry: it steps down, restarts as a standby and leads again."""
    _, js = bus
    follower = await follow(js)
    sequencer(processes, "seq1", fresh_nats.url, "--liveness-ttl-s", "2")
    first_term = await leading(js, "seq1")
    node = NodeId("node-live")
    stop_heartbeat = asyncio.Event()
    heartbeat = asyncio.create_task(keep_alive(js, node, "s1", Liveness(2.0), stop_heartbeat))
    try:
        await publish_command(js, ReportNodeProfile(node_id=node, session_id="s1", profile=PROFILE))
        await follower.wait_until(lambda s: node in s.nodes, 30)

        await js.delete_key_value(subjects.LIVENESS_BUCKET)
        await leading(js, "seq1", after=first_term)
        assert "the liveness bucket" in processes.log("seq1")  # the operator is told why the term ended
        await publish_command(js, add_card("after-restart"))
        await follower.wait_until(lambda s: card("after-restart").model_id in s.custom_cards, 30)
        assert node in follower.state.nodes  # its heartbeat went on; it was never lost
    finally:
        stop_heartbeat.set()
        await heartbeat
    # Expiry works again in the new term: the node whose heartbeat stopped is lost.
    await follower.wait_until(lambda s: node not in s.nodes, 30)
    await follower.stop()


async def test_a_command_delivered_to_the_leader_but_lost_on_the_way_is_still_handled(
    bus, fresh_nats, processes
) -> None:
    """A pull consumer counts a command as delivered once it sends it. When the delivery never reaches the
    leader (its NATS server died mid-fetch: seen with a three-server cluster), acking a later command
    (AckPolicy.ALL) would ack the lost one too, and it would never have an outcome. Here the window is held
    open: the leader is paused just long enough for its pull requests to expire, and another client takes
    the next command from the leader's own consumer and drops it."""
    _, js = bus
    follower = await follow(js)
    leader = sequencer(processes, "seq1", fresh_nats.url, "--lease-ttl-s", "30")  # the pause must not end its term
    (consumer,) = await leading(js, "seq1")
    await publish_command(js, add_card("before"), CommandId("cmd-before"))
    await follower.wait_until(lambda s: card("before").model_id in s.custom_cards, 30)

    thief = await js.pull_subscribe_bind(consumer, subjects.COMMANDS_STREAM)
    leader.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(1)  # deliberate: the paused leader's pull requests (0.2 s each) expire on the server
        await publish_command(js, add_card("lost"), CommandId("cmd-lost"))
        (stolen,) = await thief.fetch(1, timeout=5)  # delivered, never acked, never handled: lost on the way
        assert stolen.headers and stolen.headers[subjects.MSG_ID_HEADER] == "cmd-lost"
    finally:
        leader.send_signal(signal.SIGCONT)
        await thief.unsubscribe()
    await publish_command(js, add_card("after"), CommandId("cmd-after"))

    await follower.wait_until(lambda s: card("after").model_id in s.custom_cards, 30)
    await follower.wait_until(lambda s: card("lost").model_id in s.custom_cards, 10)
    per = outcomes_per_command(assert_gapless(await all_events(js)))
    assert [type(e.event) for e in per[CommandId("cmd-lost")]] == [CustomModelCardAdded]
    assert (await terms(js, "seq1")) == {consumer}  # handled in the same term, not by starting over
    await follower.stop()
