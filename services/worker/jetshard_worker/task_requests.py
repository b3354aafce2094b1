"""A leader runner's task requests (the prompts). The API stores each in JETSHARD_TASKS before it submits the task,
under the node and instance it names (`subjects.task_subject`), where only this node's identity may read: the
runner reads it once, when the task is assigned here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from jetshard_schema.ids import InstanceId, NodeId, TaskId
from jetshard_schema.subjects import TASKS_STREAM, task_subject
from nats.js import JetStreamContext

log = logging.getLogger(__name__)

UNANSWERED_PATIENCE_S = 30.0
"""How long a runner asks for a request while JETSHARD_TASKS does not answer: its servers elect a new leader after
a machine went away, within seconds."""
MISSING_PATIENCE_S = 2.0
"""How long a runner asks for a request the stream says it does not hold: a replica that has not applied the
API's store yet may answer a direct read. Past this the request is lost (the task retention dropped it)."""
FIRST_RETRY_S = 0.05
LAST_RETRY_S = 1.0


@dataclass(frozen=True)
class Stored:
    """A request as JETSHARD_TASKS holds it: its bytes and its headers (the request's trace context)."""

    data: bytes
    headers: dict[str, str] | None


class RequestLost(Exception):
    """The task's request could not be read: the message says why."""


async def read_request(
    js: JetStreamContext, node_id: NodeId, instance_id: InstanceId, task_id: TaskId, wanted: Callable[[], bool]
) -> Stored | None:
    """The task's stored request; None once the task is no longer `wanted` (cancelled while the stream did not
    answer). Raises RequestLost when the stream does not hold it, or does not answer, for longer than a
    replica's lag or a leader election takes."""
    subject = task_subject(node_id, instance_id, task_id)
    loop = asyncio.get_running_loop()
    started = loop.time()
    pause_s = FIRST_RETRY_S
    while wanted():
        try:
            found = await js.get_msg(TASKS_STREAM, subject=subject, direct=True)
            return Stored(found.data or b"", found.headers)
        except nats.js.errors.NotFoundError as error:
            if loop.time() - started >= MISSING_PATIENCE_S:
                raise RequestLost("JETSHARD_TASKS does not hold the task's request") from error
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as error:
            if loop.time() - started >= UNANSWERED_PATIENCE_S:
                raise RequestLost(f"JETSHARD_TASKS did not answer for {UNANSWERED_PATIENCE_S:.0f} s") from error
            log.info("JETSHARD_TASKS did not answer for %s (%s); asking again", task_id, error)
        await asyncio.sleep(pause_s)
        pause_s = min(LAST_RETRY_S, pause_s * 2)
    return None
