"""A GGUF file of a Hugging Face Hub repo becomes a card (`POST /models` with `gguf_file`): read from the file's header
with Range requests, sized by the repo's listing, refused with the problem named; and a node's downloader fetches that
file alone as llama.cpp's `model.gguf`.

Real parts: the local Hub server (Range and HEAD as huggingface_hub uses them), a nats-server, the sequencer, the API
and the downloader as processes; the files are written with llama.cpp's gguf-py (`write_gguf`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import httpx
import ollama
from helpers.harness import Cluster
from helpers.hub_server import HubServer
from jetshard_downloader.gguf import packaged_demo_gguf
from jetshard_downloader.hub_gguf import DOWNLOAD_DIR
from jetshard_schema.cards import ModelFormat
from jetshard_schema.commands import PlaceInstance, StartDownload
from jetshard_schema.events import CommandRejected
from jetshard_schema.ids import ModelId, model_dir_name, new_instance_id
from jetshard_schema.types import Engine, ServingSettings
from test_gguf_cards import QWEN3_TEMPLATE, write_gguf

REPO = "jetshard-test/Qwen3-Tiny-GGUF"
Q4 = "Qwen3-Tiny-Q4_K_M.gguf"
BIG_HEADER = "Qwen3-Tiny-BigVocab-Q8_0.gguf"
SPLIT_FIRST = "split/Qwen3-Tiny-Q4_K_M-00001-of-00002.gguf"
SPLIT_SECOND = "split/Qwen3-Tiny-Q4_K_M-00002-of-00002.gguf"


def _hub_repo(hub_server: HubServer, root: Path) -> Path:
    """The repo's files, on the Hub as REPO: a qwen3 K-quant with 4 MiB of tensors behind its header, one whose
    header (a vocabulary of 200,000 tokens: 3 MiB) is longer than the first Range request, a split model, a projector,
    a file that is not GGUF and one of an architecture llama.cpp does not know."""
    root.mkdir(parents=True)
    write_gguf(root / Q4, "qwen3", context=40960, template=QWEN3_TEMPLATE, tokens=16384)
    write_gguf(
        root / BIG_HEADER,
        "qwen3",
        file_type=gguf.LlamaFileType.MOSTLY_Q8_0,
        tensor_type=gguf.GGMLQuantizationType.Q8_0,
        tokens=200_000,
        embedding_rows=16,
    )
    (root / "split").mkdir()
    for i, name in enumerate((SPLIT_FIRST, SPLIT_SECOND)):
        write_gguf(root / name, "qwen3", extra={"split.no": i, "split.count": 2})
    write_gguf(root / "mmproj-F16.gguf", "clip")
    (root / "not-a-model.gguf").write_bytes(os.urandom(4096))
    write_gguf(root / "odd.gguf", "transmogrifier")
    (root / "README.md").write_text("tiny GGUF files for jetshard's tests\n")
    hub_server.add_repo(REPO, root)
    return root


def _add(api: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{api}/models", json=body, timeout=60)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


async def test_a_hub_gguf_becomes_a_card_from_its_header_and_a_llama_cpp_placement_downloads_that_file_alone(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    files = _hub_repo(hub_server, tmp_path / "repo")
    api = cluster.start_api()

    added = _add(api, model_id=REPO, gguf_file=Q4)
    assert added.status_code == 201, added.text
    card = added.json()
    assert card["model_id"] == REPO and card["formats"] == ["gguf"] and card["file_type"] == "Q4_K_M"
    assert card["source"] == "hub-gguf" and card["source_ref"] == f"{REPO}:{Q4}"
    assert card["architecture"] == "qwen3" and card["context_length"] == 40960 and card["num_layers"] == 2
    assert card["capabilities"] == ["completion", "tools", "thinking", "embedding"]
    size = (files / Q4).stat().st_size
    assert card["storage_size_bytes"] == size and not card["storage_size_estimated"]
    # Only the header was read, not the 4 MiB of tensors behind it.
    assert 0 < hub_server.bytes_served[(REPO, Q4)] < size // 2
    assert _add(api, model_id=REPO, gguf_file=Q4).status_code == 200  # known already
    other = _error(_add(api, model_id=REPO, gguf_file=BIG_HEADER), 409)  # another file is not that card
    assert other["param"] == "model_id" and f"{REPO} is a card already, of {REPO}:{Q4}" in other["message"]
    # Ollama's model list digests the model as the file's real sha256 (the Hub's LFS record).
    listed = {m.model: m for m in ollama.Client(host=api).list().models}
    assert listed[f"{REPO}:latest"].digest == hashlib.sha256((files / Q4).read_bytes()).hexdigest()
    # Its size in parameters counted from the tensors' shapes (gguf-py's reader counts them here), and its type by
    # the name llama.cpp gives it, as Ollama lists a GGUF's.
    parameters = sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(files / Q4).tensors)
    assert card["parameter_count"] == parameters
    details = listed[f"{REPO}:latest"].details
    assert details is not None and details.quantization_level == "Q4_K_M"
    assert 10**6 < parameters < 10**9 and details.parameter_size == f"{parameters / 10**6:.2f}M"

    # A second quantization of the same repo takes an id of its own; its header is longer than the first read.
    big = _add(api, model_id="jetshard-test/qwen3-big-vocab", repo=REPO, gguf_file=BIG_HEADER)
    assert big.status_code == 201, big.text
    assert big.json()["vocab_size"] == 200_000 and big.json()["file_type"] == "Q8_0"
    assert big.json()["source_ref"] == f"{REPO}:{BIG_HEADER}"

    # The same through the CLI.
    command = [sys.executable, "-m", "jetshard", "models", "--api", api, "add", "jetshard-test/qwen3-q4-cli"]
    command += ["--repo", REPO, "--gguf", Q4]
    result = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, env=cluster.env, timeout=60
    )
    assert result.returncode == 0 and "added jetshard-test/qwen3-q4-cli" in result.stdout, result.stderr

    split = _add(api, model_id="jetshard-test/qwen3-split", repo=REPO, gguf_file=SPLIT_FIRST)
    assert split.status_code == 201, split.text
    assert split.json()["storage_size_bytes"] == sum((files / n).stat().st_size for n in (SPLIT_FIRST, SPLIT_SECOND))
    # Only its first part's header is read, which lists that part's tensors: their parameters per byte, over both
    # parts' bytes.
    whole = sum(int(t.n_elements) for n in (SPLIT_FIRST, SPLIT_SECOND) for t in gguf.GGUFReader(files / n).tensors)
    assert 0.8 * whole < split.json()["parameter_count"] < 1.25 * whole
    seeing = _add(api, model_id="jetshard-test/qwen3-sees", repo=REPO, gguf_file=Q4, mmproj_file="mmproj-F16.gguf")
    assert seeing.status_code == 201, seeing.text
    assert "vision" in seeing.json()["capabilities"]
    assert seeing.json()["storage_size_bytes"] == size + (files / "mmproj-F16.gguf").stat().st_size

    # Bad repos and files: the problem named, no card.
    def refused(status: int, **body: Any) -> str:
        response = _add(api, **{"model_id": "jetshard-test/refused", **body})
        message: str = _error(response, status)["message"]
        return message

    assert "jetshard-test/no-such-repo was not found on the Hub" in refused(
        404, repo="jetshard-test/no-such-repo", gguf_file=Q4
    )
    missing = refused(404, repo=REPO, gguf_file="Qwen3-Tiny-Q2_K.gguf")
    assert "has no file 'Qwen3-Tiny-Q2_K.gguf'" in missing and Q4 in missing
    assert "does not start with the GGUF magic bytes" in refused(400, repo=REPO, gguf_file="not-a-model.gguf")
    assert "architecture 'transmogrifier' is not one llama.cpp knows" in refused(400, repo=REPO, gguf_file="odd.gguf")
    assert "is not a projector" in refused(400, repo=REPO, gguf_file=Q4, mmproj_file="odd.gguf")
    assert "without ':'" in refused(400, repo=REPO, gguf_file="a:b.gguf")
    for outside in ("../../etc/passwd.gguf", "/abs.gguf", "split//a.gguf", "a\x00.gguf"):
        assert "is not a file's path in a repo" in refused(400, repo=REPO, gguf_file=outside), outside
    assert "is not a file's path in a repo" in refused(400, repo=REPO, gguf_file=Q4, mmproj_file="../mmproj.gguf")
    assert "goes with gguf_file" in refused(400, repo=REPO)
    hub_server.add_repo("jetshard-test/gated-gguf", files, gated=True)
    assert "is gated" in refused(403, repo="jetshard-test/gated-gguf", gguf_file=Q4)
    (files / SPLIT_SECOND).unlink()
    hub_server.add_repo("jetshard-test/half-split", files)
    assert "the repo lacks split/Qwen3-Tiny-Q4_K_M-00002-of-00002.gguf" in refused(
        400, repo="jetshard-test/half-split", gguf_file=SPLIT_FIRST
    )
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{api}/models/jetshard-test/refused")).status_code == 404

    # A llama.cpp instance: its node's downloader fetches that one file as model.gguf, nothing else of the repo.
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config, engines=(Engine.LLAMA_CPP,))
    cluster.start_downloader("downloader", config, "--default-models-dir", str(models))
    hub_server.reset_counters()
    serving = ServingSettings(engine=Engine.LLAMA_CPP)
    placed = await cluster.submit(
        PlaceInstance(instance_id=new_instance_id(), model_id=ModelId(REPO), node_ids=(node,), serving=serving)
    )
    assert not any(isinstance(e, CommandRejected) for e in placed), placed
    done = await cluster.wait_download_of(node, REPO, ModelFormat.GGUF, 60)
    directory = models / model_dir_name(ModelId(REPO))
    assert done.progress.directory == str(directory) and done.progress.bytes_done == size
    assert sorted(p.name for p in directory.iterdir()) == [".jetshard-manifest.json", "model.gguf"]
    assert (directory / "model.gguf").read_bytes() == (files / Q4).read_bytes()
    assert {name for repo, name in hub_server.bytes_served if repo == REPO} == {Q4}
    assert sorted(p.name for p in models.iterdir()) == [directory.name]  # no staging or download folder left

    # The model that sees, downloaded on its own: the GGUF and its projector, as llama.cpp's files.
    await cluster.submit(StartDownload(model_id=ModelId("jetshard-test/qwen3-sees"), node_id=node))
    seen = await cluster.wait_download_of(node, "jetshard-test/qwen3-sees", ModelFormat.GGUF, 60)
    assert seen.progress.directory == str(models / "jetshard-test--qwen3-sees")
    assert sorted(p.name for p in (models / "jetshard-test--qwen3-sees").iterdir()) == [
        ".jetshard-manifest.json",
        "mmproj.gguf",
        "model.gguf",
    ]


async def test_an_mlx_download_of_a_hub_gguf_mlx_can_hold_converts_it_beside_the_gguf(
    cluster: Cluster, hub_server: HubServer, tmp_path: Path
) -> None:
    demo = packaged_demo_gguf()
    repo = tmp_path / "demo-repo"
    repo.mkdir()
    shutil.copyfile(demo, repo / demo.name)
    hub_server.add_repo("jetshard-test/SmolLM2-GGUF", repo)
    api = cluster.start_api()
    added = _add(api, model_id="jetshard-test/SmolLM2-GGUF", gguf_file=demo.name)
    assert added.status_code == 201, added.text
    assert added.json()["formats"] == ["gguf", "mlx"]  # a llama GGUF today's converter converts

    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config)
    cluster.start_downloader("downloader", config, "--default-models-dir", str(models))
    await cluster.submit(StartDownload(model_id=ModelId("jetshard-test/SmolLM2-GGUF"), node_id=node))
    done = await cluster.wait_download_of(node, "jetshard-test/SmolLM2-GGUF", ModelFormat.MLX, 120)
    assert set(done.progress.formats) == {ModelFormat.GGUF, ModelFormat.MLX}
    directory = models / "jetshard-test--SmolLM2-GGUF"
    assert (directory / "model.gguf").read_bytes() == demo.read_bytes() and (directory / "config.json").is_file()
    assert not (directory / DOWNLOAD_DIR).exists()
    assert sorted(p.name for p in models.iterdir()) == [directory.name]
