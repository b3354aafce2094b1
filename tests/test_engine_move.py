"""An instance placement put on MLX moves to llama.cpp once its node runs it and the instance is idle: the
sequencer removes it and places its replacement in one command. A request waiting for the model to be ready is
then answered by the replacement, never refused because the instance it first waited for left.

Real parts: a nats-server, a sequencer and an API; the node is present on the bus as its worker would make it, with
no worker behind it, so its instances stay on their way to ready and the window stays open as long as the test
needs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from helpers.cards import tiny_card
from helpers.harness import Cluster
from jetshard_bus.node import node_id_for
from jetshard_schema.cards import ModelFormat, ModelSource
from jetshard_schema.commands import AddCustomModelCard, ReportNodeProfile
from jetshard_schema.types import Engine, NodeProfile

MODEL = "jetshard-test/tiny-moving"
GiB = 1 << 30


async def test_a_request_waiting_for_an_instance_that_moves_to_llama_cpp_waits_for_its_replacement(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = tmp_path / "node-a"
    node = await cluster.join(config)
    card = tiny_card(
        MODEL,
        num_layers=4,
        storage_size_bytes=1000,
        source=ModelSource.LOCAL_GGUF,
        formats=(ModelFormat.GGUF, ModelFormat.MLX),
        is_custom=True,
    )
    await cluster.submit(AddCustomModelCard(card=card))
    api = await asyncio.to_thread(cluster.start_api)
    async with httpx.AsyncClient(base_url=api, timeout=60) as client:
        placed = await client.post("/instances", json={"model_id": MODEL})
        assert placed.status_code == 201, placed.text
        first = placed.json()["instance_id"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await asyncio.sleep(1.0)  # the request waits for `first` to be ready
        assert not request.done(), request.result().text
        # The node's build of llama.cpp is ready: its worker reports it among its engines.
        profile = NodeProfile(
            hostname=node_id_for(config),
            os="test",
            cpu_cores=4,
            memory_total_bytes=64 * GiB,
            memory_available_bytes=32 * GiB,
            engines=(Engine.MLX, Engine.LLAMA_CPP),
        )
        await cluster.submit(ReportNodeProfile(node_id=node, session_id="test-session", profile=profile))
        state = await cluster.wait(
            lambda s: first not in s.instances and any(i.model_id == MODEL for i in s.instances.values()),
            what="the instance moved to llama.cpp",
        )
        (replacement,) = [i for i in state.instances.values() if i.model_id == MODEL]
        assert replacement.serving.engine is Engine.LLAMA_CPP
        await asyncio.sleep(2.0)  # the API has seen the move
        assert not request.done(), f"the waiting request was answered: {request.result().text}"
        request.cancel()
