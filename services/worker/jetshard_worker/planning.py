"""Worker planning: which runners this node should have, as a pure function of State. Tested without NATS."""

from __future__ import annotations

import msgspec
from jetshard_schema.ids import InstanceId, ModelId, NodeId
from jetshard_schema.state import Instance, State
from jetshard_schema.types import RunnerStatus, ServingSettings, WeightsDtype, engine_format


class RunnerKey(msgspec.Struct, frozen=True):
    instance_id: InstanceId
    generation: int


class RunnerPlan(msgspec.Struct, frozen=True, kw_only=True):
    key: RunnerKey
    model_id: ModelId
    rank: int
    world_size: int
    start_layer: int
    end_layer: int
    model_dir: str
    endpoints: tuple[str, ...]
    """`host:port` of every rank, in rank order."""
    certificates: tuple[str, ...] = ()
    """The certificate each rank's worker presents on the instance's tunnels, in rank order (`Endpoint`)."""
    layer_ranges: tuple[tuple[int, int], ...] = ()
    """Every rank's `[start_layer, end_layer)`, in rank order: llama.cpp's leader splits the model by them."""
    leader_rank: int = 0
    serving: ServingSettings = ServingSettings()
    weights: WeightsDtype = WeightsDtype.NATIVE
    """What this rank holds its weights as (its shard's own dtype)."""
    reserved_bytes: int = 0
    """The memory placement counted for this rank (`ShardAssignment.memory_bytes`): its node holds it back until
    the runner has grown into it (prompt caches, KV rows of a full batch)."""
    draft_dir: str = ""
    """On the leader of an instance whose `serving.draft` names a model: where that model's files are, in the form its
    engine loads."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    report_endpoint: tuple[RunnerKey, ...] = ()
    """Generations of instances for which this node must still report its rank's endpoint."""
    start: tuple[RunnerPlan, ...] = ()
    keep: frozenset[RunnerKey] = frozenset()
    """Every runner that may run now; anything else running is stopped."""


def plan(state: State, node_id: NodeId, session_id: str, started: frozenset[RunnerKey], now_ms: int) -> Plan:
    """What this node's worker does next. `started`: the runners this session started, running or ended; each starts
    once (one that ended is reported FAILED, and its instance restarts as the next generation)."""
    report, start, keep = [], [], set()
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        shard = instance.shard_for(node_id)
        if shard is None or instance.failed:
            continue
        key = RunnerKey(instance.instance_id, instance.generation)
        mine = instance.runners.get(shard.rank)
        if (
            mine is not None
            and mine.worker_session != session_id
            and mine.status not in (RunnerStatus.STOPPED, RunnerStatus.FAILED)
        ):
            # A runner of this worker's previous life, which died with it: the sequencer restarts the instance when
            # this session joins; until then its old endpoints and statuses are not to be built on.
            continue
        if now_ms < instance.not_before_ms:
            continue  # restart back-off
        keep.add(key)
        if shard.rank not in instance.endpoints:
            report.append(key)
            continue
        if key in started or (mine is not None and mine.status in (RunnerStatus.STOPPED, RunnerStatus.FAILED)):
            continue
        runner_plan = _startable(state, instance, node_id)
        if runner_plan is not None:
            start.append(runner_plan)
    return Plan(report_endpoint=tuple(report), start=tuple(start), keep=frozenset(keep))


def _startable(state: State, instance: Instance, node_id: NodeId) -> RunnerPlan | None:
    """A runner can start once this node's shard is downloaded and every rank's endpoint is known."""
    shard = instance.shard_for(node_id)
    assert shard is not None
    download = state.download(node_id, instance.model_id)
    if download is None or not download.progress.holds(engine_format(instance.serving.engine)):
        return None  # the form its engine loads is not here yet (one record per model: it may hold another)
    if download.progress.start_layer > shard.start_layer or download.progress.end_layer < shard.end_layer:
        return None
    if any(s.rank not in instance.endpoints for s in instance.shards):
        return None
    draft_dir = ""
    if instance.serving.draft_model is not None and shard.rank == instance.leader_rank:
        draft = state.download(node_id, instance.serving.draft_model)
        if draft is None or not draft.progress.holds(engine_format(instance.serving.engine)):
            return None  # the model that drafts is not here yet (the downloader fetches it for the leader)
        draft_dir = draft.progress.directory
    reported = [instance.endpoints[s.rank] for s in instance.shards]
    return RunnerPlan(
        key=RunnerKey(instance.instance_id, instance.generation),
        model_id=instance.model_id,
        serving=instance.serving,
        weights=shard.weights_in(instance.serving),
        reserved_bytes=shard.memory_bytes,
        rank=shard.rank,
        world_size=len(instance.shards),
        start_layer=shard.start_layer,
        end_layer=shard.end_layer,
        model_dir=download.progress.directory,
        endpoints=tuple(f"{endpoint.host}:{endpoint.port}" for endpoint in reported),
        certificates=tuple(endpoint.certificate_pem for endpoint in reported),
        layer_ranges=tuple((s.start_layer, s.end_layer) for s in instance.shards),
        leader_rank=instance.leader_rank,
        draft_dir=draft_dir,
    )


def runners_on_machine(state: State, node_id: NodeId) -> int:
    """Runners that share this node's machine: the shards of live instances on every node that reports the same
    hostname (several nodes may run on one machine, as the ranks of a pipeline do in a test or a benchmark).
    Their BLAS thread pools split the machine's cores: more threads than cores only preempt each other."""
    node = state.nodes.get(node_id)
    if node is None:
        return 1
    here = {n.node_id for n in state.nodes.values() if n.profile.hostname == node.profile.hostname}
    shards = sum(1 for i in state.instances.values() if not i.failed for s in i.shards if s.node_id in here)
    return max(1, shards)
