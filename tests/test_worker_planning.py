"""Worker planning is a pure function of State: which endpoints to report, which runners to start or stop."""

from __future__ import annotations

import msgspec
from helpers import states
from helpers.states import INSTANCE, MODEL, A, B, fold
from jetshard_schema.cards import ModelFormat
from jetshard_schema.events import (
    DownloadCompleted,
    InstancePlaced,
    InstanceRestarting,
    NodeJoined,
    RunnerEndpointReported,
    RunnerStatusChanged,
)
from jetshard_schema.ids import ModelId, NodeId
from jetshard_schema.types import (
    Endpoint,
    Engine,
    NodeProfile,
    RunnerReport,
    RunnerStatus,
    ServingSettings,
    ShardAssignment,
    WeightsDtype,
)
from jetshard_worker.planning import RunnerKey, plan, runners_on_machine

PROFILE = NodeProfile(hostname="h", os="Linux", cpu_cores=2, memory_total_bytes=2**34, memory_available_bytes=2**33)


PLACED = (
    NodeJoined(node_id=A, session_id="s-a", profile=PROFILE),
    NodeJoined(node_id=B, session_id="s-b", profile=PROFILE),
    InstancePlaced(
        instance_id=INSTANCE,
        model_id=MODEL,
        shards=(
            ShardAssignment(node_id=A, rank=0, start_layer=0, end_layer=2),
            ShardAssignment(node_id=B, rank=1, start_layer=2, end_layer=4),
        ),
    ),
)


def downloaded(node: NodeId, start: int, end: int) -> DownloadCompleted:
    return states.downloaded(node, MODEL, start, end, f"/models/{node}", size=10)


def endpoint(node: NodeId, rank: int, generation: int = 0) -> RunnerEndpointReported:
    return RunnerEndpointReported(
        instance_id=INSTANCE,
        generation=generation,
        node_id=node,
        rank=rank,
        endpoint=Endpoint("127.0.0.1", 5000 + rank),
    )


def test_a_placed_shard_first_reports_its_endpoint() -> None:
    wanted = plan(fold(*PLACED), A, "s-a", frozenset(), now_ms=0)
    assert wanted.report_endpoint == (RunnerKey(INSTANCE, 0),)
    assert wanted.start == ()


def test_a_runner_starts_only_once_downloaded_and_every_endpoint_is_known() -> None:
    only_mine = fold(*PLACED, downloaded(A, 0, 2), endpoint(A, 0))
    assert plan(only_mine, A, "s-a", frozenset(), now_ms=0).start == ()
    everyone = fold(*PLACED, downloaded(A, 0, 2), endpoint(A, 0), endpoint(B, 1))
    (start,) = plan(everyone, A, "s-a", frozenset(), now_ms=0).start
    assert (start.rank, start.world_size, start.start_layer, start.end_layer) == (0, 2, 0, 2)
    assert start.model_dir == "/models/node-a"
    assert start.endpoints == ("127.0.0.1:5000", "127.0.0.1:5001")
    assert plan(everyone, A, "s-a", frozenset({start.key}), now_ms=0).start == ()


def test_a_download_of_another_layer_range_does_not_count() -> None:
    state = fold(*PLACED, downloaded(A, 2, 4), endpoint(A, 0), endpoint(B, 1))
    assert plan(state, A, "s-a", frozenset(), now_ms=0).start == ()


def test_a_runner_waits_for_the_form_its_engine_loads() -> None:
    shard = ShardAssignment(node_id=A, rank=0, start_layer=0, end_layer=4)
    llama = InstancePlaced(
        instance_id=INSTANCE, model_id=MODEL, shards=(shard,), serving=ServingSettings(engine=Engine.LLAMA_CPP)
    )
    mlx_only = msgspec.structs.replace(
        downloaded(A, 0, 4), progress=msgspec.structs.replace(downloaded(A, 0, 4).progress, formats=(ModelFormat.MLX,))
    )
    waiting = fold(PLACED[0], llama, mlx_only, endpoint(A, 0))
    assert plan(waiting, A, "s-a", frozenset(), now_ms=0).start == ()  # the MLX directory is no llama.cpp model
    both = msgspec.structs.replace(
        mlx_only, progress=msgspec.structs.replace(mlx_only.progress, formats=(ModelFormat.GGUF, ModelFormat.MLX))
    )
    (start,) = plan(fold(PLACED[0], llama, both, endpoint(A, 0)), A, "s-a", frozenset(), now_ms=0).start
    assert start.model_dir == "/models/node-a"
    # A record from before formats is an MLX directory: an instance placed before engines still starts on it.
    assert plan(
        fold(*PLACED, downloaded(A, 0, 2), endpoint(A, 0), endpoint(B, 1)), A, "s-a", frozenset(), now_ms=0
    ).start


def test_a_restart_waits_for_its_back_off_and_drops_the_old_generation() -> None:
    restarting = InstanceRestarting(
        instance_id=INSTANCE, generation=1, attempt=1, not_before_ms=5_000, reason="rank 1 failed"
    )
    state = fold(*PLACED, downloaded(A, 0, 2), endpoint(A, 0), endpoint(B, 1), restarting)
    early = plan(state, A, "s-a", frozenset({RunnerKey(INSTANCE, 0)}), now_ms=1_000)
    assert RunnerKey(INSTANCE, 0) not in early.keep
    assert early.report_endpoint == ()
    later = plan(state, A, "s-a", frozenset(), now_ms=6_000)
    assert later.report_endpoint == (RunnerKey(INSTANCE, 1),)


def test_runners_of_a_previous_worker_life_are_left_to_the_sequencer_to_restart() -> None:
    ready = RunnerStatusChanged(
        instance_id=INSTANCE,
        generation=0,
        runner=RunnerReport(node_id=A, rank=0, worker_session="old", status=RunnerStatus.READY),
    )
    state = fold(*PLACED, downloaded(A, 0, 2), endpoint(A, 0), endpoint(B, 1), ready)
    wanted = plan(state, A, "new", frozenset(), now_ms=0)
    assert (wanted.start, wanted.report_endpoint, wanted.keep) == ((), (), frozenset())


def test_nodes_without_a_shard_plan_nothing() -> None:
    wanted = plan(fold(*PLACED), NodeId("node-c"), "s-c", frozenset({RunnerKey(INSTANCE, 0)}), now_ms=0)
    assert (wanted.report_endpoint, wanted.start, wanted.keep) == ((), (), frozenset())


def test_nodes_on_one_machine_count_each_others_runners() -> None:
    # A and B report the same hostname (two nodes of one machine): their two ranks share its cores.
    state = fold(*PLACED)
    assert runners_on_machine(state, A) == runners_on_machine(state, B) == 2
    elsewhere = msgspec.structs.replace(PROFILE, hostname="other")
    apart = fold(NodeJoined(node_id=B, session_id="s-b2", profile=elsewhere), state=state)
    assert runners_on_machine(apart, A) == runners_on_machine(apart, B) == 1
    assert runners_on_machine(fold(), A) == 1  # a node State does not know yet


def test_each_rank_loads_its_own_shards_dtype() -> None:
    mixed = InstancePlaced(
        instance_id=INSTANCE,
        model_id=MODEL,
        shards=(
            ShardAssignment(node_id=A, rank=0, start_layer=0, end_layer=2, weights=WeightsDtype.FLOAT32),
            ShardAssignment(node_id=B, rank=1, start_layer=2, end_layer=4, weights=WeightsDtype.BFLOAT16),
        ),
        serving=ServingSettings(weights=WeightsDtype.AUTO),
    )
    ready = (downloaded(A, 0, 2), downloaded(B, 2, 4), endpoint(A, 0), endpoint(B, 1))
    state = fold(*PLACED[:2], mixed, *ready)
    assert [plan(state, n, s, frozenset(), now_ms=0).start[0].weights for n, s in ((A, "s-a"), (B, "s-b"))] == [
        WeightsDtype.FLOAT32,
        WeightsDtype.BFLOAT16,
    ]
    # A placement recorded before shards had a dtype of their own: the instance's.
    legacy = msgspec.structs.replace(
        mixed, shards=PLACED[2].shards, serving=ServingSettings(weights=WeightsDtype.FLOAT32)
    )
    (start,) = plan(fold(*PLACED[:2], legacy, *ready), B, "s-b", frozenset(), now_ms=0).start
    assert start.weights is WeightsDtype.FLOAT32


def test_the_leader_of_an_instance_that_drafts_with_a_model_waits_for_that_models_gguf_too() -> None:
    draft = ModelId("test/tiny-draft")
    drafting = ServingSettings(engine=Engine.LLAMA_CPP, draft=draft)
    placed = InstancePlaced(instance_id=INSTANCE, model_id=MODEL, shards=PLACED[2].shards, serving=drafting)
    ready = (PLACED[0], PLACED[1], placed, endpoint(A, 0), endpoint(B, 1), gguf(downloaded(A, 0, 2)))
    ready += (gguf(downloaded(B, 2, 4)),)
    # The helper rank (B) needs no draft; the leader (A, rank 0 on llama.cpp) waits for it.
    assert [s.rank for s in plan(fold(*ready), B, "s-b", frozenset(), now_ms=0).start] == [1]
    assert plan(fold(*ready), A, "s-a", frozenset(), now_ms=0).start == ()
    draft_as_mlx = states.downloaded(A, draft, 0, 2, "/drafts/a")
    assert plan(fold(*ready, draft_as_mlx), A, "s-a", frozenset(), now_ms=0).start == ()
    (start,) = plan(fold(*ready, gguf(draft_as_mlx)), A, "s-a", frozenset(), now_ms=0).start
    assert (start.rank, start.model_dir, start.draft_dir) == (0, "/models/node-a", "/drafts/a")
    # Without a draft model (ngram or none), no draft directory.
    plain_placed = msgspec.structs.replace(placed, serving=ServingSettings(engine=Engine.LLAMA_CPP))
    (plain,) = plan(fold(*ready[:2], plain_placed, *ready[3:]), A, "s-a", frozenset(), now_ms=0).start
    assert plain.draft_dir == ""


def gguf(event: DownloadCompleted) -> DownloadCompleted:
    return msgspec.structs.replace(event, progress=msgspec.structs.replace(event.progress, formats=(ModelFormat.GGUF,)))
