"""One small cluster for every dialect's tests (OpenAI's tools, structured output, logprobs, n, embeddings;
Ollama; Anthropic Messages; Responses), started once per session: a nats-server, a sequencer, an API and one
node serving a tiny llama model on one runner, added through the local Hub server like a user would. The node
also has a read-only model directory holding a second tiny model (on the Hub too), which nothing has asked for.

Registered as a pytest plugin by `conftest.py`, so its fixtures need no import.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from jetshard_schema.ids import ModelId, model_dir_name

from helpers.harness import InferenceCluster, hub_cluster
from helpers.tiny_models import make_tiny_model

if TYPE_CHECKING:
    import anthropic
    import ollama
    import openai

TINY_MODEL = "jetshard-test/tiny-dialects"
SHARED_MODEL = "jetshard-test/tiny-shared"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
"""A person's document, for structured output: bounded strings and numbers, and an enum."""
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
"""The weather tool's arguments, the same in the OpenAI, Anthropic and Responses tests, each sending them in its
dialect's own tool."""


@dataclass
class DialectCluster:
    cluster: InferenceCluster
    model: str
    model_dir: Path
    shared_dir: Path
    """node-a's read-only model directory, holding SHARED_MODEL."""

    @property
    def api(self) -> str:
        return self.cluster.api

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Whatever the block leaves placed or added, it removes at its end, even when it fails: the instances
        and custom cards that were not there before it. The next test finds the cluster as this one did."""
        before = self.cluster.get("/state")
        try:
            yield
        finally:
            after = self.cluster.get("/state")
            for instance_id in sorted(after["instances"].keys() - before["instances"].keys()):
                httpx.delete(f"{self.api}/instances/{instance_id}", timeout=30)
            for model_id in sorted(after["custom_cards"].keys() - before["custom_cards"].keys()):
                httpx.delete(f"{self.api}/models/{model_id}", timeout=30)

    @contextmanager
    def serving(self, model_id: str, model_dir: Path) -> Iterator[None]:
        """`model_dir` added through the local Hub server as a user would, and placed beside the cluster's own model
        on its node until the block ends (then its instance and card are removed)."""
        with self.restored():
            self.cluster.hub.add_repo(model_id, model_dir)
            self.cluster.add_model(model_id)
            self.cluster.wait_instance(self.cluster.place(model_id, min_nodes=1))
            yield


@pytest.fixture
def restores_the_dialect_cluster(dialect_cluster: DialectCluster) -> Iterator[None]:
    """For a test that places or adds on the shared cluster: what it leaves is removed, even when it fails."""
    with dialect_cluster.restored():
        yield


# The clients are imported as a fixture asks for one: this plugin loads in every session, and they take seconds.


@pytest.fixture(scope="module")
def openai_client(dialect_cluster: DialectCluster) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{dialect_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(dialect_cluster: DialectCluster) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=dialect_cluster.api, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def ollama_client(dialect_cluster: DialectCluster) -> ollama.Client:
    import ollama

    return ollama.Client(host=dialect_cluster.api, timeout=120)


@pytest.fixture(scope="session")
def dialect_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DialectCluster]:
    root = tmp_path_factory.mktemp("dialects")
    model_dir = make_tiny_model(root / "repos" / "tiny", arch="llama", num_layers=2, num_files=1, seed=5)
    shared_dir = root / "shared-models"
    shared_model = make_tiny_model(shared_dir / model_dir_name(ModelId(SHARED_MODEL)), num_layers=2, num_files=1)
    # The runner reports its counters (prefix-cache hits) every 0.5 s, for the test of `n` choices, and every
    # service its stats, for the test of /metrics.
    env = {"JETSHARD_COUNTERS_INTERVAL_S": "0.5", "JETSHARD_STATS_INTERVAL_S": "0.5"}
    with hub_cluster(root, env=env) as cluster:
        cluster.hub.add_repo(TINY_MODEL, model_dir)
        cluster.hub.add_repo(SHARED_MODEL, shared_model)
        cluster.start_core()
        cluster.serve_one_node(TINY_MODEL, env={"JETSHARD_MODELS_READ_ONLY_DIRS": str(shared_dir)})
        yield DialectCluster(cluster=cluster, model=TINY_MODEL, model_dir=model_dir, shared_dir=shared_dir)
