"""One cluster for the llama.cpp engine's tests, started once per session: a nats-server, a sequencer, an API and one
node whose worker finds the suite's llama.cpp build (`bash tests/run` makes it), serving the demo GGUF on llama.cpp
as it ships (no conversion). Registered as a pytest plugin by `conftest.py`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from jetshard_schema.catalogue import DEMO_MODEL_ID

from helpers.harness import InferenceCluster, hub_cluster, wait_for


@dataclass
class LlamaCppCluster:
    cluster: InferenceCluster
    instance_id: str
    model: str = DEMO_MODEL_ID

    @property
    def api(self) -> str:
        return self.cluster.api

    def place(self, model_id: str, engine: str = "llama.cpp", **fields: object) -> str:
        body = {"model_id": model_id, "min_nodes": 1, "engine": engine, **fields}
        response = httpx.post(f"{self.api}/instances", json=body, timeout=60)
        assert response.status_code == 201, response.text
        return str(response.json()["instance_id"])


@pytest.fixture(scope="session")
def llamacpp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppCluster]:
    root = tmp_path_factory.mktemp("llamacpp")
    env = {"JETSHARD_COUNTERS_INTERVAL_S": "0.5", "JETSHARD_STATS_INTERVAL_S": "0.5"}
    with hub_cluster(root, env=env) as cluster:
        cluster.start_core()
        cluster.start_node("node-a")
        cluster.wait_nodes(1)

        def runs_llama_cpp() -> bool:
            return any("llama.cpp" in node["profile"]["engines"] for node in cluster.get("/nodes"))

        assert wait_for(runs_llama_cpp, timeout=60), (
            "the node found no llama.cpp build: run the suite with `bash tests/run`, which builds one and names its "
            f"cache in JETSHARD_LLAMA_CPP_CACHE\n{cluster.get('/nodes')}"
        )
        serving = LlamaCppCluster(cluster, "")
        serving.instance_id = serving.place(DEMO_MODEL_ID)
        cluster.wait_instance(serving.instance_id, timeout=240)
        yield serving
