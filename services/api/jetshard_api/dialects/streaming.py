"""A streamed answer as Server-Sent Events, for the dialects that stream that way (OpenAI, Responses,
Anthropic): the dialect says which events a chunk, a wait, the end and an error make; this module runs the task.

Opening the stream places the model and submits the task first, so those errors are plain HTTP errors; later
ones end the stream with the dialect's error events. While the task waits the dialect's keep-alive is sent.
A client that leaves cancels the task, and the response's background step closes it in any case, whether or
not the stream was ever iterated (`tasks.LiveTask`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from jetshard_schema.types import Chunk, TaskRequest
from litestar.background_tasks import BackgroundTask
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from litestar.types import Receive

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ApiError
from jetshard_api.settings import InferenceSettings
from jetshard_api.tasks import LiveTask, Waiting


class StreamEvents(Protocol):
    """One streamed answer's events in a dialect; called in order: `opening`, then `waiting` or `chunk` per
    item, then `closing` after the last chunk or `failed` instead."""

    def opening(self) -> Iterable[ServerSentEventMessage]: ...

    def waiting(self, what: str) -> Iterable[ServerSentEventMessage]: ...

    def chunk(self, chunk: Chunk) -> Iterable[ServerSentEventMessage]: ...

    def closing(self) -> Iterable[ServerSentEventMessage]: ...

    def failed(self, error: ApiError) -> Iterable[ServerSentEventMessage]: ...


def keep_alive_comment(what: str) -> list[ServerSentEventMessage]:
    """An SSE comment saying what the task waits for: clients skip it, proxies see the connection used."""
    return [ServerSentEventMessage(comment=what, data=None)]


async def streamed(
    cluster: Cluster, settings: InferenceSettings, task: TaskRequest, receive: Receive, events: StreamEvents
) -> ServerSentEvent:
    live = await LiveTask.open(cluster, settings, task, receive)

    async def sent() -> AsyncIterator[ServerSentEventMessage]:
        async with live:
            try:
                for event in events.opening():
                    yield event
                async for item in live.items():
                    for event in events.waiting(item.what) if isinstance(item, Waiting) else events.chunk(item):
                        yield event
                ending = events.closing()
            except ApiError as error:
                ending = events.failed(error)
            for event in ending:
                yield event

    return ServerSentEvent(sent(), background=BackgroundTask(live.close))
