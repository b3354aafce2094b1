"""The sequencer shell: lease, command consumption, event appends, snapshots, node expiry.

Several sequencers may run; the one holding the lease (a KV key with a TTL) writes, the others follow
the event stream and wait. Every append carries `Nats-Expected-Last-Sequence`, so a leader that lost its
lease without noticing (paused, partitioned) is refused by the stream and steps down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect, disconnect
from jetshard_bus.follower import StateFollower
from jetshard_bus.snapshots import save_snapshot, stream_created
from jetshard_bus.stats import publish_stats
from jetshard_bus.streams import declare
from jetshard_bus.tracing import inject, span_from
from jetshard_schema import subjects
from jetshard_schema.codec import decode_command, encode
from jetshard_schema.commands import ExpireNode, ExpireRequester, ForgetInstance, UnloadIdleInstance
from jetshard_schema.events import CommandRejected, Event, EventEnvelope, TaskAssigned
from jetshard_schema.ids import CommandId, ValidCommandId, new_id
from jetshard_schema.state import State, apply
from jetshard_schema.stats import SequencerStats
from jetshard_schema.types import RejectCode
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, RawStreamMsg, StreamInfo
from nats.js.kv import KeyValue
from opentelemetry.trace import Span, StatusCode

from jetshard_sequencer.config import SequencerConfig
from jetshard_sequencer.handlers import Context, handle, idle_past_keep_alive, misaddressed, past_retention

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071
APPEND_ACK_TIMEOUT_S = 5.0
ATOMIC_BATCH_MAX = 1000
"""nats-server's limit on the messages of one atomic batch."""


@dataclass(frozen=True)
class StoredCommand:
    """A command as the commands stream holds it: delivered by the consumer, or read from the stream where a
    delivery was lost."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]

    @classmethod
    def delivered(cls, msg: Msg) -> StoredCommand:
        return cls(msg.metadata.sequence.stream, msg.subject, msg.data, msg.headers or {})

    @classmethod
    def read(cls, msg: RawStreamMsg) -> StoredCommand:
        assert msg.seq is not None and msg.subject is not None  # a stored message has both
        return cls(msg.seq, msg.subject, msg.data or b"", msg.headers or {})


COMMAND_WAIT_S = 0.2
"""How long one fetch waits for a command: the lease is checked between fetches."""


async def next_commands(subscription: JetStreamContext.PullSubscription, batch_size: int) -> list[Msg]:
    """The next commands, at most `batch_size`; none if none came within `COMMAND_WAIT_S`.

    One command is waited for, then exactly as many more as its delivery says are pending. A single fetch of a
    whole batch would leave its request open on the server once it returned with fewer: a command that arrived
    next went to that spent request, and the fetch waiting then took it only when the spent one expired, up to
    `COMMAND_WAIT_S` later (a request's time to first token drew 0-150 ms more, at random)."""
    try:
        first = await subscription.fetch(1, timeout=COMMAND_WAIT_S)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    pending = min(first[0].metadata.num_pending, batch_size - 1)
    if pending == 0:
        return first
    try:
        return first + await subscription.fetch(pending, timeout=COMMAND_WAIT_S)
    except (TimeoutError, nats.errors.TimeoutError):
        return first


@dataclass
class Standing:
    """What this sequencer's stats say: whether it leads, since which term, what it appended."""

    sequencer_id: str
    term: int = 0
    """The leader key's revision when the lease was taken; 0 while standing by."""
    events_appended: int = 0

    def stats(self, interval_s: float) -> SequencerStats:
        return SequencerStats(
            interval_s=interval_s,
            sequencer_id=self.sequencer_id,
            leading=self.term > 0,
            term=self.term,
            events_appended=self.events_appended,
        )


class StaleLeaderError(RuntimeError):
    pass


class LivenessUnknownError(RuntimeError):
    pass


async def run_sequencer(config: SequencerConfig, stop: asyncio.Event) -> None:
    client, js = await connect(config.nats, f"jetshard-sequencer {config.sequencer_id}", config.timings)
    standing = Standing(config.sequencer_id)
    stats = asyncio.create_task(publish_stats(client, standing.stats))
    try:
        while not stop.is_set():
            try:
                await _follow_then_lead(client, js, config, stop, standing)
            except Exception as error:
                # NATS timeouts under load, a JetStream still electing its leaders after a network cut: start over
                # as a standby. Those are expected, and said in a line; anything else is a bug, with its traceback.
                if isinstance(error, nats.errors.Error | TimeoutError):
                    name = type(error).__name__
                    log.warning("sequencer %s: starting over as a standby (%s: %s)", config.sequencer_id, name, error)
                else:
                    log.exception("sequencer %s: starting over as a standby", config.sequencer_id)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        stats.cancel()
        await disconnect(client)


async def _follow_then_lead(
    client: Client, js: JetStreamContext, config: SequencerConfig, stop: asyncio.Event, standing: Standing
) -> None:
    """Follow the events as a standby until the lease is ours, then lead until stopped or stale."""
    # Each term starts from the streams and buckets as they should be: one may have been deleted since.
    await declare(js, config.timings, replicas=config.nats.replicas)
    follower = StateFollower(js)
    await follower.start()
    try:
        lease = Lease(js, config.sequencer_id, config.timings.lease_ttl_s)
        await _wait_for_lease(lease, stop)
        if stop.is_set():
            return
        started = time.monotonic()
        events_info = await js.stream_info(subjects.EVENTS_STREAM)
        last_seq = events_info.state.last_seq
        await _caught_up(follower, last_seq)
    finally:
        await follower.stop()
    log.info(
        "sequencer %s leads from event %d (took over in %.2f s)",
        config.sequencer_id,
        last_seq,
        time.monotonic() - started,
    )
    leader = Leader(client, js, config, follower.state, follower.partial, last_seq, lease, events_info, standing)
    standing.term = lease.term
    try:
        await leader.run(stop)
    except* StaleLeaderError as stale:
        log.warning("stepping down: %s", stale.exceptions[0])
    finally:
        standing.term = 0
        await lease.release()


async def _stopped_within(stop: asyncio.Event, timeout_s: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout_s)
    return stop.is_set()


async def _caught_up(follower: StateFollower, last_seq: int) -> None:
    await follower.wait_until(lambda _: follower.received_seq >= last_seq, 30)


async def _wait_for_lease(lease: Lease, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            if await lease.try_acquire():
                return
        except Exception as error:  # a slow or briefly unreachable server: keep waiting as a standby
            log.warning("could not try the lease: %s", error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), lease.ttl_s / 6)


class Lease:
    """The leader lease: a KV key created by one sequencer and renewed well within its TTL."""

    def __init__(self, js: JetStreamContext, holder: str, ttl_s: float) -> None:
        self._js = js
        self.holder = holder
        self.ttl_s = ttl_s
        self._revision: int | None = None
        self.term = 0
        """The key's revision when this lease was taken: every new holder's is larger."""

    async def try_acquire(self) -> bool:
        kv = await self._js.key_value(subjects.LEADER_BUCKET)
        try:
            self._revision = await kv.create(subjects.LEADER_KEY, self.holder.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        self.term = self._revision
        return True

    async def renew(self) -> None:
        """Raises StaleLeaderError when someone else holds the lease now."""
        kv = await self._js.key_value(subjects.LEADER_BUCKET)
        try:
            self._revision = await kv.update(subjects.LEADER_KEY, self.holder.encode(), last=self._revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError) as error:
            raise StaleLeaderError(f"lease lost: {error}") from error

    async def release(self) -> None:
        if self._revision is None:
            return
        kv = await self._js.key_value(subjects.LEADER_BUCKET)
        with contextlib.suppress(Exception):
            await kv.delete(subjects.LEADER_KEY, last=self._revision)
        self._revision = None


class Leader:
    def __init__(
        self,
        client: Client,
        js: JetStreamContext,
        config: SequencerConfig,
        state: State,
        partial: list[tuple[int, EventEnvelope]],
        last_seq: int,
        lease: Lease,
        events: StreamInfo,
        standing: Standing,
    ) -> None:
        self._client = client
        self._js = js
        self._config = config
        self.state = state
        self._partial = partial
        self._last_seq = last_seq
        self._lease = lease
        self._renewed_at = time.monotonic()  # the lease was acquired just before this leader was made
        self._since_snapshot = 0
        self._events_created = stream_created(events)
        """The incarnation of the events stream this term appends to, named in its snapshots."""
        self._append_batch_max = ATOMIC_BATCH_MAX if events.config.allow_atomic else 1
        """Events stored together (and synced to disk once) per append; 1 where the server has no atomic batches
        (before nats-server 2.12)."""
        self._standing = standing
        self._next_command_seq = state.last_command_seq + 1
        """The stream sequence of the next command this term expects: where its consumer starts, then one past
        the last command it handled."""

    async def run(self, stop: asyncio.Event) -> None:
        # A consumer of this leadership term's own, starting right after the last command with events.
        # A shared durable would still hold the commands a dead (or paused) leader had fetched but not
        # acked: they would come back only after ack_wait, behind newer commands, and be skipped as done.
        consumer = f"{subjects.SEQUENCER_DURABLE}-{self._config.sequencer_id}-{new_id()[:8]}"
        subscription = await self._js.pull_subscribe(
            f"{subjects.COMMAND_PREFIX}.>",
            durable=consumer,
            stream=subjects.COMMANDS_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.ALL,
                ack_wait=30,
                max_deliver=-1,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self._next_command_seq,
                max_ack_pending=-1,
                inactive_threshold=60,
            ),
        )
        try:
            # The lease and the housekeeping run beside the commands for the whole term: if any of the three
            # fails, the group cancels the others and the failure ends the term (a standby starts over).
            async with asyncio.TaskGroup() as term:
                term.create_task(self._renew_lease(stop))
                term.create_task(self._housekeep(stop))
                await self._sequence_commands(subscription, stop)
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
            with contextlib.suppress(Exception):
                await self._js.delete_consumer(subjects.COMMANDS_STREAM, consumer)

    async def _sequence_commands(self, subscription: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        # While one batch's appends are in flight the next batch is fetched and handled: its events
        # follow in the same stream, and its commands are acked only after its own appends are stored.
        in_flight: tuple[list[asyncio.Future[Any]], Msg] | None = None
        while not stop.is_set():
            self._check_lease()
            try:
                messages = await next_commands(subscription, self._config.batch_size)
            except nats.js.errors.APIError as error:  # e.g. our consumer was removed while we were paused
                raise StaleLeaderError(f"reading commands failed: {error}") from error
            self._check_lease()  # the fetch may have waited while the process was paused
            appended = await self._handle_batch(messages) if messages else None
            if in_flight is not None:
                await self._confirm(*in_flight)
            in_flight = (appended, messages[-1]) if appended is not None else None
            if self._since_snapshot >= self._config.snapshot_every and in_flight is None:
                self._since_snapshot = 0
                await save_snapshot(self._js, self.state, self._events_created)
        if in_flight is not None:
            await self._confirm(*in_flight)

    async def _renew_lease(self, stop: asyncio.Event) -> None:
        while not await _stopped_within(stop, self._lease.ttl_s / 3):
            try:
                await self._lease.renew()
                self._renewed_at = time.monotonic()
            except StaleLeaderError:
                raise
            except Exception as error:  # a slow server: the lease holds until its TTL runs out
                if time.monotonic() - self._renewed_at >= self._lease.ttl_s:
                    raise StaleLeaderError(f"could not renew the lease for {self._lease.ttl_s} s: {error}") from error
                log.warning("lease renewal failed, retrying: %s", error)

    def _check_lease(self) -> None:
        """Refuse to lead on a lease older than its TTL. The renewal task's failure cancels the command loop,
        but a cancellation can be swallowed inside a NATS fetch, and a leader paused past its TTL (SIGSTOP, a
        starved VM) wakes with overdue timers: before it handles another command it must know it still leads."""
        if time.monotonic() - self._renewed_at >= self._lease.ttl_s:
            raise StaleLeaderError(f"the lease was not renewed for {self._lease.ttl_s} s")

    async def _handle_batch(self, messages: list[Msg]) -> list[asyncio.Future[Any]]:
        """Handle commands and append their events (see `_append`); returns the appends' acks."""
        appends: list[tuple[str, bytes, dict[str, str]]] = []
        now_ms = int(time.time() * 1000)
        for msg in await self._in_stream_order(messages):
            command_seq = msg.seq
            if command_seq < self.state.last_command_seq or (
                command_seq == self.state.last_command_seq and not self._partial
            ):
                continue  # its events are stored already: redelivered after a crash or a takeover
            already_stored = self._take_partial(command_seq)
            command_id, id_error = _command_id(msg, command_seq)
            with span_from(msg.headers, f"sequencer {_command_type(msg.subject)}") as handling:
                events = self._events_for(msg, command_id, now_ms) if id_error is None else [id_error]
                if handling is not None:
                    _describe(handling, command_id, command_seq, events)
                trace_headers = inject({})
            for index, event in enumerate(events):
                envelope = EventEnvelope(
                    command_id=command_id,
                    command_seq=command_seq,
                    index=index,
                    count=len(events),
                    at_ms=now_ms,
                    event=event,
                )
                if index < len(already_stored):
                    seq = already_stored[index]
                else:
                    headers = {subjects.MSG_ID_HEADER: f"{command_id}/{index}", **trace_headers}
                    appends.append((event.subject, encode(envelope), headers))
                    self._last_seq += 1
                    seq = self._last_seq
                self.state = apply(self.state, event, seq, command_seq)
            self._since_snapshot += len(events)
        return await self._append(appends, self._last_seq - len(appends))

    async def _append(
        self, appends: list[tuple[str, bytes, dict[str, str]]], last_seq: int
    ) -> list[asyncio.Future[Any]]:
        """Publish events to follow stream sequence `last_seq`, pipelined, as atomic batches where the stream
        allows them: a server that syncs every write to disk before acknowledging it then syncs once per batch
        rather than once per event. Returns one ack per batch."""
        acks: list[asyncio.Future[Any]] = []
        for start in range(0, len(appends), self._append_batch_max):
            batch = appends[start : start + self._append_batch_max]
            batch_headers = atomic_batch_headers(len(batch), last_seq + start)
            *staged, last = [
                (subject, data, {**own, **extra})
                for (subject, data, own), extra in zip(batch, batch_headers, strict=True)
            ]
            for subject, data, headers in staged:
                # Only a batch's commit is answered: an answer to the others would be empty, which nats-py
                # cannot read.
                await self._client.publish(subject, data, headers=headers)
            subject, data, headers = last
            acks.append(await self._js.publish_async(subject, data, headers=headers))
        return acks

    async def _confirm(self, acks: list[asyncio.Future[Any]], last: Msg) -> None:
        """Wait until a batch's events are stored, then ack its commands."""
        try:
            # nats-py raises a refused append's error (10071) inside its reply callback instead of failing
            # the future, which then never resolves: an ack that does not come is a refusal too.
            gathered = asyncio.gather(*acks, return_exceptions=True)
            results = await asyncio.wait_for(gathered, APPEND_ACK_TIMEOUT_S)
        except TimeoutError as error:
            raise StaleLeaderError("appended events were not acknowledged (wrong last sequence?)") from error
        for result in results:
            if isinstance(result, nats.js.errors.APIError) and result.err_code == WRONG_LAST_SEQUENCE:
                raise StaleLeaderError("another sequencer appended events (wrong last sequence)")
            if isinstance(result, BaseException):
                raise StaleLeaderError(f"appending events failed: {result!r}")
            if result.duplicate:
                # Cannot happen while the events' dedupe window is shorter than the commands' (streams.py);
                # if it does, our count of the stream's sequence is off: re-read it as a follower.
                raise StaleLeaderError("an appended event was a duplicate; resynchronising")
            self._standing.events_appended += result.batch_size or 1
        # Acked only now that every event is stored: a crash before this redelivers the commands. With
        # AckPolicy.ALL one ack of the batch's last command covers the whole batch.
        await last.ack()

    async def _in_stream_order(self, messages: list[Msg]) -> list[StoredCommand]:
        """The batch's commands in stream order, each once, with any the consumer skipped.

        A pull consumer counts a command as delivered once it sends it, and sends them in stream order. One
        lost on the way (the leader's NATS server died mid-fetch) would come back only after `ack_wait`, and
        acking a later command (AckPolicy.ALL) acks it too: it would never be handled. So a jump in sequence
        is read from the stream itself; what the stream no longer has (expired, deleted) is skipped."""
        ordered: list[StoredCommand] = []
        for msg in map(StoredCommand.delivered, messages):
            if msg.seq < self._next_command_seq:
                continue  # delivered again: handled in this term already
            while (skipped := await self._stored_command_from(self._next_command_seq, before=msg.seq)) is not None:
                log.warning("command %d was delivered but never arrived: read it from the stream", skipped.seq)
                ordered.append(skipped)
                self._next_command_seq = skipped.seq + 1
            ordered.append(msg)
            self._next_command_seq = msg.seq + 1
        return ordered

    async def _stored_command_from(self, first_seq: int, before: int) -> StoredCommand | None:
        """The first command the commands stream holds from `first_seq` on, if it comes before `before`."""
        if first_seq >= before:
            return None
        try:
            raw = await self._js.get_msg(
                subjects.COMMANDS_STREAM, seq=first_seq, subject=f"{subjects.COMMAND_PREFIX}.>", next=True
            )
        except nats.js.errors.NotFoundError:
            return None
        stored = StoredCommand.read(raw)
        return stored if stored.seq < before else None

    def _take_partial(self, command_seq: int) -> list[int]:
        """Sequences of this command's events that a previous leader stored before it died.

        The stored events of an earlier command that is not coming again (gone from the commands stream) are
        applied as they stand, as every follower applies them, so that the next append follows them."""
        if not self._partial or self._partial[0][1].command_seq > command_seq:
            return []
        partial, self._partial = self._partial, []
        if partial[0][1].command_seq == command_seq:
            return [seq for seq, _ in partial]
        for seq, envelope in partial:
            self.state = apply(self.state, envelope.event, seq, envelope.command_seq)
        return []

    def _events_for(self, msg: StoredCommand, command_id: CommandId, now_ms: int) -> list[Event]:
        try:
            command = decode_command(msg.data)
        except msgspec.DecodeError as error:  # a ValidationError too: a bad id among them
            return [
                CommandRejected(
                    command_type=subjects.command_type_name(msg.subject),
                    code=RejectCode.INVALID,
                    reason=f"malformed command: {error}",
                )
            ]
        refused = misaddressed(command, msg.subject)
        if refused is not None:
            return [refused]
        ctx = Context(command_id=command_id, now_ms=now_ms, max_restarts=self._config.max_restarts)
        try:
            return handle(self.state, command, ctx)
        except Exception as error:  # a handler bug must not stop the cluster; the command is answered
            log.exception("handler failed for %s", type(command).__name__)
            return [
                CommandRejected(
                    command_type=type(command).__name__,
                    code=RejectCode.INVALID,
                    reason=f"internal error handling the command: {error}",
                )
            ]

    async def _housekeep(self, stop: asyncio.Event) -> None:
        """Publish the sequencer's own observations, a few times per liveness TTL: `ExpireNode` for a node in
        State whose liveness key lapsed (the bucket's TTL removed it; not in the term's first TTL),
        `ExpireRequester` for an API session that holds tasks and whose key lapsed, `ForgetInstance` for a failed
        instance past its retention, `UnloadIdleInstance` for one idle past its keep-alive.

        Each key is read directly: only the server's own "no such key" counts as lapsed. (Listing the
        bucket's keys is a watch that can come back empty under load, which once declared a live node lost.)
        """
        ttl_s = self._config.timings.liveness_ttl_s
        # A node gets one TTL from the start of this term to be seen alive, as long as its key would have lived: its
        # worker may be starting again with the whole cluster (a stopping worker deletes its key).
        nodes_judged_from = time.monotonic() + ttl_s
        kv = await self._js.key_value(subjects.LIVENESS_BUCKET)
        while not await _stopped_within(stop, ttl_s / 4):
            state = self.state
            judged = time.monotonic() >= nodes_judged_from
            lapsed = [node for node in list(state.nodes.values()) if judged and not await _alive(kv, node.node_id)]
            newest_task: dict[str, int] = {}
            for task in state.tasks.values():
                if task.ref.requester:
                    newest_task[task.ref.requester] = max(newest_task.get(task.ref.requester, 0), task.assigned_seq)
            gone = [r for r in sorted(newest_task) if not await _alive(kv, subjects.requester_key(r))]
            if lapsed or gone:
                await _check_liveness_bucket(self._js)
            # One command per lapse: its id names the node's record (a node back from a network cut keeps its
            # session, and JetStream drops a command whose id it saw in the last 120 s as a duplicate), or the
            # requester's newest task.
            for node in lapsed:
                await publish_command(
                    self._js,
                    ExpireNode(node_id=node.node_id, session_id=node.session_id),
                    CommandId(f"expire-{node.node_id}-{node.session_id}-{node.profile_seq}"),
                )
            for session_id in gone:
                command_id = CommandId(f"expire-api-{session_id}-{newest_task[session_id]}")
                await publish_command(self._js, ExpireRequester(session_id=session_id), command_id)
            now_ms = int(time.time() * 1000)
            for instance_id in past_retention(state, now_ms, self._config.failed_retention_s):
                await publish_command(
                    self._js, ForgetInstance(instance_id=instance_id), CommandId(f"forget-{instance_id}")
                )
            for instance_id in idle_past_keep_alive(state, now_ms):
                # One command per idle spell: the id names when it began, so a spell is unloaded once.
                idle_since = state.instances[instance_id].idle_since_ms
                command_id = CommandId(f"unload-{instance_id}-{idle_since}")
                await publish_command(self._js, UnloadIdleInstance(instance_id=instance_id), command_id)


def atomic_batch_headers(count: int, last_seq: int) -> list[dict[str, str]]:
    """Headers that make `count` appends one atomic batch to follow stream sequence `last_seq`: its first names
    that sequence, and the server stores all of the batch or, the sequence being stale, none of it. A single
    append needs only the sequence."""
    expected = {subjects.EXPECTED_LAST_SEQUENCE_HEADER: str(last_seq)}
    if count == 1:
        return [expected]
    batch_id = new_id()
    return [
        {
            **(expected if position == 1 else {}),
            Header.BATCH_ID.value: batch_id,
            Header.BATCH_SEQUENCE.value: str(position),
            **({Header.BATCH_COMMIT.value: "1"} if position == count else {}),
        }
        for position in range(1, count + 1)
    ]


def _command_id(msg: StoredCommand, command_seq: int) -> tuple[CommandId, CommandRejected | None]:
    """The command's id from its `Nats-Msg-Id`, else `cmd-<seq>`. An id that is not valid is replaced too
    (events may carry only ids every follower can decode), and the command is rejected saying why."""
    fallback = CommandId(f"cmd-{command_seq}")
    header = msg.headers.get(subjects.MSG_ID_HEADER)
    if not header:
        return fallback, None
    try:
        return msgspec.convert(header, ValidCommandId), None
    except msgspec.ValidationError as error:
        return fallback, CommandRejected(
            command_type=subjects.command_type_name(msg.subject),
            code=RejectCode.INVALID,
            reason=f"invalid command id in {subjects.MSG_ID_HEADER}: {error}",
        )


def _command_type(subject: str) -> str:
    """`SubmitTask` for `jetshard.cmd.api.submit_task`: the name a trace shows for the command."""
    snake = subjects.command_type_name(subject)
    return "".join(word.capitalize() for word in snake.split("_"))


def _describe(handling: Span, command_id: CommandId, command_seq: int, events: Sequence[Event]) -> None:
    handling.set_attributes(
        {
            "jetshard.command_id": command_id,
            "jetshard.command_seq": command_seq,
            "jetshard.events": [type(event).__name__ for event in events],
        }
    )
    for event in events:
        if isinstance(event, CommandRejected):
            handling.set_status(StatusCode.ERROR, f"{event.code}: {event.reason}")
        elif isinstance(event, TaskAssigned):
            handling.set_attributes({"jetshard.task_id": event.task.task_id, "jetshard.instance_id": event.instance_id})


async def _alive(kv: KeyValue, key: str) -> bool:
    try:
        await kv.get(key)
    except nats.js.errors.KeyNotFoundError:  # includes a key deleted by a clean stop
        return False
    except Exception as error:
        log.warning("could not read the liveness of %s: %s", key, error)
    return True


async def _check_liveness_bucket(js: JetStreamContext) -> None:
    """nats-py reports a key of a bucket that is gone as not found: every node would seem lost at once."""
    try:
        await js.stream_info(subjects.kv_stream(subjects.LIVENESS_BUCKET))
    except nats.js.errors.NotFoundError as error:
        raise LivenessUnknownError(f"the liveness bucket {subjects.LIVENESS_BUCKET} is gone") from error
