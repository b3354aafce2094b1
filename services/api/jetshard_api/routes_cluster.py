"""Cluster routes: health, State, nodes, and the event stream as Server-Sent Events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from jetshard_bus.streams import subscribe_events
from jetshard_schema.codec import decode_event
from jetshard_schema.types import NodeStorage
from litestar import Controller, get
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster


class ClusterController(Controller):
    tags = ["cluster"]

    @get("/healthz")
    async def healthz(self, cluster: Cluster) -> dict[str, Any]:
        """Liveness: answers while the API is connected to NATS."""
        return {"status": "ok" if cluster.client.is_connected else "disconnected", "last_seq": cluster.state.last_seq}

    @get("/state")
    async def state(self, cluster: Cluster) -> dict[str, Any]:
        """This API's State replica, with `last_seq`: the stream sequence of the last event applied."""
        result: dict[str, Any] = msgspec.to_builtins(cluster.state)
        return result

    @get("/nodes")
    async def nodes(self, cluster: Cluster) -> list[dict[str, Any]]:
        state = cluster.state
        return [
            {**msgspec.to_builtins(node), **msgspec.to_builtins(state.node_storage.get(node_id, NodeStorage()))}
            for node_id, node in sorted(state.nodes.items())
        ]

    @get("/events")
    async def events(self, cluster: Cluster, since: int | None = None) -> ServerSentEvent:
        """Events from sequence `since` (default: the next one), then live, as `text/event-stream`."""
        start = since if since is not None else cluster.state.last_seq + 1
        return ServerSentEvent(_follow(cluster, max(start, 1)))


async def _follow(cluster: Cluster, start: int) -> AsyncIterator[ServerSentEventMessage]:
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=10_000)
    subscription = await subscribe_events(cluster.js, queue.put, start)
    try:
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), 15)
            except TimeoutError:
                yield ServerSentEventMessage(comment="keep-alive", data=None)
                continue
            envelope = decode_event(msg.data)
            if envelope is None:
                continue
            body = msgspec.json.encode(
                {
                    "seq": msg.metadata.sequence.stream,
                    "at_ms": envelope.at_ms,
                    "command_id": envelope.command_id,
                    "event": envelope.event,
                }
            )
            yield ServerSentEventMessage(
                data=body.decode(), event=type(envelope.event).__name__, id=str(msg.metadata.sequence.stream)
            )
    finally:
        await subscription.unsubscribe()
