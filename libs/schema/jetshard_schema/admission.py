"""Admission: whether an instance's queue has room for one more task, decided on the single writer's State.

An instance holds at most `max_batch + max_queued` unfinished tasks. A task that fits may still be refused:
when the instance's pace says it would wait longer to start than its requester waits, queuing it would only
turn into a timeout. The pace is the recent tasks' time from start to finish (`Instance.task_ms`, a moving
average), or the age of its oldest running task where that is longer: when the node slows down (another
program takes its CPU), the running tasks show it at once, long before they finish and move the average. A
refusal says when to retry, from the same pace. Pure; tested without NATS.

The API names the instance it stored a task's request for (`route`, on its replica of State); the sequencer
takes the task for that instance when it has room (`admit`), so the runner that runs it finds its request
stored. Both choose the same way, and a rejection reaches the API after the events it was decided on, so a
request named for an instance that filled meanwhile is named again for the right one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from jetshard_schema.ids import InstanceId, ModelId
from jetshard_schema.state import Instance, State, ready_instances

UNKNOWN_PACE_RETRY_AFTER_S = 2
"""What a refusal says to wait before the instance has finished a task to measure its pace by."""


class Queue(msgspec.Struct, frozen=True, kw_only=True):
    """An instance's unfinished tasks: those its runners started, and those waiting for a row of the batch."""

    running: int
    waiting: int
    oldest_running_ms: int = 0
    """How long the longest-running of its started tasks has run so far (0: none runs)."""


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    retry_after_s: int


def queue_of(state: State, instance: Instance, now_ms: int) -> Queue:
    tasks = [t for t in state.tasks.values() if t.instance_id == instance.instance_id]
    started_at = [t.started_at_ms for t in tasks if t.started and t.started_at_ms]
    running = sum(1 for t in tasks if t.started)
    oldest = max(0, now_ms - min(started_at)) if started_at else 0
    return Queue(running=running, waiting=len(tasks) - running, oldest_running_ms=oldest)


def pace_ms(instance: Instance, queue: Queue) -> float:
    """How long a task takes from start to finish now: the recent average, or longer where a running task has
    already taken longer (the instance slowed down since). 0 while no task has finished."""
    if not instance.task_ms:
        return 0.0
    return max(instance.task_ms, float(queue.oldest_running_ms))


def start_wait_ms(instance: Instance, queue: Queue) -> float:
    """How long a task submitted now would wait to start, at the instance's pace: the tasks ahead of it beyond
    a full batch must finish first, `max_batch` at a time. 0 while the pace is unknown."""
    ahead = queue.running + queue.waiting + 1 - instance.serving.max_batch
    return max(0, ahead) * pace_ms(instance, queue) / instance.serving.max_batch


def _seconds(ms: float) -> int:
    return max(1, math.ceil(ms / 1000))


def _refusal(instance: Instance, queue: Queue, start_within_ms: int | None) -> Refused | None:
    """Why `instance` cannot take one more task, or None when it can."""
    serving = instance.serving
    pace = pace_ms(instance, queue)
    if queue.running + queue.waiting >= serving.max_batch + serving.max_queued:
        retry = _seconds(pace / serving.max_batch) if pace else UNKNOWN_PACE_RETRY_AFTER_S
        return Refused(
            reason=f"all {serving.max_batch + serving.max_queued} places of its queue are taken",
            retry_after_s=retry,
        )
    wait_ms = start_wait_ms(instance, queue)
    if start_within_ms is not None and wait_ms > start_within_ms:
        return Refused(
            reason=f"a new task would wait about {_seconds(wait_ms)} s to start, longer than the "
            f"{start_within_ms / 1000:.0f} s its client waits",
            retry_after_s=_seconds(wait_ms - start_within_ms),
        )
    return None


def admit(
    state: State,
    model_id: ModelId,
    start_within_ms: int | None,
    now_ms: int,
    named: InstanceId | None = None,
    naming: Mapping[InstanceId, int] | None = None,
) -> Instance | Refused | None:
    """The ready instance of `model_id` a new task goes to (`named` when it has room, else among those with room
    one with a row of its batch free, the one with the fewest unfinished tasks), a refusal naming the soonest
    retry, or None when no instance is ready. `now_ms` is on the clock of the tasks' `started_at_ms` (the
    sequencer's). `naming`: tasks named for an instance that `state` does not hold yet (an API's own, submitted
    meanwhile), counted in its load, so that a burst is spread."""
    ready = ready_instances(state, model_id)
    if not ready:
        return None
    queues = {i.instance_id: queue_of(state, i, now_ms) for i in ready}
    refusals = {i.instance_id: _refusal(i, queues[i.instance_id], start_within_ms) for i in ready}
    open_ = [i for i in ready if refusals[i.instance_id] is None]
    if open_:

        def load(instance: Instance) -> int:
            queue = queues[instance.instance_id]
            return queue.running + queue.waiting + (naming or {}).get(instance.instance_id, 0)

        return min(open_, key=lambda i: (i.instance_id != named, load(i) >= i.serving.max_batch, load(i)))
    soonest = min((r for r in refusals.values() if r is not None), key=lambda r: r.retry_after_s)
    return Refused(
        reason=f"{model_id} is busy: {soonest.reason}; retry after {soonest.retry_after_s} s",
        retry_after_s=soonest.retry_after_s,
    )


def route(
    state: State,
    model_id: ModelId,
    start_within_ms: int | None,
    now_ms: int,
    naming: Mapping[InstanceId, int] | None = None,
) -> Instance | None:
    """The instance an API names for a new task: `admit`'s choice on its replica of State (with the tasks it is
    `naming` meanwhile), or the least loaded ready one where every queue looks full there (the sequencer, whose
    State is ahead, refuses or takes it). None when no instance is ready."""
    chosen = admit(state, model_id, start_within_ms, now_ms, naming=naming)
    if isinstance(chosen, Refused):
        ready = ready_instances(state, model_id)
        return min(ready, key=lambda i: (q := queue_of(state, i, now_ms)).running + q.waiting)
    return chosen
