"""Back-pressure: an instance's bounded queue (429 past it, nothing published) and keep-alive comments while a
streaming request waits; serving settings set by `jetshard api`'s flags and by `POST /instances`.

One cluster for the module, all real processes: nats-server, a sequencer, an API started with
`--max-batch 1 --max-queued 1` and a short `--keep-alive-s`, one node serving a tiny model that never stops by
itself: requests with a large `max_tokens` run until their client leaves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from helpers.harness import InferenceCluster, api_until, hub_cluster
from helpers.tiny_models import endless_model, make_tiny_model
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_schema.subjects import COMMANDS_STREAM, TASKS_STREAM, command_subject

MODEL = "back-pressure/tiny-llama"
OTHER = "back-pressure/tiny-other"
KEEP_ALIVE_S = 0.3
API_SERVING = {"max_batch": 1, "max_queued": 1}
"""What `jetshard api`'s flags set (the weights dtype is resolved elsewhere)."""
MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]
ENDLESS = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2**40, "temperature": 0, "stream": True}
"""Runs until the context is full (minutes) unless its client leaves."""

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("back-pressure")
    with hub_cluster(root) as c:
        c.hub.add_repo(MODEL, endless_model(root / "repos" / "tiny"))
        c.hub.add_repo(
            OTHER, make_tiny_model(root / "repos" / "other", arch="llama", num_layers=2, num_files=1, seed=5)
        )
        c.start_core(["--max-batch", "1", "--max-queued", "1", "--keep-alive-s", str(KEEP_ALIVE_S)])
        c.serve_one_node(MODEL)
        c.add_model(OTHER)
        yield c


TASK_COMMANDS = {command_subject("SubmitTask"), command_subject("CancelTask")}


async def task_traffic(nats_url: str) -> tuple[int, list[str]]:
    """The sequence of JETSHARD_TASKS (task requests stored), and the subject of every task command stored."""
    client, js = await connect(NatsOptions(servers=(nats_url,)), "test-reader")
    try:
        stored = int((await js.stream_info(TASKS_STREAM)).state.last_seq)
        info = await js.stream_info(COMMANDS_STREAM)
        subjects = [
            (await js.get_msg(COMMANDS_STREAM, seq)).subject
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
        ]
        return stored, [s for s in subjects if s in TASK_COMMANDS]
    finally:
        await client.close()


def tasks_of(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task_id: task for task_id, task in state["tasks"].items() if task["ref"]["model_id"] == MODEL}


def serving_flags(instance: dict[str, Any]) -> dict[str, Any]:
    return {name: instance["serving"][name] for name in API_SERVING}


def comments_and_data(lines: list[str]) -> tuple[list[str], list[str]]:
    return [line for line in lines if line.startswith(":")], [line for line in lines if line.startswith("data:")]


async def lines_until(lines: AsyncIterator[str], enough: Any) -> list[str]:
    """SSE lines read until `enough(lines so far)`. Read on with the same iterator: a new one would close
    the response when the old one is collected, and the API would see its client leave."""
    seen: list[str] = []
    async for line in lines:
        if line:
            seen.append(line)
        if enough(seen):
            return seen
    raise AssertionError(f"the stream ended after {seen}")


def jetshard(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "jetshard", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_placed_instances_take_the_apis_serving_flags(cluster: InferenceCluster) -> None:
    (instance,) = cluster.instances_of(MODEL)
    assert serving_flags(instance) == API_SERVING
    # `jetshard instances` lists them too: as the API's JSON, or as a table.
    assert json.loads(jetshard("instances", "--api", cluster.api, "ls", "--json")) == cluster.get("/instances")
    listing = jetshard("instances", "--api", cluster.api, "ls")
    (row,) = [line for line in listing.splitlines() if instance["instance_id"] in line]
    assert [cell.strip() for cell in row.split("│")[5:8]] == ["1", "1", "0"], row


def test_place_sets_some_serving_settings_and_the_api_the_rest(cluster: InferenceCluster) -> None:
    response = httpx.post(
        f"{cluster.api}/instances", json={"model_id": OTHER, "serving": {"max_queued": 5}}, timeout=60
    )
    assert response.status_code == 201, response.text
    placed = response.json()
    assert serving_flags(placed) == {**API_SERVING, "max_queued": 5}
    listed = {i["instance_id"]: i for i in cluster.get("/instances")}
    assert listed[placed["instance_id"]]["serving"] == placed["serving"]
    assert httpx.delete(f"{cluster.api}/instances/{placed['instance_id']}", timeout=60).status_code == 200


@pytest.mark.parametrize(
    "serving",
    [{"max_batch": 0}, {"max_batch": 257}, {"max_queued": -1}, {"max_batch": 1.5}, {"weights": "fp8"}, {"batch": 8}],
)
def test_place_with_bad_serving_settings_is_400(cluster: InferenceCluster, serving: dict[str, Any]) -> None:
    before = cluster.get("/instances")
    response = httpx.post(f"{cluster.api}/instances", json={"model_id": OTHER, "serving": serving}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert cluster.get("/instances") == before


async def test_a_full_queue_is_429_and_a_queued_stream_is_kept_alive(cluster: InferenceCluster) -> None:
    async with AsyncExitStack() as streams, httpx.AsyncClient(base_url=cluster.api, timeout=60) as http:
        # One task runs (max_batch 1)…
        running = await streams.enter_async_context(http.stream("POST", "/v1/chat/completions", json=ENDLESS))
        assert running.status_code == 200
        state = await api_until(http, lambda s: any(t["started"] for t in tasks_of(s).values()), "/state", 60)
        (running_id,) = tasks_of(state)

        # …one waits for its place in the batch (max_queued 1), told so every KEEP_ALIVE_S…
        queued = await streams.enter_async_context(http.stream("POST", "/v1/chat/completions", json=ENDLESS))
        assert queued.status_code == 200
        queued_lines = queued.aiter_lines()
        lines = await lines_until(queued_lines, lambda seen: len(seen) >= 4)
        comments, data = comments_and_data(lines)
        assert len(comments) == 4 and not data, lines
        assert all("queued" in c for c in comments), comments
        state = (await http.get("/state")).json()
        assert len(tasks_of(state)) == 2
        (queued_task,) = [t for task_id, t in tasks_of(state).items() if task_id != running_id]
        assert not queued_task["started"]

        # …and a third has no place: 429, whatever the route or the stream flag, and nothing is published.
        before = await task_traffic(cluster.nats.url)
        for path, body in (
            ("/v1/chat/completions", {**ENDLESS, "stream": False}),
            ("/v1/chat/completions", ENDLESS),
            ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}),
        ):
            refused = await http.post(path, json=body)
            assert refused.status_code == 429, refused.text
            assert refused.json() == {
                "error": {
                    "message": refused.json()["error"]["message"],
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "queue_full",
                }
            }
            assert MODEL in refused.json()["error"]["message"]
            assert int(refused.headers["retry-after"]) >= 1
        assert await task_traffic(cluster.nats.url) == before
        assert len(tasks_of((await http.get("/state")).json())) == 2

        # The queued stream was kept alive all along.
        more = await lines_until(queued_lines, lambda seen: len(seen) >= 2)
        assert all(line.startswith(": queued") for line in more), more
    # Both clients left: their tasks are cancelled, and the instance is free for the module's other tests.
    async with httpx.AsyncClient(base_url=cluster.api, timeout=60) as http:
        await api_until(http, lambda s: not tasks_of(s), "/state", 30)
