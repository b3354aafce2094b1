"""One small cluster for every dialect's tests (OpenAI's tools, structured output, logprobs, n, embeddings;
Ollama; Anthropic Messages; Responses), started once per session: a nats-server, a sequencer, an API and one
node serving a tiny llama model on one runner, added through the local Hub server like a user would.

Registered as a pytest plugin by `conftest.py`, so its fixtures need no import.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.harness import InferenceCluster, hub_cluster
from helpers.tiny_models import make_tiny_model

TINY_MODEL = "jetshard-test/tiny-dialects"


@dataclass
class DialectCluster:
    cluster: InferenceCluster
    model: str
    model_dir: Path

    @property
    def api(self) -> str:
        return self.cluster.api


@pytest.fixture(scope="session")
def dialect_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DialectCluster]:
    root = tmp_path_factory.mktemp("dialects")
    model_dir = make_tiny_model(root / "repos" / "tiny", arch="llama", num_layers=2, num_files=1, seed=5)
    # The runner reports its counters (prefix-cache hits) every 0.5 s, for the test of `n` choices, and every
    # service its stats, for the test of /metrics.
    env = {"JETSHARD_COUNTERS_INTERVAL_S": "0.5", "JETSHARD_STATS_INTERVAL_S": "0.5"}
    with hub_cluster(root, env=env) as cluster:
        cluster.hub.add_repo(TINY_MODEL, model_dir)
        cluster.start_core()
        cluster.serve_one_node(TINY_MODEL)
        yield DialectCluster(cluster=cluster, model=TINY_MODEL, model_dir=model_dir)
