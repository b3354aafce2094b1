"""Requests never hang: a task assigned as its runner becomes ready, a download that cannot succeed, an
offline node without the model, and clients that leave before their answer is done.

One cluster per module, all real processes: nats-server, a sequencer, an API and three nodes:
* `fast` serves the window test, which stops its runner (SIGSTOP) for a few seconds as it starts: that opens wide
  the window between a runner's launch and its instance being ready;
* `no-hub` reaches no Hub (its downloader's `HF_ENDPOINT` is a closed port);
* `offline` runs its downloader offline;
* `lossy` reaches NATS through a proxy that passes only the first chunk of each answer
  (`helpers.nats_proxy`), as a NATS server that fails drops chunks in flight;
* `refusing` reaches NATS through a proxy that refuses its runners' chunks as a server refuses a payload past its
  limit (`-ERR 'Maximum Payload Violation'`, then it closes the connection), so that the NATS client closes for
  good and its runner's chunk publisher fails for real.
Placement names its nodes explicitly, so each test knows where its model lands.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import openai
import pytest
from helpers.harness import ChunkTap, InferenceCluster, hub_cluster, wait_for
from helpers.nats_proxy import Fault, FaultyNatsProxy
from helpers.tiny_models import LONG_STORY, make_tiny_model
from jetshard_schema.events import InstanceRestarting, TaskAssigned, TaskCancelled, TaskFinished
from jetshard_schema.subjects import CHUNK_PREFIX
from jetshard_schema.types import Chunk, TaskOutcome

ORG = "jetshard-test"
WINDOW = f"{ORG}/tiny-window"
NO_HUB = f"{ORG}/tiny-no-hub"
OFFLINE = f"{ORG}/tiny-offline"
LEAVING = f"{ORG}/tiny-leaving"
LOSSY = f"{ORG}/tiny-lossy"
REFUSED = f"{ORG}/tiny-refused"
STOPPED_S = 4
"""How long the window test's runner is stopped as it starts."""
UNAVAILABLE_DEADLINE_S = 30

pytestmark = pytest.mark.timeout(240)


class SilentHub:
    """A "Hub" that accepts connections and never answers, until `go_away` closes them and stops listening:
    the downloader then sees a dropped connection, and a refused one on any retry."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self._accepted.append(self._listener.accept()[0])

    def go_away(self) -> None:
        self._listener.close()
        for connection in self._accepted:
            connection.close()


def drop_after_the_first_chunk(subject: str, payload: bytes) -> Fault | None:
    later = subject.startswith(f"{CHUNK_PREFIX}.") and msgspec.json.decode(payload, type=Chunk).index >= 1
    return Fault.DROP if later else None


def refuse_chunks(subject: str, payload: bytes) -> Fault | None:
    return Fault.REFUSE if subject.startswith(f"{CHUNK_PREFIX}.") else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("never-hang")
    with (
        hub_cluster(root) as c,
        FaultyNatsProxy(c.nats.url, drop_after_the_first_chunk) as lossy_nats,
        FaultyNatsProxy(c.nats.url, refuse_chunks) as refusing_nats,
    ):
        # Seed 0 with LONG_STORY decodes greedily for well over 1,500 tokens without an EOS (REFUSED's too: an
        # answer that goes on after the first chunk's refusal).
        seeds = {LEAVING: 0, WINDOW: 1, NO_HUB: 2, OFFLINE: 3, LOSSY: 4, REFUSED: 0}
        for model_id, seed in seeds.items():
            c.hub.add_repo(model_id, make_tiny_model(root / "repos" / model_id.split("/")[1], num_files=1, seed=seed))
        c.start_core()
        c.start_node("fast")
        c.silent_hub = SilentHub()  # type: ignore[attr-defined]
        c.start_node("no-hub", {"HF_ENDPOINT": c.silent_hub.url})  # type: ignore[attr-defined]
        c.start_node("offline", {"JETSHARD_OFFLINE": "1"})
        c.start_node("lossy", {"JETSHARD_NATS": lossy_nats.url})
        c.start_node("refusing", {"JETSHARD_NATS": refusing_nats.url})
        c.wait_nodes(5)
        for model_id in seeds:
            c.add_model(model_id)
        yield c


@pytest.fixture(scope="module")
def client(cluster: InferenceCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=90, max_retries=0)


def place_on(cluster: InferenceCluster, model_id: str, node: str) -> httpx.Response:
    body = {"model_id": model_id, "node_ids": [cluster.node_ids[node]]}
    return httpx.post(f"{cluster.api}/instances", json=body, timeout=60)


def test_a_task_assigned_as_its_runner_becomes_ready_is_served(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    """The request waits for the instance and is submitted the moment it is ready, as the runner's follower
    goes live: the runner must see the task anyway."""
    since = cluster.last_seq()
    response = place_on(cluster, WINDOW, "fast")
    assert response.status_code == 201
    instance_id = response.json()["instance_id"]
    assert wait_for(lambda: cluster.runners_of(instance_id), timeout=90)
    (runner,) = cluster.runners_of(instance_id)
    os.killpg(runner.pid, signal.SIGSTOP)  # its own process group: the runner and whatever it started
    threading.Timer(STOPPED_S, os.killpg, (runner.pid, signal.SIGCONT)).start()
    assert cluster.get(f"/instances/{instance_id}")["status"] != "ready", "the runner was ready before it was stopped"
    started = time.monotonic()
    reply = client.chat.completions.create(model=WINDOW, messages=LONG_STORY, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert time.monotonic() - started < 60
    assigned = [e for _, e in cluster.events(since) if isinstance(e, TaskAssigned)]
    assert len(assigned) == 1, "the request was not submitted while the instance came up"


def test_chunks_lost_after_the_task_finished_fail_the_request_soon(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    """The runner finished and said which chunk was its last, but chunks after the first never came: the
    request fails a few seconds after the finish (502 `chunk_gap`), not after a minute of silence."""
    response = place_on(cluster, LOSSY, "lossy")
    assert response.status_code == 201
    cluster.wait_instance(response.json()["instance_id"])
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=LOSSY, messages=LONG_STORY, max_tokens=4, temperature=0)
    assert raised.value.status_code == 502
    assert raised.value.body["code"] == "chunk_gap"  # type: ignore[index]
    assert "of the output were lost" in raised.value.body["message"]  # type: ignore[index]
    assert time.monotonic() - started < 30  # the runner's silence deadline is 60 s


def test_a_runner_whose_chunk_publisher_fails_restarts_and_its_client_hears_so_soon(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    """NATS refuses the answer's first chunk and the publisher fails on the next: the runner exits, its worker
    reports it failed, the instance restarts, and the request fails within seconds saying why, not after the 300 s
    first-chunk timeout."""
    response = place_on(cluster, REFUSED, "refusing")
    assert response.status_code == 201
    instance_id = response.json()["instance_id"]
    generation = cluster.wait_instance(instance_id)["generation"]
    since = cluster.last_seq()
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=REFUSED, messages=LONG_STORY, max_tokens=200, temperature=0)
    elapsed = time.monotonic() - started
    print(f"the request failed {elapsed:.1f} s after it was sent")
    assert elapsed < 20
    assert raised.value.status_code == 502
    assert raised.value.body["code"] == "runner_failed"  # type: ignore[index]
    message = raised.value.body["message"]  # type: ignore[index]
    assert "restarted" in message and "the chunk publisher failed: ConnectionClosedError" in message, message
    restarting = cluster.wait_event(lambda e: isinstance(e, InstanceRestarting) and e.instance_id == instance_id, since)
    assert isinstance(restarting, InstanceRestarting) and restarting.generation == generation + 1
    assert cluster.wait_instance(instance_id, timeout=90)["generation"] == generation + 1


def test_a_download_that_cannot_reach_the_hub_fails_its_instance_and_answers_503(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    assert place_on(cluster, NO_HUB, "no-hub").status_code == 201

    def non_streaming() -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=NO_HUB, messages=LONG_STORY, max_tokens=4)
        return caught.value

    def streaming() -> dict[str, object]:
        body = {"model": NO_HUB, "messages": LONG_STORY, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{cluster.api}/v1/chat/completions", json=body, timeout=90) as response:
            data = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]"
        return dict(json.loads(data[-2]))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(non_streaming), pool.submit(streaming)
        time.sleep(1)  # deliberate fault timing: both requests wait for the instance, its download is stuck
        assert not any(w.done() for w in waiting)
        cluster.silent_hub.go_away()  # type: ignore[attr-defined]
        gone = time.monotonic()
        error, streamed = waiting[0].result(), waiting[1].result()
    elapsed = time.monotonic() - gone
    print(f"waiting requests answered {elapsed:.1f} s after the Hub went away")
    assert elapsed < UNAVAILABLE_DEADLINE_S
    assert error.status_code == 503
    assert isinstance(error.body, dict) and error.body["code"] == "model_unavailable"
    assert "could not reach the Hub" in error.body["message"], error.body
    assert streamed["error"]["code"] == "model_unavailable"  # type: ignore[index]
    (instance,) = cluster.instances_of(NO_HUB)
    assert instance["status"] == "failed" and "could not reach the Hub" in instance["reason"]


def test_an_offline_node_without_the_model_is_refused_at_once(cluster: InferenceCluster) -> None:
    nodes = {n["node_id"]: n for n in cluster.get("/nodes")}
    assert nodes[cluster.node_ids["offline"]]["offline"] is True
    assert nodes[cluster.node_ids["fast"]]["offline"] is False
    started = time.monotonic()
    response = place_on(cluster, OFFLINE, "offline")
    assert time.monotonic() - started < 5
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_unavailable"
    assert "offline" in response.json()["error"]["message"]
    assert not cluster.instances_of(OFFLINE)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_cancels_its_task(cluster: InferenceCluster, stream: bool) -> None:
    if not cluster.instances_of(LEAVING):
        assert place_on(cluster, LEAVING, "fast").status_code == 201
    cluster.wait_instance(cluster.instances_of(LEAVING)[0]["instance_id"], "ready", timeout=90)
    since = cluster.last_seq() + 1
    # Until the context is full: minutes on this machine, unless the task is cancelled.
    body = {"model": LEAVING, "messages": LONG_STORY, "max_tokens": 2**70, "temperature": 0, "stream": stream}
    with ChunkTap(cluster.nats.url) as tap:
        # The client leaves once its task is generating (a raw socket, closed mid-request).
        payload = json.dumps(body).encode()
        host, port = cluster.api.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload)
            )
            assert wait_for(lambda: any(len(chunks) > 3 for chunks in tap.chunks.values()), timeout=60)
        left_at_ms = time.time() * 1000
        cancelled = cluster.wait_event(lambda e: isinstance(e, TaskCancelled), since, timeout=10)
        assert isinstance(cancelled, TaskCancelled)
        (task_id,) = [e.task.task_id for _, e in cluster.events(since) if isinstance(e, TaskAssigned)]
        assert cancelled.task_id == task_id
        at_ms = next(env.at_ms for _, env in cluster.envelopes(since) if isinstance(env.event, TaskCancelled))
        print(
            f"{'streaming' if stream else 'non-streaming'}: cancelled {at_ms - left_at_ms:.0f} ms after the client left"
        )
        assert at_ms - left_at_ms < 1000
        # The runner stops at its next step: its last chunk says so, long before the context is full.
        assert wait_for(lambda: tap.final(task_id) is not None, timeout=10)
        final = tap.final(task_id)
        assert final.finish_reason is TaskOutcome.CANCELLED
        assert final.usage.completion_tokens < 1500
    assert not any(isinstance(e, TaskFinished) and e.task_id == task_id for _, e in cluster.events(since))
