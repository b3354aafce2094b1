"""The downloader service end to end: real nats-server, sequencer and downloader processes, the local Hub,
real files on real (sometimes size-limited or read-only tmpfs) directories, the API and `jetshard download`.

Nodes are made present by the test itself (ReportNodeProfile + the liveness key a worker would keep), so no
worker process (and no MLX runner) is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from helpers.harness import Cluster, api_until, free_port, until
from helpers.hub_server import HubServer
from helpers.model_files import model_files, sha256
from helpers.mounts import remount_read_only, tmpfs
from helpers.tiny_models import make_tiny_model
from jetshard_bus.scratch import DOWNLOADER_PREFIX
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.locate import find_model
from jetshard_downloader.paths import MANIFEST_NAME
from jetshard_downloader.resume import PARTIAL_DIR
from jetshard_schema.catalogue import DEMO_MODEL_ID
from jetshard_schema.commands import (
    PlaceInstance,
    StartDownload,
)
from jetshard_schema.events import (
    CommandRejected,
    DownloadCompleted,
    DownloadFailed,
    DownloadProgressed,
)
from jetshard_schema.ids import ModelId, new_instance_id
from jetshard_schema.types import DownloadStatus

pytestmark = pytest.mark.timeout(120)


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root`: file contents, symlink targets, directories."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = sha256(path)
        else:
            out[rel] = "dir"
    return out


@contextlib.contextmanager
def read_only_disk(path: Path, fill: Callable[[Path], object]) -> Iterator[Path]:
    """A small tmpfs at `path` that `fill` writes, then mounted read-only; nothing in it may change in the block."""
    with tmpfs(path, "8m") as disk:
        fill(disk)
        remount_read_only(disk)
        before = tree_digest(disk)
        yield disk
        assert tree_digest(disk) == before


# ------------------------------------------------------------------------------------------------------ tests


async def test_spillover_to_the_second_dir_and_no_space_names_every_dir(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    small = make_tiny_model(tmp_path / "src-small", num_layers=4, num_files=4, hidden_size=128)  # ~2.9 MB
    big = make_tiny_model(tmp_path / "src-big", num_layers=8, num_files=4, hidden_size=128)  # ~5.3 MB
    hub_server.add_repo("tiny/small", small)
    hub_server.add_repo("tiny/big", big)
    with tmpfs(tmp_path / "first", "1m") as first, tmpfs(tmp_path / "second", "4m") as second:
        config = tmp_path / "node"
        node = await cluster.join(config)
        await cluster.add_card("tiny/small", 4, 128)
        await cluster.add_card("tiny/big", 8, 128)
        cluster.start_downloader(
            "downloader", config, JETSHARD_DEFAULT_MODELS_DIR=str(first), JETSHARD_MODELS_DIRS=str(second)
        )

        await cluster.submit(StartDownload(model_id=ModelId("tiny/small"), node_id=node))
        done = await cluster.wait_download(node, "tiny/small")
        assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
        assert done.progress.directory == str(second / "tiny--small")
        assert model_files(second / "tiny--small") == model_files(small)
        assert not (first / "tiny--small").exists()
        # The real size replaced the card's estimate.
        weights = sum(p.stat().st_size for p in small.glob("*.safetensors"))
        assert cluster.follower.state.measured_sizes[ModelId("tiny/small")] == weights

        await cluster.submit(StartDownload(model_id=ModelId("tiny/big"), node_id=node))
        failed = await cluster.wait_download(node, "tiny/big")
        assert failed.progress.status is DownloadStatus.FAILED
        assert "not enough disk space" in failed.progress.reason
        assert str(first) in failed.progress.reason and str(second) in failed.progress.reason
        assert not any(repo == "tiny/big" and name.endswith(".safetensors") for repo, name in hub_server.bytes_served)
        cluster.processes.stop_all()


def _hf_cache_layout(root: Path, model_id: str, source: Path) -> str:
    """`models--org--name/{blobs,refs,snapshots/<rev>}` with snapshot entries linking to blobs, as the Hub
    client leaves it."""
    repo = root / f"models--{model_id.replace('/', '--')}"
    revision = hashlib.sha1(model_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for path in source.iterdir():
        blob = sha256(path)
        shutil.copy(path, repo / "blobs" / blob)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return str(snapshot)


async def test_read_only_dirs_are_used_without_network_and_never_changed(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=4, num_files=2)
    snapshot = ""

    def fill(ro: Path) -> None:
        nonlocal snapshot
        shutil.copytree(source, ro / "tiny--plain")  # jetshard layout, no manifest: another tool put it there
        snapshot = _hf_cache_layout(ro, "tiny/cached", source)

    with read_only_disk(tmp_path / "ro", fill) as ro:
        config = tmp_path / "node"
        node = await cluster.join(config)
        await cluster.add_card("tiny/plain", 4)
        await cluster.add_card("tiny/cached", 4)
        await cluster.add_card("tiny/nowhere", 4)  # a card whose repo the Hub does not have
        api = cluster.start_api()
        cluster.start_downloader(
            "downloader",
            config,
            JETSHARD_DEFAULT_MODELS_DIR=str(tmp_path / "models"),
            JETSHARD_MODELS_READ_ONLY_DIRS=str(ro),
        )
        hub_server.reset_counters()

        async with httpx.AsyncClient(base_url=api, timeout=30) as http:
            for model_id, where in (("tiny/plain", str(ro / "tiny--plain")), ("tiny/cached", snapshot)):
                response = await http.post("/downloads", json={"model_id": model_id})  # the only node
                assert response.status_code == 202, response.text
                assert response.json()["node_id"] == node
                done = await cluster.wait_download(node, model_id)
                assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
                assert done.progress.read_only and done.progress.directory == where
            assert sum(hub_server.requests.values()) == 0, hub_server.requests

            expected = {("tiny/plain", "completed", True), ("tiny/cached", "completed", True)}
            await api_until(
                http, lambda listed: {(d["model_id"], d["status"], d["read_only"]) for d in listed} == expected
            )

            refused = await http.delete(f"/downloads/{node}/tiny/plain")
            assert refused.status_code == 409, refused.text
            assert "read-only" in refused.json()["error"]["message"]
            bad = await http.post("/downloads", json={"model_id": "../etc"})
            assert bad.status_code == 400
            unknown_node = await http.post("/downloads", json={"model_id": "tiny/plain", "node_id": "nope"})
            assert unknown_node.status_code == 404

        # `jetshard download`: 0 for a model that is (already) there, 1 with the reason for a failure.
        cli = [sys.executable, "-m", "jetshard", "download", "--api", api, "--timeout-s", "60"]
        ok = await asyncio.to_thread(subprocess.run, [*cli, "tiny/plain"], capture_output=True, text=True, timeout=90)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert str(ro / "tiny--plain") in ok.stderr
        failed = await asyncio.to_thread(
            subprocess.run, [*cli, "tiny/nowhere"], capture_output=True, text=True, timeout=90
        )
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "not found on the Hub" in failed.stderr
        nowhere = [*cli[:4], "--api", f"http://127.0.0.1:{free_port()}", "tiny/plain"]
        down = await asyncio.to_thread(subprocess.run, nowhere, capture_output=True, text=True, timeout=90)
        assert down.returncode == 3 and "cannot reach the jetshard API" in down.stderr, down.stderr


async def test_a_models_dir_on_a_read_only_filesystem_is_only_read(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    """The default directory configured as writable, on a disk mounted read-only (a shared export, a disk the
    kernel remounted after errors): its models serve, nothing is written there, and a download says why not."""
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=1)
    hub_server.add_repo("tiny/elsewhere", source)
    with read_only_disk(tmp_path / "mount", lambda disk: shutil.copytree(source, disk / "tiny--there")) as mount:
        config = tmp_path / "node"
        node = await cluster.join(config)
        await cluster.add_card("tiny/there", 2)
        await cluster.add_card("tiny/elsewhere", 2)
        api = cluster.start_api()
        cluster.start_downloader("downloader", config, JETSHARD_DEFAULT_MODELS_DIR=str(mount))
        async with httpx.AsyncClient(base_url=api, timeout=30) as http:
            nodes = await api_until(
                http,
                lambda listed: any(n["node_id"] == node and n["model_dirs"] for n in listed),
                path="/nodes",
            )
            (shown,) = [n for n in nodes if n["node_id"] == node]
            assert [(d["path"], d["read_only"]) for d in shown["model_dirs"]] == [(str(mount), True)]

            for model_id in ("tiny/there", "tiny/elsewhere"):
                response = await http.post("/downloads", json={"model_id": model_id})
                assert response.status_code == 202, response.text
            there = await cluster.wait_download(node, "tiny/there")
            assert there.progress.status is DownloadStatus.COMPLETED, there.progress.reason
            assert there.progress.read_only and there.progress.directory == str(mount / "tiny--there")
            elsewhere = await cluster.wait_download(node, "tiny/elsewhere")
            assert elsewhere.progress.status is DownloadStatus.FAILED
            assert "read-only filesystem" in elsewhere.progress.reason, elsewhere.progress.reason


async def test_killed_mid_download_resumes_in_the_same_directory(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=2, hidden_size=256)  # 2 x ~2.9 MB
    repo = "tiny/big"
    held = "model-00001-of-00002.safetensors"
    hold_at = 2 * 2**20
    size = (source / held).stat().st_size
    assert size > hold_at + 2**19
    hub_server.add_repo(repo, source)
    hub_server.hold_after(repo, held, hold_at)

    config = tmp_path / "node"
    models = tmp_path / "models"
    other = tmp_path / "more-models"
    node = await cluster.join(config)
    await cluster.add_card(repo, 2, 256)
    api = cluster.start_api()
    scratch = tmp_path / "tmp"  # where the downloader keeps its file server's key
    scratch.mkdir()
    env = {"JETSHARD_DEFAULT_MODELS_DIR": str(models), "JETSHARD_MODELS_DIRS": str(other), "TMPDIR": str(scratch)}
    first = cluster.start_downloader("downloader-1", config, **env)
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        response = await http.post("/downloads", json={"model_id": repo, "node_id": node})
        assert response.status_code == 202, response.text
        assert await asyncio.to_thread(hub_server.wait_held, repo, held, 30)
        partial = models / "tiny--big" / PARTIAL_DIR / f"{held}.incomplete"
        await until(lambda: partial.exists() and partial.stat().st_size >= hold_at, 10)
        ongoing = await cluster.wait_download(node, repo, (DownloadStatus.ONGOING,), 10)
        assert ongoing.progress.directory == str(models / "tiny--big") and ongoing.progress.bytes_total > size

        listed = await api_until(
            http, lambda listed: [(d["model_id"], d["status"]) for d in listed] == [(repo, "ongoing")]
        )
        assert listed[0]["bytes_done"] >= hold_at and listed[0]["speed_bytes_per_s"] >= 0
        seen: list[str] = []
        async with asyncio.timeout(15), http.stream("GET", "/events", params={"since": 1}) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line[len("event: ") :])
                if "DownloadProgressed" in seen:
                    break
        assert "DownloadRequested" in seen

    assert find_model(ModelDirs.from_options(models, [other]), repo) is None
    assert not any(isinstance(e, DownloadCompleted) for e in cluster.events)
    cluster.processes.kill(first)
    (key_left,) = scratch.glob(f"{DOWNLOADER_PREFIX}{first.pid}-*")
    kept = partial.stat().st_size
    assert hold_at <= kept < size
    assert (
        not (models / "tiny--big" / MANIFEST_NAME).exists()
        or find_model(ModelDirs.from_options(models, [other]), repo) is None
    )

    hub_server.release()
    hub_server.reset_counters()
    second = cluster.start_downloader("downloader-2", config, **env)  # resumes from State: no new request
    done = await cluster.wait_download(node, repo)
    assert not key_left.exists()  # the killed one's key, removed by the next start
    assert [path.name.startswith(f"{DOWNLOADER_PREFIX}{second.pid}-") for path in scratch.iterdir()] == [True]
    assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
    assert done.progress.directory == str(models / "tiny--big")
    assert hub_server.bytes_served[(repo, held)] == size - kept  # only the remainder
    assert model_files(models / "tiny--big") == model_files(source)
    for name in model_files(source):
        assert sha256(models / "tiny--big" / name) == sha256(source / name), name
    assert not (models / "tiny--big" / PARTIAL_DIR).exists()
    assert not other.exists() or not any(other.iterdir())
    assert sum(isinstance(e, DownloadCompleted) for e in cluster.events) == 1


async def test_two_nodes_fetch_complementary_shards_once(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=4, num_files=4)
    (source / "pytorch_model.bin").write_bytes(b"x" * 1000)  # another format: never fetched
    repo = "tiny/sharded"
    hub_server.add_repo(repo, source)
    await cluster.add_card(repo, 4)
    nodes = []
    for name in ("a", "b"):
        config = tmp_path / f"node-{name}"
        nodes.append(await cluster.join(config))
        cluster.start_downloader(
            f"downloader-{name}", config, JETSHARD_DEFAULT_MODELS_DIR=str(tmp_path / f"models-{name}")
        )
    # A downloader that starts following after the placement picks it up from State (`resume`): no wait.
    hub_server.reset_counters()
    events = await cluster.submit(
        PlaceInstance(instance_id=new_instance_id(), model_id=ModelId(repo), node_ids=tuple(nodes), min_nodes=2)
    )
    assert not any(isinstance(e, CommandRejected) for e in events), events
    ranges = {}
    for node in nodes:
        done = await cluster.wait_download(node, repo)
        assert done.progress.status is DownloadStatus.COMPLETED, done.progress.reason
        ranges[node] = (done.progress.start_layer, done.progress.end_layer)
    assert sorted(ranges.values()) == [(0, 2), (2, 4)]

    weights = sorted(p.name for p in source.glob("*.safetensors"))
    served = {name: hub_server.bytes_served[(repo, name)] for name in weights}
    assert served == {name: (source / name).stat().st_size for name in weights}  # each file exactly once
    assert hub_server.bytes_served[(repo, "pytorch_model.bin")] == 0
    on_a = {n for n in model_files(tmp_path / "models-a" / "tiny--sharded") if n.endswith(".safetensors")}
    on_b = {n for n in model_files(tmp_path / "models-b" / "tiny--sharded") if n.endswith(".safetensors")}
    assert on_a == set(weights[:2]) and on_b == set(weights[2:])


async def test_offline_makes_no_request_and_converts_the_packaged_demo(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    hub_server.add_repo("tiny/online", make_tiny_model(tmp_path / "src", num_layers=2, num_files=1))
    config = tmp_path / "node"
    node = await cluster.join(config)
    await cluster.add_card("tiny/online", 2)
    models = tmp_path / "models"
    cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    hub_server.reset_counters()

    started = time.monotonic()
    await cluster.submit(StartDownload(model_id=ModelId("tiny/online"), node_id=node))
    failed = await cluster.wait_download(node, "tiny/online")
    assert failed.progress.status is DownloadStatus.FAILED and "not available offline" in failed.progress.reason
    assert time.monotonic() - started < 10

    await cluster.submit(StartDownload(model_id=DEMO_MODEL_ID, node_id=node))
    demo = await cluster.wait_download(node, DEMO_MODEL_ID, timeout_s=90)
    assert demo.progress.status is DownloadStatus.COMPLETED, demo.progress.reason
    target = models / "jetshard--SmolLM2-135M-Instruct-Q4"
    assert demo.progress.directory == str(target) and not demo.progress.read_only
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {f["name"] for f in manifest["files"]}
    assert not [p for p in models.iterdir() if p.name.startswith(".")]  # no staging left
    assert any(isinstance(e, DownloadProgressed) for e in cluster.events)
    assert sum(hub_server.requests.values()) == 0, hub_server.requests
    assert not any(isinstance(e, DownloadFailed) and e.model_id == DEMO_MODEL_ID for e in cluster.events)


async def test_cancel_keeps_finished_files_and_delete_removes_them(
    cluster: Cluster,
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=2, hidden_size=256)
    repo = "tiny/cancel"
    held = "model-00002-of-00002.safetensors"  # fetched after config.json, generation_config.json, 00001
    hub_server.add_repo(repo, source)
    hub_server.hold_after(repo, held, 2**20)
    config = tmp_path / "node"
    models = tmp_path / "models"
    node = await cluster.join(config)
    await cluster.add_card(repo, 2, 256)
    api = cluster.start_api()
    cluster.start_downloader("downloader", config, JETSHARD_DEFAULT_MODELS_DIR=str(models))
    target = models / "tiny--cancel"
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        assert (await http.post("/downloads", json={"model_id": repo})).status_code == 202
        assert await asyncio.to_thread(hub_server.wait_held, repo, held, 30)
        cancelled = await http.post("/downloads/cancel", json={"model_id": repo, "node_id": node})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        hub_server.release()  # the next chunk reaches the downloader, which stops there and says so
        stopped = await cluster.wait(
            lambda s: (d := s.download(node, ModelId(repo))) is not None and d.progress.reason.startswith("stopped"),
            20,
            "the downloader to stop the cancelled download",
        )
        progress = stopped.download(node, ModelId(repo)).progress
        assert progress.status is DownloadStatus.CANCELLED and 0 < progress.bytes_done < progress.bytes_total
        manifest = json.loads((target / MANIFEST_NAME).read_text())
        assert "model-00001-of-00002.safetensors" in {f["name"] for f in manifest["files"]}
        assert not (target / held).exists() and not (target / "tokenizer.json").exists()
        assert (target / PARTIAL_DIR).is_dir()  # kept for the next attempt

        again = await http.post("/downloads/cancel", json={"model_id": repo, "node_id": node})
        assert again.status_code == 409  # not in progress any more
        deleted = await http.delete(f"/downloads/{node}/{repo}")
        assert deleted.status_code == 200, deleted.text
        assert not target.exists()
        await api_until(http, lambda listed: listed == [])
        missing = await http.delete(f"/downloads/{node}/{repo}")
        assert missing.status_code == 404
