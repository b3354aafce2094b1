"""The test fixtures themselves: the fake Hub through the real huggingface_hub client, and tiny models."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import mlx_lm
import pytest
from helpers.harness import wait_for
from helpers.hub_server import DEFAULT_TOKEN, HubServer
from helpers.tiny_models import greedy_token_ids, layer_of, make_tiny_model
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

pytestmark = pytest.mark.timeout(120)

REPO = "tiny/llama"
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes downloads to disk in chunks of this size


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "tiny-llama", arch="llama", num_layers=4, num_files=3)


@pytest.fixture
def big_repo(hub_server: HubServer, tmp_path: Path) -> tuple[str, bytes]:
    """A repo with a file larger than one client write chunk, so a partial download reaches disk."""
    root = tmp_path / "big"
    root.mkdir()
    data = os.urandom(CHUNK + 2 * 1024 * 1024)
    (root / "blob.bin").write_bytes(data)
    (root / "config.json").write_text("{}")
    hub_server.add_repo("tiny/big", root)
    return "tiny/big", data


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_greedy_output_varies(tmp_path: Path, arch: str) -> None:
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    model, tokenizer = mlx_lm.load(str(model_dir))
    outputs = []
    for prompt in ["hello", "the quick brown fox", "what is two plus two"]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        tokens = greedy_token_ids(model, ids, max_tokens=30)
        assert len(tokens) == 30
        assert len(set(tokens)) >= 5, f"greedy output of {arch} is nearly constant: {tokens}"
        outputs.append(tokens)
    assert len({tuple(o) for o in outputs}) == len(outputs), "output does not depend on the prompt"


def test_tiny_model_is_deterministic_and_split_by_layer(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", num_layers=6, num_files=3, seed=7)
    b = make_tiny_model(tmp_path / "b", num_layers=6, num_files=3, seed=7)
    c = make_tiny_model(tmp_path / "c", num_layers=6, num_files=3, seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model-00002-of-00003.safetensors").read_bytes() != (
        c / "model-00002-of-00003.safetensors"
    ).read_bytes()

    index = json.loads((a / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    assert index["metadata"]["total_size"] == sum(_tensor_bytes(a / f, n) for n, f in weight_map.items())
    files_of_layer: dict[int, set[str]] = {}
    for name, file in weight_map.items():
        if (layer := layer_of(name)) is not None:
            files_of_layer.setdefault(layer, set()).add(file)
    assert all(len(files) == 1 for files in files_of_layer.values()), "a layer spans two files"
    file_order = [min(files_of_layer[layer]) for layer in range(6)]
    assert file_order == sorted(file_order), "layer ranges are not contiguous per file"
    assert len(set(file_order)) == 3
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00003.safetensors"
    assert weight_map["lm_head.weight"] == weight_map["model.norm.weight"] == "model-00003-of-00003.safetensors"

    single = make_tiny_model(tmp_path / "single", arch="qwen3", num_files=1)
    assert (single / "model.safetensors").is_file()
    assert not (single / "model.safetensors.index.json").exists()


def _tensor_bytes(path: Path, name: str) -> int:
    with path.open("rb") as src:
        header = json.loads(src.read(int.from_bytes(src.read(8), "little")))
    start, end = header[name]["data_offsets"]
    return end - start


# ---------------------------------------------------------------------- hub server


def test_model_info_lists_siblings_with_sizes(hub_server: HubServer, tiny_dir: Path) -> None:
    hub_server.add_repo(REPO, tiny_dir)
    info = HfApi().model_info(REPO, files_metadata=True)
    assert info.id == REPO
    assert info.sha == hub_server.repo(REPO).sha
    assert info.gated is False and info.private is False
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    assert sizes == {p.name: p.stat().st_size for p in tiny_dir.iterdir()}
    lfs = {s.rfilename: s.lfs for s in info.siblings or [] if s.lfs is not None}
    assert set(lfs) == {p.name for p in tiny_dir.glob("*.safetensors")}
    for name, blob in lfs.items():
        assert blob.sha256 == sha256((tiny_dir / name).read_bytes())
    assert info.safetensors is not None and info.safetensors.total > 0
    # The module-level function is bound to an HfApi created at import time: it must reach us too.
    from huggingface_hub import model_info

    assert model_info(REPO, revision="main").sha == info.sha


def test_list_repo_tree_and_paths_info(hub_server: HubServer, tiny_dir: Path) -> None:
    (tiny_dir / "sub").mkdir()
    (tiny_dir / "sub" / "extra.txt").write_text("x")
    hub_server.add_repo(REPO, tiny_dir)
    api = HfApi()
    top = {e.path for e in api.list_repo_tree(REPO)}
    assert "sub" in top and "sub/extra.txt" not in top
    deep = {e.path for e in api.list_repo_tree(REPO, recursive=True)}
    assert "sub/extra.txt" in deep
    infos = api.get_paths_info(REPO, ["config.json", "sub", "missing.txt"])
    assert [i.path for i in infos] == ["config.json", "sub"]
    assert api.file_exists(REPO, "config.json") and not api.file_exists(REPO, "nope.json")


def test_hf_hub_download_to_local_dir(hub_server: HubServer, tiny_dir: Path, tmp_path: Path) -> None:
    hub_server.add_repo(REPO, tiny_dir)
    path = hf_hub_download(REPO, "config.json", local_dir=tmp_path / "out")
    assert Path(path).read_bytes() == (tiny_dir / "config.json").read_bytes()
    weights = "model-00002-of-00003.safetensors"
    cached = hf_hub_download(REPO, weights)  # into the (temporary) HF cache
    assert Path(cached).read_bytes() == (tiny_dir / weights).read_bytes()
    assert hub_server.bytes_served[(REPO, weights)] == (tiny_dir / weights).stat().st_size
    assert hub_server.requests[f"/{REPO}/resolve/main/config.json"] >= 1


def test_dropped_connection_is_resumed_with_range(
    hub_server: HubServer,
    big_repo: tuple[str, bytes],
    tmp_path: Path,
) -> None:
    repo, data = big_repo
    # Drop after the client has written one chunk, so its retry asks for the rest only.
    hub_server.drop_after(repo, "blob.bin", CHUNK + 1024 * 1024)
    path = hf_hub_download(repo, "blob.bin", local_dir=tmp_path / "out")
    assert sha256(Path(path).read_bytes()) == sha256(data)
    gets = [r for r in hub_server.request_log if r.method == "GET" and r.path.endswith("/blob.bin")]
    assert len(gets) == 2
    assert gets[1].headers.get("Range") == f"bytes={CHUNK}-" and gets[1].status == 206


def test_server_answers_range_requests(hub_server: HubServer, big_repo: tuple[str, bytes]) -> None:
    repo, data = big_repo
    url = f"{hub_server.url}/{repo}/resolve/main/blob.bin"
    r = httpx.get(url, headers={"Range": "bytes=100-"})
    assert r.status_code == 206
    assert r.headers["Content-Range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    assert r.content == data[100:]
    r = httpx.get(url, headers={"Range": "bytes=5-9"})
    assert r.status_code == 206 and r.content == data[5:10]
    r = httpx.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416
    head = httpx.head(url)
    assert head.headers["X-Linked-Size"] == str(len(data))
    assert head.headers["X-Linked-Etag"] == f'"{sha256(data)}"'
    assert "X-Xet-Hash" not in head.headers


def test_killed_downloader_then_download_again(
    hub_server: HubServer,
    hf_env: dict[str, str],
    big_repo: tuple[str, bytes],
    tmp_path: Path,
) -> None:
    repo, data = big_repo
    out = tmp_path / "out"
    hub_server.hold_after(repo, "blob.bin", CHUNK + 1024 * 1024)
    script = textwrap.dedent(
        f"""
        from huggingface_hub import hf_hub_download
        hf_hub_download({repo!r}, "blob.bin", local_dir={str(out)!r})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=hf_env)
    try:
        assert hub_server.wait_held(repo, "blob.bin", timeout=60), "download never reached the hold point"
        # The first chunk is on disk in a partial file before we kill the downloader.
        assert wait_for(lambda: any(p.stat().st_size == CHUNK for p in out.rglob("*.incomplete")))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (out / "blob.bin").exists()
    hub_server.release()
    hub_server.reset_counters()

    # huggingface_hub >= 1.x downloads into a process-unique temporary file, so a new process starts
    # from zero: resuming across processes is up to the caller (see test_server_answers_range_requests).
    path = hf_hub_download(repo, "blob.bin", local_dir=out)
    assert sha256(Path(path).read_bytes()) == sha256(data)
    assert hub_server.bytes_served[(repo, "blob.bin")] == len(data)


def test_snapshot_download_with_allow_patterns(hub_server: HubServer, tiny_dir: Path, tmp_path: Path) -> None:
    hub_server.add_repo(REPO, tiny_dir)
    wanted = ["config.json", "model-00002-of-00003.safetensors"]
    folder = Path(snapshot_download(REPO, allow_patterns=wanted, local_dir=tmp_path / "snap"))
    got = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    got = [p for p in got if not p.startswith(".cache/")]
    assert got == sorted(wanted)
    served = {name for (_, name), n in hub_server.bytes_served.items() if n > 0}
    assert served == set(wanted)


def test_missing_repo_file_and_revision(hub_server: HubServer, tiny_dir: Path, tmp_path: Path) -> None:
    hub_server.add_repo(REPO, tiny_dir)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("nobody/nothing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("nobody/nothing", "config.json", local_dir=tmp_path / "a")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.json", local_dir=tmp_path / "b")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="v9", local_dir=tmp_path / "c")


def test_gated_and_private_repos(hub_server: HubServer, tiny_dir: Path, tmp_path: Path) -> None:
    hub_server.add_repo("tiny/gated", tiny_dir, gated=True)
    hub_server.add_repo("tiny/private", tiny_dir, private=True)
    # Gated repos are visible to anyone, their files are not.
    assert HfApi().model_info("tiny/gated").gated == "manual"
    with pytest.raises(GatedRepoError):
        hf_hub_download("tiny/gated", "config.json", local_dir=tmp_path / "a")
    with pytest.raises(GatedRepoError):
        hf_hub_download("tiny/gated", "config.json", local_dir=tmp_path / "a", token="hf_wrong")
    hf_hub_download("tiny/gated", "config.json", local_dir=tmp_path / "a", token=DEFAULT_TOKEN)
    # Private repos look missing without a valid token.
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("tiny/private")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("tiny/private", local_dir=tmp_path / "b")
    assert HfApi(token=DEFAULT_TOKEN).model_info("tiny/private").private is True


def test_rate_limit(hub_server: HubServer, tiny_dir: Path, tmp_path: Path) -> None:
    hub_server.add_repo(REPO, tiny_dir)
    hub_server.rate_limit(1, retry_after=0)
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi().model_info(REPO)
    assert caught.value.response.status_code == 429
    assert caught.value.response.headers["Retry-After"] == "0"
    assert HfApi().model_info(REPO).id == REPO  # the limit covered one request only


def test_mlx_lm_loads_downloaded_tiny_model(hub_server: HubServer, tmp_path: Path) -> None:
    source = make_tiny_model(tmp_path / "src", arch="qwen3", num_files=2)
    hub_server.add_repo("tiny/qwen3", source)
    folder = snapshot_download("tiny/qwen3", local_dir=tmp_path / "dl")
    model, tokenizer = mlx_lm.load(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8)
    assert isinstance(text, str) and text
