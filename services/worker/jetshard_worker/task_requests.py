"""A leader runner's task requests (the prompts). The API stores each once the task is assigned, under the node and
instance that serve it (`subjects.task_subject`), where only this node's identity may read: the runner subscribes
there, so a request reaches it as it is stored, and reads the stream for one stored before it subscribed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from jetshard_schema.ids import InstanceId, NodeId, TaskId
from jetshard_schema.subjects import TASKS_STREAM, task_subject
from nats.js import JetStreamContext

log = logging.getLogger(__name__)

REQUEST_WAIT_S = 10.0
"""How long an assigned task waits for its request: its API stores it as soon as it sees the assignment."""
READ_AGAIN_S = 2.0
"""How often a waiting task asks the stream again, in case the subscription missed the request."""
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
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Stored | None] = loop.create_future()
        self._waiting[task_id] = waiter
        deadline = loop.time() + REQUEST_WAIT_S
        try:
            # Stored before this runner subscribed, or while the subscription's interest was still travelling to
            # the API's server (a cluster of servers learns it within moments): the stream has it either way. It
            # may not answer while a machine is lost and its servers elect new leaders, so the subscription is
            # listened to all the while, and the stream asked again until the deadline.
            while (left_s := deadline - loop.time()) > 0:
                read = asyncio.ensure_future(self._read(task_id))
                await asyncio.wait({waiter, read}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                elif read.result() is not None:
                    return read.result()
                if waiter.done():
                    return waiter.result()
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter), min(READ_AGAIN_S, deadline - loop.time()))
            return None
        finally:
            self._waiting.pop(task_id, None)

    async def _read(self, task_id: TaskId) -> Stored | None:
        """The stored request; None when the stream does not hold it or does not answer now."""
        subject = task_subject(self._node_id, self._instance_id, task_id)
        try:
            found = await self._js.get_msg(TASKS_STREAM, subject=subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as error:
            log.info("JETSHARD_TASKS did not answer for %s (%s); listening and asking again", task_id, error)
            return None
        return Stored(found.data or b"", found.headers)

    def abandon(self, task_id: TaskId) -> None:
        """The task left State (cancelled): stop waiting for its request."""
        self._arrived.pop(task_id, None)
        waiter = self._waiting.pop(task_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
