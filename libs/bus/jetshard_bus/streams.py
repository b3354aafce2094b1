"""Declaring jetshard's streams and buckets. Idempotent; only privileged identities (the sequencer, the admin
`jetshard up` connects as) may: the other services wait for them to exist (`wait_for_streams`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import msgspec.json
import nats.errors
import nats.js.errors
from jetshard_schema import subjects
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    Placement,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class BusTimings(msgspec.Struct, frozen=True, kw_only=True):
    """Time settings shared by every service of a cluster (they must agree)."""

    lease_ttl_s: Annotated[
        float, msgspec.Meta(description="a sequencer lease not renewed for this long passes to a standby")
    ] = 3.0
    liveness_ttl_s: Annotated[float, msgspec.Meta(description="a node not heard from for this long is lost")] = 15.0
    """Its liveness key is refreshed every fifth of that."""
    dedupe_window_s: float = 120.0
    """JETSHARD_COMMANDS drops a command whose `Nats-Msg-Id` it stored this recently."""
    task_retention_s: Annotated[
        float,
        msgspec.Meta(
            description="how long a task's request (its prompt) is kept in JETSHARD_TASKS; nothing keeps it longer"
        ),
    ] = 4 * 3600.0
    """Long enough for any task to start, and no user data kept beyond that."""


async def declare(
    js: JetStreamContext, timings: BusTimings = BusTimings(), replicas: int = 1, placement_tag: str | None = None
) -> None:
    """Create what is missing, with `replicas` each (on servers tagged `placement_tag`, if given), and bring
    existing streams' other settings up to date. Replicas and placement of what exists are left as they are:
    only `scale` changes them, so a service started with other flags never shrinks a cluster's streams."""
    placement = Placement(tags=[placement_tag]) if placement_tag else None
    await _ensure_stream(
        js,
        _file_stream(
            subjects.COMMANDS_STREAM,
            subjects.COMMAND_PREFIX,
            max_age=7 * 24 * 3600,
            duplicate_window=timings.dedupe_window_s,
            num_replicas=replicas,
            placement=placement,
            discard=DiscardPolicy.OLD,
        ),
    )
    await _ensure_stream(
        js,
        _file_stream(
            subjects.EVENTS_STREAM,
            subjects.EVENT_PREFIX,
            # Shorter than the commands' window: a command the commands stream accepts again (re-sent after
            # its window) can never collide with its earlier events' ids, which would make an append a silent
            # no-op and throw the sequencer's count of the stream's sequence off.
            duplicate_window=timings.dedupe_window_s / 2,
            num_replicas=replicas,
            placement=placement,
            # Events are the history State is folded from: never discard one silently, and let no one delete
            # or purge them through the API. The log is compacted by State snapshots instead, and user data
            # leaves it through the retention of task data.
            discard=DiscardPolicy.NEW,
            deny_delete=True,
            deny_purge=True,
            # The sequencer appends a round's events as one atomic batch (nats-server 2.12 and later; an older
            # server ignores this and the sequencer appends one by one): one sync to disk for the round.
            allow_atomic=True,
        ),
    )
    await _ensure_stream(
        js,
        _file_stream(
            subjects.TASKS_STREAM,
            subjects.TASK_PREFIX,
            max_age=timings.task_retention_s,
            max_msgs_per_subject=1,
            # A runner reads a request by its subject, which names the runner's node: the one read that NATS
            # permissions can grant per node (a read by sequence could reach any node's requests).
            allow_direct=True,
            duplicate_window=min(timings.dedupe_window_s, timings.task_retention_s),
            num_replicas=replicas,
            placement=placement,
            discard=DiscardPolicy.OLD,
        ),
    )
    await _ensure_kv(
        js,
        KeyValueConfig(
            bucket=subjects.LEADER_BUCKET, ttl=timings.lease_ttl_s, replicas=replicas, history=1, placement=placement
        ),
    )
    await _ensure_kv(
        js,
        KeyValueConfig(
            bucket=subjects.LIVENESS_BUCKET,
            ttl=timings.liveness_ttl_s,
            replicas=replicas,
            history=1,
            placement=placement,
        ),
    )
    try:
        await js.object_store(subjects.SNAPSHOT_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        await js.create_object_store(
            subjects.SNAPSHOT_BUCKET,
            config=ObjectStoreConfig(
                storage=StorageType.FILE,
                replicas=replicas,
                placement=placement,
            ),
        )


def _file_stream(name: str, prefix: str, **config: Any) -> StreamConfig:
    """A stream of every subject under `prefix`, kept on disk until its limits (`config`) drop a message."""
    return StreamConfig(
        name=name,
        subjects=[f"{prefix}.>"],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        **config,
    )


async def wait_for_streams(js: JetStreamContext, wait: bool = True, interval_s: float = 0.5) -> None:
    """Return once every jetshard stream and bucket exists; raises StreamsMissingError if not and not `wait`."""
    logged = False
    while missing := [name for name in subjects.ALL_STREAMS if not await _stream_exists(js, name)]:
        if not wait:
            raise StreamsMissingError(f"NATS has no {', '.join(missing)} yet; is a sequencer running?")
        if not logged:
            log.info("waiting for the sequencer to declare %s", ", ".join(missing))
            logged = True
        await asyncio.sleep(interval_s)


class StreamsMissingError(ConnectionError):
    pass


async def while_unavailable(operation: Callable[[], Awaitable[T]], interval_s: float = 1.0) -> T:
    """`operation()` once JetStream answers it: a cluster electing its leaders (a machine joining or gone)
    answers 503 or nothing for a few seconds, which a starting service waits out rather than dying of."""
    while True:
        try:
            return await operation()
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as error:
            log.warning("JetStream is not ready yet (%s); trying again", error)
            await asyncio.sleep(interval_s)


async def _stream_exists(js: JetStreamContext, name: str) -> bool:
    try:
        await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:  # exists with other settings (e.g. a changed dedupe window)
        existing = (await js.stream_info(config.name or "")).config
        config.num_replicas, config.placement = existing.num_replicas, existing.placement
        await js.update_stream(config)


async def scale(js: JetStreamContext, replicas: int) -> list[str]:
    """Give every jetshard stream and bucket `replicas` copies; returns the names of those that changed.
    JetStream copies the data to the new peers in the background and keeps serving meanwhile."""
    changed = []
    for name in subjects.ALL_STREAMS:
        config = (await js.stream_info(name)).config
        if config.num_replicas != replicas:
            config.num_replicas = replicas
            await js.update_stream(config)
            changed.append(name)
    return changed


async def _ensure_kv(js: JetStreamContext, config: KeyValueConfig) -> None:
    try:
        await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        await js.create_key_value(config)


ORDERED_CONSUMER_HEARTBEAT_S = 1.0
"""The server's idle heartbeat to an ordered consumer. Two missed ones make nats-py recreate the consumer:
a restarted server (or a lost cluster member) forgets ordered consumers, so this bounds how long a follower
goes without events after one (nats-py's default, 5 s, left followers ten seconds behind)."""


MAX_EVENT_SEQ = 2**63 - 1
"""The last event sequence one may ask to start from (JetStream's are unsigned 64-bit; none comes near)."""


async def subscribe_events(
    js: JetStreamContext, cb: Callable[[Msg], Awaitable[None]], start_seq: int | None = None
) -> JetStreamContext.PushSubscription:
    """An ordered push consumer on JETSHARD_EVENTS from `start_seq` (None: only new events), at most
    `MAX_EVENT_SEQ`."""
    if start_seq is None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(start_seq, 1))
    return await js.subscribe(
        f"{subjects.EVENT_PREFIX}.>",
        stream=subjects.EVENTS_STREAM,
        ordered_consumer=True,
        idle_heartbeat=ORDERED_CONSUMER_HEARTBEAT_S,
        config=config,
        cb=cb,
        pending_msgs_limit=1_000_000,
        pending_bytes_limit=1 << 30,
    )
