"""Download routes: every node's downloads, starting, cancelling and deleting one."""

from __future__ import annotations

import contextlib

import msgspec
from jetshard_schema.commands import CancelDownload, DeleteDownload, StartDownload
from jetshard_schema.ids import ModelId, NodeId
from jetshard_schema.state import Download, State
from jetshard_schema.types import DownloadProgress
from litestar import Response, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ERROR_RESPONSES, ApiError
from jetshard_api.model_steps import checked_model_id, checked_name


class _DownloadTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The download a request names: the node may be left out where the cluster has only one."""

    model_id: str
    node_id: str | None = None


class StartDownloadRequest(_DownloadTarget, frozen=True):
    start_layer: int | None = None
    end_layer: int | None = None


class CancelDownloadRequest(_DownloadTarget, frozen=True):
    """Stop a pending or ongoing download."""


class DownloadDescription(DownloadProgress, frozen=True, kw_only=True):
    """One download, flat: its node and model beside its progress."""

    node_id: NodeId
    model_id: ModelId
    deleting: bool = False


def describe(download: Download) -> DownloadDescription:
    return DownloadDescription(
        node_id=download.node_id,
        model_id=download.model_id,
        deleting=download.deleting,
        **msgspec.structs.asdict(download.progress),
    )


class NoDownload(msgspec.Struct, frozen=True, kw_only=True):
    """A model this node has no download of."""

    node_id: NodeId
    model_id: ModelId
    status: None = None


class DownloadDeleted(msgspec.Struct, frozen=True):
    deleted: ModelId
    node_id: NodeId


def _node(state: State, node_id: str | None) -> NodeId:
    if node_id:
        if node_id not in state.nodes:
            raise ApiError(404, f"unknown node {node_id}; see GET /nodes", "node_not_found", "node_id")
        return NodeId(node_id)
    if len(state.nodes) == 1:
        return next(iter(state.nodes))
    if not state.nodes:
        raise ApiError(
            400, "no node has joined the cluster; start `jetshard worker` (or `jetshard up`)", "no_nodes", "node_id"
        )
    raise ApiError(
        400,
        f"the cluster has {len(state.nodes)} nodes; say which one with node_id ({', '.join(sorted(state.nodes))})",
        "node_required",
        "node_id",
    )


def _target(state: State, data: _DownloadTarget) -> tuple[ModelId, NodeId]:
    return checked_model_id(data.model_id), _node(state, data.node_id)


def _current(state: State, node_id: NodeId, model_id: ModelId) -> DownloadDescription | NoDownload:
    download = state.download(node_id, model_id)
    return describe(download) if download else NoDownload(node_id=node_id, model_id=model_id)


class DownloadsController(StrictController):
    path = "/downloads"
    tags = ["downloads"]

    @get("/", responses=ERROR_RESPONSES)
    async def list_downloads(self, cluster: NamedDependency[Cluster]) -> list[DownloadDescription]:
        """Every node's downloads: status, bytes, speed, ETA, directory, read_only, reason."""
        state = cluster.state
        return [
            describe(download)
            for _, per_node in sorted(state.downloads.items())
            for _, download in sorted(per_node.items())
        ]

    @post("/", status_code=202, responses=ERROR_RESPONSES)
    async def start_download(
        self, cluster: NamedDependency[Cluster], data: JSONBody[StartDownloadRequest]
    ) -> DownloadDescription | NoDownload:
        """Download a model (or a layer range of it) to a node; answers with the download's state."""
        model_id, node_id = _target(cluster.state, data)
        await cluster.submit(
            StartDownload(model_id=model_id, node_id=node_id, start_layer=data.start_layer, end_layer=data.end_layer)
        )
        return _current(cluster.state, node_id, model_id)

    @post("/cancel", status_code=200, responses=ERROR_RESPONSES)
    async def cancel_download(
        self, cluster: NamedDependency[Cluster], data: JSONBody[CancelDownloadRequest]
    ) -> DownloadDescription | NoDownload:
        model_id, node_id = _target(cluster.state, data)
        await cluster.submit(CancelDownload(model_id=model_id, node_id=node_id))
        return _current(cluster.state, node_id, model_id)

    @delete(
        "/{node_id:str}/{org:str}/{name:str}",
        status_code=200,
        responses={
            **ERROR_RESPONSES,
            202: ResponseSpec(DownloadDescription, description="requested; the node has not deleted it yet"),
        },
    )
    async def delete_download(
        self, cluster: NamedDependency[Cluster], node_id: FromPath[str], org: FromPath[str], name: FromPath[str]
    ) -> Response[DownloadDeleted | DownloadDescription]:
        """Delete a model's files from a node's writable directories (409 for read-only or in-use models).

        200 once the node reports the files gone; 202 if it has not within the command timeout (the
        deletion is requested and happens when the node's downloader runs)."""
        model_id = checked_model_id(f"{org}/{name}")
        node = NodeId(checked_name(node_id, "node_id"))
        await cluster.submit(DeleteDownload(model_id=model_id, node_id=node))
        with contextlib.suppress(TimeoutError):
            await cluster.wait_until(lambda state: state.download(node, model_id) is None, cluster.command_timeout_s)
        download = cluster.state.download(node, model_id)
        if download is None:
            return Response(DownloadDeleted(deleted=model_id, node_id=node), status_code=200)
        return Response(describe(download), status_code=202)
