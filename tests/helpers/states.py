"""Building a State from events, as a follower would: each event at the next stream sequence."""

from __future__ import annotations

from typing import Any

import msgspec
from jetshard_schema.events import DownloadCompleted, Event, EventEnvelope
from jetshard_schema.ids import CommandId, InstanceId, ModelId, NodeId
from jetshard_schema.state import State, apply
from jetshard_schema.types import DownloadProgress, DownloadStatus, NodeProfile

GiB = 2**30
A, B, C = NodeId("node-a"), NodeId("node-b"), NodeId("node-c")
"""The nodes of the tests of State, its handlers and planning."""
MODEL = ModelId("acme/tiny-7")
INSTANCE = InstanceId("inst-1")


def fold(*events: Event, state: State | None = None) -> State:
    state = state or State()
    for event in events:
        state = apply(state, event, state.last_seq + 1, state.last_command_seq + 1)
    return state


def envelope_of(event: Event, command_id: str = "c", command_seq: int = 1) -> EventEnvelope:
    """The envelope of a command's one event, as the sequencer stores it (at time 0)."""
    return EventEnvelope(
        command_id=CommandId(command_id), command_seq=command_seq, index=0, count=1, at_ms=0, event=event
    )


def raw_envelope(event: Any, **fields: Any) -> dict[str, Any]:
    """An event envelope as raw JSON-ready data (the first event of command "c"); `fields` add or override."""
    return {"command_id": "c", "command_seq": 1, "index": 0, "count": 1, "at_ms": 0, **fields, "event": event}


def profile(available_gib: float, total_gib: int = 64, **fields: Any) -> NodeProfile:
    """A Linux node with `available_gib` of its `total_gib` memory free and a fast BLAS; `fields` set the rest."""
    base = NodeProfile(
        hostname="h",
        os="Linux",
        cpu_cores=4,
        memory_total_bytes=total_gib * GiB,
        memory_available_bytes=int(available_gib * GiB),
        fast_blas=True,
    )
    return msgspec.structs.replace(base, **fields)


def completed(
    start_layer: int,
    end_layer: int,
    directory: str = "/m",
    *,
    bytes_total: int = 1,
    bytes_done: int = 0,
    read_only: bool = False,
) -> DownloadProgress:
    """A finished download of layers [start_layer, end_layer) in `directory`."""
    return DownloadProgress(
        status=DownloadStatus.COMPLETED,
        start_layer=start_layer,
        end_layer=end_layer,
        bytes_done=bytes_done,
        bytes_total=bytes_total,
        directory=directory,
        read_only=read_only,
    )


def downloaded(
    node: NodeId, model: ModelId, start: int, end: int, directory: str = "/m", size: int = 1
) -> DownloadCompleted:
    """The event of `node` having all `size` bytes of `model`'s layers [start, end) in `directory`."""
    progress = completed(start, end, directory, bytes_total=size, bytes_done=size)
    return DownloadCompleted(node_id=node, model_id=model, progress=progress)
