"""Instance routes: place a model on nodes, watch its shards come up, remove it."""

from __future__ import annotations

from typing import Any

import msgspec
from jetshard_schema.commands import DeleteInstance
from jetshard_schema.ids import InstanceId
from jetshard_schema.models import find_card
from jetshard_schema.placement import ModelUnavailable, PlacementError, place_in
from jetshard_schema.state import Instance, State, instance_status
from jetshard_schema.types import DownloadStatus, InstanceStatus
from litestar import Controller, delete, get, post

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ERROR_RESPONSES, ApiError
from jetshard_api.route_steps import checked_model_id, place_instance


class PlaceRequest(msgspec.Struct, frozen=True):
    model_id: str
    node_ids: list[str] | None = None
    min_nodes: int = 1


def describe_instance(state: State, instance: Instance) -> dict[str, Any]:
    status = instance_status(state, instance)
    shards = []
    for shard in instance.shards:
        download = state.download(shard.node_id, instance.model_id)
        runner = instance.runners.get(shard.rank)
        entry: dict[str, Any] = {**msgspec.to_builtins(shard)}
        if runner is not None:
            entry.update(
                status=str(runner.status),
                worker_session=runner.worker_session,
                layers_loaded=runner.layers_loaded,
                layers_total=runner.layers_total,
                reason=runner.reason or None,
            )
        elif download is None or download.status is not DownloadStatus.COMPLETED:
            entry.update(
                status="downloading" if download is None or download.status is not DownloadStatus.FAILED else "failed",
                bytes_done=download.bytes_done if download else 0,
                bytes_total=download.bytes_total if download else 0,
                reason=(download.reason or None) if download else None,
            )
        else:
            entry.update(status="waiting")
        shards.append(entry)
    return {
        "instance_id": instance.instance_id,
        "model_id": instance.model_id,
        "status": str(status),
        "generation": instance.generation,
        "restart_attempt": instance.restart_attempt,
        # Why it failed or last restarted: news only until it is ready again.
        "reason": (instance.failed_reason or None) if status is not InstanceStatus.READY else None,
        "shards": shards,
        "tasks_in_flight": sum(1 for t in state.tasks.values() if t.instance_id == instance.instance_id),
    }


class InstancesController(Controller):
    path = "/instances"
    tags = ["instances"]

    @get("/", responses=ERROR_RESPONSES)
    async def list_instances(self, cluster: Cluster) -> list[dict[str, Any]]:
        state = cluster.state
        return [describe_instance(state, i) for _, i in sorted(state.instances.items())]

    @get("/preview", responses=ERROR_RESPONSES)
    async def preview(self, cluster: Cluster, model_id: str, min_nodes: int = 1) -> dict[str, Any]:
        """The placement that would be chosen now, without placing anything."""
        card = find_card(cluster.state, checked_model_id(model_id))
        if card is None:
            raise ApiError(404, f"unknown model {model_id}", "model_not_found")
        try:
            placement = place_in(cluster.state, card, None, min_nodes)
        except ModelUnavailable as error:
            raise ApiError(503, str(error), "model_unavailable") from error
        except PlacementError as error:
            raise ApiError(409, str(error), "insufficient_memory") from error
        return {
            "model_id": card.model_id,
            "required_bytes": placement.required_bytes,
            "shards": msgspec.to_builtins(placement.shards),
        }

    @get("/{instance_id:str}", responses=ERROR_RESPONSES)
    async def show(self, cluster: Cluster, instance_id: str) -> dict[str, Any]:
        instance = cluster.state.instances.get(InstanceId(instance_id))
        if instance is None:
            raise ApiError(404, f"no instance {instance_id}", "instance_not_found")
        return describe_instance(cluster.state, instance)

    @post("/", status_code=201, responses=ERROR_RESPONSES)
    async def create(self, cluster: Cluster, data: PlaceRequest) -> dict[str, Any]:
        instance = await place_instance(cluster, checked_model_id(data.model_id), data.node_ids, data.min_nodes)
        return describe_instance(cluster.state, instance)

    @delete("/{instance_id:str}", status_code=200, responses=ERROR_RESPONSES)
    async def remove(self, cluster: Cluster, instance_id: str) -> dict[str, Any]:
        await cluster.submit(DeleteInstance(instance_id=InstanceId(instance_id)))
        return {"deleted": instance_id}
