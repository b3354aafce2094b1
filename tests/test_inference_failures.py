"""Inference when things go wrong: a runner killed mid-stream, a runner's death reported while JetStream
refused commands, an instance deleted, a node lost, and placement on demand (auto-place) or its refusal
(`--no-auto-place`).

One cluster per module, all real processes: nats-server, a sequencer, two APIs (one with `--no-auto-place`)
and two full nodes (worker + downloader each). Every service runs with `--liveness-ttl-s 3`, so a stopped
worker is noticed quickly. The lost-node test runs last: it leaves one node.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
from helpers.harness import InferenceCluster, hub_cluster, limit_message_size, run_async, runner_spec, wait_for
from helpers.streams import stream_error
from helpers.tiny_models import LONG_STORY, make_tiny_model
from jetshard_schema.events import (
    InstanceDeleted,
    InstancePlaced,
    InstanceRestarting,
    NodeLost,
)
from jetshard_schema.ids import ModelId, model_dir_name
from jetshard_schema.subjects import COMMANDS_STREAM

ORG = "jetshard-test"
SPLIT = f"{ORG}/tiny-split"
TENSOR = f"{ORG}/tiny-tensor"
"""SPLIT's weights under another name, served tensor-parallel: each node a slice of every layer."""
AUTO = f"{ORG}/tiny-auto"
NO_AUTO = f"{ORG}/tiny-no-auto"
DELETED = f"{ORG}/tiny-deleted"
GONE = f"{ORG}/tiny-gone"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("inference-failures")
    repos = {
        SPLIT: ("llama", 0),
        TENSOR: ("llama", 0),
        AUTO: ("qwen3", 1),
        NO_AUTO: ("llama", 2),
        DELETED: ("qwen3", 3),
        GONE: ("llama", 4),
    }
    with hub_cluster(root, {"JETSHARD_LIVENESS_TTL_S": "3"}) as c:
        for model_id, (arch, seed) in repos.items():
            c.hub.add_repo(
                model_id,
                make_tiny_model(
                    root / "repos" / model_id.split("/")[1], arch=arch, num_layers=4, num_files=2, seed=seed
                ),
            )
        c.start_core()
        c.no_auto_api = c.start_api(["--no-auto-place"], name="api-no-auto")  # type: ignore[attr-defined]
        for node in ("node-a", "node-b"):
            c.start_node(node)
        c.wait_nodes(2)
        for model_id in repos:
            c.add_model(model_id)
        c.split_instance = c.place(SPLIT, min_nodes=2)  # type: ignore[attr-defined]
        c.tensor_instance = c.place(TENSOR, min_nodes=2, parallelism="tensor")  # type: ignore[attr-defined]
        c.watch_until_ready([c.split_instance, c.tensor_instance])  # type: ignore[attr-defined]
        yield c


@pytest.fixture(scope="module")
def client(cluster: InferenceCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def greedy(client: openai.OpenAI, model: str, max_tokens: int = 12) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=LONG_STORY,
        temperature=0,  # type: ignore[arg-type]
        max_tokens=max_tokens,
    )
    return response.choices[0].message.content or ""


# ------------------------------------------------------------------------------------------- runner death


def scores(client: openai.OpenAI, model: str) -> list[Any]:
    """The greedy answer's first tokens with their logprobs and top two alternatives."""
    reply = client.chat.completions.create(
        model=model,
        messages=LONG_STORY,
        temperature=0,  # type: ignore[arg-type]
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = reply.choices[0].logprobs
    return list(logprobs.content or []) if logprobs is not None else []


def test_a_tensor_parallel_instance_answers_as_the_pipeline_of_the_same_weights(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    shards = cluster.get(f"/instances/{cluster.tensor_instance}")["shards"]  # type: ignore[attr-defined]
    assert sorted((s["tensor_rank"], s["start_layer"], s["end_layer"]) for s in shards) == [(0, 0, 4), (1, 0, 4)]
    assert len({s["node_id"] for s in shards}) == 2
    assert greedy(client, TENSOR, max_tokens=24) == greedy(client, SPLIT, max_tokens=24)
    # Logprobs and constrained decoding, both the sampling rank's alone, as on the pipeline.
    tensor_scores, pipeline_scores = (scores(client, model) for model in (TENSOR, SPLIT))
    assert [t.token for t in tensor_scores] == [t.token for t in pipeline_scores] and tensor_scores
    assert [t.logprob for t in tensor_scores] == pytest.approx([t.logprob for t in pipeline_scores], abs=1e-3)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    reply = client.chat.completions.create(
        model=TENSOR, messages=LONG_STORY, response_format=response_format, max_tokens=40
    )
    assert isinstance(json.loads(reply.choices[0].message.content or "")["n"], int)


def long_stream(client: openai.OpenAI, model: str) -> Iterator[object]:
    """A greedy stream of a long answer, its first chunk taken: still going when the test cuts it."""
    stream = client.chat.completions.create(
        model=model,
        messages=LONG_STORY,
        stream=True,  # type: ignore[arg-type]
        max_tokens=1500,
        temperature=0,
    )
    assert next(stream).choices
    return stream


@pytest.mark.parametrize(
    ("model", "rank"),
    [(SPLIT, 1), (SPLIT, 0), (TENSOR, 0)],
    ids=["leader", "first-rank", "tensor-rank"],
)
def test_kill_9_of_a_runner_mid_stream(cluster: InferenceCluster, client: openai.OpenAI, model: str, rank: int) -> None:
    instance_id = cluster.tensor_instance if model == TENSOR else cluster.split_instance  # type: ignore[attr-defined]
    cluster.wait_instance(instance_id, "ready")
    before = greedy(client, model)
    generation = cluster.get(f"/instances/{instance_id}")["generation"]
    since = cluster.last_seq()
    victim = next(p for p in cluster.runners_of(instance_id) if runner_spec(p).plan.rank == rank)

    stream = long_stream(client, model)
    victim.kill()
    started = time.monotonic()
    error = stream_error(stream, started, "a runner died")
    assert "stopped" in str(error.message) or "restart" in str(error.message), error

    restarting = cluster.wait_event(lambda e: isinstance(e, InstanceRestarting) and e.instance_id == instance_id, since)
    assert isinstance(restarting, InstanceRestarting) and restarting.generation == generation + 1
    assert restarting.reason
    cluster.wait_instance(instance_id, "ready", timeout=120, after_generation=generation)
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    assert greedy(client, model) == before


# ------------------------------------------------------------------------------------------- refused reports


@contextlib.contextmanager
def commands_refused(cluster: InferenceCluster) -> Iterator[None]:
    """JETSHARD_COMMANDS refuses every command meanwhile (a size limit below any command's): JetStream answers
    each publish with an error and stores nothing, as a stream that cannot take writes for a while does."""
    limit = run_async(limit_message_size(cluster.nats.url, COMMANDS_STREAM, 1))
    try:
        yield
    finally:
        run_async(limit_message_size(cluster.nats.url, COMMANDS_STREAM, limit))


def test_a_runner_death_reported_while_commands_were_refused_is_reported_once_they_are_not(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    instance_id = cluster.split_instance  # type: ignore[attr-defined]
    cluster.wait_instance(instance_id, "ready")
    generation = cluster.get(f"/instances/{instance_id}")["generation"]
    since = cluster.last_seq()
    runners = cluster.runners_of(instance_id)
    # Each rank was handed the socket holding the port its worker reported, and its ring came up on that port.
    assert all(runner_spec(p).ring_socket_fd is not None for p in runners), [runner_spec(p) for p in runners]
    victim = next(p for p in runners if runner_spec(p).plan.rank == 1)
    node = next(n for n in cluster.workers if victim.pid in {p.pid for p in cluster.runner_processes(n)})
    logged = len(cluster.processes.log(f"{node}-worker"))

    with commands_refused(cluster):
        victim.kill()

        def refused_twice() -> bool:  # a whole pass of the worker went by with the report unsent
            return cluster.processes.log(f"{node}-worker")[logged:].count("runner report not stored") >= 2

        assert wait_for(refused_twice, timeout=30), cluster.processes.log(f"{node}-worker")[logged:]
        assert cluster.get(f"/instances/{instance_id}")["generation"] == generation  # nothing stored
        # Its instance restarts as a whole once the report is in: the dead rank is not started again meanwhile.
        restarted = f"started runner rank 1 of {instance_id} (generation {generation})"
        assert restarted not in cluster.processes.log(f"{node}-worker")[logged:]

    restarting = cluster.wait_event(lambda e: isinstance(e, InstanceRestarting) and e.instance_id == instance_id, since)
    assert isinstance(restarting, InstanceRestarting) and restarting.generation == generation + 1
    # The killed rank's report, or its peer's: that rank's engine failed as the ring broke, and it says so.
    assert restarting.reason.startswith(("runner was killed by SIGKILL", "runner exited with status 1: ")), restarting
    cluster.wait_instance(instance_id, "ready", timeout=120)
    assert greedy(client, SPLIT)


def test_a_restart_gets_back_the_files_that_went_away_since_the_instance_loaded(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    """Its node's downloader fetches them again for the new runners, as for a placement, rather than the restart
    waiting for files (or failing on them) until the instance gives up."""
    instance_id = cluster.place(GONE, min_nodes=1)
    cluster.wait_instance(instance_id, "ready")
    before = greedy(client, GONE)
    described = cluster.get(f"/instances/{instance_id}")
    [node] = [name for name, node_id in cluster.node_ids.items() if node_id == described["shards"][0]["node_id"]]
    weights = list((cluster.root / node / "models" / model_dir_name(ModelId(GONE))).glob("*.safetensors"))
    assert weights
    for file in weights:
        file.unlink()
    [victim] = cluster.runners_of(instance_id)
    victim.kill()
    cluster.wait_instance(instance_id, "ready", timeout=120, after_generation=described["generation"])
    assert all(file.exists() for file in weights)
    assert greedy(client, GONE) == before
    assert httpx.delete(f"{cluster.api}/instances/{instance_id}", timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------- delete


def test_deleting_an_instance_stops_its_runners(cluster: InferenceCluster, client: openai.OpenAI) -> None:
    instance_id = cluster.place(DELETED, min_nodes=2)
    cluster.watch_until_ready([instance_id])
    assert greedy(client, DELETED)
    runners = cluster.runners_of(instance_id)
    assert len(runners) == 2
    stream = long_stream(client, DELETED)
    response = httpx.delete(f"{cluster.api}/instances/{instance_id}", timeout=30)
    assert response.status_code == 200, response.text
    # The answer under way ends saying why, as the event does (a node lost names the node).
    error = stream_error(stream, time.monotonic(), "its instance was deleted")
    assert "its instance was deleted: deleted on request" in str(error.message), error
    assert httpx.get(f"{cluster.api}/instances/{instance_id}", timeout=10).status_code == 404
    gone = psutil.wait_procs(runners, timeout=60)[1]
    assert not gone, "runners still alive after their instance was deleted"
    assert not cluster.runners_of(instance_id)


# ------------------------------------------------------------------------------------------- auto-place


def test_no_auto_place_is_404_listing_ready_models(cluster: InferenceCluster) -> None:
    no_auto = openai.OpenAI(
        base_url=f"{cluster.no_auto_api}/v1",
        api_key="unused",  # type: ignore[attr-defined]
        timeout=60,
        max_retries=0,
    )
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as caught:
            no_auto.chat.completions.create(
                model=NO_AUTO,
                messages=LONG_STORY,
                max_tokens=3,  # type: ignore[arg-type]
                stream=stream,
            )
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "model_not_found"
        assert SPLIT in caught.value.body["message"]
    assert not cluster.instances_of(NO_AUTO)
    # A ready model is served by that API as usual.
    response = no_auto.chat.completions.create(model=SPLIT, messages=LONG_STORY, max_tokens=3)  # type: ignore[arg-type]
    assert response.usage is not None and response.usage.completion_tokens >= 1


def test_auto_place_on_first_request(cluster: InferenceCluster) -> None:
    assert not cluster.instances_of(AUTO)
    body = {"model": AUTO, "messages": LONG_STORY, "max_tokens": 5, "temperature": 0, "stream": True}
    comments, data = [], []
    with httpx.stream("POST", f"{cluster.api}/v1/chat/completions", json=body, timeout=180) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").strip())
    assert comments, "no keep-alive comment while the model was being placed"
    assert data[-1] == "[DONE]"
    assert all(data), "an SSE event without data (a comment must not carry an empty data field)"
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("length", "stop")
    placed = cluster.instances_of(AUTO)
    assert len(placed) == 1 and placed[0]["status"] == "ready"
    # Non-streaming requests now go to the same instance.
    client = openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=60, max_retries=0)
    assert greedy(client, AUTO, 3) is not None
    assert len(cluster.instances_of(AUTO)) == 1


# ------------------------------------------------------------------------------------------- lost node


def test_a_lost_node_moves_its_instance(cluster: InferenceCluster, client: openai.OpenAI) -> None:
    instance_id = cluster.split_instance  # type: ignore[attr-defined]
    cluster.wait_instance(instance_id, "ready")
    before = greedy(client, SPLIT)
    since = cluster.last_seq()
    lost = "node-b"
    lost_id, kept_id = cluster.node_ids[lost], cluster.node_ids["node-a"]
    cluster.stop_worker(lost, signal.SIGTERM)

    cluster.wait_event(lambda e: isinstance(e, NodeLost) and e.node_id == lost_id, since, timeout=60)
    deleted = cluster.wait_event(lambda e: isinstance(e, InstanceDeleted) and e.instance_id == instance_id, since)
    assert isinstance(deleted, InstanceDeleted) and lost_id in deleted.reason
    replaced = cluster.wait_event(
        lambda e: isinstance(e, InstancePlaced) and e.model_id == SPLIT and e.instance_id != instance_id, since
    )
    assert isinstance(replaced, InstancePlaced)
    assert [s.node_id for s in replaced.shards] == [kept_id]
    assert (replaced.shards[0].start_layer, replaced.shards[0].end_layer) == (0, 4)
    try:
        cluster.wait_instance(replaced.instance_id, "ready", timeout=180)
    except AssertionError as error:
        history = "\n".join(f"{seq} {event!r}"[:300] for seq, event in cluster.events(since))
        raise AssertionError(f"{error}\nevents since the worker stopped:\n{history}") from None
    assert httpx.get(f"{cluster.api}/instances/{instance_id}", timeout=10).status_code == 404
    assert greedy(client, SPLIT) == before
    assert wait_for(lambda: lost_id not in {n["node_id"] for n in cluster.get("/nodes")}, timeout=30)
