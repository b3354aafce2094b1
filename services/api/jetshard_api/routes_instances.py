"""Instance routes: place a model on nodes, watch its shards come up, remove it."""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from jetshard_schema.commands import DeleteInstance, SetInstanceKeepAlive
from jetshard_schema.ids import InstanceId, ModelId
from jetshard_schema.models import find_card
from jetshard_schema.placement import device_of
from jetshard_schema.types import (
    MAX_NODES,
    DraftSetting,
    Engine,
    KvCacheType,
    MaxBatch,
    MaxQueued,
    MinNodes,
    NodeIds,
    Parallelism,
    PrefixCacheBytes,
    ServingSettings,
    ShardAssignment,
    WeightsDtype,
)
from jetshard_schema.view import InstanceDescription, describe_instance
from litestar import Request, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ERROR_RESPONSES, ApiError, refused_as_bad_request
from jetshard_api.model_steps import (
    Deleted,
    checked_keep_alive,
    checked_model_id,
    checked_name,
    place_instance,
    preview_placement,
)
from jetshard_api.settings import InferenceSettings


class ServingRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the new instance serves; each setting left out is the API's (`jetshard api --max-batch ...`)."""

    max_batch: MaxBatch | msgspec.UnsetType = msgspec.UNSET
    max_queued: MaxQueued | msgspec.UnsetType = msgspec.UNSET
    prefix_cache_bytes: PrefixCacheBytes | msgspec.UnsetType = msgspec.UNSET
    weights: WeightsDtype | msgspec.UnsetType = msgspec.UNSET
    kv_cache_type: KvCacheType | msgspec.UnsetType = msgspec.UNSET
    draft: DraftSetting | msgspec.UnsetType | None = msgspec.UNSET

    def __post_init__(self) -> None:
        if isinstance(self.draft, str):
            ServingSettings(draft=self.draft)  # a ValueError saying what a draft may be: the body's 400

    def over(self, defaults: ServingSettings) -> ServingSettings:
        given = {name: getattr(self, name) for name in self.__struct_fields__}
        return msgspec.structs.replace(defaults, **{k: v for k, v in given.items() if v is not msgspec.UNSET})


class PlaceRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_id: str
    node_ids: NodeIds | None = None
    """The nodes to place on, in rank order; left out (or null), placement chooses."""
    min_nodes: MinNodes = 1
    """How many nodes the instance spans at least; for a tensor-parallel one, exactly (unless `node_ids` names
    them)."""
    serving: ServingRequest = ServingRequest()
    parallelism: Parallelism = Parallelism.PIPELINE
    engine: Engine | None = None
    """What serves the instance: "mlx" or "llama.cpp"; left out (or null), placement chooses the fastest its nodes
    run for a format the model has."""
    keep_alive_s: float | None = None
    """How long it stays loaded with nothing to do, in seconds (0: unload as soon as it is idle); left out, null
    or negative: until removed."""


class KeepAliveRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keep_alive_s: float | None
    """How long the instance stays loaded with nothing to do from now on, in seconds (0: unload it as soon as it
    is idle); null or negative: until removed."""


class PreviewShard(ShardAssignment, frozen=True, kw_only=True):
    device: str
    """What the shard would run on: "cuda:0 (<GPU name>)", "metal" or "cpu"."""


class PlacementPreview(msgspec.Struct, frozen=True):
    model_id: ModelId
    required_bytes: int
    shards: tuple[PreviewShard, ...]
    serving: ServingSettings
    """The API's settings as placement would resolve them (AUTO made concrete)."""
    engine: Engine
    """What would serve it: the engine asked for, or the one placement chooses."""


PREVIEW_PARAMETERS = frozenset({"model_id", "min_nodes", "parallelism", "engine", "kv_cache_type", "draft"})


class InstancesController(StrictController):
    path = "/instances"
    tags = ["instances"]

    @get("/", responses=ERROR_RESPONSES)
    async def list_instances(self, cluster: NamedDependency[Cluster]) -> list[InstanceDescription]:
        state, now_ms = cluster.state, int(time.time() * 1000)
        return [describe_instance(state, i, now_ms) for _, i in sorted(state.instances.items())]

    @get("/preview", responses=ERROR_RESPONSES)
    async def preview(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        request: Request[Any, Any, Any],
        model_id: FromQuery[str],
        min_nodes: Annotated[int, Parameter(ge=1, le=MAX_NODES)] = 1,  # a query parameter: Litestar's bounds
        parallelism: FromQuery[Parallelism] = Parallelism.PIPELINE,
        engine: FromQuery[Engine | None] = None,
        kv_cache_type: FromQuery[KvCacheType | None] = None,
        draft: FromQuery[str | None] = None,
    ) -> PlacementPreview:
        """The placement that would be chosen now with the API's serving settings (`kv_cache_type` and `draft` as
        given, else the API's), without placing anything."""
        unknown = sorted(set(request.query_params) - PREVIEW_PARAMETERS)
        if unknown:
            raise ApiError(400, f"unknown query parameter(s): {', '.join(unknown)}", "invalid_request", unknown[0])
        card = find_card(cluster.state, checked_model_id(model_id))
        if card is None:
            raise ApiError(404, f"unknown model {model_id}", "model_not_found")
        serving = msgspec.structs.replace(
            settings.serving,
            parallelism=parallelism,
            engine=engine,
            kv_cache_type=kv_cache_type or settings.serving.kv_cache_type,
            draft=settings.serving.draft if draft is None else _checked_draft(draft),
        )
        placement = preview_placement(cluster.state, card, serving, min_nodes)
        return PlacementPreview(
            model_id=card.model_id,
            required_bytes=placement.required_bytes,
            shards=tuple(
                PreviewShard(**msgspec.structs.asdict(s), device=device_of(cluster.state.nodes[s.node_id].profile))
                for s in placement.shards
            ),
            serving=placement.serving,
            engine=placement.serving.engine or Engine.MLX,
        )

    @get("/{instance_id:str}", responses=ERROR_RESPONSES)
    async def show(self, cluster: NamedDependency[Cluster], instance_id: FromPath[str]) -> InstanceDescription:
        instance = cluster.state.instances.get(InstanceId(checked_name(instance_id, "instance_id")))
        if instance is None:
            raise ApiError(404, f"no instance {instance_id}", "instance_not_found")
        return describe_instance(cluster.state, instance, int(time.time() * 1000))

    @post("/", status_code=201, responses=ERROR_RESPONSES)
    async def create(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[PlaceRequest],
    ) -> InstanceDescription:
        serving = msgspec.structs.replace(
            data.serving.over(settings.serving), parallelism=data.parallelism, engine=data.engine
        )
        keep_alive = checked_keep_alive(data.keep_alive_s)
        instance = await place_instance(
            cluster, checked_model_id(data.model_id), serving, data.node_ids, data.min_nodes, keep_alive
        )
        return describe_instance(cluster.state, instance, int(time.time() * 1000))

    @patch("/{instance_id:str}", status_code=200, responses=ERROR_RESPONSES)
    async def set_keep_alive(
        self, cluster: NamedDependency[Cluster], instance_id: FromPath[str], data: JSONBody[KeepAliveRequest]
    ) -> InstanceDescription:
        """Change how long the instance stays loaded with nothing to do, counted from now."""
        instance_id = checked_name(instance_id, "instance_id")
        keep_alive = checked_keep_alive(data.keep_alive_s)
        await cluster.submit(SetInstanceKeepAlive(instance_id=InstanceId(instance_id), keep_alive_ms=keep_alive))
        instance = cluster.state.instances.get(InstanceId(instance_id))
        if instance is None:  # removed meanwhile
            raise ApiError(404, f"no instance {instance_id}", "instance_not_found")
        return describe_instance(cluster.state, instance, int(time.time() * 1000))

    @delete("/{instance_id:str}", status_code=200, responses=ERROR_RESPONSES)
    async def remove(self, cluster: NamedDependency[Cluster], instance_id: FromPath[str]) -> Deleted:
        await cluster.submit(DeleteInstance(instance_id=InstanceId(checked_name(instance_id, "instance_id"))))
        return Deleted(deleted=instance_id)


def _checked_draft(draft: str) -> str:
    with refused_as_bad_request("invalid_request", "draft"):
        return ServingSettings(draft=draft).draft or ""
