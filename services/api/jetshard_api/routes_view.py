"""The cluster at a glance (`GET /view`, and live as Server-Sent Events) and the tasks in flight.

The view is derived from this API's State replica on every change, so the dashboard and `jetshard status
--watch` render it as it comes, without folding events or polling the whole State.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from jetshard_schema.commands import CancelTask
from jetshard_schema.events import EventEnvelope
from jetshard_schema.ids import TaskId
from jetshard_schema.state import State
from jetshard_schema.view import ClusterView, EventLine, TaskView, cluster_view, event_line, task_views
from litestar import Controller, delete, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ERROR_RESPONSES, ApiError
from jetshard_api.model_steps import Deleted, checked_name

VIEW_EVERY_S = 0.25
"""A burst of events (a download's progress, a placement) sends one view per this interval, not one each."""
REFRESH_S = 2.0
"""Figures that change without an event (tokens per second) are looked at this often."""
KEEP_ALIVE_S = 15.0
"""A view stream with nothing new sends a comment this often, so proxies and clients see it alive."""


def current_view(cluster: Cluster) -> ClusterView:
    return cluster_view(cluster.state, int(time.time() * 1000), cluster.stats.instances())


class ViewController(Controller):
    tags = ["cluster"]

    @get("/view", responses=ERROR_RESPONSES)
    async def view(self, cluster: NamedDependency[Cluster]) -> ClusterView:
        """Nodes, the models on them, instances with their shards and runners, and the tasks in flight."""
        return current_view(cluster)

    @get("/view/stream", responses=ERROR_RESPONSES, media_type="text/event-stream")
    async def view_stream(self, cluster: NamedDependency[Cluster]) -> ServerSentEvent:
        """The view now and after every change (`event: view`), and each event as one readable line
        (`event: event`, an EventLine), starting with the latest few, as `text/event-stream`."""
        return ServerSentEvent(_view_stream(cluster))

    @get("/tasks", responses=ERROR_RESPONSES)
    async def tasks(self, cluster: NamedDependency[Cluster]) -> list[TaskView]:
        """Tasks in flight, oldest first: queued for their instance, or running."""
        return task_views(cluster.state)

    @delete("/tasks/{task_id:str}", status_code=200, responses=ERROR_RESPONSES)
    async def cancel_task(self, cluster: NamedDependency[Cluster], task_id: FromPath[str]) -> Deleted:
        """Stop a task; its request ends with an error saying it was cancelled (status 502, or the stream's
        error object after what was generated)."""
        # Only an id State holds is published, so a hostile one never reaches a subject.
        if TaskId(checked_name(task_id, "task_id")) not in cluster.state.tasks:
            raise ApiError(404, f"no task {task_id} in flight", "task_not_found")
        await cluster.submit(CancelTask(task_id=TaskId(task_id)))
        return Deleted(deleted=task_id)


def _message(kind: str, body: msgspec.Struct) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=kind, data=msgspec.json.encode(body).decode())


async def _view_stream(cluster: Cluster) -> AsyncIterator[ServerSentEventMessage]:
    lines: asyncio.Queue[EventLine] = asyncio.Queue(maxsize=10_000)

    def on_event(envelope: EventEnvelope, state: State, live: bool) -> None:
        if not lines.full():
            lines.put_nowait(event_line(state.last_seq, envelope))

    # The recent lines and the listener are taken with no await between them: no event falls in a gap.
    recent = cluster.recent_event_lines()
    with cluster.listening(on_event):
        for past in recent:
            yield _message("event", past)
        sent, sent_at = current_view(cluster), time.monotonic()
        yield _message("view", sent)
        while True:
            try:
                line: EventLine | None = await asyncio.wait_for(lines.get(), timeout=REFRESH_S)
            except TimeoutError:
                line = None
            while line is not None:
                yield _message("event", line)
                line = None if lines.empty() else lines.get_nowait()
            if (wait_s := VIEW_EVERY_S - (time.monotonic() - sent_at)) > 0:
                await asyncio.sleep(wait_s)
            view = current_view(cluster)
            if view != sent:
                sent, sent_at = view, time.monotonic()
                yield _message("view", view)
            elif time.monotonic() - sent_at >= KEEP_ALIVE_S:
                sent_at = time.monotonic()
                yield ServerSentEventMessage(comment="keep-alive", data=None)
