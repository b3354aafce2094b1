"""In-process checks of the downloader's building blocks: resumable fetch, shard lookup, stale reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cards import tiny_card
from helpers.hub_server import HubServer
from helpers.tiny_models import make_tiny_model
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.fetch import fetch_bytes, fetch_files, list_remote_files
from jetshard_downloader.local import find_shard, required_local_files
from jetshard_downloader.manifest import read_manifest
from jetshard_downloader.resume import PARTIAL_DIR, partial_path
from jetshard_schema.commands import ReportDownloadProgress
from jetshard_schema.events import CustomModelCardAdded, DownloadCancelled, DownloadRequested
from jetshard_schema.ids import CommandId, ModelId, NodeId
from jetshard_schema.state import State, apply
from jetshard_schema.types import DownloadProgress, DownloadStatus
from jetshard_sequencer.handlers import Context, handle

REPO = "tiny/resume"


def test_a_partial_file_left_by_another_process_is_resumed_with_a_range_request(
    hub_server: HubServer,
    tmp_path: Path,
) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=2)
    hub_server.add_repo(REPO, source)
    listing = list_remote_files(REPO, endpoint=hub_server.url)
    name = "model-00001-of-00002.safetensors"
    remote = listing.select([name])
    target = tmp_path / "models" / "tiny--resume"
    # What a killed downloader leaves: the first bytes of the file, and what revision they belong to.
    partial = partial_path(target, name)
    partial.parent.mkdir(parents=True)
    data = (source / name).read_bytes()
    kept = len(data) // 3
    partial.write_bytes(data[:kept])
    partial.with_name(partial.name + ".json").write_text(
        json.dumps({"revision": listing.revision, "size": remote[0].size, "sha256": remote[0].sha256})
    )
    hub_server.reset_counters()

    progress: list[tuple[int, int]] = []
    manifest = fetch_files(
        REPO,
        listing.revision,
        target,
        remote,
        endpoint=hub_server.url,
        on_progress=lambda d, t: progress.append((d, t)),
    )
    assert hub_server.bytes_served[(REPO, name)] == len(data) - kept
    ranges = [r.headers.get("Range") for r in hub_server.request_log if r.path.endswith(name)]
    assert ranges == [f"bytes={kept}-"]
    assert (target / name).read_bytes() == data
    assert [f.name for f in manifest.files] == [name]
    assert not (target / PARTIAL_DIR).exists()
    assert progress[-1] == (len(data), len(data))


def test_a_partial_file_of_another_revision_is_discarded(hub_server: HubServer, tmp_path: Path) -> None:
    source = make_tiny_model(tmp_path / "src", num_layers=2, num_files=1)
    hub_server.add_repo(REPO, source)
    listing = list_remote_files(REPO, endpoint=hub_server.url)
    remote = listing.select(["model.safetensors"])
    target = tmp_path / "models" / "tiny--resume"
    partial = partial_path(target, "model.safetensors")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"garbage from an older commit")
    partial.with_name(partial.name + ".json").write_text(json.dumps({"revision": "0" * 40, "size": 1, "sha256": None}))
    fetch_files(REPO, listing.revision, target, remote, endpoint=hub_server.url)
    assert (target / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    config = fetch_bytes(REPO, listing.revision, "config.json", endpoint=hub_server.url)
    assert json.loads(config) == json.loads((source / "config.json").read_text())


def test_find_shard_uses_the_local_index(tmp_path: Path) -> None:
    source = make_tiny_model(tmp_path / "models" / "tiny--resume", num_layers=4, num_files=4)
    dirs = ModelDirs.from_options(tmp_path / "default", read_only_dirs=[tmp_path / "models"])
    card = tiny_card(REPO, num_layers=4)
    assert required_local_files(dirs, card, 0, 2) == {
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
    }
    (source / "model-00004-of-00004.safetensors").unlink()
    found = find_shard(dirs, card, 0, 2)
    assert found is not None and found[0].read_only and found[0].path == source
    assert found[1] == sum((source / n).stat().st_size for n in required_local_files(dirs, card, 0, 2))
    assert find_shard(dirs, card, 2, 4) is None
    assert find_shard(ModelDirs.from_options(tmp_path / "empty"), card, 0, 4) is None
    assert read_manifest(source) is None  # nothing was written to the read-only copy


@pytest.mark.parametrize("status", [DownloadStatus.ONGOING, DownloadStatus.PENDING])
def test_a_progress_report_sent_before_a_cancel_does_not_revive_the_download(status: DownloadStatus) -> None:
    node, model = NodeId("n1"), ModelId(REPO)
    state = apply(State(), CustomModelCardAdded(card=tiny_card(REPO, num_layers=2)), 1)
    state = apply(state, DownloadRequested(node_id=node, model_id=model, start_layer=0, end_layer=2), 2)
    state = apply(state, DownloadCancelled(node_id=node, model_id=model), 3)
    late = ReportDownloadProgress(
        node_id=node, model_id=model, progress=DownloadProgress(status=status, bytes_done=5, bytes_total=10)
    )
    assert handle(state, late, Context(command_id=CommandId("c"), now_ms=0)) == []
    # A new request resets the download; its reports count again.
    state = apply(state, DownloadRequested(node_id=node, model_id=model, start_layer=0, end_layer=2), 4)
    assert handle(state, late, Context(command_id=CommandId("d"), now_ms=0)) != []
