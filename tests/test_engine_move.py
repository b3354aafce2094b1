"""An instance placement put on MLX moves to llama.cpp once its node runs it and the instance is idle: the
sequencer removes it and places its replacement in one command. A request waiting for the model to be ready is
then answered by the replacement, never refused because the instance it first waited for left; nor is one whose
instance leaves between the API's look and the sequencer's.

Real parts: a nats-server, a sequencer and an API; the node is present on the bus as its worker would make it, with
no worker behind it, so its instances stay on their way to ready (or are made ready by the test's own reports) and
the window stays open as long as the test needs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import httpx
from helpers.cards import tiny_card
from helpers.harness import Cluster, api_until
from helpers.states import completed
from jetshard_bus.node import node_id_for
from jetshard_schema.cards import ModelFormat, ModelSource
from jetshard_schema.commands import (
    AddCustomModelCard,
    Command,
    DeleteInstance,
    ReportDownloadProgress,
    ReportNodeProfile,
    ReportRunnerStatus,
    SubmitTask,
)
from jetshard_schema.ids import InstanceId, ModelId, NodeId
from jetshard_schema.state import State
from jetshard_schema.subjects import COMMANDS_STREAM, command_subject
from jetshard_schema.types import Engine, NodeProfile, RunnerReport, RunnerStatus
from nats.js.errors import NotFoundError

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


async def test_a_request_whose_instance_leaves_before_the_sequencer_takes_it_waits_for_the_next(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The window between the API seeing an instance ready and the sequencer taking the task, forced open: the
    sequencer is stopped while a delete of the instance and then the request reach the bus, so it removes the
    instance before it sees the task. The task is refused for want of an instance (`no_capacity`); the API then
    waits for the model's next instance, as a first request does, instead of answering 503."""
    node = await cluster.join(tmp_path / "node-a")
    await cluster.add_card(MODEL, num_layers=4)
    api = await asyncio.to_thread(cluster.start_api)
    (sequencer,) = [p for p in cluster.processes.started if "sequencer" in str(p.args)]
    async with httpx.AsyncClient(base_url=api, timeout=60) as client:
        placed = await client.post("/instances", json={"model_id": MODEL})
        assert placed.status_code == 201, placed.text
        first = InstanceId(placed.json()["instance_id"])
        await _make_ready(cluster, node, first)
        await api_until(client, lambda instance: instance["status"] == "ready", f"/instances/{first}")

        before = (await cluster.js.stream_info(COMMANDS_STREAM)).state.last_seq
        os.killpg(sequencer.pid, signal.SIGSTOP)
        try:
            deleting = asyncio.create_task(client.delete(f"/instances/{first}"))
            await _stored_after(cluster, before, DeleteInstance)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await _stored_after(cluster, before, SubmitTask)
        finally:
            os.killpg(sequencer.pid, signal.SIGCONT)
        assert (await deleting).status_code in (200, 202, 204)

        # The request placed the model again; once that instance is ready the task goes to it. (The test's own
        # replica may not have applied the delete yet when the API answered it: the first does not count.)
        def placed_again(state: State) -> list[InstanceId]:
            return [i.instance_id for i in state.instances.values() if i.model_id == MODEL and i.instance_id != first]

        state = await cluster.wait(lambda s: request.done() or bool(placed_again(s)), what="the model placed again")
        assert not request.done(), f"the request was answered: {request.result().text}"
        (second,) = placed_again(state)
        await _make_ready(cluster, node, second)
        await cluster.wait(
            lambda s: any(t.instance_id == second for t in s.tasks.values()), what="the task assigned to the next"
        )
        assert not request.done(), f"the request was answered: {request.result().text}"
        request.cancel()


async def _make_ready(cluster: Cluster, node: NodeId, instance_id: InstanceId) -> None:
    """Report what the node's downloader and runner would: the shard's layers on disk, then the runner ready. The
    test's own follower may not have read the placement yet when the API answered it."""
    state = await cluster.wait(lambda s: instance_id in s.instances, what=f"{instance_id} in the test's state")
    instance = state.instances[instance_id]
    (shard,) = instance.shards
    progress = completed(shard.start_layer, shard.end_layer)
    await cluster.submit(ReportDownloadProgress(node_id=node, model_id=ModelId(MODEL), progress=progress))
    runner = RunnerReport(node_id=node, rank=0, worker_session="test-session", status=RunnerStatus.READY)
    await cluster.submit(ReportRunnerStatus(instance_id=instance_id, generation=instance.generation, runner=runner))


async def _stored_after(cluster: Cluster, seq: int, command: type[Command]) -> None:
    """Until a `command` later than stream sequence `seq` is stored (the sequencer is stopped: none is taken)."""
    subject = command_subject(command.__name__, command.sender, None)

    async def stored() -> bool:
        with contextlib.suppress(NotFoundError):
            return (await cluster.js.get_last_msg(COMMANDS_STREAM, subject)).seq > seq
        return False

    deadline = asyncio.get_running_loop().time() + 10
    while not await stored():
        assert asyncio.get_running_loop().time() < deadline, f"no {command.__name__} reached the bus"
        await asyncio.sleep(0.05)
