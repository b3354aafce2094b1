"""State snapshots in an Object Store bucket (a snapshot can outgrow NATS's per-message limit)."""

from __future__ import annotations

import logging

import msgspec
import nats.js.errors
from jetshard_schema.codec import decode_state, encode
from jetshard_schema.state import State
from jetshard_schema.subjects import SNAPSHOT_BUCKET, SNAPSHOT_OBJECT
from nats.js import JetStreamContext

log = logging.getLogger(__name__)


async def load_snapshot(js: JetStreamContext) -> State:
    """The latest snapshot, or the empty State when there is none (or it can't be read by this version)."""
    store = await js.object_store(SNAPSHOT_BUCKET)
    try:
        result = await store.get(SNAPSHOT_OBJECT)
    except nats.js.errors.ObjectNotFoundError:
        return State()
    try:
        return decode_state(result.data or b"")
    except msgspec.DecodeError as error:
        log.warning("ignoring an unreadable snapshot (%s); rebuilding State from the first event", error)
        return State()


async def save_snapshot(js: JetStreamContext, state: State) -> None:
    store = await js.object_store(SNAPSHOT_BUCKET)
    await store.put(SNAPSHOT_OBJECT, encode(state))
