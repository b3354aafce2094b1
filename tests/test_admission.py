"""The single writer's cluster-wide decisions, as pure handlers (no NATS): one instance per cold model however
many ask at once, memory counted for instances placed but not loaded, a queue bound and a start deadline
checked at assignment with a `Retry-After` from the instance's measured pace, tasks cancelled with their
requester, failed instances forgotten after their retention."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers.cards import tiny_card
from helpers.states import GiB
from jetshard_schema.admission import Queue, route, start_wait_ms
from jetshard_schema.commands import (
    AddCustomModelCard,
    CancelTask,
    EnsureInstance,
    ExpireRequester,
    ForgetInstance,
    PlaceInstance,
    ReportTaskFinished,
    ReportTaskStarted,
    SubmitTask,
)
from jetshard_schema.events import CommandRejected, Event, InstanceChosen, InstanceDeleted, InstancePlaced, TaskAssigned
from jetshard_schema.ids import CommandId, InstanceId, NodeId, TaskId
from jetshard_schema.placement import pending_bytes, required_memory_bytes
from jetshard_schema.state import Instance
from jetshard_schema.types import (
    RejectCode,
    RunnerStatus,
    ServingSettings,
    ShardAssignment,
    TaskKind,
    TaskOutcome,
    TaskRef,
    Usage,
    WeightsDtype,
)
from jetshard_sequencer.handlers import Context, handle, past_retention
from test_handlers import CARD, MODEL, A, InMemoryCluster, rejected

SMALL_QUEUE = ServingSettings(max_batch=2, max_queued=2, weights=WeightsDtype.NATIVE)


@pytest.fixture
def cluster() -> InMemoryCluster:
    cluster = InMemoryCluster()
    cluster.run(AddCustomModelCard(card=tiny_card(MODEL, num_layers=8, storage_size_bytes=GiB, context_length=256)))
    return cluster


def ensure(cluster: InMemoryCluster, instance: str) -> InstanceId:
    *replaced, event = cluster.run(
        EnsureInstance(instance_id=InstanceId(instance), model_id=MODEL, serving=SMALL_QUEUE)
    )
    assert isinstance(event, InstancePlaced | InstanceChosen), event
    assert all(isinstance(e, InstanceDeleted) for e in replaced), replaced
    return event.instance_id


def submit(cluster: InMemoryCluster, task: str, start_within_ms: int | None = None, requester: str = "api-1") -> object:
    ref = TaskRef(task_id=TaskId(task), model_id=MODEL, kind=TaskKind.CHAT, requester=requester)
    (event,) = cluster.submit(ref, start_within_ms)
    return event


def start_and_finish(cluster: InMemoryCluster, instance: InstanceId, task: str, took_ms: int) -> None:
    cluster.run(ReportTaskStarted(node_id=A, task_id=TaskId(task), instance_id=instance, prompt_tokens=3))
    cluster.now_ms += took_ms
    usage = Usage(prompt_tokens=3, completion_tokens=4)
    cluster.run(
        ReportTaskFinished(node_id=A, task_id=TaskId(task), instance_id=instance, outcome=TaskOutcome.STOP, usage=usage)
    )


def paced(cluster: InMemoryCluster, task_ms: int) -> InstanceId:
    """A ready instance of MODEL on A that has finished one task, in `task_ms`: its measured pace."""
    cluster.join(A)
    instance = ensure(cluster, "inst-1")
    cluster.make_ready(instance)
    submit(cluster, "warm-up")
    start_and_finish(cluster, instance, "warm-up", took_ms=task_ms)
    assert cluster.state.instances[instance].task_ms == task_ms
    return instance


def test_concurrent_first_requests_place_one_instance(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    # Eight APIs' requests, each with an instance id of its own, in whatever order the sequencer takes them.
    chosen = {ensure(cluster, f"inst-{n}") for n in range(8)}
    assert chosen == {InstanceId("inst-0")}
    assert list(cluster.state.instances) == ["inst-0"]
    # Explicit placement still places as many as asked.
    assert isinstance(cluster.run(PlaceInstance(instance_id=InstanceId("more"), model_id=MODEL))[0], InstancePlaced)


def test_a_failed_instance_is_replaced_not_reused(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    first = ensure(cluster, "inst-1")
    cluster.run(cluster.runner(first, 0, RunnerStatus.FAILED, "out of memory"), max_restarts=0)
    assert cluster.state.instances[first].failed
    assert ensure(cluster, "inst-2") == InstanceId("inst-2")
    assert list(cluster.state.instances) == ["inst-2"]  # it replaced the failed one
    # A retried command whose instance id is taken by a failed instance places nothing twice.
    cluster.run(cluster.runner(InstanceId("inst-2"), 0, RunnerStatus.FAILED, "again"), max_restarts=0)
    retried = cluster.run(EnsureInstance(instance_id=InstanceId("inst-2"), model_id=MODEL))
    rejected(retried, RejectCode.ALREADY_EXISTS)


def place_native(cluster: InMemoryCluster, instance: str, nodes: tuple[NodeId, ...] | None = None) -> list[Event]:
    native = ServingSettings(weights=WeightsDtype.NATIVE)
    return cluster.run(PlaceInstance(instance_id=InstanceId(instance), model_id=MODEL, node_ids=nodes, serving=native))


def test_placement_counts_what_unloaded_instances_will_take(cluster: InMemoryCluster) -> None:
    cluster.join(A, available_gib=4)
    (first,) = place_native(cluster, "inst-1")
    assert isinstance(first, InstancePlaced)
    (shard,) = first.shards
    assert shard.memory_bytes == required_memory_bytes(CARD, first.serving)  # ~1.6 GiB: weights, caches
    assert pending_bytes(cluster.state) == {A: shard.memory_bytes}
    # A still reports 4 GiB free, but only what the first left is offered to the second, and nothing to a third.
    assert isinstance(place_native(cluster, "inst-2")[0], InstancePlaced)
    assert pending_bytes(cluster.state) == {A: 2 * shard.memory_bytes}
    refused = rejected(place_native(cluster, "inst-3"), RejectCode.INSUFFICIENT_MEMORY)
    assert "available" in refused.reason
    # A loaded instance counts until a report of its node's shows its memory taken: the first report since it
    # loaded is recorded however little moved (1.6 of 64 GiB here), and from then on it counts there only.
    cluster.make_ready(first.instance_id)
    assert pending_bytes(cluster.state) == {A: 2 * shard.memory_bytes}
    cluster.join(A, available_gib=4 - shard.memory_bytes / GiB)
    assert pending_bytes(cluster.state) == {A: shard.memory_bytes}
    rejected(place_native(cluster, "inst-3"), RejectCode.INSUFFICIENT_MEMORY)


def test_a_burst_is_spread_over_the_instances_and_a_free_row_comes_before_a_queue(cluster: InMemoryCluster) -> None:
    """An API names instances on a State behind its own submissions: those it is naming meanwhile count. And a
    task goes where a row of the batch is free before where it would queue, however few wait there."""
    cluster.join(A)
    for name, max_batch in (("inst-wide", 4), ("inst-narrow", 1)):
        serving = ServingSettings(max_batch=max_batch, max_queued=4, weights=WeightsDtype.NATIVE)
        cluster.run(PlaceInstance(instance_id=InstanceId(name), model_id=MODEL, serving=serving))
        cluster.make_ready(InstanceId(name))
    naming: Counter[InstanceId] = Counter()
    named = []
    for _ in range(3):
        chosen = route(cluster.state, MODEL, None, cluster.now_ms, naming)
        assert chosen is not None
        naming[chosen.instance_id] += 1
        named.append(chosen.instance_id)
    assert set(named[:2]) == {"inst-wide", "inst-narrow"} and named[2] == "inst-wide", named
    for n, instance in enumerate(["inst-wide"] * 3 + ["inst-narrow"]):
        ref = TaskRef(task_id=TaskId(f"task-{n}"), model_id=MODEL, kind=TaskKind.CHAT, requester="api-1")
        assert isinstance(cluster.run(SubmitTask(task=ref, instance_id=InstanceId(instance)))[0], TaskAssigned)
    chosen = route(cluster.state, MODEL, None, cluster.now_ms)
    assert chosen is not None and chosen.instance_id == "inst-wide"  # 3 of 4 rows taken, not 1 of 1 and a queue


def test_the_queue_bound_holds_for_every_requester(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    instance = ensure(cluster, "inst-1")
    cluster.make_ready(instance)
    for n in range(4):  # max_batch 2 + max_queued 2, from two APIs
        assert isinstance(submit(cluster, f"task-{n}", requester=f"api-{n % 2}"), TaskAssigned)
    refused = submit(cluster, "task-4", requester="api-9")
    assert isinstance(refused, CommandRejected) and refused.code is RejectCode.QUEUE_FULL
    assert refused.retry_after_s == 2  # no task has finished yet: no pace to say better
    assert MODEL in refused.reason and "4 places" in refused.reason
    assert TaskId("task-4") not in cluster.state.tasks


def test_a_task_that_could_not_start_in_time_is_refused_with_a_retry_from_the_pace(
    cluster: InMemoryCluster,
) -> None:
    paced(cluster, task_ms=10_000)
    # Two run (a full batch); a third would start once one of them ends, in about 5 s at 2 rows per 10 s.
    assert isinstance(submit(cluster, "run-1"), TaskAssigned)
    assert isinstance(submit(cluster, "run-2"), TaskAssigned)
    assert isinstance(submit(cluster, "waits-5s", start_within_ms=6_000), TaskAssigned)
    # The next waits about 10 s: refused for a client waiting 6 s, told to come back when that is 6 s.
    refused = submit(cluster, "waits-10s", start_within_ms=6_000)
    assert isinstance(refused, CommandRejected) and refused.code is RejectCode.QUEUE_FULL
    assert refused.retry_after_s == 4 and "10 s to start" in refused.reason
    assert isinstance(submit(cluster, "patient", start_within_ms=60_000), TaskAssigned)
    # Now the queue is full: the retry is the time one place takes to free, 10 s / 2 rows.
    full = submit(cluster, "one-more", start_within_ms=60_000)
    assert isinstance(full, CommandRejected) and full.retry_after_s == 5
    negative = TaskRef(task_id=TaskId("t"), model_id=MODEL, kind=TaskKind.CHAT)
    rejected(cluster.submit(negative, start_within_ms=-1), RejectCode.INVALID)


def test_a_node_that_slows_down_refuses_at_once_what_it_can_no_longer_start_in_time(
    cluster: InMemoryCluster,
) -> None:
    instance = paced(cluster, task_ms=10_000)
    for task in ("run-1", "run-2"):  # a full batch, started
        assert isinstance(submit(cluster, task), TaskAssigned)
        cluster.run(ReportTaskStarted(node_id=A, task_id=TaskId(task), instance_id=instance, prompt_tokens=3))
    # At the average pace a third would start in about 5 s…
    assert isinstance(submit(cluster, "in-time", start_within_ms=6_000), TaskAssigned)
    cluster.run(CancelTask(task_id=TaskId("in-time")))
    # …but the node slowed down: its two tasks have run 30 s and not finished, so none will free a place in 5 s,
    # though no task has finished to lower the average. Refused, with a retry from the pace they show.
    cluster.now_ms += 30_000
    assert cluster.state.instances[instance].task_ms == 10_000
    refused = submit(cluster, "too-late", start_within_ms=6_000)
    assert isinstance(refused, CommandRejected) and refused.code is RejectCode.QUEUE_FULL
    assert "15 s to start" in refused.reason and refused.retry_after_s == 9


def test_the_pace_follows_the_recent_tasks() -> None:
    queue = Queue(running=2, waiting=3)
    instance = Instance(
        instance_id=InstanceId("i"),
        model_id=MODEL,
        shards=(ShardAssignment(node_id=A, rank=0, start_layer=0, end_layer=8),),
        serving=SMALL_QUEUE,
        task_ms=4000,
    )
    assert start_wait_ms(instance, queue) == 4 * 4000 / 2  # four ahead of it beyond the batch, two at a time
    assert start_wait_ms(instance, Queue(running=1, waiting=0)) == 0


def test_a_lapsed_requesters_tasks_are_cancelled_and_only_its(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    instance = ensure(cluster, "inst-1")
    cluster.make_ready(instance)
    submit(cluster, "mine-1", requester="dead-api")
    submit(cluster, "mine-2", requester="dead-api")
    submit(cluster, "theirs", requester="live-api")
    cancelled = cluster.run(ExpireRequester(session_id="dead-api"))
    assert sorted(e.task_id for e in cancelled) == ["mine-1", "mine-2"]  # type: ignore[attr-defined]
    assert "dead-api" in cancelled[0].reason  # type: ignore[attr-defined]
    assert list(cluster.state.tasks) == ["theirs"]
    assert cluster.run(ExpireRequester(session_id="dead-api")) == []


def test_failed_instances_leave_state_after_their_retention(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    failed = ensure(cluster, "inst-1")
    cluster.run(cluster.runner(failed, 0, RunnerStatus.FAILED, "bad weights"), max_restarts=0)
    alive = cluster.place("inst-2", [A])
    failed_at = cluster.state.instances[failed].failed_at_ms
    assert failed_at == cluster.now_ms
    assert past_retention(cluster.state, failed_at + 59_000, retention_s=60) == []
    assert past_retention(cluster.state, failed_at + 60_000, retention_s=60) == [failed]
    assert cluster.run(ForgetInstance(instance_id=failed)) == [
        InstanceDeleted(instance_id=failed, reason="failed; its retention ran out")
    ]
    assert list(cluster.state.instances) == [alive]
    # A stale observation forgets nothing: the instance is gone, or alive.
    assert cluster.run(ForgetInstance(instance_id=failed)) == []
    assert cluster.run(ForgetInstance(instance_id=alive)) == []


def test_handlers_stay_pure_for_the_new_commands(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    before = cluster.state
    ctx = Context(command_id=CommandId("x"), now_ms=5)
    command = EnsureInstance(instance_id=InstanceId("inst-9"), model_id=MODEL)
    assert handle(before, command, ctx) == handle(before, command, ctx)
    assert cluster.state is before
