"""A leader runner's wait for a task's request, against a real nats-server: the request reaches it whether it was
stored before the runner subscribed, while the stream cannot answer (its servers electing a leader after a machine
went away), or not at all (then the task fails, and the runner lives on)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from jetshard_schema.ids import InstanceId, NodeId, TaskId
from jetshard_schema.subjects import TASKS_STREAM, task_subject
from jetshard_worker import task_requests
from jetshard_worker.task_requests import TaskRequests

NODE, INSTANCE = NodeId("node-a"), InstanceId("instance-1")


async def _requests(bus: tuple[Any, Any]) -> TaskRequests:
    client, js = bus
    requests = TaskRequests(client, js, NODE, INSTANCE)
    await requests.subscribe()
    return requests


async def test_a_request_stored_before_the_runner_subscribed_is_read_from_the_stream(bus: tuple[Any, Any]) -> None:
    _, js = bus
    await js.publish(task_subject(NODE, INSTANCE, "t-early"), b"early prompt", headers={"traceparent": "00-x"})
    requests = await _requests(bus)
    stored = await asyncio.wait_for(requests.take(TaskId("t-early")), 5)
    assert stored is not None and stored.data == b"early prompt"
    assert stored.headers is not None and stored.headers["traceparent"] == "00-x"


async def test_a_request_arrives_while_the_stream_cannot_answer(bus: tuple[Any, Any]) -> None:
    client, js = bus
    requests = await _requests(bus)
    await js.delete_stream(TASKS_STREAM)  # every read of the stream now goes unanswered
    waiting = asyncio.create_task(requests.take(TaskId("t-late")))
    await asyncio.sleep(0.5)  # deliberate timing: the first read has failed by now, and the take still waits
    assert not waiting.done()
    await client.publish(task_subject(NODE, INSTANCE, "t-late"), b"late prompt")
    stored = await asyncio.wait_for(waiting, 5)
    assert stored is not None and stored.data == b"late prompt"


async def test_a_request_that_never_comes_ends_the_wait_and_an_abandoned_one_ends_it_at_once(
    bus: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, js = bus
    monkeypatch.setattr(task_requests, "REQUEST_WAIT_S", 1.5)
    requests = await _requests(bus)
    await js.delete_stream(TASKS_STREAM)
    assert await asyncio.wait_for(requests.take(TaskId("t-never")), 5) is None

    waiting = asyncio.create_task(requests.take(TaskId("t-cancelled")))
    await asyncio.sleep(0.2)  # deliberate timing: the take is waiting when it is abandoned
    requests.abandon(TaskId("t-cancelled"))
    assert await asyncio.wait_for(waiting, 1) is None
