"""Model cards end to end: the /models routes, custom cards synced to every node, and `jetshard models`.

One cluster per module, all real processes: a nats-server, a sequencer, three APIs (one pointed at the local
fake Hub, one offline, one whose Hub is a closed port) and two workers with their own config directories, so
they are two nodes. Each test uses model ids of its own, so the tests share the cluster without depending on
each other's order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from helpers.cards import TINY_SHAPE, tiny_card
from helpers.harness import InferenceCluster, free_port, hub_cluster, wait_for
from helpers.tiny_models import make_tiny_model
from jetshard_bus.node import node_id_for
from jetshard_bus.scratch import WORKER_PREFIX
from jetshard_schema.cards import GenerationDefaults, Quantization
from jetshard_schema.events import CustomModelCardAdded, CustomModelCardDeleted, Event
from jetshard_schema.ids import MODEL_ID_MAX_LENGTH, ModelId, NodeId
from jetshard_schema.state import Download
from jetshard_schema.types import DownloadProgress, DownloadStatus

ORG = "jetshard-test"
SPLIT = f"{ORG}/tiny-split"
SINGLE = f"{ORG}/tiny-single"
BUILTIN = "mlx-community/Qwen3-0.6B-4bit"
UNSET_GENERATION = dict.fromkeys(GenerationDefaults.__struct_fields__)
"""A card's `generation` table that sets nothing."""

pytestmark = pytest.mark.timeout(180)


@dataclass
class ModelsCluster(InferenceCluster):
    """The module's cluster: three APIs, nodes that are workers only, and the two tiny models' directories."""

    offline_api: str = field(init=False)
    unreachable_api: str = field(init=False)
    split_dir: Path = field(init=False)
    single_dir: Path = field(init=False)

    def card_dir(self, node: str) -> Path:
        return self.root / node / "config" / "cards"

    def card_file(self, node: str, model_id: str) -> Path:
        return self.card_dir(node) / (model_id.replace("/", "--") + ".json")

    def start_worker(self, node: str) -> None:
        """Start the node's worker and wait until it has reconciled its card directory with State: it does
        that before it joins, so until GET /nodes shows the node in a new session."""
        node_id = node_id_for(self.root / node / "config")
        before = self._session(node_id)
        self.workers[node] = self.processes.start(f"{node}-worker", "worker", env=self.node_env(node))
        joined = wait_for(lambda: self._session(node_id) not in (None, before), timeout=60)
        assert joined, self.processes.log(f"{node}-worker")

    def _session(self, node_id: str) -> str | None:
        return next((n["session_id"] for n in self.get("/nodes") if n["node_id"] == node_id), None)

    def serve(self, repo_id: str, path: Path, **kwargs: Any) -> None:
        self.hub.add_repo(repo_id, path, **kwargs)

    def hub_requests(self) -> int:
        return sum(self.hub.requests.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelsCluster]:
    root = tmp_path_factory.mktemp("models_api")
    split_dir = make_tiny_model(root / "repos" / "split", arch="llama", num_layers=4, num_files=2)
    single_dir = make_tiny_model(root / "repos" / "single", arch="qwen3", num_layers=2, num_files=1)
    config = json.loads((single_dir / "config.json").read_text())
    config["quantization"] = {"bits": 4, "group_size": 64}  # only the card reads it; the weights stay float
    (single_dir / "config.json").write_text(json.dumps(config))
    # Qwen3's own sampling defaults
    generation = json.loads((single_dir / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    (single_dir / "generation_config.json").write_text(json.dumps(generation))

    with hub_cluster(root) as started:
        cluster = ModelsCluster(**vars(started))
        cluster.split_dir, cluster.single_dir = split_dir, single_dir
        cluster.serve(SPLIT, split_dir)
        cluster.serve(SINGLE, single_dir)
        cluster.start_core()
        cluster.offline_api = cluster.start_api(name="api-offline", env={"JETSHARD_OFFLINE": "1"})
        unreachable_hub = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
        cluster.unreachable_api = cluster.start_api(name="api-unreachable", env=unreachable_hub)
        for node in ("node-a", "node-b"):
            cluster.start_worker(node)
        yield cluster


# ------------------------------------------------------------------------------------------------ helpers


def _card_events(cluster: ModelsCluster) -> list[Event]:
    return [e for _, e in cluster.events() if isinstance(e, (CustomModelCardAdded, CustomModelCardDeleted))]


def added_events(cluster: ModelsCluster, model_id: str) -> int:
    events = _card_events(cluster)
    return sum(1 for e in events if isinstance(e, CustomModelCardAdded) and e.card.model_id == model_id)


def deleted_events(cluster: ModelsCluster, model_id: str) -> int:
    events = _card_events(cluster)
    return sum(1 for e in events if isinstance(e, CustomModelCardDeleted) and e.model_id == model_id)


def post(base: str, model_id: Any, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/models", json={"model_id": model_id}, timeout=timeout)


def error_message(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    return str(body["error"]["message"])


def _files_under(root: Path) -> set[Path]:
    """Every file under `root` except nats-server's store and the service logs, which change on their own."""
    return {
        p
        for p in root.rglob("*")
        if not ({"logs", "jetstream"} & set(p.relative_to(root).parts)) and not p.name.endswith(".ports")
    }


# ------------------------------------------------------------------------------------------------ routes


def test_add_split_model_from_the_hub(cluster: ModelsCluster) -> None:
    response = post(cluster.api, SPLIT)
    assert response.status_code == 201, response.text
    card = response.json()
    config = json.loads((cluster.split_dir / "config.json").read_text())
    index = json.loads((cluster.split_dir / "model.safetensors.index.json").read_text())
    assert card["model_id"] == SPLIT
    assert card["is_custom"] is True
    assert card["architecture"] == "llama"
    assert card["num_layers"] == config["num_hidden_layers"] == 4
    assert card["hidden_size"] == config["hidden_size"]
    assert card["num_attention_heads"] == config["num_attention_heads"]
    assert card["num_key_value_heads"] == config["num_key_value_heads"]
    assert card["vocab_size"] == config["vocab_size"]
    assert card["context_length"] == config["max_position_embeddings"]
    assert card["storage_size_bytes"] == index["metadata"]["total_size"]
    assert card["storage_size_estimated"] is False
    assert card["quantization"] is None
    # its generation_config.json says `do_sample: false`
    assert card["generation"] == UNSET_GENERATION | {"temperature": 0.0}

    again = post(cluster.api, SPLIT)
    assert again.status_code == 200, again.text
    assert again.json()["model_id"] == SPLIT
    assert added_events(cluster, SPLIT) == 1


def test_add_single_file_model_sizes_from_the_file(cluster: ModelsCluster) -> None:
    response = post(cluster.api, SINGLE)
    assert response.status_code == 201, response.text
    card = response.json()
    assert not (cluster.single_dir / "model.safetensors.index.json").exists()
    assert card["storage_size_bytes"] == (cluster.single_dir / "model.safetensors").stat().st_size
    assert card["architecture"] == "qwen3"
    assert card["num_layers"] == 2
    assert card["quantization"] == {"bits": 4, "group_size": 64}
    assert card["generation"] == UNSET_GENERATION | {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert added_events(cluster, SINGLE) == 1
    listed = {m["id"]: m for m in httpx.get(f"{cluster.api}/v1/models", timeout=30).json()["data"]}
    assert listed[SINGLE]["generation_defaults"] == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 512,
    }


def test_a_broken_generation_config_only_loses_the_sampling_defaults(cluster: ModelsCluster) -> None:
    model_id = f"{ORG}/tiny-broken-generation"
    repo = cluster.root / "repos" / "broken-generation"
    shutil.copytree(cluster.split_dir, repo)
    (repo / "generation_config.json").write_text("{not json")
    cluster.serve(model_id, repo)
    response = post(cluster.api, model_id)
    assert response.status_code == 201, response.text
    assert response.json()["generation"] == UNSET_GENERATION


def test_list_show_and_delete(cluster: ModelsCluster) -> None:
    model_id = f"{ORG}/tiny-listed"
    cluster.serve(model_id, cluster.split_dir)
    assert post(cluster.api, model_id).status_code == 201

    listed = httpx.get(f"{cluster.api}/models", timeout=10).json()
    by_id = {card["model_id"]: card for card in listed}
    assert by_id[model_id]["is_custom"] is True
    assert by_id[BUILTIN]["is_custom"] is False
    assert sum(1 for card in listed if not card["is_custom"]) >= 10  # the built-in catalogue
    assert all("downloads" in card for card in listed)

    shown = httpx.get(f"{cluster.api}/models/{model_id}", timeout=10)
    assert shown.status_code == 200
    assert shown.json()["model_id"] == model_id and shown.json()["num_layers"] == 4
    builtin = httpx.get(f"{cluster.api}/models/{BUILTIN}", timeout=10)
    assert builtin.status_code == 200 and builtin.json()["is_custom"] is False

    deleted = httpx.delete(f"{cluster.api}/models/{model_id}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"deleted": model_id}
    assert httpx.get(f"{cluster.api}/models/{model_id}", timeout=10).status_code == 404
    listed_after = httpx.get(f"{cluster.api}/models", timeout=10).json()
    assert model_id not in {card["model_id"] for card in listed_after}
    assert deleted_events(cluster, model_id) == 1

    refused = httpx.delete(f"{cluster.api}/models/{BUILTIN}", timeout=10)
    assert refused.status_code == 409
    assert "built-in" in error_message(refused)
    assert httpx.get(f"{cluster.api}/models/{BUILTIN}", timeout=10).status_code == 200

    unknown = httpx.delete(f"{cluster.api}/models/{ORG}/never-added", timeout=10)
    assert unknown.status_code == 404
    assert error_message(unknown)
    assert httpx.get(f"{cluster.api}/models/{ORG}/never-added", timeout=10).status_code == 404


def _assert_not_added(cluster: ModelsCluster, model_id: str) -> None:
    assert httpx.get(f"{cluster.api}/models/{model_id}", timeout=10).status_code == 404
    assert added_events(cluster, model_id) == 0


IMPORTED = f"{ORG}/tiny-imported"
IMPORTED_CARD = {**TINY_SHAPE, "model_id": IMPORTED, "source": "local-gguf", "source_ref": "/models/tiny.gguf"}
"""A card as `jetshard models import-gguf` sends it, built from a converted GGUF."""
CARD_LIES: list[tuple[dict[str, Any], str]] = [
    ({"quantization": {"bits": 4, "group_size": 0}}, "quantization.group_size"),
    ({"quantization": {"bits": 0, "group_size": 64}}, "quantization.bits"),
    ({"num_layers": 10**9}, "num_layers"),
    ({"num_layers": 2**64}, "num_layers"),
    ({"context_length": -5}, "context_length"),
    ({"architecture": "../../../../etc/passwd"}, "architecture"),
    ({"display_name": "x" * (4 * 2**20)}, "display_name"),
    ({"capabilities": ["completion", "vision"]}, "capabilities"),  # a llama: no vision tower
]


def test_a_card_that_lies_is_refused_naming_the_field(cluster: ModelsCluster) -> None:
    """A card supplied in the body: each lie would have broken placement or every listing while the card stayed."""

    def add(body: dict[str, Any]) -> dict[str, object]:
        response = httpx.post(f"{cluster.api}/models", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error: dict[str, object] = response.json()["error"]
        assert len(response.content) < 2000, "the refusal does not echo the body back"
        return error

    # The body is decoded strictly, as every request body is: unknown fields and wrong types are named.
    error = add({"model_id": IMPORTED, "card": IMPORTED_CARD, "cards": [IMPORTED_CARD]})
    assert error["message"] == "Object contains unknown field `cards`", error
    error = add({"model_id": IMPORTED, "card": {**IMPORTED_CARD, "num_layers": "30"}})
    assert (error["param"], error["code"]) == ("card", "invalid_type"), error
    assert "$.card.num_layers" in str(error["message"]), error
    for lies, named in CARD_LIES:
        error = add({"model_id": IMPORTED, "card": {**IMPORTED_CARD, **lies}})
        assert error["param"] == "card" and named in str(error["message"]), (named, error)
    _assert_not_added(cluster, IMPORTED)
    for path in ("/models", "/api/tags", f"/instances/preview?model_id={BUILTIN}"):
        assert httpx.get(f"{cluster.api}{path}", timeout=30).status_code != 500, path

    # A Hub repo whose config.json lies is refused too, naming the config.
    deep = f"{ORG}/tiny-deep"
    repo = cluster.root / "repos" / "deep"
    shutil.copytree(cluster.split_dir, repo)
    config = json.loads((repo / "config.json").read_text())
    (repo / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 10**9}))
    cluster.serve(deep, repo)
    response = post(cluster.api, deep)
    assert response.status_code == 400, response.text
    assert "config.json describes no servable model: num_layers must be between 1 and 4096" in error_message(response)
    _assert_not_added(cluster, deep)

    # The honest card adds.
    added = httpx.post(f"{cluster.api}/models", json={"model_id": IMPORTED, "card": IMPORTED_CARD}, timeout=30)
    assert added.status_code == 201, added.text
    assert httpx.delete(f"{cluster.api}/models/{IMPORTED}", timeout=30).status_code == 200


def test_hub_errors_add_nothing(cluster: ModelsCluster) -> None:
    root = cluster.root / "repos"
    gated = f"{ORG}/tiny-gated"
    cluster.serve(gated, cluster.split_dir, gated=True)

    no_config = root / "no-config"
    no_config.mkdir()
    shutil.copy(cluster.single_dir / "model.safetensors", no_config / "model.safetensors")
    (no_config / "README.md").write_text("weights without a config\n")
    cluster.serve(f"{ORG}/tiny-no-config", no_config)

    unsupported = root / "unsupported"
    shutil.copytree(cluster.single_dir, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    config["model_type"] = "mamba"
    (unsupported / "config.json").write_text(json.dumps(config))
    cluster.serve(f"{ORG}/tiny-mamba", unsupported)

    cases = [
        (f"{ORG}/does-not-exist", 404, "not found"),
        (gated, 403, "gated"),
        (f"{ORG}/tiny-no-config", 400, "config.json"),
        (f"{ORG}/tiny-mamba", 400, "mamba"),
    ]
    for model_id, status, words in cases:
        response = post(cluster.api, model_id)
        assert response.status_code == status, (model_id, response.text)
        assert words in error_message(response), response.text
        _assert_not_added(cluster, model_id)

    unreachable = post(cluster.unreachable_api, SPLIT.replace("split", "elsewhere"))
    assert unreachable.status_code == 502, unreachable.text
    assert "unreachable" in error_message(unreachable)
    _assert_not_added(cluster, SPLIT.replace("split", "elsewhere"))

    offline_id = f"{ORG}/tiny-offline"
    cluster.serve(offline_id, cluster.split_dir)
    cluster.hub.reset_counters()
    offline = post(cluster.offline_api, offline_id)
    assert offline.status_code == 503, offline.text
    assert "offline" in error_message(offline)
    assert cluster.hub_requests() == 0
    _assert_not_added(cluster, offline_id)
    # Known cards are still listed and shown offline: only adding needs the Hub.
    assert httpx.get(f"{cluster.offline_api}/models/{BUILTIN}", timeout=10).status_code == 200


UNTRUSTED_IDS = [
    "../x",
    "/etc/passwd",
    "../../etc/passwd",
    "a/b/c",
    "a\\b",
    "a\\..\\..\\b",
    "",
    "/",
    "org/",
    "/name",
    "org//name",
    "..",
    "./x",
    "org/..",
    "org/.",
    "org%2Fname",
    "%2E%2E/x",
    "org/%2E%2E%2F%2E%2E%2Fetc",
    "org/name\x00.json",
    "org/name\n",
    "org /name",
    "org/" + "n" * MODEL_ID_MAX_LENGTH,
    "o" * 5000 + "/x",
]


def test_untrusted_ids_are_refused_before_any_network_call(cluster: ModelsCluster) -> None:
    card_dirs = {node: sorted(cluster.card_dir(node).iterdir()) for node in ("node-a", "node-b")}
    before = _files_under(cluster.root.parent)
    cluster.hub.reset_counters()

    for model_id in UNTRUSTED_IDS:
        response = post(cluster.api, model_id)
        assert response.status_code == 400, (model_id, response.text)
        assert error_message(response)
    for bad in (None, 42, ["org/name"], {"org": "name"}):
        assert post(cluster.api, bad).status_code == 400
    json_type = {"content-type": "application/json"}
    assert httpx.post(f"{cluster.api}/models", content=b"not json", headers=json_type, timeout=10).status_code == 400
    assert httpx.post(f"{cluster.api}/models", content=b"not json", timeout=10).status_code == 415

    # Ids in paths: percent-encoded separators and dots reach the route as one segment or do not match it.
    raw_paths = [
        "..%2F..%2Fetc/passwd",
        "%2E%2E/%2E%2E",
        "org/%2E%2E",
        "org%2Fname/x",
        "a%5Cb/c",
        "org/name%00",
        "org/" + "n" * MODEL_ID_MAX_LENGTH,
    ]
    with httpx.Client(base_url=cluster.api, timeout=10) as client:
        for path in raw_paths:
            for method in ("GET", "DELETE"):
                response = client.request(method, f"/models/{path}")
                assert response.status_code in (400, 404), (method, path, response.text)
                assert error_message(response)
        for model_id in ("org/.x", "-org/name", "org/name-", "org/a..b"):
            response = client.get(f"/models/{model_id}")
            assert response.status_code in (400, 404), (model_id, response.text)

    assert cluster.hub_requests() == 0
    assert _files_under(cluster.root.parent) == before
    for node, files in card_dirs.items():
        assert sorted(cluster.card_dir(node).iterdir()) == files
    for name in ("x", "passwd", "etc", "b", "name", "x.json"):
        assert not (cluster.root.parent / name).exists()
        assert not (cluster.root / name).exists()


# ------------------------------------------------------------------------------------------------ nodes


def test_cards_sync_to_every_node(cluster: ModelsCluster) -> None:
    model_id = f"{ORG}/tiny-synced"
    cluster.serve(model_id, cluster.split_dir)
    nodes = ("node-a", "node-b")
    assert post(cluster.api, model_id).status_code == 201
    for node in nodes:
        path = cluster.card_file(node, model_id)
        assert wait_for(path.exists, timeout=15), (node, sorted(cluster.card_dir(node).iterdir()))
        stored = json.loads(path.read_text())
        assert stored["model_id"] == model_id and stored["is_custom"] is True and stored["num_layers"] == 4
    # Only card files land in the card directories (no temporary files left behind).
    for node in nodes:
        names = [p.name for p in cluster.card_dir(node).iterdir()]
        assert all(name.endswith(".json") and not name.startswith(".") for name in names), names

    assert httpx.delete(f"{cluster.api}/models/{model_id}", timeout=30).status_code == 200
    for node in nodes:
        assert wait_for(lambda node=node: not cluster.card_file(node, model_id).exists(), timeout=15), node


def test_a_node_that_was_down_catches_up(cluster: ModelsCluster) -> None:
    model_id = f"{ORG}/tiny-late"
    cluster.serve(model_id, cluster.split_dir)

    cluster.stop_worker("node-b")
    stale = cluster.card_dir("node-b") / ".card-crashed.tmp"  # as left by a write the worker died in
    stale.write_bytes(b"{")
    assert post(cluster.api, model_id).status_code == 201
    assert wait_for(cluster.card_file("node-a", model_id).exists, timeout=15)
    assert not cluster.card_file("node-b", model_id).exists()
    cluster.start_worker("node-b")
    assert cluster.card_file("node-b", model_id).exists()
    assert json.loads(cluster.card_file("node-b", model_id).read_text())["model_id"] == model_id
    assert not stale.exists()

    cluster.stop_worker("node-b")
    assert httpx.delete(f"{cluster.api}/models/{model_id}", timeout=30).status_code == 200
    assert wait_for(lambda: not cluster.card_file("node-a", model_id).exists(), timeout=15)
    assert cluster.card_file("node-b", model_id).exists()  # down: it has not heard yet
    cluster.start_worker("node-b")
    assert not cluster.card_file("node-b", model_id).exists()
    # Reconciling removed only the deleted card: both nodes hold the same cards (those other tests added).
    names = {node: sorted(p.name for p in cluster.card_dir(node).iterdir()) for node in ("node-a", "node-b")}
    assert names["node-a"] == names["node-b"], names


def test_a_killed_workers_scratch_directory_is_removed_when_it_next_starts(cluster: ModelsCluster) -> None:
    tmp = cluster.root / "node-b" / "tmp"
    killed = cluster.workers["node-b"].pid
    assert wait_for(lambda: any(tmp.glob(f"{WORKER_PREFIX}{killed}-*")), timeout=15), sorted(tmp.iterdir())
    (left,) = tmp.glob(f"{WORKER_PREFIX}{killed}-*")
    (left / "model-0-rank0.log").write_text("a runner's log")
    another = tmp / f"{WORKER_PREFIX}{os.getpid()}-live"  # named after a process that runs: not stale
    another.mkdir()
    cluster.stop_worker("node-b", signal.SIGKILL)
    assert left.exists()  # nothing removed it: its worker had no chance to
    cluster.start_worker("node-b")
    restarted = cluster.workers["node-b"].pid
    assert wait_for(lambda: not left.exists(), timeout=15), sorted(tmp.iterdir())
    assert len(list(tmp.glob(f"{WORKER_PREFIX}{restarted}-*"))) == 1
    assert another.exists()
    another.rmdir()


# ------------------------------------------------------------------------------------------------ CLI


def jetshard_models(cluster: ModelsCluster, *args: str, api: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JETSHARD_API": api or cluster.api, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "jetshard", "models", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli(cluster: ModelsCluster) -> None:
    model_id = f"{ORG}/tiny-cli"
    cluster.serve(model_id, cluster.single_dir)

    added = jetshard_models(cluster, "add", model_id)
    assert added.returncode == 0, added.stderr
    assert f"added {model_id}" in added.stdout
    assert "qwen3" in added.stdout

    again = jetshard_models(cluster, "add", model_id)
    assert again.returncode == 0, again.stderr
    assert "already known" in again.stdout

    listed = jetshard_models(cluster, "ls")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if model_id in line)
    assert "yes" in line and "4-bit" in line  # custom, quantized
    builtin_line = next(line for line in listed.stdout.splitlines() if BUILTIN in line)
    assert " no " in builtin_line
    for header in ("id", "layers", "size", "quantization", "custom", "downloads"):
        assert header in listed.stdout

    as_json = jetshard_models(cluster, "ls", "--json")
    assert as_json.returncode == 0
    assert model_id in {card["model_id"] for card in json.loads(as_json.stdout)}

    shown = jetshard_models(cluster, "show", model_id)
    assert shown.returncode == 0, shown.stderr
    assert "architecture" in shown.stdout and "qwen3" in shown.stdout
    assert "completion, tools, embedding" in shown.stdout  # its capabilities

    # Flags before the subcommand work too.
    command = [sys.executable, "-m", "jetshard", "models", "--api", cluster.api, "rm", model_id]
    removed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert removed.returncode == 0, removed.stderr
    assert f"deleted {model_id}" in removed.stdout

    missing = jetshard_models(cluster, "show", model_id)
    assert missing.returncode == 1
    assert "unknown model" in missing.stderr and "HTTP 404" in missing.stderr

    builtin = jetshard_models(cluster, "rm", BUILTIN)
    assert builtin.returncode == 1
    assert "built-in" in builtin.stderr and "HTTP 409" in builtin.stderr

    bad = jetshard_models(cluster, "add", "../x")
    assert bad.returncode == 1
    assert "HTTP 400" in bad.stderr

    not_on_hub = jetshard_models(cluster, "add", f"{ORG}/not-on-the-hub")
    assert not_on_hub.returncode == 1
    assert "not found" in not_on_hub.stderr and "HTTP 404" in not_on_hub.stderr

    # The id becomes the request's path: one that would name another route is refused before any request.
    for hostile in ("./.", "", "../view"):
        refused = jetshard_models(cluster, "show", hostile)
        assert refused.returncode == 2 and "model id" in refused.stderr, refused.stdout + refused.stderr

    down = jetshard_models(cluster, "ls", api=f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 3
    assert "cannot reach the jetshard API" in down.stderr
    assert "Traceback" not in down.stderr
    not_a_url = jetshard_models(cluster, "ls", api="http://[::1")
    assert not_a_url.returncode == 2 and "is not a URL" in not_a_url.stderr, not_a_url.stderr


def test_ls_table_shows_download_status_per_node() -> None:
    """The table `jetshard models ls` prints for downloads in several states (no cluster needed), from the API's
    own records as it encodes them."""
    from rich.console import Console

    from jetshard.commands.models import models_table

    mlx_4bit = Quantization(bits=4, group_size=32)

    def download(node: str, deleting: bool = False, **progress: Any) -> dict[str, Any]:
        record = Download(
            node_id=NodeId(node),
            model_id=ModelId(f"{ORG}/downloading"),
            progress=DownloadProgress(**progress),
            deleting=deleting,
        )
        return msgspec.to_builtins(record)  # type: ignore[no-any-return]

    cards = [
        {
            "model_id": f"{ORG}/downloading",
            "num_layers": 4,
            "storage_size_bytes": 2_500_000_000,
            "quantization": {"bits": 4, "group_size": 64},
            "is_custom": True,
            "downloads": {
                "node-a": download("node-a", status=DownloadStatus.ONGOING, bytes_done=25, bytes_total=100),
                "node-b": download("node-b", status=DownloadStatus.COMPLETED, bytes_done=100, bytes_total=100),
                "node-c": download("node-c", status=DownloadStatus.FAILED, reason="disk full"),
                "node-d": download("node-d", deleting=True, status=DownloadStatus.COMPLETED),
            },
        },
        {
            "model_id": BUILTIN,
            "num_layers": 28,
            "storage_size_bytes": 335_000_000,
            "storage_size_estimated": True,
            "quantization": None,
            "is_custom": False,
            "downloads": {},
        },
        # GGUF files: a K-quant only llama.cpp serves, and a Q4_1 that MLX also holds (as the demo is).
        msgspec.to_builtins(tiny_card(f"{ORG}/k-quant", file_type="Q4_K_M")) | {"downloads": {}},
        msgspec.to_builtins(tiny_card(f"{ORG}/q4-1", file_type="Q4_1", quantization=mlx_4bit)) | {"downloads": {}},
    ]
    console = Console(width=160, record=True)
    console.print(models_table(cards))
    text = console.export_text()
    assert re.search(rf"{ORG}/k-quant .* Q4_K_M ", text) and re.search(rf"{ORG}/q4-1 .* Q4_1 \(MLX 4-bit/g32\)", text)
    assert "node-a: ongoing 25%" in text
    assert "node-b: completed" in text
    assert "node-c: failed: disk full" in text
    assert "node-d: deleting" in text
    assert "2.5 GB" in text and "4-bit/g64" in text
    assert "~335.0 MB" in text  # an estimated size is marked
