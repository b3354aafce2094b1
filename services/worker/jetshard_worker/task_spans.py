"""A task's spans on its runner: `runner task`, from its assignment to its end, holding `task queued` (until its
prefill begins), `prefill` (until its first token) and `decode` (until it ends). Their parent is the sequencer's
handling of the command that assigned the task, whose context the assigning event carried.

The engine runs in a thread of its own, so nothing here relies on a current context across threads: each moment
is noted (in the event loop, as the engine's callback reaches it) and the spans are made with those times, and
the parent context noted at assignment, once the task ends. A runner keeps one only while tracing is on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from jetshard_bus.tracing import extract, tracer
from jetshard_schema.ids import InstanceId, TaskId
from jetshard_schema.types import TaskOutcome, TaskRef, Usage
from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util.types import Attributes


@dataclass
class _Moments:
    task: TaskRef
    parent: context.Context
    assigned_ns: int
    started_ns: int | None = None
    prompt_tokens: int | None = None
    first_token_ns: int | None = None


class TaskSpans:
    def __init__(self, instance_id: InstanceId) -> None:
        self._instance_id = instance_id
        self._tasks: dict[TaskId, _Moments] = {}

    def assigned(self, task: TaskRef) -> None:
        """The runner took `task`; the context current now is that of the event assigning it, if it was live."""
        self._tasks[task.task_id] = _Moments(task=task, parent=context.get_current(), assigned_ns=time.time_ns())

    def requested(self, task_id: TaskId, headers: Mapping[str, str] | None) -> None:
        """The task's request was read, with the headers it was stored with: a task found in State rather than in
        a live event continues the trace of the request that submitted it."""
        moments = self._tasks.get(task_id)
        if moments is not None and not trace.get_current_span(moments.parent).get_span_context().is_valid:
            moments.parent = extract(headers)

    def started(self, task_id: TaskId, prompt_tokens: int) -> None:
        moments = self._tasks.get(task_id)
        if moments is not None:
            moments.started_ns, moments.prompt_tokens = time.time_ns(), prompt_tokens

    def token(self, task_id: TaskId) -> None:
        moments = self._tasks.get(task_id)
        if moments is not None and moments.first_token_ns is None:
            moments.first_token_ns = time.time_ns()

    def finished(self, task_id: TaskId, outcome: TaskOutcome, usage: Usage | None, error_code: str = "") -> None:
        moments = self._tasks.pop(task_id, None)
        if moments is None:
            return
        end_ns = time.time_ns()
        prompt_tokens = usage.prompt_tokens if usage is not None else moments.prompt_tokens
        attributes: dict[str, str | int] = {
            "jetshard.task_id": task_id,
            "jetshard.instance_id": self._instance_id,
            "jetshard.task_kind": str(moments.task.kind),
            "gen_ai.request.model": moments.task.model_id,
            "jetshard.outcome": str(outcome),
        }
        if prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = prompt_tokens
        if usage is not None:
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
        task = tracer.start_span(
            "runner task", moments.parent, SpanKind.CONSUMER, attributes, start_time=moments.assigned_ns
        )
        inside = trace.set_span_in_context(task)
        phases: list[tuple[str, int | None, Attributes]] = [
            ("task queued", moments.assigned_ns, None),
            ("prefill", moments.started_ns, {"gen_ai.usage.input_tokens": prompt_tokens or 0}),
            ("decode", moments.first_token_ns, {"gen_ai.usage.output_tokens": usage.completion_tokens if usage else 0}),
        ]
        begun = [(name, start, attrs) for name, start, attrs in phases if start is not None]
        ends = [start for _, start, _ in begun[1:]] + [end_ns]
        for (name, start, attrs), stop in zip(begun, ends, strict=True):
            tracer.start_span(name, inside, attributes=attrs, start_time=start).end(end_time=stop)
        if error_code:
            task.set_status(StatusCode.ERROR, error_code)
        task.end(end_time=end_ns)
