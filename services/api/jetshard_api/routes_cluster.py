"""Cluster routes: health, Prometheus metrics, State, nodes, and the event stream as Server-Sent Events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from jetshard_bus.streams import MAX_EVENT_SEQ, subscribe_events
from jetshard_schema.codec import decode_event
from jetshard_schema.state import Node, State
from jetshard_schema.types import NodeStorage
from jetshard_schema.view import NodeShard, shards_on
from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromQuery, HeaderParameter
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ERROR_RESPONSES, ApiError


class Health(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    broker: str
    reason: str | msgspec.UnsetType = msgspec.UNSET
    """Only while the broker is unreachable."""
    last_seq: int


class Serving(msgspec.Struct, frozen=True):
    status: str = "ok"


NodeDescription = msgspec.defstruct(
    "NodeDescription",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(NodeStorage)] + [("shards", list[NodeShard], [])],
    bases=(Node,),
    frozen=True,
    kw_only=True,
)
"""A node and its storage, flat: built from both structs so the two keep one definition each; and the shards it
holds (`shards_on`)."""


class ClusterController(Controller):
    tags = ["cluster"]

    @get(
        "/healthz",
        responses={
            **ERROR_RESPONSES,
            503: ResponseSpec(Health, description="NATS is unreachable, or the cluster counts this API gone"),
        },
    )
    async def healthz(self, cluster: NamedDependency[Cluster]) -> Response[Health]:
        """200 while the API reaches the message broker (NATS) and the cluster counts its session alive; 503 with the
        reason while not."""
        try:
            cluster.require_session()
        except ApiError as unavailable:
            broker = "connected" if cluster.connected else "unreachable"
            health = Health(
                status="unavailable", broker=broker, reason=unavailable.message, last_seq=cluster.state.last_seq
            )
            return Response(health, status_code=503)
        return Response(Health(status="ok", broker="connected", last_seq=cluster.state.last_seq))

    @get("/health", responses=ERROR_RESPONSES)
    async def health(self, cluster: NamedDependency[Cluster]) -> Serving:
        """The probe of load balancers and of tools made for vLLM and llama-server: 200 `{"status": "ok"}` while
        this API can take requests (as `/healthz`); 503 in the error shape while it cannot. A
        model that is not ready does not make the API unready: a request for it places it and waits."""
        cluster.require_session()
        return Serving()

    @get("/metrics", include_in_schema=False)
    async def metrics(self, cluster: NamedDependency[Cluster], request: Request[Any, Any, Any]) -> Response[bytes]:
        """Prometheus metrics, `jetshard_*`, in the text format (OpenMetrics when the scraper asks for it)."""
        body, content_type = cluster.metrics.render(request.headers.get("accept", ""))
        # Given as a header too: Litestar would append a second charset to the one the type names.
        return Response(body, media_type=content_type, headers={"content-type": content_type})

    @get("/state", responses=ERROR_RESPONSES)
    async def state(self, cluster: NamedDependency[Cluster]) -> State:
        """This API's State replica, with `last_seq`: the stream sequence of the last event applied."""
        return cluster.state

    @get("/nodes", responses=ERROR_RESPONSES)
    async def nodes(self, cluster: NamedDependency[Cluster]) -> list[NodeDescription]:  # type: ignore[valid-type]
        state = cluster.state
        return [
            NodeDescription(
                **msgspec.structs.asdict(node),
                **msgspec.structs.asdict(state.node_storage.get(node_id, NodeStorage())),
                shards=shards_on(state, node_id),
            )
            for node_id, node in sorted(state.nodes.items())
        ]

    @get("/events", responses=ERROR_RESPONSES)
    async def events(
        self,
        cluster: NamedDependency[Cluster],
        since: FromQuery[int | None] = None,
        last_event_id: Annotated[str | None, HeaderParameter(name="Last-Event-ID")] = None,
    ) -> ServerSentEvent:
        """Events from sequence `since` (default: the next one), then live, as `text/event-stream`.

        Each message's id is its sequence. A `Last-Event-ID` header resumes after that event and wins over
        `since`: an EventSource that reconnects sends it along with the URL it first opened.
        """
        if last_event_id is not None:
            start = _after_last_event_id(last_event_id)
        elif since is not None:
            start = _sequence(since, "since")
        else:
            start = cluster.state.last_seq + 1
        return ServerSentEvent(_follow(cluster, max(start, 1)))


def _sequence(value: int, param: str) -> int:
    if not 0 <= value <= MAX_EVENT_SEQ:
        raise ApiError(
            400, f"{param} must be an event sequence, 0 to {MAX_EVENT_SEQ}, got {value}", "invalid_value", param
        )
    return value


def _after_last_event_id(value: str) -> int:
    text = value.strip()
    # A number past the longest sequence is refused before `int()`, which refuses over 4300 digits with its own error.
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_EVENT_SEQ))):
        raise ApiError(
            400,
            f"Last-Event-ID must be an event sequence, 0 to {MAX_EVENT_SEQ}, got {value[:40]!r}",
            "invalid_value",
            "Last-Event-ID",
        )
    return _sequence(int(text), "Last-Event-ID") + 1


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
