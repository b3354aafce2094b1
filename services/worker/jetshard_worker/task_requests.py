"""A leader runner's task requests (the prompts). The API stores each once the task is assigned, under the node and
instance that serve it (`subjects.task_subject`), where only this node's identity may read: the runner subscribes
there, so a request reaches it as it is stored, and reads the stream for one stored before it subscribed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from jetshard_schema.ids import InstanceId, NodeId, TaskId
from jetshard_schema.subjects import TASKS_STREAM, task_subject
from nats.js import JetStreamContext

REQUEST_WAIT_S = 10.0
"""How long an assigned task waits for its request: its API stores it as soon as it sees the assignment."""
UNCLAIMED_KEPT_S = 300.0
"""How long a request nobody asked for is kept: its task was cancelled, or this runner is of an older generation."""


@dataclass(frozen=True)
class Stored:
    """A request as JETSHARD_TASKS holds it: its bytes and its headers (the request's trace context)."""

    data: bytes
    headers: dict[str, str] | None


class TaskRequests:
    def __init__(self, client: Any, js: JetStreamContext, node_id: NodeId, instance_id: InstanceId) -> None:
        self._client = client
        self._js = js
        self._node_id = node_id
        self._instance_id = instance_id
        self._arrived: dict[str, tuple[float, Stored]] = {}
        self._waiting: dict[str, asyncio.Future[Stored | None]] = {}
        self._subscription: Any = None

    async def subscribe(self) -> None:
        """Subscribe before the runner reports ready: every task is assigned after that."""
        self._subscription = await self._client.subscribe(
            task_subject(self._node_id, self._instance_id, "*"), cb=self._on_request
        )

    async def _on_request(self, msg: Any) -> None:
        task_id = msg.subject.rsplit(".", 1)[-1]
        stored = Stored(msg.data, msg.headers)
        waiter = self._waiting.pop(task_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(stored)
            return
        now = time.monotonic()
        self._arrived = {k: v for k, v in self._arrived.items() if now - v[0] < UNCLAIMED_KEPT_S}
        self._arrived[task_id] = (now, stored)

    async def take(self, task_id: TaskId) -> Stored | None:
        """The task's request; None if it is not stored within `REQUEST_WAIT_S` (its API died before it could
        store it, the task retention dropped it) or the task was abandoned meanwhile."""
        arrived = self._arrived.pop(task_id, None)
        if arrived is not None:
            return arrived[1]
        waiter: asyncio.Future[Stored | None] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = waiter
        try:
            # Stored before this runner subscribed, or while the subscription's interest was still travelling to
            # the API's server (a cluster of servers learns it within moments): the stream has it either way.
            found = await self._read(task_id)
            if found is not None:
                return found
            try:
                return await asyncio.wait_for(waiter, REQUEST_WAIT_S)
            except TimeoutError:
                return await self._read(task_id)
        finally:
            self._waiting.pop(task_id, None)

    async def _read(self, task_id: TaskId) -> Stored | None:
        subject = task_subject(self._node_id, self._instance_id, task_id)
        try:
            found = await self._js.get_msg(TASKS_STREAM, subject=subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        return Stored(found.data or b"", found.headers)

    def abandon(self, task_id: TaskId) -> None:
        """The task left State (cancelled): stop waiting for its request."""
        self._arrived.pop(task_id, None)
        waiter = self._waiting.pop(task_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
