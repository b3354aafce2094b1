"""Back-pressure, decided by the sequencer for every API at once: an instance's bounded queue (429 past it,
from any API), a task refused when it could not start before its client's deadline (429, never a timeout while
queued, even when its instance slows down after admitting it), one instance for a cold model however many ask
at once, tasks that die with the API holding their client; keep-alive comments while a streaming request
waits; serving settings set by `jetshard api`'s flags and by `POST /instances`.

One cluster for the module, all real processes: nats-server, a sequencer, an API started with
`--max-batch 1 --max-queued 1` and a short `--stream-ping-s`, more APIs with other flags, one node serving tiny
models that never stop by themselves: a request runs until its `max_tokens`, or until its client leaves.
Liveness lapses after 4 s here, so a killed API's tasks go within seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import httpx
import psutil
import pytest
from helpers.harness import InferenceCluster, api_until, hub_cluster, stream_envelopes, until
from helpers.tiny_models import LONG_STORY, endless_model, make_tiny_model
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_schema.events import CommandRejected
from jetshard_schema.subjects import API_SENDER, COMMANDS_STREAM, command_subject

MODEL = "back-pressure/tiny-llama"
OTHER = "back-pressure/tiny-other"
PAIR = "back-pressure/tiny-pair"
"""Placed twice, each instance with one place in its queue, by the test of a request named for a full instance."""
COLD = "back-pressure/tiny-cold"
"""Added, never placed by the fixture: the first requests for it place its one instance."""
ROOMY = ["--max-batch", "2", "--max-queued", "64"]
"""The flags of the APIs that place COLD: a long queue, so that only the start deadline can refuse."""
START_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 0.3
API_SERVING = {"max_batch": 1, "max_queued": 1}
"""What `jetshard api`'s flags set (the weights dtype is resolved elsewhere)."""
ENDLESS = {"model": MODEL, "messages": LONG_STORY, "max_tokens": 2**40, "temperature": 0, "stream": True}
"""Runs until the context is full (minutes) unless its client leaves."""

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("back-pressure")
    # Runners report their stats every half second: a queued request's deadline runs from its instance's last
    # report of tokens sampled, and the impatient API's is 4 s.
    with hub_cluster(root, {"JETSHARD_LIVENESS_TTL_S": "4", "JETSHARD_STATS_INTERVAL_S": "0.5"}) as c:
        c.hub.add_repo(MODEL, endless_model(root / "repos" / "tiny"))
        c.hub.add_repo(COLD, endless_model(root / "repos" / "cold"))
        c.hub.add_repo(
            OTHER, make_tiny_model(root / "repos" / "other", arch="llama", num_layers=2, num_files=1, seed=5)
        )
        c.start_core(["--max-batch", "1", "--max-queued", "1", "--stream-ping-s", str(KEEP_ALIVE_S)])
        c.serve_one_node(MODEL)
        c.add_model(OTHER)
        c.add_model(COLD)
        c.hub.add_repo(PAIR, make_tiny_model(root / "repos" / "pair", arch="llama", num_layers=2, num_files=1, seed=7))
        c.add_model(PAIR)
        yield c


@pytest.fixture(scope="module")
def roomy_api(cluster: InferenceCluster) -> str:
    """A second API, placing with other serving flags and waiting as long as the first for a task to start."""
    return cluster.start_api(ROOMY, name="api-roomy")


@pytest.fixture(scope="module")
def impatient_api(cluster: InferenceCluster) -> str:
    """A third API whose requests wait at most START_TIMEOUT_S for their task to start."""
    return cluster.start_api([*ROOMY, "--start-timeout-s", str(START_TIMEOUT_S)], name="api-impatient")


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
    assert [cell.strip() for cell in row.split("│")[6:9]] == ["1", "1", "0"], row


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


async def test_a_full_queue_is_429_from_every_api_and_a_queued_stream_is_kept_alive(
    cluster: InferenceCluster, roomy_api: str
) -> None:
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

        # …and a third has no place: 429, whatever the route or the stream flag, and from any API: the sequencer
        # counts the queue for all of them.
        for api, path, body in (
            (cluster.api, "/v1/chat/completions", {**ENDLESS, "stream": False}),
            (cluster.api, "/v1/chat/completions", ENDLESS),
            (
                cluster.api,
                "/v1/completions",
                {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True},
            ),
            (roomy_api, "/v1/chat/completions", ENDLESS),
        ):
            refused = await http.post(f"{api}{path}", json=body)
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
        assert len(tasks_of((await http.get("/state")).json())) == 2

        # The queued stream was kept alive all along.
        more = await lines_until(queued_lines, lambda seen: len(seen) >= 2)
        assert all(line.startswith(": queued") for line in more), more
    # Both clients left: their tasks are cancelled, and the instance is free for the module's other tests.
    async with httpx.AsyncClient(base_url=cluster.api, timeout=60) as http:
        await api_until(http, lambda s: not tasks_of(s), "/state", 30)


def cold_chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": COLD, "messages": LONG_STORY, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


SHORT_ANSWER = 96
"""Tokens of every COLD answer: tasks of one size, so the instance's measured pace says how long the next takes;
long enough that a queue of 64 takes longer than twice the start deadline, even on a fast machine."""


async def test_eight_concurrent_first_requests_share_one_instance(cluster: InferenceCluster, roomy_api: str) -> None:
    assert cluster.instances_of(COLD) == []
    async with httpx.AsyncClient(base_url=roomy_api, timeout=180) as http:
        answers = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=cold_chat(SHORT_ANSWER)) for _ in range(8))
        )
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == SHORT_ANSWER for a in answers)
    (instance,) = cluster.instances_of(COLD)
    assert instance["status"] == "ready" and instance["serving"]["max_queued"] == 64
    # The sequencer measures its pace from those eight once their ends are recorded, which a client may see a
    # moment after its last chunk.
    async with httpx.AsyncClient(base_url=cluster.api, timeout=30) as http:
        await api_until(http, lambda state: state["instances"][instance["instance_id"]]["task_ms"] > 0, "/state", 30)


async def test_a_burst_past_what_can_start_in_time_is_answered_or_429_never_timed_out(
    cluster: InferenceCluster, roomy_api: str, impatient_api: str
) -> None:
    (instance,) = cluster.instances_of(COLD)  # placed by the test before
    task_ms = cluster.get("/state")["instances"][instance["instance_id"]]["task_ms"]
    max_batch = instance["serving"]["max_batch"]
    # Enough requests that the last ones would wait twice the deadline at the measured pace; no more than the
    # queue holds, so that only the deadline refuses.
    burst = min(max_batch + int(2 * START_TIMEOUT_S * 1000 * max_batch / task_ms) + 4, max_batch + 64)
    assert burst * task_ms / max_batch > 1000 * START_TIMEOUT_S, f"{task_ms:.0f} ms tasks: make SHORT_ANSWER larger"
    async with httpx.AsyncClient(base_url=impatient_api, timeout=120) as http:
        answers = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=cold_chat(SHORT_ANSWER)) for _ in range(burst))
        )
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 429}, {a.status_code: a.text for a in answers if a.status_code not in (200, 429)}
    refused = [a for a in answers if a.status_code == 429]
    assert all(
        a.json()["error"]["code"] == "queue_full" and "to start" in a.json()["error"]["message"] for a in refused
    )
    assert all(1 <= int(a.headers["retry-after"]) <= 2 * START_TIMEOUT_S + task_ms / 1000 for a in refused)


@contextmanager
def slowed_down(process: psutil.Process, stopped_s: float = 0.3, running_s: float = 0.1) -> Iterator[None]:
    """`process` runs a quarter of the time, as on a node whose CPU another program took: stopped and continued
    in turn (SIGSTOP, SIGCONT) until the block ends."""
    done = threading.Event()

    def throttle() -> None:
        while not done.is_set():
            process.suspend()
            done.wait(stopped_s)
            process.resume()
            done.wait(running_s)

    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        process.resume()


async def test_work_queued_on_an_instance_that_slows_down_is_still_answered(
    cluster: InferenceCluster, roomy_api: str, impatient_api: str
) -> None:
    (instance,) = cluster.instances_of(COLD)  # placed by the tests before
    (runner,) = cluster.runners_of(instance["instance_id"])
    task_ms = cluster.get("/state")["instances"][instance["instance_id"]]["task_ms"]
    max_batch = instance["serving"]["max_batch"]
    burst = min(max_batch + int(2 * START_TIMEOUT_S * 1000 * max_batch / task_ms) + 4, max_batch + 64)
    # Admitted at the pace the instance had; then it runs four times slower, so the last admitted ones start
    # long after the deadline they were admitted for, though they were never refused. They wait their turn.
    with slowed_down(runner):
        async with httpx.AsyncClient(base_url=impatient_api, timeout=180) as http:
            answers = await asyncio.gather(
                *(http.post("/v1/chat/completions", json=cold_chat(SHORT_ANSWER)) for _ in range(burst))
            )
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) <= {200, 429}, {a.status_code: a.text for a in answers if a.status_code not in (200, 429)}
    assert statuses[200] > max_batch, statuses  # some of them waited in the queue
    assert all(a.json()["usage"]["completion_tokens"] == SHORT_ANSWER for a in answers if a.status_code == 200)


async def submitted(js: Any) -> int:
    """The tasks submitted so far: the `SubmitTask` commands in JETSHARD_COMMANDS."""
    subject = command_subject("SubmitTask", API_SENDER)
    info = await js.stream_info(COMMANDS_STREAM, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def test_a_request_named_for_an_instance_that_filled_meanwhile_runs_on_the_other(
    cluster: InferenceCluster, roomy_api: str
) -> None:
    """An API stores a task's request for the instance it names, before the sequencer assigns it. The window
    forced open: the sequencer is paused while two requests are submitted through two APIs (one spreads its own
    burst; neither knows of the other's), so each API's State shows both instances empty and both name the same
    one; that instance has one place. The sequencer gives it to the first and refuses the second for it, and that
    API names the second again (the other instance, or the first once it is free) and stores its request there:
    both are answered."""
    one_place = {"max_batch": 1, "max_queued": 0}
    (sequencer,) = [p for p in cluster.processes.started if p.args[-1] == "sequencer"]
    chat = {"model": PAIR, "messages": LONG_STORY, "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.api, timeout=120) as http:
        placed = [await http.post("/instances", json={"model_id": PAIR, "serving": one_place}) for _ in range(2)]
        assert [p.status_code for p in placed] == [201, 201], [p.text for p in placed]
        instance_ids = [p.json()["instance_id"] for p in placed]
        await asyncio.to_thread(cluster.watch_until_ready, instance_ids)
        client, js = await connect(NatsOptions(servers=(cluster.nats.url,)), "test-reader")
        submitted_before = await submitted(js)
        since_seq = (await http.get("/state")).json()["last_seq"] + 1
        os.killpg(sequencer.pid, signal.SIGSTOP)
        try:
            asked = [
                asyncio.create_task(http.post(f"{api}/v1/chat/completions", json=chat))
                for api in (cluster.api, roomy_api)
            ]

            async def both_submitted() -> bool:
                return await submitted(js) >= submitted_before + 2

            # Both stored and submitted to the paused sequencer, however slow the machine.
            await until(both_submitted, 60, "both requests submitted")
        finally:
            os.killpg(sequencer.pid, signal.SIGCONT)
            await client.close()
        answers = await asyncio.gather(*asked)
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        # The window was open: the second was refused for the instance it was named for first. (Which instance
        # answered it depends on whether the first had finished by the time it was named again.)
        events = await stream_envelopes(cluster.nats.url, since_seq)
        refusals = [e.event.reason for _, e in events if isinstance(e.event, CommandRejected)]
        assert any("cannot take" in reason for reason in refusals), refusals
        for instance_id in instance_ids:
            assert (await http.delete(f"/instances/{instance_id}")).status_code == 200


async def test_a_killed_apis_tasks_are_cancelled_within_the_liveness_ttl(
    cluster: InferenceCluster, roomy_api: str
) -> None:
    doomed_url = cluster.start_api(ROOMY, name="api-doomed")
    doomed = cluster.processes.started[-1]  # the API just started
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{doomed_url}/v1/chat/completions", json={**ENDLESS, "model": COLD}) as live:
            assert live.status_code == 200
            state = await api_until(
                http, lambda s: any(t["started"] for t in cold_tasks(s).values()), f"{cluster.api}/state", 60
            )
            (task_id,) = cold_tasks(state)
            cluster.processes.kill(doomed, signal.SIGKILL)
            # Nobody is left to read it: the sequencer cancels it once the API's liveness key lapses (4 s).
            await api_until(http, lambda s: task_id not in s["tasks"], f"{cluster.api}/state", 20)
        # The instance is free again, and serves through another API.
        again = await http.post(f"{roomy_api}/v1/chat/completions", json=cold_chat(4))
        assert again.status_code == 200, again.text


def cold_tasks(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task_id: task for task_id, task in state["tasks"].items() if task["ref"]["model_id"] == COLD}
