"""`apply` for task events, and a check that the five test_apply_* modules exercise every event type."""

from __future__ import annotations

import typing

import msgspec
import pytest
import test_apply_downloads
import test_apply_instances
import test_apply_models
import test_apply_nodes
from helpers.states import INSTANCE, MODEL, fold
from jetshard_schema import codec
from jetshard_schema.events import (
    Event,
    EventEnvelope,
    InstancePlaced,
    TaskAssigned,
    TaskCancelled,
    TaskFinished,
    TaskStarted,
)
from jetshard_schema.ids import CommandId, NodeId, TaskId
from jetshard_schema.state import State, Task, apply
from jetshard_schema.types import (
    ShardAssignment,
    TaskKind,
    TaskOutcome,
    TaskRef,
    Usage,
)

TASK = TaskId("task-1")
REF = TaskRef(task_id=TASK, model_id=MODEL, kind=TaskKind.CHAT)

SAMPLES: list[Event] = [
    TaskAssigned(task=REF, instance_id=INSTANCE, generation=0),
    TaskStarted(task_id=TASK, prompt_tokens=12),
    TaskFinished(task_id=TASK, outcome=TaskOutcome.STOP, usage=Usage(prompt_tokens=12, completion_tokens=3)),
    TaskCancelled(task_id=TASK, reason="cancelled by the client"),
]
COVERED = {type(e) for e in SAMPLES}

PLACED = InstancePlaced(
    instance_id=INSTANCE,
    model_id=MODEL,
    shards=(ShardAssignment(node_id=NodeId("n"), rank=0, start_layer=0, end_layer=8),),
)


def test_every_event_type_is_exercised() -> None:
    members = set(typing.get_args(Event))
    covered = (
        test_apply_nodes.COVERED
        | test_apply_models.COVERED
        | test_apply_downloads.COVERED
        | test_apply_instances.COVERED
        | COVERED
    )
    assert members - covered == set(), "add the new event type to a test_apply_* module"
    assert covered <= members


def test_assigned_then_started() -> None:
    state = fold(PLACED, SAMPLES[0])
    assert state.tasks == {TASK: Task(ref=REF, instance_id=INSTANCE, generation=0, assigned_seq=2)}
    assert state.unstarted_tasks(INSTANCE, 0) == [state.tasks[TASK]]
    state = fold(SAMPLES[1], state=state)
    assert state.tasks[TASK].started
    assert state.tasks[TASK].prompt_tokens == 12
    assert state.unstarted_tasks(INSTANCE, 0) == []


def test_unstarted_tasks_are_those_of_one_generation_in_assignment_order() -> None:
    later = TaskId("task-2")
    other_generation = TaskId("task-3")
    state = fold(
        PLACED,
        TaskAssigned(task=REF, instance_id=INSTANCE, generation=0),
        TaskAssigned(task=msgspec.structs.replace(REF, task_id=later), instance_id=INSTANCE, generation=0),
        TaskAssigned(task=msgspec.structs.replace(REF, task_id=other_generation), instance_id=INSTANCE, generation=1),
    )
    assert [t.task_id for t in state.unstarted_tasks(INSTANCE, 0)] == [TASK, later]
    assert [t.task_id for t in state.unstarted_tasks(INSTANCE, 1)] == [other_generation]


@pytest.mark.parametrize("end", SAMPLES[2:], ids=lambda e: type(e).__name__)
def test_finished_or_cancelled_tasks_leave_state(end: Event) -> None:
    state = fold(PLACED, SAMPLES[0], SAMPLES[1], end)
    assert state.tasks == {}
    assert state.last_seq == 4


def test_reports_about_unknown_tasks_change_nothing() -> None:
    state = fold(SAMPLES[1], SAMPLES[2], SAMPLES[3])
    assert state == State(last_seq=3, last_command_seq=3)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trip(event: Event) -> None:
    envelope = EventEnvelope(command_id=CommandId("c5"), command_seq=1, index=0, count=1, at_ms=1, event=event)
    assert codec.decode_event(codec.encode(envelope)) == envelope


def test_state_json_round_trip() -> None:
    state = fold(PLACED, SAMPLES[0], SAMPLES[1])
    assert codec.decode_state(codec.encode(state)) == state


def test_a_whole_history_round_trips_at_every_step() -> None:
    history = [
        *test_apply_nodes.SAMPLES[:4],
        *test_apply_models.SAMPLES,
        *test_apply_downloads.SAMPLES,
        *test_apply_instances.SAMPLES[:1],
        *test_apply_instances.SAMPLES[2:],
        *SAMPLES,
    ]
    state = State()
    for seq, event in enumerate(history, start=1):
        state = apply(state, event, seq, seq)
        assert codec.decode_state(codec.encode(state)) == state
    assert state.last_seq == len(history)
