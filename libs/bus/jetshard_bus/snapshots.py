"""State snapshots in an Object Store bucket (a snapshot can outgrow NATS's per-message limit).

A snapshot names the events stream it was folded from by the stream's creation time: a stream deleted and
declared again starts its sequence at 1, and a snapshot of the old one would make every follower skip the
new stream's events as already applied.
"""

from __future__ import annotations

import logging

import msgspec
import nats.js.errors
from jetshard_schema.codec import decode_state, encode
from jetshard_schema.state import State
from jetshard_schema.subjects import EVENTS_STREAM, SNAPSHOT_BUCKET, SNAPSHOT_OBJECT
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, StreamInfo

log = logging.getLogger(__name__)

EVENTS_STREAM_CREATED_HEADER = "Jetshard-Events-Stream-Created"


def stream_created(info: StreamInfo) -> str:
    """When the stream was created: it names one incarnation of a stream name."""
    if info.created is None:
        raise RuntimeError(f"the NATS server reports no creation time for {info.config.name}")
    return info.created.isoformat()


async def load_snapshot(js: JetStreamContext) -> State:
    """The latest snapshot of the current events stream, or the empty State when there is none (or it can't
    be read by this version, or it was taken of a stream that has since been deleted and declared again)."""
    store = await js.object_store(SNAPSHOT_BUCKET)
    try:
        result = await store.get(SNAPSHOT_OBJECT)
    except nats.js.errors.ObjectNotFoundError:
        return State()
    snapshot_of = (result.info.headers or {}).get(EVENTS_STREAM_CREATED_HEADER)
    current = stream_created(await js.stream_info(EVENTS_STREAM))
    if snapshot_of != current:
        log.warning(
            "ignoring the snapshot: it was taken of the %s created %s, the stream now was created %s; "
            "rebuilding State from the first event",
            EVENTS_STREAM,
            snapshot_of or "at an unknown time",
            current,
        )
        return State()
    try:
        return decode_state(result.data or b"")
    except msgspec.DecodeError as error:
        log.warning("ignoring an unreadable snapshot (%s); rebuilding State from the first event", error)
        return State()


async def save_snapshot(js: JetStreamContext, state: State, events_created: str) -> None:
    """Store `state`, folded from the events stream created at `events_created`."""
    store = await js.object_store(SNAPSHOT_BUCKET)
    meta = ObjectMeta(name=SNAPSHOT_OBJECT, headers={EVENTS_STREAM_CREATED_HEADER: events_created})
    await store.put(SNAPSHOT_OBJECT, encode(state), meta=meta)
