"""Models load on request and unload when idle, with Ollama's semantics: an instance placed for a request stays
loaded the API's default keep-alive (`--model-keep-alive-s`, 3 s here) once idle, then unloads; a request's own
`keep_alive` (Ollama's) replaces it (0: unload after this answer; negative: keep loaded); an instance placed by
hand stays until removed unless given one; a busy instance is never unloaded. A model that does not fit beside
another makes room by unloading it if it is idle, and is refused for now (503, Retry-After) if it is busy.

Real parts: nats-server, a sequencer, an API, one node, tiny models on MLX from the test Hub, the official
`ollama` and `openai` clients. Liveness lapses after 4 s here, so the sequencer looks for idle instances every
second: an unload comes within a few seconds of its time. The node lends models 1.5 GiB and each instance keeps a
600 MB prompt cache, so the two models never fit together (the endless one needs 1.06 GiB).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import ollama
import openai
import pytest
from helpers.harness import InferenceCluster, hub_cluster, wait_for
from helpers.tiny_models import endless_model, make_tiny_model

MODEL = "keep-alive/tiny-llama"
ENDLESS = "keep-alive/tiny-endless"
"""Answers until its max_tokens: a request that outlasts the keep-alive."""
DEFAULT_KEEP_ALIVE_S = 3.0
UNLOAD_DEADLINE_S = 30.0
"""Generous: an unload comes within seconds of its time; this catches one that never comes."""
QUESTION = [{"role": "user", "content": "Say hello."}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("keep-alive")
    with hub_cluster(root, {"JETSHARD_LIVENESS_TTL_S": "4"}) as c:
        c.hub.add_repo(MODEL, make_tiny_model(root / "repos" / "tiny", arch="llama", num_layers=2, num_files=1))
        c.hub.add_repo(ENDLESS, endless_model(root / "repos" / "endless"))
        c.start_core(["--model-keep-alive-s", str(DEFAULT_KEEP_ALIVE_S), "--prefix-cache-bytes", "600000000"])
        c.start_node("node-a", {"JETSHARD_MEMORY_LIMIT_GIB": "1.5"})
        c.wait_nodes(1)
        c.add_model(MODEL)
        c.add_model(ENDLESS)
        yield c


@pytest.fixture(scope="module")
def client(cluster: InferenceCluster) -> ollama.Client:
    return ollama.Client(host=cluster.api, timeout=120)


def instances_of(cluster: InferenceCluster, model: str) -> list[dict]:
    return [i for i in cluster.get("/instances") if i["model_id"] == model]


def openai_client(cluster: InferenceCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", max_retries=0, timeout=120)


def endless_stream(chat: openai.OpenAI) -> Any:
    """A streamed answer of ENDLESS that goes on until its client closes it."""
    return chat.chat.completions.create(
        model=ENDLESS,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=100_000,
        temperature=0,
        stream=True,
    )


def unloaded(cluster: InferenceCluster, model: str) -> bool:
    return not instances_of(cluster, model)


def test_a_model_placed_for_a_request_unloads_after_the_default_keep_alive_and_loads_again(
    cluster: InferenceCluster, client: ollama.Client
) -> None:
    answer = client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4})
    answered_at = time.time()
    assert answer.done
    [instance] = instances_of(cluster, MODEL)
    assert instance["keep_alive_s"] == DEFAULT_KEEP_ALIVE_S
    # Its keep-alive runs from its task's end as the sequencer recorded it: about when the answer came (a busy
    # machine may record it a little later).
    assert answered_at - 2 <= instance["unloads_at_ms"] / 1000 <= answered_at + DEFAULT_KEEP_ALIVE_S + 10
    [running] = [m for m in client.ps().models if m.model and m.model.startswith(MODEL)]
    assert running.expires_at is not None
    assert abs(running.expires_at.timestamp() - instance["unloads_at_ms"] / 1000) < 1
    listed = httpx.get(f"{cluster.api}/v1/models/{MODEL}", timeout=10).json()
    assert listed["unloads_at"] == instance["unloads_at_ms"] // 1000
    assert wait_for(lambda: unloaded(cluster, MODEL), timeout=UNLOAD_DEADLINE_S), instances_of(cluster, MODEL)
    assert time.time() >= answered_at + DEFAULT_KEEP_ALIVE_S - 2  # not before its time
    assert not [m for m in client.ps().models if m.model and m.model.startswith(MODEL)]
    # Asked again, it loads again.
    assert client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4}).done


def test_ollama_keep_alive_keeps_a_model_loaded_or_unloads_it_after_its_answer(
    cluster: InferenceCluster, client: ollama.Client
) -> None:
    client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4}, keep_alive=-1)
    time.sleep(DEFAULT_KEEP_ALIVE_S + 3)  # past the default, and past a look by the sequencer
    [instance] = instances_of(cluster, MODEL)
    assert instance["keep_alive_s"] is None and instance["unloads_at_ms"] is None
    [running] = [m for m in client.ps().models if m.model and m.model.startswith(MODEL)]
    assert running.expires_at is not None and running.expires_at > datetime.fromisoformat("9999-01-01T00:00:00+00:00")
    # "5m" as Go writes durations: the model stays five minutes once idle.
    client.generate(model=MODEL, keep_alive="5m")
    [instance] = instances_of(cluster, MODEL)
    assert instance["keep_alive_s"] == 300
    # keep_alive 0 with an answer: it unloads as soon as that answer is done.
    assert client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4}, keep_alive=0).done
    assert wait_for(lambda: unloaded(cluster, MODEL), timeout=UNLOAD_DEADLINE_S), instances_of(cluster, MODEL)
    # A load-only request with keep_alive 0 unloads a loaded model, and loads nothing when none is.
    client.generate(model=MODEL, keep_alive=-1)
    assert instances_of(cluster, MODEL)
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    assert wait_for(lambda: unloaded(cluster, MODEL), timeout=UNLOAD_DEADLINE_S), instances_of(cluster, MODEL)
    assert client.generate(model=MODEL, keep_alive="0s").done_reason == "unload"
    time.sleep(1)
    assert unloaded(cluster, MODEL)


def test_a_busy_instance_is_never_unloaded_and_one_placed_by_hand_stays(cluster: InferenceCluster) -> None:
    chat = openai_client(cluster)
    stream = endless_stream(chat)
    started = time.monotonic()
    chunks = 0
    for _ in stream:  # streams well past the keep-alive: still its instance serves it
        chunks += 1
        if time.monotonic() - started > DEFAULT_KEEP_ALIVE_S + 4:
            break
    stream.close()
    assert chunks > 1 and instances_of(cluster, ENDLESS)
    assert wait_for(lambda: unloaded(cluster, ENDLESS), timeout=UNLOAD_DEADLINE_S)  # idle, then gone

    placed = httpx.post(f"{cluster.api}/instances", json={"model_id": MODEL}, timeout=60)
    assert placed.status_code == 201, placed.text
    instance_id = placed.json()["instance_id"]
    cluster.wait_instance(instance_id)
    time.sleep(DEFAULT_KEEP_ALIVE_S + 3)
    shown = cluster.get(f"/instances/{instance_id}")
    assert shown["keep_alive_s"] is None and shown["unloads_at_ms"] is None
    # Given a keep-alive later (as the dashboard's setting does), it counts from then.
    patched = httpx.patch(f"{cluster.api}/instances/{instance_id}", json={"keep_alive_s": 1}, timeout=30)
    assert patched.status_code == 200 and patched.json()["keep_alive_s"] == 1, patched.text
    assert wait_for(lambda: unloaded(cluster, MODEL), timeout=UNLOAD_DEADLINE_S)
    refused = httpx.patch(f"{cluster.api}/instances/{instance_id}", json={"keep_alive_s": 1e12}, timeout=30)
    assert refused.status_code == 400 and "longer than a year" in refused.text


def test_a_model_that_does_not_fit_unloads_an_idle_one_and_waits_for_a_busy_one(
    cluster: InferenceCluster, client: ollama.Client
) -> None:
    client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4}, keep_alive="10m")
    assert instances_of(cluster, MODEL)
    chat = openai_client(cluster)
    stream = endless_stream(chat)
    assert next(iter(stream)).choices is not None  # ENDLESS serves: MODEL made room
    assert not instances_of(cluster, MODEL)
    # ENDLESS is busy: MODEL must wait for it, and says so at once rather than unloading it mid-answer.
    with pytest.raises(openai.APIStatusError) as refused:
        chat.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"
    assert "serving requests" in str(refused.value.message)
    chunks = 0
    for _ in stream:  # still streaming
        chunks += 1
        if chunks == 5:
            break
    stream.close()
    assert chunks == 5


def test_the_cluster_default_set_for_every_api_replaces_the_flag(cluster: InferenceCluster) -> None:
    assert httpx.get(f"{cluster.api}/settings", timeout=10).json() == {
        "model_keep_alive_s": DEFAULT_KEEP_ALIVE_S,
        "cluster_wide": False,
    }
    changed = httpx.put(f"{cluster.api}/settings", json={"model_keep_alive_s": 600}, timeout=30)
    assert changed.json() == {"model_keep_alive_s": 600, "cluster_wide": True}, changed.text
    try:
        chat = openai_client(cluster)
        chat.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
        [instance] = instances_of(cluster, MODEL)
        assert instance["keep_alive_s"] == 600
        refused = httpx.put(f"{cluster.api}/settings", json={"model_keep_alive_s": "soon"}, timeout=30)
        assert refused.status_code == 400
        too_long = httpx.put(f"{cluster.api}/settings", json={"model_keep_alive_s": 1e20}, timeout=30)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "model_keep_alive_s"
        # What a client reads it may write back as it is: kept loaded stays kept loaded.
        kept = httpx.put(f"{cluster.api}/settings", json={"model_keep_alive_s": -5}, timeout=30).json()
        assert kept == {"model_keep_alive_s": -1, "cluster_wide": True}
        again = httpx.put(
            f"{cluster.api}/settings", json={"model_keep_alive_s": kept["model_keep_alive_s"]}, timeout=30
        )
        assert again.json() == kept == httpx.get(f"{cluster.api}/settings", timeout=10).json()
    finally:
        back = httpx.put(f"{cluster.api}/settings", json={"model_keep_alive_s": None}, timeout=30)
        assert back.json() == {"model_keep_alive_s": DEFAULT_KEEP_ALIVE_S, "cluster_wide": False}
