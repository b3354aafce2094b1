"""Shard-aware, resumable downloads through the real huggingface_hub client against the local fake Hub."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers.hub_server import DEFAULT_TOKEN, HubServer
from helpers.model_files import model_files
from helpers.tiny_models import make_tiny_model
from jetshard_downloader.choose import Choice, choose_directory
from jetshard_downloader.dirs import ModelDirs, room_bytes
from jetshard_downloader.fetch import (
    AuthRequired,
    Cancelled,
    NotFoundOnHub,
    RateLimited,
    fetch_files,
    list_remote_files,
    sha256_file,
)
from jetshard_downloader.locate import find_model, partial_bytes_for
from jetshard_downloader.manifest import read_manifest
from jetshard_downloader.paths import INDEX_NAME, MANIFEST_NAME
from jetshard_downloader.resume import partial_path
from jetshard_downloader.shard_files import required_files, support_files

pytestmark = pytest.mark.timeout(120)

REPO = "tiny/llama"
NUM_LAYERS = 4


@pytest.fixture
def repo(hub_server: HubServer, tmp_path: Path) -> Path:
    src = make_tiny_model(tmp_path / "src", arch="llama", num_layers=NUM_LAYERS, num_files=4)
    (src / "pytorch_model.bin").write_bytes(b"never fetched")
    hub_server.add_repo(REPO, src)
    return src


def test_layer_range_download_fetches_only_its_files(hub_server: HubServer, repo: Path, tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "models")
    listing = list_remote_files(REPO, endpoint=hub_server.url)
    assert listing.revision == hub_server.repo(REPO).sha
    names = [f.name for f in listing.files]

    # Support files first: the index says which weight files a layer range needs.
    support = listing.select(support_files(names))
    choice = choose_directory(dirs, REPO, sum(f.size or 0 for f in support), room_bytes, {}, partial_bytes_for(REPO))
    assert isinstance(choice, Choice) and not choice.resumes
    fetch_files(REPO, listing.revision, choice.model_dir, support, endpoint=hub_server.url)
    index = json.loads((choice.model_dir / INDEX_NAME).read_text())

    shard = required_files(names, index, NUM_LAYERS, 0, 2)
    weights = sorted(n for n in shard if n.endswith(".safetensors"))
    assert weights and len(weights) < len([n for n in names if n.endswith(".safetensors")])
    hub_server.reset_counters()
    progress: list[tuple[int, int]] = []
    manifest = fetch_files(
        REPO,
        listing.revision,
        choice.model_dir,
        listing.select(shard),
        endpoint=hub_server.url,
        on_progress=lambda done, total: progress.append((done, total)),
    )

    assert model_files(choice.model_dir) == shard
    served = {name for (_, name), n in hub_server.bytes_served.items() if n}
    assert served == set(weights)  # support files were skipped thanks to the manifest
    expected_total = sum(f.size or 0 for f in listing.select(shard))
    assert progress[-1] == (expected_total, expected_total)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)

    assert read_manifest(choice.model_dir) == manifest
    by_name = {f.name: f for f in manifest.files}
    assert set(by_name) == shard
    for name in shard:
        assert by_name[name].size == (repo / name).stat().st_size
        assert by_name[name].sha256 == sha256_file(repo / name)

    found = find_model(dirs, REPO, shard)
    assert found is not None and found.path == choice.model_dir and not found.read_only
    assert find_model(dirs, REPO) is None  # the other half of the layers is not there
    assert find_model(dirs, REPO, required_files(names, index, NUM_LAYERS, 2, 4)) is None

    # The second half goes to the same directory (it holds part of the model) and completes it.
    rest = required_files(names, index, NUM_LAYERS, 2, 4)
    again = choose_directory(dirs, REPO, 10, room_bytes, {}, partial_bytes_for(REPO))
    assert isinstance(again, Choice) and again.resumes and again.model_dir == choice.model_dir
    fetch_files(REPO, listing.revision, choice.model_dir, listing.select(rest), endpoint=hub_server.url)
    assert find_model(dirs, REPO) is not None
    assert "pytorch_model.bin" not in model_files(choice.model_dir)

    hub_server.reset_counters()
    fetch_files(REPO, listing.revision, choice.model_dir, listing.select(shard | rest), endpoint=hub_server.url)
    assert sum(hub_server.bytes_served.values()) == 0  # everything is vouched for by the manifest


def test_progress_within_a_file_and_cancel_keeps_finished_files(hub_server: HubServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    big = 12 * 1024 * 1024  # more than huggingface_hub's 10 MiB write chunk
    (src / "a.bin").write_bytes(b"a" * big)
    (src / "b.bin").write_bytes(b"b" * big)
    hub_server.add_repo("tiny/big", src)
    listing = list_remote_files("tiny/big", endpoint=hub_server.url)
    target = tmp_path / "m" / "tiny--big"
    files = listing.select(["a.bin", "b.bin", "config.json"])

    cancel = threading.Event()
    progress: list[int] = []

    def on_progress(done: int, total: int) -> None:
        progress.append(done)
        if done > big:  # a.bin is finished and b.bin's first chunk arrived: cancel within b
            cancel.set()

    with pytest.raises(Cancelled):
        fetch_files(
            "tiny/big",
            listing.revision,
            target,
            files,
            endpoint=hub_server.url,
            on_progress=on_progress,
            cancel=cancel,
        )
    assert any(0 < d < big for d in progress), "no progress reported within a file"
    manifest = read_manifest(target)
    assert manifest is not None and [f.name for f in manifest.files] == ["a.bin"]
    kept = partial_path(target, "b.bin").stat().st_size  # b.bin's bytes written before the cancel
    assert 0 < kept < big

    hub_server.reset_counters()
    fetch_files("tiny/big", listing.revision, target, files, endpoint=hub_server.url)
    assert hub_server.bytes_served[("tiny/big", "a.bin")] == 0
    assert hub_server.bytes_served[("tiny/big", "b.bin")] == big - kept  # resumed, not fetched again
    assert find_model(ModelDirs.from_options(tmp_path / "m"), "tiny/big", {"a.bin", "b.bin"})
    assert not (target / MANIFEST_NAME).with_suffix(".tmp").exists()


def test_dropped_connection_is_resumed_within_the_call(hub_server: HubServer, repo: Path, tmp_path: Path) -> None:
    listing = list_remote_files(REPO, endpoint=hub_server.url)
    weight = next(f for f in listing.files if f.name.endswith(".safetensors"))
    hub_server.drop_after(REPO, weight.name, (weight.size or 2) // 2)
    manifest = fetch_files(REPO, listing.revision, tmp_path / "m", [weight], endpoint=hub_server.url)
    assert manifest.files[0].sha256 == sha256_file(repo / weight.name)


def test_errors_in_words(hub_server: HubServer, repo: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFoundOnHub, match="not found on the Hub"):
        list_remote_files("tiny/missing", endpoint=hub_server.url)
    hub_server.add_repo("tiny/private", repo, private=True)
    with pytest.raises(NotFoundOnHub, match="HF_TOKEN"):
        list_remote_files("tiny/private", endpoint=hub_server.url)
    assert list_remote_files("tiny/private", endpoint=hub_server.url, token=DEFAULT_TOKEN).files

    hub_server.add_repo("tiny/gated", repo, gated=True)
    listing = list_remote_files("tiny/gated", endpoint=hub_server.url)
    config = listing.select(["config.json"])
    with pytest.raises(AuthRequired, match="HF_TOKEN"):
        fetch_files("tiny/gated", listing.revision, tmp_path / "g", config, endpoint=hub_server.url)
    fetch_files("tiny/gated", listing.revision, tmp_path / "g", config, endpoint=hub_server.url, token=DEFAULT_TOKEN)

    listing = list_remote_files(REPO, endpoint=hub_server.url)
    with pytest.raises(NotFoundOnHub, match="no revision"):
        list_remote_files(REPO, "v9", endpoint=hub_server.url)
    with pytest.raises(ValueError, match="no files"):
        listing.select(["nope.safetensors"])


def test_rate_limits_are_waited_out_within_a_bound(hub_server: HubServer, repo: Path) -> None:
    hub_server.rate_limit(1, retry_after=1, repo_id=REPO)
    start = time.monotonic()
    assert list_remote_files(REPO, endpoint=hub_server.url).files
    assert time.monotonic() - start >= 1

    hub_server.rate_limit(100, retry_after=3600, repo_id=REPO)
    start = time.monotonic()
    with pytest.raises(RateLimited, match="429"):
        list_remote_files(REPO, endpoint=hub_server.url, max_rate_limit_wait_s=5)
    assert time.monotonic() - start < 5


def test_two_shards_downloading_into_one_directory_at_once(hub_server: HubServer, repo: Path, tmp_path: Path) -> None:
    listing = list_remote_files(REPO, endpoint=hub_server.url)
    names = [f.name for f in listing.files]
    index = json.loads((repo / INDEX_NAME).read_text())
    halves = [required_files(names, index, NUM_LAYERS, 0, 2), required_files(names, index, NUM_LAYERS, 2, 4)]
    target = tmp_path / "models" / "tiny--llama"
    errors: list[BaseException] = []

    def run(files: set[str]) -> None:
        try:
            fetch_files(REPO, listing.revision, target, listing.select(files), endpoint=hub_server.url)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(half,)) for half in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    manifest = read_manifest(target)
    assert manifest is not None and {f.name for f in manifest.files} == halves[0] | halves[1]
    assert find_model(ModelDirs.from_options(tmp_path / "models"), REPO) is not None
