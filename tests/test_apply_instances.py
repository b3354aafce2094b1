"""`apply` for instance and runner events, their wire round-trip, and the derived instance status."""

from __future__ import annotations

import msgspec
import pytest
from helpers import states
from helpers.states import INSTANCE, MODEL, A, B, fold, profile
from jetshard_schema import codec
from jetshard_schema.events import (
    DefaultKeepAliveSet,
    DownloadCompleted,
    Event,
    EventEnvelope,
    InstanceChosen,
    InstanceDeleted,
    InstanceFailed,
    InstanceKeepAliveSet,
    InstancePlaced,
    InstanceRestarting,
    NodeJoined,
    RunnerEndpointReported,
    RunnerStatusChanged,
    TaskAssigned,
    TaskCancelled,
    TaskFinished,
)
from jetshard_schema.ids import CommandId, NodeId, TaskId
from jetshard_schema.state import instance_status
from jetshard_schema.types import (
    KEEP_LOADED,
    Endpoint,
    InstanceStatus,
    RunnerReport,
    RunnerStatus,
    ShardAssignment,
    TaskKind,
    TaskOutcome,
    TaskRef,
    Usage,
)

SHARDS = (
    ShardAssignment(node_id=A, rank=0, start_layer=0, end_layer=5),
    ShardAssignment(node_id=B, rank=1, start_layer=5, end_layer=8),
)


def runner(rank: int, status: RunnerStatus, generation: int = 0, at_ms: int = 0) -> RunnerStatusChanged:
    return RunnerStatusChanged(
        instance_id=INSTANCE,
        generation=generation,
        at_ms=at_ms,
        runner=RunnerReport(
            node_id=SHARDS[rank].node_id, rank=rank, worker_session="w", status=status, layers_loaded=3, layers_total=5
        ),
    )


SAMPLES: list[Event] = [
    InstancePlaced(instance_id=INSTANCE, model_id=MODEL, shards=SHARDS),
    InstanceDeleted(instance_id=INSTANCE, reason="deleted on request"),
    RunnerEndpointReported(instance_id=INSTANCE, generation=0, node_id=A, rank=0, endpoint=Endpoint("10.0.0.1", 7000)),
    runner(0, RunnerStatus.LOADING),
    InstanceRestarting(instance_id=INSTANCE, generation=1, attempt=1, not_before_ms=5000, reason="rank 1 failed"),
    InstanceFailed(instance_id=INSTANCE, reason="gave up"),
    InstanceChosen(instance_id=INSTANCE, model_id=MODEL),
    InstanceKeepAliveSet(instance_id=INSTANCE, keep_alive_ms=0, at_ms=7000),
    DefaultKeepAliveSet(keep_alive_ms=600_000),
]
COVERED = {type(e) for e in SAMPLES}


def downloaded(node: NodeId, start: int, end: int) -> DownloadCompleted:
    return states.downloaded(node, MODEL, start, end)


def assigned(task: str) -> TaskAssigned:
    ref = TaskRef(task_id=TaskId(task), model_id=MODEL, kind=TaskKind.CHAT)
    return TaskAssigned(task=ref, instance_id=INSTANCE, generation=0)


def test_placed_instance_goes_from_downloading_to_ready() -> None:
    state = fold(SAMPLES[0])
    instance = state.instances[INSTANCE]
    assert (instance.shards, instance.generation, instance.num_layers) == (SHARDS, 0, 8)
    assert instance.shard_for(B) == SHARDS[1]
    assert instance_status(state, instance) is InstanceStatus.DOWNLOADING
    state = fold(downloaded(A, 0, 5), downloaded(B, 5, 8), state=state)
    assert instance_status(state, state.instances[INSTANCE]) is InstanceStatus.WAITING
    state = fold(runner(0, RunnerStatus.LOADING), state=state)
    assert instance_status(state, state.instances[INSTANCE]) is InstanceStatus.LOADING
    state = fold(runner(0, RunnerStatus.READY), runner(1, RunnerStatus.READY), state=state)
    assert instance_status(state, state.instances[INSTANCE]) is InstanceStatus.READY


def test_endpoint_and_runner_reports_of_another_generation_are_ignored() -> None:
    state = fold(SAMPLES[0], SAMPLES[2], runner(1, RunnerStatus.LOADING))
    assert state.instances[INSTANCE].endpoints == {0: Endpoint("10.0.0.1", 7000)}
    assert state.instances[INSTANCE].runners[1].status is RunnerStatus.LOADING
    stale = fold(
        RunnerEndpointReported(instance_id=INSTANCE, generation=3, node_id=B, rank=1, endpoint=Endpoint("h", 1)),
        runner(0, RunnerStatus.READY, generation=3),
        state=state,
    )
    assert stale.instances == state.instances
    assert stale.last_seq == state.last_seq + 2


def test_reports_about_an_unknown_instance_are_ignored() -> None:
    state = fold(SAMPLES[2], SAMPLES[3], SAMPLES[4], SAMPLES[5])
    assert state.instances == {}


def test_restarting_bumps_the_generation_and_drops_runners_endpoints_and_tasks() -> None:
    state = fold(SAMPLES[0], SAMPLES[2], runner(0, RunnerStatus.READY), assigned("task-1"), SAMPLES[4])
    instance = state.instances[INSTANCE]
    assert (instance.generation, instance.restart_attempt, instance.not_before_ms) == (1, 1, 5000)
    assert (instance.endpoints, instance.runners, instance.failed_reason) == ({}, {}, "rank 1 failed")
    assert state.tasks == {}
    assert instance_status(state, instance) is InstanceStatus.RESTARTING


def test_failed_instance_stays_with_its_reason() -> None:
    state = fold(SAMPLES[0], runner(0, RunnerStatus.READY), assigned("task-1"), SAMPLES[5])
    instance = state.instances[INSTANCE]
    assert instance.failed
    assert instance.failed_reason == "gave up"
    assert instance.runners == {}
    assert state.tasks == {}
    assert instance_status(state, instance) is InstanceStatus.FAILED


def test_deleted_instance_takes_its_tasks_along() -> None:
    state = fold(SAMPLES[0], assigned("task-1"), SAMPLES[1])
    assert state.instances == {}
    assert state.tasks == {}


def test_an_instance_that_leaves_gives_its_nodes_memory_back_at_once_as_far_as_their_reports_showed_it() -> None:
    """A gets back the 3 GiB placement counted for the instance as it leaves, not once it reports again (its runner
    still stopping); never more than A has. B's last report came while the instance loaded: placement counted the
    instance there as pending, so nothing is given back until B reports again."""
    gib = 2**30

    def joined(node: NodeId, available_gib: float) -> NodeJoined:
        return NodeJoined(node_id=node, session_id="s", profile=profile(available_gib, total_gib=8))

    shards = tuple(msgspec.structs.replace(s, memory_bytes=3 * gib) for s in SHARDS)
    state = fold(
        InstancePlaced(instance_id=INSTANCE, model_id=MODEL, shards=shards),
        joined(B, 7),  # while it loaded
        runner(0, RunnerStatus.READY),
        runner(1, RunnerStatus.READY),
        joined(A, 6),  # after it was ready: 2 GiB resident of the 3 reserved
    )
    state = fold(InstanceDeleted(instance_id=INSTANCE, reason="unloaded"), state=state)
    assert state.nodes[A].profile.memory_available_bytes == 8 * gib  # 6 + 3, at most all 8
    assert state.nodes[B].profile.memory_available_bytes == 7 * gib  # as it reported


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trip(event: Event) -> None:
    envelope = EventEnvelope(command_id=CommandId("c4"), command_seq=1, index=0, count=1, at_ms=1, event=event)
    assert codec.decode_event(codec.encode(envelope)) == envelope


def test_state_json_round_trip_keeps_integer_rank_keys() -> None:
    state = fold(SAMPLES[0], SAMPLES[2], runner(1, RunnerStatus.LOADING))
    decoded = codec.decode_state(codec.encode(state))
    assert decoded == state
    assert list(decoded.instances[INSTANCE].endpoints) == [0]


def test_an_instance_unloads_its_keep_alive_after_its_last_task_ended_and_a_request_may_change_it() -> None:
    placed = InstancePlaced(instance_id=INSTANCE, model_id=MODEL, shards=SHARDS, keep_alive_ms=300_000, at_ms=1000)
    state = fold(placed, runner(0, RunnerStatus.READY, at_ms=2000))
    assert state.instances[INSTANCE].unloads_at_ms(busy=False) is None  # loading, for the request that placed it
    # Idle from when it could first serve, however long it took to load; a rank that reports again later (a
    # restart of nothing) does not move that.
    ready = runner(1, RunnerStatus.READY, at_ms=400_000)
    state = fold(ready, runner(1, RunnerStatus.READY, at_ms=500_000), state=state)
    assert state.instances[INSTANCE].unloads_at_ms(busy=False) == 700_000
    assert state.instances[INSTANCE].unloads_at_ms(busy=True) is None
    # A request's own keep-alive (Ollama's) replaces the instance's; its end starts the idle time.
    ref = TaskRef(task_id=TaskId("t1"), model_id=MODEL, kind=TaskKind.CHAT, keep_alive_ms=0)
    state = fold(TaskAssigned(task=ref, instance_id=INSTANCE, generation=0), state=state)
    assert state.instances[INSTANCE].keep_alive_ms == 0
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    state = fold(TaskFinished(task_id=TaskId("t1"), outcome=TaskOutcome.STOP, usage=usage, at_ms=900_000), state=state)
    assert state.instances[INSTANCE].unloads_at_ms(busy=False) == 900_000
    # A cancelled task ends the busy time too; an older end never moves it back.
    state = fold(assigned("t2"), TaskCancelled(task_id=TaskId("t2"), reason="gone", at_ms=912_000), state=state)
    assert state.instances[INSTANCE].idle_since_ms == 912_000
    state = fold(assigned("t3"), TaskCancelled(task_id=TaskId("t3"), reason="gone", at_ms=911_000), state=state)
    assert state.instances[INSTANCE].idle_since_ms == 912_000
    # Kept loaded (Ollama's negative keep_alive, or placed by hand): it never unloads.
    state = fold(InstanceKeepAliveSet(instance_id=INSTANCE, keep_alive_ms=KEEP_LOADED, at_ms=913_000), state=state)
    assert state.instances[INSTANCE].unloads_at_ms(busy=False) is None
    placed = fold(InstancePlaced(instance_id=INSTANCE, model_id=MODEL, shards=SHARDS))
    assert placed.instances[INSTANCE].keep_alive_ms == KEEP_LOADED


def test_the_cluster_default_keep_alive_is_set_and_given_back_to_each_api() -> None:
    state = fold(DefaultKeepAliveSet(keep_alive_ms=600_000))
    assert state.default_keep_alive_ms == 600_000
    assert fold(DefaultKeepAliveSet(keep_alive_ms=None), state=state).default_keep_alive_ms is None
