"""Command handlers as pure functions: (State, Command, Context) -> events. No NATS."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
from helpers.cards import tiny_card
from helpers.states import A, B, C, GiB, completed, downloaded, fold, profile
from jetshard_api.errors import REJECT_STATUS
from jetshard_schema.admission import route
from jetshard_schema.cards import ModelCard, ModelFormat
from jetshard_schema.commands import (
    AddCustomModelCard,
    CancelDownload,
    CancelTask,
    Command,
    DeleteCustomModelCard,
    DeleteDownload,
    DeleteInstance,
    EnsureInstance,
    ExpireNode,
    ExpireRequester,
    PlaceInstance,
    ReportDownloadProgress,
    ReportNodeProfile,
    ReportNodeStorage,
    ReportRunnerEndpoint,
    ReportRunnerStatus,
    ReportTaskFinished,
    ReportTaskStarted,
    SetInstanceKeepAlive,
    StartDownload,
    SubmitTask,
    UnloadIdleInstance,
)
from jetshard_schema.events import (
    CommandRejected,
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadCancelled,
    DownloadDeleteRequested,
    DownloadFailed,
    DownloadProgressed,
    DownloadRequested,
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstanceKeepAliveSet,
    InstancePlaced,
    InstanceRestarting,
    NodeJoined,
    NodeLost,
    NodeStorageUpdated,
    NodeUpdated,
    RunnerEndpointReported,
    RunnerStatusChanged,
    TaskAssigned,
    TaskCancelled,
    TaskFinished,
    TaskStarted,
)
from jetshard_schema.ids import CommandId, InstanceId, ModelId, NodeId, TaskId
from jetshard_schema.state import State, apply, instance_status
from jetshard_schema.types import (
    DownloadProgress,
    DownloadStatus,
    Endpoint,
    Engine,
    GpuInfo,
    InstanceStatus,
    ModelDirInfo,
    NodeProfile,
    NodeStorage,
    Parallelism,
    RejectCode,
    RunnerReport,
    RunnerStatus,
    ServingSettings,
    TaskKind,
    TaskOutcome,
    TaskRef,
    Usage,
    WeightsDtype,
)
from jetshard_sequencer.handlers import Context, handle, idle_past_keep_alive, misaddressed

BUILTIN = ModelId("mlx-community/Qwen3-0.6B-4bit")
MODEL = ModelId("acme/tiny-8")
CARD = tiny_card(MODEL, num_layers=8, vocab_size=1000, storage_size_bytes=GiB, context_length=256)


class InMemoryCluster:
    """A State plus the handler, applying each command's events as the sequencer would."""

    def __init__(self, now_ms: int = 1_000_000) -> None:
        self.state = State()
        self.now_ms = now_ms
        self.count = 0

    def run(self, command: Command, **ctx: int) -> list[Event]:
        self.count += 1
        events = handle(
            self.state, command, Context(command_id=CommandId(f"cmd-{self.count}"), now_ms=self.now_ms, **ctx)
        )
        for event in events:
            self.state = apply(self.state, event, self.state.last_seq + 1, self.count)
        return events

    def submit(self, task: TaskRef, start_within_ms: int | None = None) -> list[Event]:
        """Submit `task` as an API does: naming the instance `route` chooses on this State (any instance of the
        model when none is ready, to be refused)."""
        chosen = route(self.state, task.model_id, start_within_ms, self.now_ms)
        named = chosen.instance_id if chosen else InstanceId("none-ready")
        return self.run(SubmitTask(task=task, instance_id=named, start_within_ms=start_within_ms))

    def join(self, node: NodeId, available_gib: float = 16, session: str = "s1") -> None:
        self.run(ReportNodeProfile(node_id=node, session_id=session, profile=profile(available_gib)))

    def place(self, instance: str, nodes: Sequence[NodeId] | None = None) -> InstanceId:
        events = self.run(
            PlaceInstance(instance_id=InstanceId(instance), model_id=MODEL, node_ids=tuple(nodes) if nodes else None)
        )
        assert isinstance(events[0], InstancePlaced), events
        return InstanceId(instance)

    def make_ready(self, instance_id: InstanceId) -> None:
        instance = self.state.instances[instance_id]
        for shard in instance.shards:
            self.run(
                ReportDownloadProgress(
                    node_id=shard.node_id,
                    model_id=MODEL,
                    progress=completed(shard.start_layer, shard.end_layer),
                )
            )
            self.run(self.runner(instance_id, shard.rank, RunnerStatus.READY))
        assert instance_status(self.state, self.state.instances[instance_id]) is InstanceStatus.READY

    def runner(self, instance_id: InstanceId, rank: int, status: RunnerStatus, reason: str = "") -> ReportRunnerStatus:
        instance = self.state.instances[instance_id]
        return ReportRunnerStatus(
            instance_id=instance_id,
            generation=instance.generation,
            runner=RunnerReport(
                node_id=instance.shards[rank].node_id, rank=rank, worker_session="w", status=status, reason=reason
            ),
        )


def rejected(events: list[Event], code: RejectCode) -> CommandRejected:
    assert len(events) == 1 and isinstance(events[0], CommandRejected), events
    assert events[0].code is code, events[0]
    assert events[0].reason
    return events[0]


@pytest.fixture
def cluster() -> InMemoryCluster:
    cluster = InMemoryCluster()
    assert cluster.run(AddCustomModelCard(card=CARD)) == [
        CustomModelCardAdded(card=msgspec.structs.replace(CARD, is_custom=True))
    ]
    return cluster


# --- nodes -------------------------------------------------------------------------------------------------


def test_node_join_rejoin_and_meaningful_updates_only() -> None:
    cluster = InMemoryCluster()
    first = ReportNodeProfile(node_id=A, session_id="s1", profile=profile(16))
    assert cluster.run(first) == [NodeJoined(node_id=A, session_id="s1", profile=profile(16))]
    assert cluster.run(first) == []  # the same report again: nothing new
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=profile(16.5))) == []  # < 5 % of 64 GiB
    assert cluster.state.nodes[A].profile == profile(16)
    moved = ReportNodeProfile(node_id=A, session_id="s1", profile=profile(8))
    assert cluster.run(moved) == [NodeUpdated(node_id=A, profile=profile(8))]
    renamed = msgspec.structs.replace(profile(8), hostname="other")
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=renamed)) == [
        NodeUpdated(node_id=A, profile=renamed)
    ]
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s2", profile=renamed)) == [
        NodeJoined(node_id=A, session_id="s2", profile=renamed)
    ]
    assert list(cluster.state.nodes) == [A]


def test_a_gpu_whose_free_memory_moves_updates_the_node() -> None:
    """A GPU given as data (none here): its free memory is what placement counts on a CUDA node."""
    cluster = InMemoryCluster()

    def with_gpu(free_gib: float, name: str = "NVIDIA H200") -> NodeProfile:
        gpu = GpuInfo(
            name=name,
            memory_total_bytes=140 * GiB,
            memory_free_bytes=int(free_gib * GiB),
            compute_capability="9.0",
            driver="580.65",
        )
        return msgspec.structs.replace(profile(16), accelerator="cuda", gpus=(gpu,))

    cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_gpu(100)))
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_gpu(97))) == []  # < 5 % of 140
    taken = with_gpu(80)
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=taken)) == [
        NodeUpdated(node_id=A, profile=taken)
    ]
    swapped = with_gpu(80, name="NVIDIA H100")
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=swapped)) == [
        NodeUpdated(node_id=A, profile=swapped)
    ]


def test_node_storage_reported_only_when_it_changes_meaningfully() -> None:
    cluster = InMemoryCluster()
    dirs = (ModelDirInfo(path="/m", read_only=False, free_bytes=10 * GiB, total_bytes=100 * GiB),)
    storage = NodeStorage(model_dirs=dirs)
    assert cluster.run(ReportNodeStorage(node_id=A, storage=storage)) == [
        NodeStorageUpdated(node_id=A, storage=storage)
    ]
    nudged = NodeStorage(model_dirs=(msgspec.structs.replace(dirs[0], free_bytes=10 * GiB - 2**20),))
    assert cluster.run(ReportNodeStorage(node_id=A, storage=nudged)) == []
    shrunk = NodeStorage(model_dirs=(msgspec.structs.replace(dirs[0], free_bytes=5 * GiB),))
    assert cluster.run(ReportNodeStorage(node_id=A, storage=shrunk)) == [NodeStorageUpdated(node_id=A, storage=shrunk)]
    for changed in (
        msgspec.structs.replace(shrunk, offline=True),
        msgspec.structs.replace(shrunk, offline=True, available_models=(MODEL,)),
    ):
        assert cluster.run(ReportNodeStorage(node_id=A, storage=changed)) == [
            NodeStorageUpdated(node_id=A, storage=changed)
        ]


def test_expire_node_tears_down_its_instances_and_places_them_again(cluster: InMemoryCluster) -> None:
    cluster.join(A, 16)
    cluster.join(B, 16)
    lost = cluster.place("inst-1", [A])
    untouched = cluster.place("inst-2", [B])
    events = cluster.run(ExpireNode(node_id=A, session_id="s1"))
    assert isinstance(events[0], NodeLost)
    assert events[1] == InstanceDeleted(instance_id=lost, reason=f"node {A} was lost")
    assert isinstance(events[2], InstancePlaced)
    assert events[2].model_id == MODEL
    assert [s.node_id for s in events[2].shards] == [B]
    assert len(events) == 3
    assert set(cluster.state.instances) == {untouched, events[2].instance_id}
    assert list(cluster.state.nodes) == [B]


def test_a_restarted_worker_restarts_the_instances_its_runners_served(cluster: InMemoryCluster) -> None:
    """A new session of a known node is its worker restarted, whose runners died with it: their READY must not
    stand until the liveness TTL runs out, nor wait for the new worker to report them."""
    cluster.join(A, 16)
    cluster.join(B, 16)
    spanning = cluster.place("inst-1", [A, B])
    elsewhere = cluster.place("inst-2", [B])
    cluster.make_ready(spanning)
    cluster.make_ready(elsewhere)
    events = cluster.run(ReportNodeProfile(node_id=A, session_id="s2", profile=profile(16)))
    assert events[0] == NodeJoined(node_id=A, session_id="s2", profile=profile(16))
    assert events[1:] == [
        InstanceRestarting(
            instance_id=spanning,
            generation=1,
            attempt=1,
            not_before_ms=cluster.now_ms + 1000,
            reason=f"the worker on {A} restarted; its runners died with it",
        )
    ]
    assert instance_status(cluster.state, cluster.state.instances[spanning]) is not InstanceStatus.READY
    assert instance_status(cluster.state, cluster.state.instances[elsewhere]) is InstanceStatus.READY


def test_a_tensor_parallel_instance_lost_with_a_node_is_placed_again_over_as_many_ranks(
    cluster: InMemoryCluster,
) -> None:
    for node_id in (A, B, C):
        cluster.join(node_id, 16)
    tensor = ServingSettings(parallelism=Parallelism.TENSOR)
    [placed] = cluster.run(PlaceInstance(instance_id=InstanceId("inst-1"), model_id=MODEL, min_nodes=2, serving=tensor))
    assert isinstance(placed, InstancePlaced)
    assert [(s.node_id, s.tensor_rank) for s in placed.shards] == [(A, 0), (B, 1)]

    events = cluster.run(ExpireNode(node_id=A, session_id="s1"))

    assert isinstance(events[2], InstancePlaced)
    assert [(s.node_id, s.tensor_rank, s.start_layer, s.end_layer) for s in events[2].shards] == [
        (B, 0, 0, 8),
        (C, 1, 0, 8),
    ]
    assert events[2].serving.parallelism is Parallelism.TENSOR


def test_a_tensor_parallel_placement_whose_heads_do_not_divide_is_invalid(cluster: InMemoryCluster) -> None:
    for node_id in (A, B, C):
        cluster.join(node_id, 16)
    tensor = ServingSettings(parallelism=Parallelism.TENSOR)
    [rejected] = cluster.run(
        PlaceInstance(instance_id=InstanceId("inst-1"), model_id=MODEL, min_nodes=3, serving=tensor)
    )
    assert isinstance(rejected, CommandRejected) and rejected.code is RejectCode.INVALID
    assert "4 attention heads and 2 key/value heads, which do not both divide by 3 nodes" in rejected.reason
    assert REJECT_STATUS[rejected.code] == 400


def test_expire_node_is_deterministic() -> None:
    def expire() -> list[Event]:
        cluster = InMemoryCluster()
        cluster.run(AddCustomModelCard(card=CARD))
        cluster.join(A)
        cluster.join(B)
        cluster.place("inst-1", [A])
        return cluster.run(ExpireNode(node_id=A, session_id="s1"))

    assert expire() == expire()


def test_expired_instance_is_not_placed_again_when_nothing_fits(cluster: InMemoryCluster) -> None:
    cluster.join(A, 16)
    cluster.join(B, 0.1)
    cluster.place("inst-1", [A])
    events = cluster.run(ExpireNode(node_id=A, session_id="s1"))
    assert [type(e) for e in events] == [NodeLost, InstanceDeleted]
    assert cluster.state.instances == {}


def test_expire_of_an_old_session_or_unknown_node_does_nothing(cluster: InMemoryCluster) -> None:
    cluster.join(A, session="s1")
    cluster.join(A, session="s2")
    assert cluster.run(ExpireNode(node_id=A, session_id="s1")) == []
    assert cluster.run(ExpireNode(node_id=C, session_id="s1")) == []
    assert list(cluster.state.nodes) == [A]


# --- model cards -------------------------------------------------------------------------------------------


def test_card_add_duplicate_builtin_and_invalid(cluster: InMemoryCluster) -> None:
    assert MODEL in cluster.state.custom_cards
    assert cluster.state.custom_cards[MODEL].is_custom
    rejected(cluster.run(AddCustomModelCard(card=CARD)), RejectCode.ALREADY_EXISTS)
    builtin = msgspec.structs.replace(CARD, model_id=BUILTIN)
    rejected(cluster.run(AddCustomModelCard(card=builtin)), RejectCode.ALREADY_EXISTS)
    # A card's own fields are checked where it is decoded (tests/test_hostile_ids.py); which architectures the
    # shard engine runs is checked here, where it may change between versions without refusing a stored card.
    gpt2 = msgspec.structs.replace(CARD, model_id=ModelId("acme/gpt2"), architecture="gpt2")
    refusal = rejected(cluster.run(AddCustomModelCard(card=gpt2)), RejectCode.INVALID)
    assert "architecture 'gpt2' is not supported" in refusal.reason
    assert ModelId("acme/gpt2") not in cluster.state.custom_cards
    # A name is kept without the control characters a terminal that shows it would obey (a title, a clipboard).
    named = msgspec.structs.replace(CARD, model_id=ModelId("acme/named"), display_name="\x1b]0;pwned\x07Named\x1b[2J")
    cluster.run(AddCustomModelCard(card=named))
    assert cluster.state.custom_cards[ModelId("acme/named")].display_name == "]0;pwnedNamed[2J"


def test_card_delete_builtin_is_a_409_conflict_and_unknown_is_404(cluster: InMemoryCluster) -> None:
    refusal = rejected(cluster.run(DeleteCustomModelCard(model_id=BUILTIN)), RejectCode.CONFLICT)
    assert "built-in" in refusal.reason
    assert REJECT_STATUS[refusal.code] == 409
    refusal = rejected(cluster.run(DeleteCustomModelCard(model_id=ModelId("acme/none"))), RejectCode.NOT_FOUND)
    assert REJECT_STATUS[refusal.code] == 404
    assert cluster.run(DeleteCustomModelCard(model_id=MODEL)) == [CustomModelCardDeleted(model_id=MODEL)]
    assert cluster.state.custom_cards == {}


def test_a_card_in_use_is_not_deleted(cluster: InMemoryCluster) -> None:
    """Its instances need it (to restart) and its downloads' records (to start their runners)."""
    cluster.join(A)
    instance = cluster.place("inst-1")
    refusal = rejected(cluster.run(DeleteCustomModelCard(model_id=MODEL)), RejectCode.CONFLICT)
    assert refusal.reason == f"{MODEL} is in use by instance(s) inst-1; delete them first"
    assert REJECT_STATUS[refusal.code] == 409
    cluster.run(DeleteInstance(instance_id=instance))
    assert cluster.run(DeleteCustomModelCard(model_id=MODEL)) == [CustomModelCardDeleted(model_id=MODEL)]


def test_a_failed_instance_does_not_hold_its_model_or_its_files(cluster: InMemoryCluster) -> None:
    """A failed instance runs nothing and never restarts: its model and files may go while State keeps it to say
    why it failed."""
    cluster.join(A)
    instance = cluster.place("inst-1", [A])
    failed = DownloadProgress(status=DownloadStatus.FAILED, reason="disk full")
    cluster.run(ReportDownloadProgress(node_id=A, model_id=MODEL, progress=failed))
    assert cluster.state.instances[instance].failed
    assert cluster.run(DeleteDownload(node_id=A, model_id=MODEL)) == [
        DownloadDeleteRequested(node_id=A, model_id=MODEL)
    ]
    assert cluster.run(DeleteCustomModelCard(model_id=MODEL)) == [CustomModelCardDeleted(model_id=MODEL)]
    assert cluster.state.instances[instance].failed_reason == f"downloading {MODEL} to node {A} failed: disk full"


def test_a_download_ending_after_its_card_was_deleted_is_not_recorded(cluster: InMemoryCluster) -> None:
    """The download was forgotten with its card: the downloader's last report of it must not bring it back."""
    cluster.join(A)
    cluster.run(StartDownload(model_id=MODEL, node_id=A))
    cluster.run(DeleteCustomModelCard(model_id=MODEL))
    assert cluster.state.downloads[A] == {}
    failed = DownloadProgress(status=DownloadStatus.FAILED, reason=f"unknown model {MODEL}: no card in the catalogue")
    for progress in (completed(0, 8), failed):
        assert cluster.run(ReportDownloadProgress(node_id=A, model_id=MODEL, progress=progress)) == []
    assert cluster.state.downloads[A] == {}


# --- downloads ---------------------------------------------------------------------------------------------


def test_start_download_checks_model_node_and_range(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    rejected(cluster.run(StartDownload(model_id=ModelId("acme/none"), node_id=A)), RejectCode.NOT_FOUND)
    rejected(cluster.run(StartDownload(model_id=MODEL, node_id=C)), RejectCode.NOT_FOUND)
    rejected(cluster.run(StartDownload(model_id=MODEL, node_id=A, start_layer=4, end_layer=9)), RejectCode.INVALID)
    rejected(cluster.run(StartDownload(model_id=MODEL, node_id=A, start_layer=4, end_layer=4)), RejectCode.INVALID)
    assert cluster.run(StartDownload(model_id=MODEL, node_id=A)) == [
        DownloadRequested(node_id=A, model_id=MODEL, start_layer=0, end_layer=8)
    ]


def test_cancel_download_only_while_in_progress(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    rejected(cluster.run(CancelDownload(model_id=MODEL, node_id=A)), RejectCode.NOT_FOUND)
    cluster.run(StartDownload(model_id=MODEL, node_id=A))
    assert cluster.run(CancelDownload(model_id=MODEL, node_id=A)) == [DownloadCancelled(node_id=A, model_id=MODEL)]
    rejected(cluster.run(CancelDownload(model_id=MODEL, node_id=A)), RejectCode.CONFLICT)
    # the downloader's report that it stopped the cancelled download is recorded, with what it kept
    stopped = DownloadProgress(status=DownloadStatus.CANCELLED, bytes_done=5, bytes_total=9, reason="stopped")
    assert cluster.run(ReportDownloadProgress(node_id=A, model_id=MODEL, progress=stopped)) == [
        DownloadProgressed(node_id=A, model_id=MODEL, progress=stopped)
    ]
    # one from an attempt that a new request replaced is not: the new download goes on
    cluster.run(StartDownload(model_id=MODEL, node_id=A))
    assert cluster.run(ReportDownloadProgress(node_id=A, model_id=MODEL, progress=stopped)) == []


def test_delete_download_refuses_read_only_and_in_use(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    rejected(cluster.run(DeleteDownload(model_id=MODEL, node_id=A)), RejectCode.NOT_FOUND)
    cluster.run(
        ReportDownloadProgress(
            node_id=A,
            model_id=MODEL,
            progress=completed(0, 8, "/ro", read_only=True),
        )
    )
    refusal = rejected(cluster.run(DeleteDownload(model_id=MODEL, node_id=A)), RejectCode.CONFLICT)
    assert "read-only" in refusal.reason
    cluster.run(
        ReportDownloadProgress(
            node_id=A,
            model_id=MODEL,
            progress=completed(0, 8, "/rw"),
        )
    )
    instance = cluster.place("inst-1", [A])
    refusal = rejected(cluster.run(DeleteDownload(model_id=MODEL, node_id=A)), RejectCode.CONFLICT)
    assert instance in refusal.reason
    cluster.run(DeleteInstance(instance_id=instance))
    assert cluster.run(DeleteDownload(model_id=MODEL, node_id=A)) == [
        DownloadDeleteRequested(node_id=A, model_id=MODEL)
    ]


# --- instances and runners ---------------------------------------------------------------------------------


def test_place_and_delete_instance(cluster: InMemoryCluster) -> None:
    cluster.join(A, 16)
    rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i"), model_id=ModelId("acme/none"))),
        RejectCode.NOT_FOUND,
    )
    instance = cluster.place("inst-1")
    rejected(cluster.run(PlaceInstance(instance_id=instance, model_id=MODEL)), RejectCode.ALREADY_EXISTS)
    big = msgspec.structs.replace(CARD, model_id=ModelId("acme/huge"), storage_size_bytes=100 * GiB)
    cluster.run(AddCustomModelCard(card=big))
    refusal = rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i2"), model_id=big.model_id)),
        RejectCode.INSUFFICIENT_MEMORY,
    )
    assert "GiB" in refusal.reason
    # A node named twice, or one the cluster does not know, is the request's fault, not a lack of memory.
    for node_ids in ((A, A), (A, NodeId("nowhere"))):
        place = PlaceInstance(instance_id=InstanceId("i3"), model_id=MODEL, node_ids=node_ids)
        rejected(cluster.run(place), RejectCode.INVALID)
    # Thousands of unknown nodes: the refusal names a few, not every one of them.
    unknown = tuple(NodeId(f"nowhere-{n}") for n in range(4096))
    refusal = rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i3"), model_id=MODEL, node_ids=unknown)), RejectCode.INVALID
    )
    assert refusal.reason == "unknown node(s): nowhere-0, nowhere-1, nowhere-2 and 4093 more; see GET /nodes"
    # More nodes than the cluster has: not a lack of memory either, and not the request's fault alone.
    refusal = rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i3"), model_id=MODEL, min_nodes=2)),
        RejectCode.NOT_ENOUGH_NODES,
    )
    assert refusal.reason == "2 node(s) requested but only 1 available"
    assert REJECT_STATUS[refusal.code] == 409
    rejected(cluster.run(DeleteInstance(instance_id=InstanceId("nope"))), RejectCode.NOT_FOUND)
    assert cluster.run(DeleteInstance(instance_id=instance)) == [
        InstanceDeleted(instance_id=instance, reason="deleted on request")
    ]


def test_runner_endpoint_checks_rank_and_generation(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    cluster.join(B)
    instance = cluster.place("inst-1", [A, B])
    ok = ReportRunnerEndpoint(instance_id=instance, generation=0, node_id=B, rank=1, endpoint=Endpoint("h", 9))
    assert cluster.run(ok) == [
        RunnerEndpointReported(instance_id=instance, generation=0, node_id=B, rank=1, endpoint=Endpoint("h", 9))
    ]
    rejected(cluster.run(msgspec.structs.replace(ok, rank=0)), RejectCode.FORBIDDEN)
    assert cluster.run(msgspec.structs.replace(ok, generation=5)) == []


def test_runner_failure_restarts_with_backoff_then_fails(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    cluster.join(B)
    instance = cluster.place("inst-1", [A, B])
    cluster.make_ready(instance)
    now = cluster.now_ms
    restarts: list[InstanceRestarting] = []
    for attempt in (1, 2, 3):
        old_generation = cluster.state.instances[instance].generation
        events = cluster.run(cluster.runner(instance, 1, RunnerStatus.FAILED, reason="out of memory"))
        assert isinstance(events[0], RunnerStatusChanged)
        assert isinstance(events[1], InstanceRestarting)
        restarts.append(events[1])
        assert events[1].attempt == attempt
        assert events[1].generation == old_generation + 1
        assert events[1].reason == "out of memory"
        assert cluster.state.instances[instance].generation == old_generation + 1
        # a late report from the previous generation is ignored
        stale = msgspec.structs.replace(cluster.runner(instance, 0, RunnerStatus.FAILED), generation=old_generation)
        assert cluster.run(stale) == []
    assert [r.not_before_ms - now for r in restarts] == [1000, 2000, 4000]
    events = cluster.run(cluster.runner(instance, 0, RunnerStatus.FAILED, reason="segfault"))
    assert isinstance(events[-1], InstanceFailed)
    assert "gave up after 3 restarts" in events[-1].reason
    assert instance_status(cluster.state, cluster.state.instances[instance]) is InstanceStatus.FAILED
    assert cluster.run(cluster.runner(instance, 0, RunnerStatus.FAILED)) == []  # failed for good


def test_a_ready_instance_failing_again_starts_counting_from_one(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    instance = cluster.place("inst-1", [A])
    cluster.make_ready(instance)
    events = cluster.run(cluster.runner(instance, 0, RunnerStatus.FAILED), max_restarts=1)
    assert isinstance(events[1], InstanceRestarting) and events[1].attempt == 1
    for rank in (0,):
        cluster.run(cluster.runner(instance, rank, RunnerStatus.READY))
    events = cluster.run(cluster.runner(instance, 0, RunnerStatus.STOPPED), max_restarts=1)
    assert isinstance(events[1], InstanceRestarting) and events[1].attempt == 1


# --- tasks -------------------------------------------------------------------------------------------------


def submit(cluster: InMemoryCluster, task: str) -> list[Event]:
    return cluster.submit(TaskRef(task_id=TaskId(task), model_id=MODEL, kind=TaskKind.CHAT))


def test_submit_routes_to_the_ready_instance_with_fewest_tasks(cluster: InMemoryCluster) -> None:
    rejected(submit(cluster, "task-0"), RejectCode.NO_CAPACITY)
    cluster.join(A)
    cluster.join(B)
    first, second = cluster.place("inst-1", [A]), cluster.place("inst-2", [B])
    rejected(submit(cluster, "task-0"), RejectCode.NO_CAPACITY)  # placed but not ready
    cluster.make_ready(first)
    cluster.make_ready(second)
    chosen = []
    for n in range(4):
        events = submit(cluster, f"task-{n}")
        assert isinstance(events[0], TaskAssigned)
        chosen.append(events[0].instance_id)
    assert sorted(chosen) == [first, first, second, second]
    # finishing two tasks of `first` makes it the least loaded
    for n, instance in enumerate(chosen):
        if instance == first:
            cluster.run(
                ReportTaskFinished(
                    node_id=A,
                    task_id=TaskId(f"task-{n}"),
                    instance_id=first,
                    outcome=TaskOutcome.STOP,
                    usage=Usage(prompt_tokens=1, completion_tokens=1),
                )
            )
    events = submit(cluster, "task-9")
    assert isinstance(events[0], TaskAssigned) and events[0].instance_id == first
    rejected(submit(cluster, "task-9"), RejectCode.ALREADY_EXISTS)


def test_a_task_goes_to_the_instance_its_request_was_stored_for_or_is_refused(cluster: InMemoryCluster) -> None:
    """The API stores a task's request for the leader of the instance it names: the sequencer assigns the task
    there while that instance can take it, else refuses it with the instance that can, never elsewhere."""
    cluster.join(A)
    cluster.join(B)
    first, second = cluster.place("inst-1", [A]), cluster.place("inst-2", [B])
    cluster.make_ready(first)

    def named(task: str, instance_id: str) -> list[Event]:
        ref = TaskRef(task_id=TaskId(task), model_id=MODEL, kind=TaskKind.CHAT)
        return cluster.run(SubmitTask(task=ref, instance_id=InstanceId(instance_id)))

    assert isinstance(named("t1", first)[0], TaskAssigned)
    refused = rejected(named("t2", second), RejectCode.NO_CAPACITY)  # placed, not ready
    assert first in refused.reason
    rejected(named("t2", "no-such-instance"), RejectCode.NO_CAPACITY)
    cluster.make_ready(second)
    # The named one is taken though it has more tasks than the other: the request waits on its node.
    events = named("t2", first)
    assert isinstance(events[0], TaskAssigned) and events[0].instance_id == first
    assert TaskId("t2") in cluster.state.tasks


def test_task_lifecycle_and_cancel(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    instance = cluster.place("inst-1", [A])
    cluster.make_ready(instance)
    submit(cluster, "task-1")
    task = TaskId("task-1")
    assert cluster.run(ReportTaskStarted(node_id=A, task_id=task, instance_id=instance, prompt_tokens=3)) == [
        TaskStarted(task_id=task, prompt_tokens=3, at_ms=cluster.now_ms)
    ]
    assert cluster.run(CancelTask(task_id=task)) == [
        TaskCancelled(task_id=task, reason="cancelled by the client", at_ms=cluster.now_ms)
    ]
    assert cluster.state.tasks == {}
    assert cluster.run(CancelTask(task_id=task)) == []
    assert cluster.run(ReportTaskStarted(node_id=A, task_id=task, instance_id=instance, prompt_tokens=3)) == []
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    assert (
        cluster.run(
            ReportTaskFinished(node_id=A, task_id=task, instance_id=instance, outcome=TaskOutcome.STOP, usage=usage)
        )
        == []
    )
    submit(cluster, "task-2")
    assert cluster.run(
        ReportTaskFinished(
            node_id=A, task_id=TaskId("task-2"), instance_id=instance, outcome=TaskOutcome.LENGTH, usage=usage
        )
    ) == [TaskFinished(task_id=TaskId("task-2"), outcome=TaskOutcome.LENGTH, usage=usage, at_ms=cluster.now_ms)]


# --- who may say what --------------------------------------------------------------------------------------


def test_a_command_is_refused_on_any_subject_but_its_own() -> None:
    """NATS lets a node's identity publish only under its own node: a body about another node, or a user's
    command, arriving there is that node speaking for someone else."""
    report = ReportNodeProfile(node_id=B, session_id="s1", profile=profile(2000))
    assert report.subject == f"jetshard.cmd.node.{B}.worker.report_node_profile"
    assert misaddressed(report, report.subject) is None
    forged = misaddressed(report, f"jetshard.cmd.node.{A}.worker.report_node_profile")
    assert forged is not None and forged.code is RejectCode.FORBIDDEN
    assert f"node {B}'s worker" in forged.reason and f"node.{A}" in forged.reason
    # the downloader of the same node may not send the worker's reports, nor a node a user's command
    assert misaddressed(report, f"jetshard.cmd.node.{B}.downloader.report_node_profile") is not None
    cancel = CancelTask(task_id=TaskId("someone-elses"))
    assert cancel.subject == "jetshard.cmd.api.cancel_task"
    refused = misaddressed(cancel, f"jetshard.cmd.node.{A}.worker.cancel_task")
    assert refused is not None and "the api" in refused.reason
    assert ExpireNode(node_id=A, session_id="s1").subject == "jetshard.cmd.sequencer.expire_node"
    assert REJECT_STATUS[RejectCode.FORBIDDEN] == 403


def test_a_node_reports_only_on_the_ranks_and_tasks_it_runs(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    cluster.join(B)
    instance = cluster.place("inst-1", [A, B])  # rank 1, the leader, on B
    cluster.make_ready(instance)
    before = cluster.state.instances[instance]
    forged = ReportRunnerStatus(
        instance_id=instance,
        generation=0,
        runner=RunnerReport(node_id=A, rank=1, worker_session="w", status=RunnerStatus.FAILED, reason="forged"),
    )
    rejected(cluster.run(forged), RejectCode.FORBIDDEN)
    assert cluster.state.instances[instance] == before  # no restart
    submit(cluster, "task-1")
    task = TaskId("task-1")
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    for node in (A, B):
        outcome = ReportTaskFinished(
            node_id=node, task_id=task, instance_id=instance, outcome=TaskOutcome.STOP, usage=usage
        )
        if node == A:  # holds a rank, but the leader on B runs the task
            rejected(cluster.run(outcome), RejectCode.FORBIDDEN)
            rejected(
                cluster.run(ReportTaskStarted(node_id=A, task_id=task, instance_id=instance, prompt_tokens=1)),
                RejectCode.FORBIDDEN,
            )
            assert task in cluster.state.tasks
        else:
            assert isinstance(cluster.run(outcome)[0], TaskFinished)
    endpoint = ReportRunnerEndpoint(
        instance_id=instance, generation=0, node_id=A, rank=1, endpoint=Endpoint(host="h", port=1)
    )
    rejected(cluster.run(endpoint), RejectCode.FORBIDDEN)


def test_handlers_are_pure() -> None:
    cluster = InMemoryCluster()
    cluster.join(A)
    before = cluster.state
    command = ReportNodeProfile(node_id=A, session_id="s2", profile=profile(1))
    ctx = Context(command_id=CommandId("x"), now_ms=5)
    assert handle(before, command, ctx) == handle(before, command, ctx)
    assert cluster.state is before


# --- download failures and offline nodes -------------------------------------------------------------------


def test_a_failed_download_fails_the_instances_waiting_for_it_at_once(cluster: InMemoryCluster) -> None:
    cluster.join(A, 16)
    cluster.join(B, 16)
    waiting = cluster.place("inst-1", [A])
    elsewhere = cluster.place("inst-2", [B])
    retrying = ReportDownloadProgress(
        node_id=A,
        model_id=MODEL,
        progress=DownloadProgress(status=DownloadStatus.PENDING, reason="connection reset", attempt=1, max_attempts=3),
    )
    assert cluster.run(retrying) == [DownloadProgressed(node_id=A, model_id=MODEL, progress=retrying.progress)]
    download = cluster.state.download(A, MODEL)
    assert download is not None and (download.progress.attempt, download.progress.max_attempts) == (1, 3)
    assert not cluster.state.instances[waiting].failed
    events = cluster.run(
        ReportDownloadProgress(
            node_id=A, model_id=MODEL, progress=DownloadProgress(status=DownloadStatus.FAILED, reason="Hub unreachable")
        )
    )
    assert events == [
        DownloadFailed(node_id=A, model_id=MODEL, reason="Hub unreachable"),
        InstanceFailed(
            instance_id=waiting,
            reason=f"downloading {MODEL} to node {A} failed: Hub unreachable",
            at_ms=cluster.now_ms,
        ),
    ]
    assert cluster.state.instances[waiting].failed
    assert not cluster.state.instances[elsewhere].failed


def test_a_request_placing_a_model_again_replaces_its_failed_instances(cluster: InMemoryCluster) -> None:
    """A client retrying a model whose files cannot be fetched leaves one failed instance, the latest, saying why;
    not one per retry until their retention. A placement asked for by name leaves the failures be."""
    cluster.join(A, 16)
    unreachable = DownloadProgress(status=DownloadStatus.FAILED, reason="Hub unreachable")
    failed: list[InstanceId] = []
    for attempt in range(3):
        *replaced, placed = cluster.run(EnsureInstance(instance_id=InstanceId(f"auto-{attempt}"), model_id=MODEL))
        assert isinstance(placed, InstancePlaced), placed
        assert replaced == (
            [InstanceDeleted(instance_id=failed[-1], reason=f"replaced by auto-{attempt}")] if failed else []
        )
        cluster.run(ReportDownloadProgress(node_id=A, model_id=MODEL, progress=unreachable))
        failed.append(placed.instance_id)
        assert list(cluster.state.instances) == [placed.instance_id]
        assert cluster.state.instances[placed.instance_id].failed
    by_name = cluster.place("by-name", [A])
    assert sorted(cluster.state.instances) == [failed[-1], by_name]


def test_a_failed_download_leaves_a_ready_instance_alone(cluster: InMemoryCluster) -> None:
    cluster.join(A, 16)
    ready = cluster.place("inst-1", [A])
    cluster.make_ready(ready)
    events = cluster.run(
        ReportDownloadProgress(
            node_id=A, model_id=MODEL, progress=DownloadProgress(status=DownloadStatus.FAILED, reason="disk full")
        )
    )
    assert [type(e) for e in events] == [DownloadFailed]
    assert instance_status(cluster.state, cluster.state.instances[ready]) is InstanceStatus.READY


def test_placement_skips_offline_nodes_that_lack_the_model(cluster: InMemoryCluster) -> None:
    cluster.join(A, 32)  # the roomier node, but offline without the model
    cluster.join(B, 16)
    cluster.run(ReportNodeStorage(node_id=A, storage=NodeStorage(offline=True)))
    placed = cluster.place("inst-1")
    assert [s.node_id for s in cluster.state.instances[placed].shards] == [B]
    named = cluster.run(PlaceInstance(instance_id=InstanceId("inst-2"), model_id=MODEL, node_ids=(A,)))
    assert A in rejected(named, RejectCode.MODEL_UNAVAILABLE).reason
    cluster.run(ReportNodeStorage(node_id=B, storage=NodeStorage(offline=True)))
    nowhere = cluster.run(PlaceInstance(instance_id=InstanceId("inst-3"), model_id=MODEL))
    assert "offline" in rejected(nowhere, RejectCode.MODEL_UNAVAILABLE).reason
    cluster.run(ReportNodeStorage(node_id=A, storage=NodeStorage(offline=True, available_models=(MODEL,))))
    assert isinstance(cluster.run(PlaceInstance(instance_id=InstanceId("inst-4"), model_id=MODEL))[0], InstancePlaced)


def test_an_offline_node_holds_what_it_completed_before_its_next_storage_report(cluster: InMemoryCluster) -> None:
    """A model imported on an offline node is placed there at once: its completed download is in State before the
    node's next storage report lists it."""
    cluster.join(A, 32)
    cluster.run(ReportNodeStorage(node_id=A, storage=NodeStorage(offline=True)))
    refused = cluster.run(PlaceInstance(instance_id=InstanceId("inst-1"), model_id=MODEL))
    assert "offline" in rejected(refused, RejectCode.MODEL_UNAVAILABLE).reason
    cluster.state = fold(downloaded(A, MODEL, 0, CARD.num_layers), state=cluster.state)
    assert isinstance(cluster.run(PlaceInstance(instance_id=InstanceId("inst-2"), model_id=MODEL))[0], InstancePlaced)


def test_placement_records_the_resolved_weights_dtype(cluster: InMemoryCluster) -> None:
    """AUTO never reaches State: the event says what the runners will hold, and a replacement keeps it."""
    cluster.join(A, 16)
    cluster.join(B, 16)
    placed = cluster.run(PlaceInstance(instance_id=InstanceId("inst-1"), model_id=MODEL, node_ids=(A,)))
    assert isinstance(placed[0], InstancePlaced)
    assert placed[0].serving == ServingSettings(weights=WeightsDtype.FLOAT32, engine=Engine.MLX)
    assert cluster.state.instances[InstanceId("inst-1")].serving.weights is WeightsDtype.FLOAT32
    native = ServingSettings(max_batch=2, weights=WeightsDtype.NATIVE)
    asked = cluster.run(PlaceInstance(instance_id=InstanceId("inst-2"), model_id=MODEL, node_ids=(B,), serving=native))
    assert isinstance(asked[0], InstancePlaced) and asked[0].serving == msgspec.structs.replace(
        native, engine=Engine.MLX
    )
    replaced = cluster.run(ExpireNode(node_id=A, session_id="s1"))
    assert isinstance(replaced[2], InstancePlaced) and replaced[2].serving.weights is WeightsDtype.FLOAT32


# --- engines -----------------------------------------------------------------------------------------------

GGUF_MODEL = ModelId("acme/tiny-gguf")
GGUF_CARD = msgspec.structs.replace(CARD, model_id=GGUF_MODEL, formats=(ModelFormat.GGUF, ModelFormat.MLX))


def with_llama_cpp(available_gib: float = 16) -> NodeProfile:
    return msgspec.structs.replace(profile(available_gib), engines=(Engine.MLX, Engine.LLAMA_CPP))


def test_an_engine_no_node_runs_is_a_conflict_and_one_the_card_cannot_serve_is_invalid(
    cluster: InMemoryCluster,
) -> None:
    cluster.join(A)
    cluster.run(AddCustomModelCard(card=GGUF_CARD))
    llama_cpp = ServingSettings(engine=Engine.LLAMA_CPP)
    refused = rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i1"), model_id=GGUF_MODEL, serving=llama_cpp)),
        RejectCode.CONFLICT,
    )
    assert "no node runs llama.cpp" in refused.reason and REJECT_STATUS[refused.code] == 409
    refused = rejected(
        cluster.run(PlaceInstance(instance_id=InstanceId("i1"), model_id=MODEL, serving=llama_cpp)),
        RejectCode.INVALID,
    )
    assert "no gguf weights" in refused.reason


def test_an_idle_instance_whose_engine_placement_chose_moves_to_llama_cpp_once_its_node_runs_it(
    cluster: InMemoryCluster,
) -> None:
    cluster.join(A)
    cluster.run(AddCustomModelCard(card=GGUF_CARD))
    placed = cluster.run(PlaceInstance(instance_id=InstanceId("auto"), model_id=GGUF_MODEL))
    assert isinstance(placed[0], InstancePlaced) and placed[0].serving.engine is Engine.MLX
    assert placed[0].requested == ServingSettings()
    asked_mlx = ServingSettings(engine=Engine.MLX)
    cluster.run(PlaceInstance(instance_id=InstanceId("asked"), model_id=GGUF_MODEL, serving=asked_mlx))
    for instance_id in (InstanceId("auto"), InstanceId("asked")):
        cluster.make_ready(instance_id)
    busy = TaskRef(task_id=TaskId("t1"), model_id=GGUF_MODEL, kind=TaskKind.CHAT)
    assert isinstance(cluster.submit(busy)[0], TaskAssigned)
    assert cluster.state.tasks[TaskId("t1")].instance_id == InstanceId("asked")  # the first ready, by id
    busy_auto = TaskRef(task_id=TaskId("t2"), model_id=GGUF_MODEL, kind=TaskKind.CHAT)
    cluster.submit(busy_auto)
    assert cluster.state.tasks[TaskId("t2")].instance_id == InstanceId("auto")

    # llama.cpp's build is done on A: the busy instance waits, the one asked for on MLX stays.
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp())) == [
        NodeUpdated(node_id=A, profile=with_llama_cpp())
    ]
    finished = cluster.run(
        ReportTaskFinished(
            node_id=A,
            task_id=TaskId("t1"),
            instance_id=InstanceId("asked"),
            outcome=TaskOutcome.STOP,
            usage=Usage(prompt_tokens=1, completion_tokens=1),
        )
    )
    assert [type(e) for e in finished] == [TaskFinished]
    moved = cluster.run(CancelTask(task_id=TaskId("t2")))
    assert [type(e) for e in moved] == [TaskCancelled, InstanceDeleted, InstancePlaced]
    assert isinstance(moved[1], InstanceDeleted) and moved[1].instance_id == InstanceId("auto")
    assert "moved to llama.cpp" in moved[1].reason
    replacement = cluster.state.instances[moved[2].instance_id]  # type: ignore[attr-defined]
    assert replacement.serving.engine is Engine.LLAMA_CPP and replacement.engine_chosen
    assert [(s.node_id, s.start_layer, s.end_layer) for s in replacement.shards] == [(A, 0, 8)]
    assert sorted(cluster.state.instances) == sorted([InstanceId("asked"), replacement.instance_id])
    # Placed again on llama.cpp, it stays there; later placements choose llama.cpp.
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp(4))) == [
        NodeUpdated(node_id=A, profile=with_llama_cpp(4))
    ]
    later = cluster.run(PlaceInstance(instance_id=InstanceId("later"), model_id=GGUF_MODEL))
    assert isinstance(later[0], InstancePlaced) and later[0].serving.engine is Engine.LLAMA_CPP


def test_an_idle_instance_moves_as_soon_as_its_node_reports_llama_cpp(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    cluster.run(AddCustomModelCard(card=GGUF_CARD))
    cluster.run(PlaceInstance(instance_id=InstanceId("auto"), model_id=GGUF_MODEL))
    cluster.make_ready(InstanceId("auto"))
    events = cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp()))
    assert [type(e) for e in events] == [NodeUpdated, InstanceDeleted, InstancePlaced]
    assert isinstance(events[2], InstancePlaced) and events[2].serving.engine is Engine.LLAMA_CPP
    # Redelivered, the same command changes nothing more.
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp())) == []


def test_an_instance_moves_once_the_last_of_the_tasks_ending_together_ends(cluster: InMemoryCluster) -> None:
    """An API that went away takes its tasks with it, several on one instance: the instance waits for the last
    one, and another API's task keeps it where it is."""
    cluster.join(A)
    cluster.run(AddCustomModelCard(card=GGUF_CARD))
    cluster.run(PlaceInstance(instance_id=InstanceId("auto"), model_id=GGUF_MODEL))
    cluster.make_ready(InstanceId("auto"))
    for task_id, requester in (("t1", "api-1"), ("t2", "api-1"), ("t3", "api-2")):
        ref = TaskRef(task_id=TaskId(task_id), model_id=GGUF_MODEL, kind=TaskKind.CHAT, requester=requester)
        assert isinstance(cluster.submit(ref)[0], TaskAssigned)
    assert cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp())) == [
        NodeUpdated(node_id=A, profile=with_llama_cpp())
    ]
    assert [type(e) for e in cluster.run(ExpireRequester(session_id="api-1"))] == [TaskCancelled, TaskCancelled]
    moved = cluster.run(ExpireRequester(session_id="api-2"))
    assert [type(e) for e in moved] == [TaskCancelled, InstanceDeleted, InstancePlaced]
    assert isinstance(moved[2], InstancePlaced) and moved[2].serving.engine is Engine.LLAMA_CPP


def test_an_instance_whose_engine_placement_chose_is_replaced_on_another_engine_when_its_node_is_lost(
    cluster: InMemoryCluster,
) -> None:
    """Lost with its node, an instance placement put on llama.cpp comes back on MLX where no node left runs
    llama.cpp: the request left the engine open."""
    cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp(32)))
    cluster.join(B, 16)
    cluster.run(AddCustomModelCard(card=GGUF_CARD))
    [placed] = cluster.run(PlaceInstance(instance_id=InstanceId("auto"), model_id=GGUF_MODEL))
    assert isinstance(placed, InstancePlaced) and placed.serving.engine is Engine.LLAMA_CPP
    events = cluster.run(ExpireNode(node_id=A, session_id="s1"))
    assert [type(e) for e in events] == [NodeLost, InstanceDeleted, InstancePlaced]
    replacement = cluster.state.instances[events[2].instance_id]  # type: ignore[attr-defined]
    assert replacement.engine is Engine.MLX and replacement.engine_chosen
    assert [s.node_id for s in replacement.shards] == [B]


def test_an_instance_idle_past_its_keep_alive_is_unloaded_and_never_a_busy_one(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    by_hand = cluster.place("by-hand")  # placed by hand: it stays until removed
    cluster.make_ready(by_hand)
    cluster.now_ms += 10**9
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == []
    cluster.run(DeleteInstance(instance_id=by_hand))
    auto = InstanceId("auto")  # placed for a request, with the API's default keep-alive
    assert isinstance(
        cluster.run(EnsureInstance(instance_id=auto, model_id=MODEL, keep_alive_ms=60_000))[0], InstancePlaced
    )
    cluster.make_ready(auto)
    cluster.now_ms += 59_000
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == []
    cluster.now_ms += 1_000
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == [auto]
    # A request comes before the sequencer acts on what it saw: busy, it stays.
    assert isinstance(submit(cluster, "task-1")[0], TaskAssigned)
    assert cluster.run(UnloadIdleInstance(instance_id=auto)) == []
    cluster.now_ms += 5_000
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    finished = ReportTaskFinished(
        node_id=A, task_id=TaskId("task-1"), instance_id=auto, outcome=TaskOutcome.STOP, usage=usage
    )
    assert isinstance(cluster.run(finished)[0], TaskFinished)
    assert cluster.run(UnloadIdleInstance(instance_id=auto)) == []  # idle again only from now
    cluster.now_ms += 60_000
    [unloaded] = cluster.run(UnloadIdleInstance(instance_id=auto))
    assert isinstance(unloaded, InstanceDeleted) and "past its keep-alive of 60 s" in unloaded.reason
    assert auto not in cluster.state.instances


def test_a_keep_alive_set_later_counts_from_then(cluster: InMemoryCluster) -> None:
    cluster.join(A)
    instance = cluster.place("inst-1")
    cluster.make_ready(instance)
    cluster.now_ms += 600_000
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == []
    [set_] = cluster.run(SetInstanceKeepAlive(instance_id=instance, keep_alive_ms=0))
    assert isinstance(set_, InstanceKeepAliveSet) and set_.at_ms == cluster.now_ms
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == [instance]
    rejected(
        cluster.run(SetInstanceKeepAlive(instance_id=InstanceId("nowhere"), keep_alive_ms=0)), RejectCode.NOT_FOUND
    )


NATIVE = ServingSettings(weights=WeightsDtype.NATIVE)


def other_model(cluster: InMemoryCluster) -> ModelCard:
    """A second model of the same size as MODEL (1.6 GiB as stored), added to the cluster."""
    other = msgspec.structs.replace(CARD, model_id=ModelId("acme/other"))
    cluster.run(AddCustomModelCard(card=other))
    return other


def ensure_other(cluster: InMemoryCluster, other: ModelCard) -> list[Event]:
    """`other` placed as a request with Ollama's keep_alive 0 would place it."""
    return cluster.run(
        EnsureInstance(instance_id=InstanceId("other"), model_id=other.model_id, keep_alive_ms=0, serving=NATIVE)
    )


def test_placing_a_model_that_does_not_fit_unloads_idle_instances_least_recently_used_first(
    cluster: InMemoryCluster,
) -> None:
    """Each card takes 1.6 GiB here (as stored): a 3.5 GiB node holds two instances, not three."""
    others = [msgspec.structs.replace(CARD, model_id=ModelId(f"acme/other-{n}")) for n in (1, 2)]
    for card in others:
        cluster.run(AddCustomModelCard(card=card))
    cluster.join(A, 3.5)
    placed = {}
    for name, model in (("first", MODEL), ("second", others[0].model_id)):
        [event] = cluster.run(
            EnsureInstance(instance_id=InstanceId(name), model_id=model, keep_alive_ms=600_000, serving=NATIVE)
        )
        assert isinstance(event, InstancePlaced), event
        cluster.make_ready(event.instance_id)
        placed[name] = event.instance_id
        cluster.now_ms += 1_000
    # "first" was used last: "second" is the least recently used, and the one unloaded.
    assert isinstance(submit(cluster, "task-1")[0], TaskAssigned)
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    cluster.run(
        ReportTaskFinished(
            node_id=A, task_id=TaskId("task-1"), instance_id=placed["first"], outcome=TaskOutcome.STOP, usage=usage
        )
    )
    third = cluster.run(
        EnsureInstance(
            instance_id=InstanceId("third"), model_id=others[1].model_id, keep_alive_ms=600_000, serving=NATIVE
        )
    )
    assert [type(e) for e in third] == [InstanceDeleted, InstancePlaced], third
    assert third[0].instance_id == placed["second"] and "to make room for acme/other-2" in third[0].reason
    assert set(cluster.state.instances) == {placed["first"], InstanceId("third")}


def test_a_node_s_first_report_since_an_instance_loaded_is_kept_so_that_unloading_it_makes_room(
    cluster: InMemoryCluster,
) -> None:
    """The last report State kept came while the instance loaded (half its memory taken); the next ones moved too
    little to be kept. Unless the first since it loaded is kept, placement would count the instance as still to
    come, and making room by unloading it would give back only what it had not taken yet."""
    other = other_model(cluster)

    def report(available_gib: float) -> ReportNodeProfile:
        return ReportNodeProfile(node_id=A, session_id="s1", profile=profile(available_gib, total_gib=8))

    cluster.run(report(2.8))
    first = InstanceId("first")  # 1.6 GiB, as each card here
    cluster.run(EnsureInstance(instance_id=first, model_id=MODEL, keep_alive_ms=600_000, serving=NATIVE))
    cluster.run(report(1.5))  # while it loads
    cluster.make_ready(first)
    loaded = report(1.2)  # less than 5 % of the node moved
    assert cluster.run(loaded) == [NodeUpdated(node_id=A, profile=loaded.profile)]
    assert cluster.run(loaded) == []  # and only the first
    placed = ensure_other(cluster, other)
    assert [type(e) for e in placed] == [InstanceDeleted, InstancePlaced], placed


def test_room_is_never_made_from_an_instance_loading_for_its_request(cluster: InMemoryCluster) -> None:
    other = other_model(cluster)
    cluster.join(A, 2.5)
    loading = InstanceId("loading")
    cluster.run(EnsureInstance(instance_id=loading, model_id=MODEL, keep_alive_ms=1, serving=NATIVE))
    cluster.now_ms += 600_000  # slow to load: far past its keep-alive, and still not idle
    assert idle_past_keep_alive(cluster.state, cluster.now_ms) == []
    [refused] = ensure_other(cluster, other)
    assert isinstance(refused, CommandRejected) and refused.code is RejectCode.NO_CAPACITY, refused
    assert "loading for them (loading)" in refused.reason
    cluster.make_ready(loading)
    assert idle_past_keep_alive(cluster.state, cluster.now_ms + 1) == [loading]


def test_room_is_never_made_from_a_busy_instance_nor_one_kept_loaded(cluster: InMemoryCluster) -> None:
    other = other_model(cluster)
    cluster.join(A, 2.5)
    busy = InstanceId("busy")
    cluster.run(EnsureInstance(instance_id=busy, model_id=MODEL, keep_alive_ms=600_000, serving=NATIVE))
    cluster.make_ready(busy)
    assert isinstance(submit(cluster, "task-1")[0], TaskAssigned)
    [refused] = ensure_other(cluster, other)
    assert isinstance(refused, CommandRejected) and refused.code is RejectCode.NO_CAPACITY
    assert refused.retry_after_s == 5 and "serving requests or loading for them (busy)" in refused.reason
    assert busy in cluster.state.instances
    # Kept loaded until removed (placed by hand): it stays, and the placement says why, as it always did.
    cluster.run(DeleteInstance(instance_id=busy))
    kept = cluster.place("kept")
    cluster.make_ready(kept)
    rejected(
        cluster.run(
            EnsureInstance(instance_id=InstanceId("other"), model_id=other.model_id, keep_alive_ms=0, serving=NATIVE)
        ),
        RejectCode.INSUFFICIENT_MEMORY,
    )
    assert kept in cluster.state.instances


DRAFT = msgspec.structs.replace(CARD, model_id=ModelId("acme/small-gguf"), formats=(ModelFormat.GGUF,), num_layers=2)


def place_drafting(cluster: InMemoryCluster) -> InstanceId:
    """A GGUF model placed on A and B (A leads, on llama.cpp) drafting with DRAFT."""
    model = msgspec.structs.replace(CARD, model_id=ModelId("acme/big-gguf"), formats=(ModelFormat.GGUF,))
    for card in (model, DRAFT):
        cluster.run(AddCustomModelCard(card=card))
    for node in (A, B):
        cluster.run(ReportNodeProfile(node_id=node, session_id="s1", profile=with_llama_cpp()))
    serving = ServingSettings(engine=Engine.LLAMA_CPP, draft=DRAFT.model_id)
    placed = PlaceInstance(instance_id="inst-d", model_id=model.model_id, node_ids=(A, B), serving=serving)
    assert isinstance(cluster.run(placed)[0], InstancePlaced)
    return InstanceId("inst-d")


def test_a_model_that_drafts_for_an_instance_is_in_use_on_its_leader(cluster: InMemoryCluster) -> None:
    """Its leader's runner loads it beside the model: its card and its files there stay while the instance does."""
    place_drafting(cluster)
    for node in (A, B):
        cluster.run(ReportDownloadProgress(node_id=node, model_id=DRAFT.model_id, progress=completed(0, 2)))
    says = f"{DRAFT.model_id} is in use by instance(s) inst-d; delete them first"
    assert rejected(cluster.run(DeleteCustomModelCard(model_id=DRAFT.model_id)), RejectCode.CONFLICT).reason == says
    in_use = DeleteDownload(model_id=DRAFT.model_id, node_id=A)  # the leader, on llama.cpp the first rank
    assert rejected(cluster.run(in_use), RejectCode.CONFLICT).reason == says
    assert cluster.run(DeleteDownload(model_id=DRAFT.model_id, node_id=B)) == [
        DownloadDeleteRequested(node_id=B, model_id=DRAFT.model_id)
    ]


def test_an_instance_whose_draft_cannot_reach_its_leader_fails_saying_so(cluster: InMemoryCluster) -> None:
    instance = place_drafting(cluster)
    failed = DownloadProgress(status=DownloadStatus.FAILED, reason="the Hub is unreachable")
    on_b = cluster.run(ReportDownloadProgress(node_id=B, model_id=DRAFT.model_id, progress=failed))
    assert [type(e) for e in on_b] == [DownloadFailed]  # B does not lead: the instance does not need it there
    (_, failure) = cluster.run(ReportDownloadProgress(node_id=A, model_id=DRAFT.model_id, progress=failed))
    assert isinstance(failure, InstanceFailed) and failure.instance_id == instance
    assert failure.reason == f"downloading {DRAFT.model_id} to node {A} failed: the Hub is unreachable"


def test_a_request_places_with_the_apis_default_drafting_where_the_model_takes_it(cluster: InMemoryCluster) -> None:
    """`jetshard api --draft ngram`: a model only MLX serves drafts by prompt lookup on MLX, placed for a request or
    asked by name; a default draft model without MLX weights is left out of a placement for a request."""
    cluster.run(ReportNodeProfile(node_id=A, session_id="s1", profile=with_llama_cpp()))
    defaults = ServingSettings(draft="ngram")
    (placed,) = cluster.run(EnsureInstance(instance_id="inst-e", model_id=MODEL, serving=defaults))
    assert isinstance(placed, InstancePlaced)
    assert (placed.serving.engine, placed.serving.draft) == (Engine.MLX, "ngram")
    (asked,) = cluster.run(PlaceInstance(instance_id="inst-p", model_id=MODEL, serving=defaults))
    assert isinstance(asked, InstancePlaced) and asked.serving.draft == "ngram"
    other = msgspec.structs.replace(CARD, model_id=ModelId("acme/other-mlx"))
    for card in (other, DRAFT):
        cluster.run(AddCustomModelCard(card=card))
    gguf_draft = ServingSettings(draft=DRAFT.model_id)
    (without,) = cluster.run(EnsureInstance(instance_id="inst-g", model_id=other.model_id, serving=gguf_draft))
    assert isinstance(without, InstancePlaced)
    assert (without.serving.engine, without.serving.draft) == (Engine.MLX, None)
