"""Which nodes of the cluster a downloader may copy a model's files from, and which certificates its file server
admits: pure functions of State, no I/O.

A node is a source of a model when its downloader's last storage report lists the model in `available_models`
(complete, every layer, in one of its directories) and names a file server. Whether it is offline does not matter
(offline means it makes no call to the Hub; it still serves its peers). Where State records the node's download of
the model, that record must hold the form wanted (a node that has only the GGUF is no source of the MLX directory);
where it records none (a copy found on a read-only disk), the source's own manifest decides. Sources come in node
id order: deterministic, and every node asking at once spreads nothing but asks the same first node, which is fine
for a LAN of a few machines; the caller tries the next one when a source fails, and the Hub only when none is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetshard_schema.cards import ModelCard, ModelFormat
from jetshard_schema.ids import ModelId, NodeId
from jetshard_schema.state import State
from jetshard_schema.types import DownloadProgress, DownloadStatus, engine_format


@dataclass(frozen=True)
class PeerSource:
    node_id: NodeId
    host: str
    port: int
    certificate_pem: str


def copy_sources(state: State, node_id: NodeId, model_id: ModelId, form: ModelFormat) -> list[PeerSource]:
    """The other nodes `node_id` may copy `model_id` in `form` from, in the order to try them."""
    sources = []
    for other in sorted(state.node_storage):
        if other == node_id:
            continue
        storage = state.node_storage[other]
        server = storage.file_server
        if server is None or model_id not in storage.available_models:
            continue
        download = state.download(other, model_id)
        if download is not None and download.progress.status is DownloadStatus.COMPLETED:
            if not download.progress.holds(form):
                continue
        sources.append(PeerSource(other, server.host, server.port, server.certificate_pem))
    return sources


def admitted_certificates(state: State, node_id: NodeId) -> set[str]:
    """The certificates (PEM) the file server of `node_id` admits: those of every other node's downloader session,
    as their storage reports name them."""
    return {
        storage.file_server.certificate_pem
        for other, storage in state.node_storage.items()
        if other != node_id and storage.file_server is not None
    }


HUB_FETCHING = (DownloadStatus.PENDING, DownloadStatus.ONGOING)


def awaited_sources(state: State, node_id: NodeId, card: ModelCard, form: ModelFormat) -> list[NodeId]:
    """Nodes about to be sources of all of `card`'s model in `form`, for `node_id` to wait for rather than go to the
    Hub. So that each file crosses from the Hub once however many nodes need it at the same time, the node with the
    lowest id fetches and the others wait: for one with an id before `node_id` fetching all of it from the Hub now,
    or about to (asked for it and not begun, or holding a shard of an instance of the model and not yet reporting
    a download: the shards of one placement start together). Also any node that has all of it (fetched, copied or
    imported) but whose storage report, which makes it a source, has not come yet. A GGUF is fetched whole for any
    shard, of llama.cpp's or (when the model has no MLX weights) of MLX's, which converts it; the MLX files of a
    shard's layers never make a node a source of the whole model."""
    model_id = card.model_id
    mlx_from_gguf = ModelFormat.MLX not in card.formats

    def whole(start_layer: int, end_layer: int) -> bool:
        return form is ModelFormat.GGUF or (start_layer <= 0 and end_layer >= card.num_layers)

    def serves_peers(other: NodeId) -> bool:
        storage = state.node_storage.get(other)
        return other != node_id and storage is not None and storage.file_server is not None

    awaited = set()
    for other, downloads in state.downloads.items():
        download = downloads.get(model_id)
        if download is None or not serves_peers(other):
            continue
        progress = download.progress
        if not whole(progress.start_layer, progress.end_layer):
            continue
        fetching = (fetching_from_hub(progress) and form in progress.formats) or not_begun(progress)
        unreported = progress.holds(form) and model_id not in state.node_storage[other].available_models
        if (fetching and other < node_id) or unreported:
            awaited.add(other)
    for instance in state.instances.values():
        fetched = engine_format(instance.serving.engine)
        if instance.model_id != model_id or (fetched is not form and not (mlx_from_gguf and form is ModelFormat.GGUF)):
            continue
        for shard in instance.shards:
            other = shard.node_id
            starting = state.download(other, model_id) is None and whole(shard.start_layer, shard.end_layer)
            if starting and other < node_id and serves_peers(other):
                awaited.add(other)
    return sorted(awaited)


def fetching_from_hub(progress: DownloadProgress) -> bool:
    return progress.status in HUB_FETCHING and progress.source == "hub"


def not_begun(progress: DownloadProgress) -> bool:
    """Asked for, and its node has not yet said where from (nor in what form)."""
    return progress.status is DownloadStatus.PENDING and not progress.source and not progress.formats
