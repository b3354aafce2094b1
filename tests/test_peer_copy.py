"""Weights from the machine next door: a node copies the model files another node holds from that node's downloader
instead of the Hub. Real nats-server, sequencer and downloader processes, the local Hub (which counts what it
serves), real files; nodes are made present by the test (no worker, no runner).

Also the file server's refusals: a stranger with a certificate of its own, a client without one, plain HTTP, and
hostile paths from a client the cluster vouches for.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from helpers.cards import tiny_card
from helpers.harness import Cluster, until
from helpers.hub_server import HubServer
from helpers.model_files import model_files, sha256
from helpers.tiny_models import make_tiny_model
from jetshard_bus.tls_identity import PeerIdentity, client_context
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.file_server import _Refused, parse_range, parse_target, served_file
from jetshard_downloader.manifest import Manifest, ManifestFile, write_manifest
from jetshard_downloader.peer_copy import PeerUnavailable, fetch_manifest
from jetshard_downloader.peers import PeerSource, admitted_certificates, awaited_sources, copy_sources
from jetshard_downloader.resume import PARTIAL_DIR
from jetshard_downloader.service import STOPPED
from jetshard_schema.cards import ModelFormat
from jetshard_schema.commands import CancelDownload, StartDownload
from jetshard_schema.events import CommandRejected
from jetshard_schema.ids import InstanceId, ModelId, NodeId, model_dir_name
from jetshard_schema.state import Download, Instance, State
from jetshard_schema.types import (
    DownloadProgress,
    DownloadStatus,
    Engine,
    FileServer,
    NodeStorage,
    ServingSettings,
    ShardAssignment,
)

pytestmark = pytest.mark.timeout(180)


def hub_requests_for(hub: HubServer, repo: str) -> int:
    return sum(count for path, count in hub.requests.items() if f"/{repo}/" in path or path.endswith(f"/{repo}"))


async def start_nodes(
    cluster: Cluster, tmp_path: Path, names: str
) -> tuple[dict[str, NodeId], dict[str, Path], dict[str, subprocess.Popen[bytes]]]:
    """Nodes with a downloader each (its own config, model and temporary directories), once State names their
    file servers."""
    nodes: dict[str, NodeId] = {}
    models: dict[str, Path] = {}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    for name in names:
        config = tmp_path / f"node-{name}"
        nodes[name] = await cluster.join(config)
        models[name] = tmp_path / f"models-{name}"
        scratch = tmp_path / f"tmp-{name}"
        scratch.mkdir()
        processes[name] = cluster.start_downloader(
            f"downloader-{name}", config, JETSHARD_DEFAULT_MODELS_DIR=str(models[name]), TMPDIR=str(scratch)
        )
    await cluster.wait(
        lambda s: all((st := s.node_storage.get(n)) is not None and st.file_server for n in nodes.values()),
        60,
        "every node's file server",
    )
    return nodes, models, processes


def identity_of(tmp_path: Path, name: str, node_id: str) -> PeerIdentity:
    """The identity node `name`'s downloader session made (the test acts as that node)."""
    (directory,) = (tmp_path / f"tmp-{name}").glob("jetshard-downloader-*")
    certificate = directory / f"downloader-{node_id}.crt"
    return PeerIdentity(certificate.read_text(), certificate, directory / f"downloader-{node_id}.key")


def raw_get(server: FileServer, context: ssl.SSLContext, target: str) -> int:
    connection = http.client.HTTPSConnection(server.host, server.port, context=context, timeout=10)
    try:
        connection.putrequest("GET", target, skip_accept_encoding=True)
        connection.endheaders()
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


# ------------------------------------------------------------------------------------------ the whole story


async def test_a_node_copies_from_the_node_that_has_the_model_and_refuses_a_damaged_copy(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=4, num_files=2)
    repo, other = "tiny/copied", "tiny/damaged"
    hub_server.add_repo(repo, source)
    hub_server.add_repo(other, source)
    await cluster.add_card(repo, 4)
    await cluster.add_card(other, 4)
    nodes, models, _ = await start_nodes(cluster, tmp_path, "ab")
    a, b = nodes["a"], nodes["b"]

    for model in (repo, other):
        await cluster.submit(StartDownload(model_id=ModelId(model), node_id=a))
        done = await cluster.wait_download(a, model)
        assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
        assert done.progress.source == "hub"
        assert hub_requests_for(hub_server, model) > 0
    await cluster.wait(
        lambda s: {ModelId(repo), ModelId(other)} <= set(s.node_storage[a].available_models), 30, f"{a} to list both"
    )
    assert [s.node_id for s in copy_sources(cluster.follower.state, b, ModelId(repo), ModelFormat.MLX)] == [a]

    # B copies the model from A: the Hub hears nothing about it.
    hub_server.reset_counters()
    await cluster.submit(StartDownload(model_id=ModelId(repo), node_id=b))
    copied = await cluster.wait_download(b, repo)
    assert copied.progress.status is DownloadStatus.COMPLETED, copied.progress.reason
    assert copied.progress.source == a
    assert copied.progress.directory == str(models["b"] / "tiny--copied")
    assert hub_requests_for(hub_server, repo) == 0, dict(hub_server.requests)
    assert model_files(models["b"] / "tiny--copied") == model_files(source)
    for name in model_files(source):
        assert sha256(models["b"] / "tiny--copied" / name) == sha256(source / name), name
    assert not (models["b"] / "tiny--copied" / PARTIAL_DIR).exists()

    # A damaged file on A (same size: A still serves it) is refused by B, which fetches it from the Hub instead.
    damaged = "model-00002-of-00002.safetensors"
    path = models["a"] / "tiny--damaged" / damaged
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    hub_server.reset_counters()
    await cluster.submit(StartDownload(model_id=ModelId(other), node_id=b))
    fixed = await cluster.wait_download(b, other)
    assert fixed.progress.status is DownloadStatus.COMPLETED, fixed.progress.reason
    for name in model_files(source):
        assert sha256(models["b"] / "tiny--damaged" / name) == sha256(source / name), name
    assert f"{other}/{damaged} copied from node {a} has sha256" in cluster.processes.log("downloader-b")
    assert hub_server.bytes_served[(other, damaged)] == (source / damaged).stat().st_size
    assert hub_server.bytes_served[(other, "model-00001-of-00002.safetensors")] == 0  # copied from A before

    # Strangers get nothing from A's file server.
    server = cluster.follower.state.node_storage[a].file_server
    assert server is not None
    stranger = PeerIdentity.create(tmp_path / "stranger", "stranger")
    with pytest.raises(PeerUnavailable):
        await asyncio.to_thread(
            fetch_manifest,
            PeerSource(a, server.host, server.port, server.certificate_pem),
            client_context(stranger, server.certificate_pem),
            ModelId(repo),
        )
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.check_hostname = False
    anonymous.verify_mode = ssl.CERT_NONE
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        await asyncio.to_thread(raw_get, server, anonymous, f"/v1/models/{repo}/manifest")
    with pytest.raises(httpx.HTTPError):
        await asyncio.to_thread(httpx.get, f"http://{server.host}:{server.port}/v1/models/{repo}/manifest", timeout=5)

    # A client the cluster vouches for (B's session) gets 4xx for hostile paths, the manifest for a good one.
    as_b = client_context(identity_of(tmp_path, "b", b), server.certificate_pem)
    assert await asyncio.to_thread(raw_get, server, as_b, f"/v1/models/{repo}/manifest") == 200
    for target in (
        f"/v1/models/{repo}/files/../../../../etc/passwd",
        f"/v1/models/{repo}/files/%2Fetc%2Fpasswd",
        f"/v1/models/{repo}/files/.jetshard-manifest.json",
        f"/v1/models/{repo}/files/not-there.bin",
        "/v1/models/../etc/manifest",
        "/v1/models/..%2F..%2Fetc/passwd/manifest",
        "/v1/models/tiny/copied/../../x/manifest",
        "/etc/passwd",
    ):
        status = await asyncio.to_thread(raw_get, server, as_b, target)
        assert 400 <= status < 500, (target, status)


BIG = "model.safetensors"


@dataclass
class BigCopy:
    """A model of one big file that node A holds (from the Hub) and node B has begun to copy from A."""

    repo: str
    source: Path
    a: NodeId
    b: NodeId
    models: dict[str, Path]
    processes: dict[str, subprocess.Popen[bytes]]

    @property
    def size(self) -> int:
        return (self.source / BIG).stat().st_size

    @property
    def partial(self) -> Path:
        return self.models["b"] / model_dir_name(ModelId(self.repo)) / PARTIAL_DIR / f"{BIG}.incomplete"


async def big_copy_begun(cluster: Cluster, hub_server: HubServer, tmp_path: Path, repo: str) -> BigCopy:
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=1, hidden_size=1024)
    assert (source / BIG).stat().st_size > 24 * 2**20
    hub_server.add_repo(repo, source)
    await cluster.add_card(repo, 2, 1024)
    nodes, models, processes = await start_nodes(cluster, tmp_path, "ab")
    copy = BigCopy(repo, source, nodes["a"], nodes["b"], models, processes)
    await cluster.submit(StartDownload(model_id=ModelId(repo), node_id=copy.a))
    done = await cluster.wait_download(copy.a, repo, timeout_s=60)
    assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
    await cluster.wait(lambda s: ModelId(repo) in s.node_storage[copy.a].available_models, 30, f"A to list {repo}")
    hub_server.reset_counters()
    await cluster.submit(StartDownload(model_id=ModelId(repo), node_id=copy.b))
    await until(lambda: copy.partial.exists() and copy.partial.stat().st_size > 0, 30, "B's copy", interval_s=0.001)
    return copy


async def resumed_from(cluster: Cluster, hub_server: HubServer, copy: BigCopy, kept: int) -> None:
    """B's copy completes from A, from the `kept` bytes on, and the Hub heard nothing of it."""
    finished = await cluster.wait_download(copy.b, copy.repo, timeout_s=60)
    assert finished.progress.status is DownloadStatus.COMPLETED, finished.progress.reason
    assert finished.progress.source == copy.a
    assert sha256(copy.models["b"] / model_dir_name(ModelId(copy.repo)) / BIG) == sha256(copy.source / BIG)
    assert f"sending {copy.repo}/{BIG} from byte {kept} of {copy.size}" in cluster.processes.log("downloader-a")
    assert hub_requests_for(hub_server, copy.repo) == 0, dict(hub_server.requests)


async def test_an_interrupted_copy_resumes_where_it_stopped(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    copy = await big_copy_begun(cluster, hub_server, tmp_path, "tiny/big")
    # A is stopped mid-file (SIGSTOP), B is killed, A goes on, B starts again.
    os.kill(copy.processes["a"].pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(0.5)  # what the sockets held reaches B
        cluster.processes.kill(copy.processes["b"])
        kept = copy.partial.stat().st_size
        assert 0 < kept < copy.size, (kept, copy.size)
    finally:
        os.kill(copy.processes["a"].pid, signal.SIGCONT)

    cluster.start_downloader(
        "downloader-b2",
        tmp_path / "node-b",
        JETSHARD_DEFAULT_MODELS_DIR=str(copy.models["b"]),
        TMPDIR=str(tmp_path / "tmp-b"),
    )
    await resumed_from(cluster, hub_server, copy, kept)


async def test_a_copy_cancelled_mid_file_stops_keeps_its_bytes_and_resumes_when_asked_again(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    copy = await big_copy_begun(cluster, hub_server, tmp_path, "tiny/cancelled")
    model = ModelId(copy.repo)
    # A is held still (SIGSTOP) while the cancel is asked for, so that it lands mid-file.
    os.kill(copy.processes["a"].pid, signal.SIGSTOP)
    try:
        cancelled = await cluster.submit(CancelDownload(model_id=model, node_id=copy.b))
    finally:
        os.kill(copy.processes["a"].pid, signal.SIGCONT)
    assert not any(isinstance(e, CommandRejected) for e in cancelled), cancelled
    stopped = await cluster.wait(
        lambda s: (d := s.download(copy.b, model)) is not None and d.progress.reason == STOPPED, 60, "B to stop"
    )
    assert stopped.download(copy.b, model).progress.status is DownloadStatus.CANCELLED  # type: ignore[union-attr]
    kept = copy.partial.stat().st_size
    assert 0 < kept < copy.size, (kept, copy.size)
    assert not (copy.models["b"] / model_dir_name(model) / BIG).exists()

    await cluster.submit(StartDownload(model_id=model, node_id=copy.b))
    await resumed_from(cluster, hub_server, copy, kept)


# --------------------------------------------------------------------------------------------- pure parts


BOTH_FORMS = tiny_card("org/model", num_layers=4, formats=(ModelFormat.MLX, ModelFormat.GGUF))
GGUF_ONLY = msgspec.structs.replace(BOTH_FORMS, formats=(ModelFormat.GGUF,))


def _state(storage: dict[str, NodeStorage], downloads: dict[str, DownloadProgress] | None = None) -> State:
    model = ModelId("org/model")
    return State(
        node_storage={NodeId(n): s for n, s in storage.items()},
        downloads={
            NodeId(n): {model: Download(node_id=NodeId(n), model_id=model, progress=p)}
            for n, p in (downloads or {}).items()
        },
    )


def test_copy_sources_are_the_other_nodes_that_hold_the_model_with_a_file_server() -> None:
    model = ModelId("org/model")
    server = FileServer(host="10.0.0.2", port=7000, certificate_pem="PEM")
    state = _state(
        {
            "n3": NodeStorage(available_models=(model,), file_server=server, offline=True),
            "n1": NodeStorage(available_models=(model,), file_server=server),
            "n2": NodeStorage(available_models=(), file_server=server),
            "n4": NodeStorage(available_models=(model,)),  # no file server: an older downloader
            "me": NodeStorage(available_models=(model,), file_server=server),
            "n5": NodeStorage(available_models=(model,), file_server=server),
        },
        {
            "n5": DownloadProgress(status=DownloadStatus.COMPLETED, formats=(ModelFormat.GGUF,)),
            "n3": DownloadProgress(status=DownloadStatus.COMPLETED, formats=(ModelFormat.MLX,)),
        },
    )
    mlx = copy_sources(state, NodeId("me"), model, ModelFormat.MLX)
    assert [s.node_id for s in mlx] == ["n1", "n3"]  # id order; offline does not matter; n5 has only the GGUF
    assert mlx[0] == PeerSource(NodeId("n1"), "10.0.0.2", 7000, "PEM")
    assert [s.node_id for s in copy_sources(state, NodeId("me"), model, ModelFormat.GGUF)] == ["n1", "n5"]
    assert copy_sources(state, NodeId("me"), ModelId("org/other"), ModelFormat.MLX) == []
    assert admitted_certificates(state, NodeId("me")) == {"PEM"}
    assert admitted_certificates(_state({"me": NodeStorage(file_server=server)}), NodeId("me")) == set()


def test_a_node_waits_for_the_lower_node_fetching_the_whole_model_from_the_hub() -> None:
    model = ModelId("org/model")
    server = FileServer(host="10.0.0.2", port=7000, certificate_pem="PEM")
    fetching = DownloadProgress(status=DownloadStatus.ONGOING, end_layer=4, source="hub", formats=(ModelFormat.MLX,))
    state = _state(
        {name: NodeStorage(file_server=server) for name in ("n1", "n2", "n3", "n4", "n5")},
        {
            "n1": fetching,
            "n2": msgspec.structs.replace(fetching, end_layer=2),  # a shard only: never a whole source
            "n3": msgspec.structs.replace(fetching, source="n1"),  # waiting itself, or copying
            "n5": fetching,  # a higher id: it waits for n1, not n4 for it
        },
    )
    assert awaited_sources(state, NodeId("n4"), BOTH_FORMS, ModelFormat.MLX) == ["n1"]
    assert awaited_sources(state, NodeId("n4"), BOTH_FORMS, ModelFormat.GGUF) == []  # another form
    assert awaited_sources(state, NodeId("n1"), BOTH_FORMS, ModelFormat.MLX) == []  # the lowest fetches
    # A GGUF is fetched whole for any shard of llama.cpp's: the node fetching one for its layers is a source to be.
    gguf = msgspec.structs.replace(fetching, start_layer=1, end_layer=3, formats=(ModelFormat.GGUF,))
    shards = _state({name: NodeStorage(file_server=server) for name in ("n1", "n2")}, {"n1": gguf})
    assert awaited_sources(shards, NodeId("n2"), BOTH_FORMS, ModelFormat.GGUF) == ["n1"]
    # Nodes asked at the same moment (one placement's shards) wait for the lowest before it has begun.
    asked = DownloadProgress(status=DownloadStatus.PENDING, end_layer=4)
    at_once = _state({name: NodeStorage(file_server=server) for name in ("n1", "n2")}, {"n1": asked, "n2": asked})
    assert awaited_sources(at_once, NodeId("n2"), BOTH_FORMS, ModelFormat.GGUF) == ["n1"]
    assert awaited_sources(at_once, NodeId("n1"), BOTH_FORMS, ModelFormat.GGUF) == []
    # A placement's shards start at once: before any has reported, each waits for the lowest shard's node.
    shards = tuple(
        ShardAssignment(node_id=NodeId(n), rank=r, start_layer=2 * r, end_layer=2 * r + 2, memory_bytes=1)
        for r, n in enumerate(("n2", "n1"))
    )
    llama_cpp = ServingSettings(engine=Engine.LLAMA_CPP)
    placed = Instance(instance_id=InstanceId("i"), model_id=model, shards=shards, serving=llama_cpp)
    quiet = _state({n: NodeStorage(file_server=server) for n in ("n1", "n2", "n3")})
    quiet = msgspec.structs.replace(quiet, instances={placed.instance_id: placed})
    assert awaited_sources(quiet, NodeId("n2"), BOTH_FORMS, ModelFormat.GGUF) == ["n1"]
    assert awaited_sources(quiet, NodeId("n3"), BOTH_FORMS, ModelFormat.GGUF) == ["n1", "n2"]
    assert awaited_sources(quiet, NodeId("n1"), BOTH_FORMS, ModelFormat.GGUF) == []
    assert awaited_sources(quiet, NodeId("n3"), BOTH_FORMS, ModelFormat.MLX) == []  # another form (and shards)
    # MLX's runners of a model that has only a GGUF convert it: each of their nodes fetches the GGUF whole.
    on_mlx = msgspec.structs.replace(placed, serving=ServingSettings(engine=Engine.MLX))
    converting = msgspec.structs.replace(quiet, instances={placed.instance_id: on_mlx})
    assert awaited_sources(converting, NodeId("n2"), BOTH_FORMS, ModelFormat.GGUF) == []
    assert awaited_sources(converting, NodeId("n2"), GGUF_ONLY, ModelFormat.GGUF) == ["n1"]
    # A node that has it all (an import, here) but has not reported it in its storage yet: a source on its way.
    imported = DownloadProgress(status=DownloadStatus.COMPLETED, end_layer=4, formats=(ModelFormat.GGUF,))
    state = _state({"n9": NodeStorage(file_server=server), "n1": NodeStorage(file_server=server)}, {"n9": imported})
    assert awaited_sources(state, NodeId("n1"), BOTH_FORMS, ModelFormat.GGUF) == ["n9"]
    listed = _state({"n9": NodeStorage(file_server=server, available_models=(model,))}, {"n9": imported})
    assert awaited_sources(listed, NodeId("n1"), BOTH_FORMS, ModelFormat.GGUF) == []


async def test_nodes_that_need_a_model_at_once_take_it_from_the_hub_once(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=4, num_files=2)
    repo = "tiny/at-once"
    hub_server.add_repo(repo, source)
    await cluster.add_card(repo, 4)
    nodes, _, _ = await start_nodes(cluster, tmp_path, "abc")
    hub_server.reset_counters()
    first = sorted(nodes.values())[0]
    await cluster.submit(StartDownload(model_id=ModelId(repo), node_id=first))
    await cluster.wait(
        lambda s: (d := s.download(first, ModelId(repo))) is not None and d.progress.source == "hub", 30, "a Hub fetch"
    )
    for node in sorted(nodes.values())[1:]:
        await cluster.submit(StartDownload(model_id=ModelId(repo), node_id=node))
    for node in nodes.values():
        done = await cluster.wait_download(node, repo)
        assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
        assert done.progress.source == ("hub" if node == first else first), (node, done.progress)
    weights = [name for name in model_files(source) if name.endswith(".safetensors")]
    for name in weights:  # each weight file left the Hub once, for the whole cluster
        served = sum(count for path, count in hub_server.requests.items() if path.endswith(f"/{name}"))
        assert served == 1, (name, dict(hub_server.requests))


def test_the_file_server_serves_only_whole_manifest_files_inside_the_model(tmp_path: Path) -> None:
    models = tmp_path / "models"
    model_dir = models / "org--model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"w" * 10)
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 10)
    (model_dir / "link.bin").symlink_to(outside)
    write_manifest(
        model_dir,
        Manifest(
            model_id="org/model",
            revision="abc",
            files=(
                ManifestFile("config.json", 2, "x"),
                ManifestFile("model.safetensors", 10, "y"),
                ManifestFile("link.bin", 10, "z"),
            ),
        ),
    )
    dirs = ModelDirs.from_options(models, [])
    model = ModelId("org/model")
    assert served_file(dirs, model, "model.safetensors").size == 10
    for name, status in [("link.bin", 403), ("../secret", 400), ("/etc/passwd", 400), ("nothing", 404)]:
        with pytest.raises(_Refused) as refused:
            served_file(dirs, model, name)
        assert refused.value.status == status, name
    (model_dir / "model.safetensors").write_bytes(b"w" * 5)  # not whole any more
    with pytest.raises(_Refused):
        served_file(dirs, model, "model.safetensors")
    assert parse_target("/v1/models/org/model/files/a/b.json") == (model, "a/b.json")
    assert parse_target("/v1/models/org/model/manifest") == (model, None)
    for target, status in [("/v1/models/../x/manifest", 400), ("/v1/models/org/model/other", 404), ("/", 404)]:
        with pytest.raises(_Refused) as refused:
            parse_target(target)
        assert refused.value.status == status, target
    assert parse_range(None, 10) is None
    assert parse_range("bytes=4-", 10) == (4, 10)
    assert parse_range("bytes=0-3", 10) == (0, 4)
    for header in ("bytes=10-", "bytes=11-", "bytes=1-2,4-5", "lines=1-"):
        with pytest.raises(_Refused):
            parse_range(header, 10)


async def test_a_hub_gguf_and_a_split_one_are_copied_from_the_node_that_has_them(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    from test_hub_gguf import Q4, REPO, SPLIT_FIRST, SPLIT_SECOND, _add, _hub_repo

    files = _hub_repo(hub_server, tmp_path / "repo")
    api = cluster.start_api()
    split = "jetshard-test/qwen3-split"
    assert (await asyncio.to_thread(_add, api, model_id=REPO, gguf_file=Q4)).status_code == 201
    assert (await asyncio.to_thread(_add, api, model_id=split, repo=REPO, gguf_file=SPLIT_FIRST)).status_code == 201
    nodes, models, _ = await start_nodes(cluster, tmp_path, "ab")
    a, b = nodes["a"], nodes["b"]
    for model in (REPO, split):
        await cluster.submit(StartDownload(model_id=ModelId(model), node_id=a))
        await cluster.wait_download_of(a, model, ModelFormat.GGUF, 60)
    await cluster.wait(
        lambda s: {ModelId(REPO), ModelId(split)} <= set(s.node_storage[a].available_models), 30, f"{a} to list both"
    )

    hub_server.reset_counters()
    for model in (REPO, split):
        await cluster.submit(StartDownload(model_id=ModelId(model), node_id=b))
        done = await cluster.wait_download_of(b, model, ModelFormat.GGUF, 60)
        assert done.progress.source == a
    assert sum(hub_server.bytes_served.values()) == 0, dict(hub_server.bytes_served)
    on_b = models["b"] / "jetshard-test--Qwen3-Tiny-GGUF"
    assert sha256(on_b / "model.gguf") == sha256(files / Q4)
    split_on_b = models["b"] / "jetshard-test--qwen3-split"
    assert sha256(split_on_b / "model.gguf") == sha256(files / SPLIT_FIRST)  # the link to its first part
    assert sha256(split_on_b / "model-00002-of-00002.gguf") == sha256(files / SPLIT_SECOND)
