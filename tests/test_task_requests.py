"""A leader runner's read of a task's request, against a real nats-server: the API stored it before it submitted
the task, so one read finds it, with its trace context; while the stream cannot answer (its servers electing a
leader after a machine went away) the runner asks again, and gives up on a task cancelled meanwhile; a request the
stream does not hold fails the task after a short wait, never a long one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from jetshard_bus.streams import declare
from jetshard_schema.ids import InstanceId, NodeId, TaskId
from jetshard_schema.subjects import TASKS_STREAM, task_subject
from jetshard_worker import task_requests
from jetshard_worker.task_requests import RequestLost, read_request

NODE, INSTANCE = NodeId("node-a"), InstanceId("instance-1")


def _wanted() -> bool:
    return True


async def test_a_stored_request_is_read_with_its_trace_context(bus: tuple[Any, Any]) -> None:
    _, js = bus
    await js.publish(task_subject(NODE, INSTANCE, "t-stored"), b"the prompt", headers={"traceparent": "00-x"})
    stored = await asyncio.wait_for(read_request(js, NODE, INSTANCE, TaskId("t-stored"), _wanted), 5)
    assert stored is not None and stored.data == b"the prompt"
    assert stored.headers is not None and stored.headers["traceparent"] == "00-x"


async def test_the_runner_asks_again_while_the_stream_cannot_answer(bus: tuple[Any, Any]) -> None:
    _, js = bus
    await js.delete_stream(TASKS_STREAM)  # every read of the stream now goes unanswered
    reading = asyncio.create_task(read_request(js, NODE, INSTANCE, TaskId("t-late"), _wanted))
    await asyncio.sleep(0.5)  # deliberate timing: the first reads have failed by now, and the runner still asks
    assert not reading.done()
    await declare(js)
    await js.publish(task_subject(NODE, INSTANCE, "t-late"), b"late prompt")
    stored = await asyncio.wait_for(reading, 5)
    assert stored is not None and stored.data == b"late prompt"


async def test_a_cancelled_task_stops_the_asking(bus: tuple[Any, Any]) -> None:
    _, js = bus
    await js.delete_stream(TASKS_STREAM)
    cancelled = asyncio.Event()

    def still_wanted() -> bool:
        return not cancelled.is_set()

    reading = asyncio.create_task(read_request(js, NODE, INSTANCE, TaskId("t-cancelled"), still_wanted))
    await asyncio.sleep(0.2)  # deliberate timing: the runner is asking when the task is cancelled
    cancelled.set()
    assert await asyncio.wait_for(reading, 3) is None


async def test_a_request_the_stream_does_not_hold_fails_the_read_soon(
    bus: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, js = bus
    monkeypatch.setattr(task_requests, "MISSING_PATIENCE_S", 0.5)
    with pytest.raises(RequestLost, match="does not hold"):
        await asyncio.wait_for(read_request(js, NODE, INSTANCE, TaskId("t-never"), _wanted), 5)
