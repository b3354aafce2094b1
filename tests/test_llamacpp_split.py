"""A GGUF model too big for either of two nodes serves across both on llama.cpp: the leader's llama-server keeps the
first layers and reaches the other node's through llama.cpp's RPC backend (`ggml-rpc-server` behind the instance's
tunnel). Real parts: a nats-server, every service, two nodes on this machine each lending 1 GiB of memory to models
(`--memory-limit-gib`; the demo on llama.cpp needs 1.45 GiB with its default slots and prompt cache), the suite's
llama.cpp build, the official clients. The same split across network-namespace hosts, strangers and a cut cable are
in tests/test_lan.py.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from helpers.harness import InferenceCluster, hub_cluster, runner_spec, wait_for
from helpers.streams import stream_error
from jetshard_schema.catalogue import DEMO_MODEL_ID
from jetshard_schema.events import InstanceRestarting
from jetshard_worker.engines.llamacpp.probe import ready_build
from jetshard_worker.engines.llamacpp.server import free_port

MEMORY_LIMIT_GIB = "1.0"
PROMPT = "The capital of France is"
ASKED = "What is the capital of France? Answer in one sentence."
QUESTION = [{"role": "user", "content": ASKED}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("llamacpp-split")
    with hub_cluster(root, env={"JETSHARD_MEMORY_LIMIT_GIB": MEMORY_LIMIT_GIB}) as cluster:
        cluster.start_core()
        for node in ("node-a", "node-b"):
            cluster.start_node(node)
        cluster.wait_nodes(2)

        def both_run_llama_cpp() -> bool:
            return all("llama.cpp" in n["profile"]["engines"] for n in cluster.get("/nodes"))

        assert wait_for(both_run_llama_cpp, timeout=60), f"run the suite with `bash tests/run`: {cluster.get('/nodes')}"
        yield cluster


@pytest.fixture(scope="module")
def split(cluster: InferenceCluster) -> dict:
    """The demo placed as a user places it (engine and nodes left to placement): too big for either node."""
    response = httpx.post(f"{cluster.api}/instances", json={"model_id": DEMO_MODEL_ID}, timeout=60)
    assert response.status_code == 201, response.text
    return dict(cluster.wait_instance(response.json()["instance_id"], timeout=240))


@pytest.fixture(scope="module")
def client(cluster: InferenceCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_model_too_big_for_either_node_is_split_across_both_the_leader_first(
    cluster: InferenceCluster, split: dict
) -> None:
    assert split["engine"] == "llama.cpp"
    shards = split["shards"]
    assert [s["rank"] for s in shards] == [0, 1] and len({s["node_id"] for s in shards}) == 2, shards
    assert (shards[0]["start_layer"], shards[0]["end_layer"]) == (0, shards[1]["start_layer"])
    assert shards[1]["end_layer"] == 30
    assert [s["leader"] for s in shards] == [True, False]
    assert [s["weights_dtype"] for s in shards] == ["GGUF (llama.cpp)", "GGUF (llama.cpp RPC)"]
    # Each node lends 1 GiB: its shard fits there, the whole model would not.
    for shard in shards:
        assert shard["memory_bytes"] <= float(MEMORY_LIMIT_GIB) * 2**30
    for node in cluster.get("/nodes"):
        assert node["profile"]["memory_total_bytes"] <= float(MEMORY_LIMIT_GIB) * 2**30
        [held] = [s for s in node["shards"] if s["instance_id"] == split["instance_id"]]
        shard = next(s for s in shards if s["node_id"] == node["node_id"])
        assert (held["rank"], held["ranks"], held["leader"]) == (shard["rank"], 2, shard["leader"])
        assert (held["start_layer"], held["end_layer"], held["engine"]) == (
            shard["start_layer"],
            shard["end_layer"],
            "llama.cpp",
        )
    # The helper's process tree is ggml-rpc-server on loopback; llama-server runs on the leader's.
    helper = next(p for p in cluster.runners_of(split["instance_id"]) if runner_spec(p).plan.rank == 1)
    names = {child.name() for child in helper.children(recursive=True)}
    assert any("rpc-server" in name for name in names), names
    assert not any("llama-server" in name for name in names), names


def test_the_split_gives_the_greedy_tokens_of_one_llama_cpp_process_holding_it_all(
    cluster: InferenceCluster, split: dict, client: openai.OpenAI, tmp_path: Path
) -> None:
    split_text = client.completions.create(model=DEMO_MODEL_ID, prompt=PROMPT, max_tokens=32, temperature=0)
    build = ready_build()
    assert build is not None
    gguf = next((cluster.root / "node-a" / "models").rglob("model.gguf"), None)
    gguf = gguf or next((cluster.root / "node-b" / "models").rglob("model.gguf"))
    port = free_port()
    log = (tmp_path / "llama-server.log").open("wb")
    whole = subprocess.Popen(
        [str(build.llama_server), "-m", str(gguf.resolve()), "--port", str(port), "-c", "1024", "--no-webui"],
        cwd=build.build.root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert wait_for(lambda: _healthy(port), timeout=120), (tmp_path / "llama-server.log").read_text()[-2000:]
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
        alone = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
    finally:
        whole.terminate()
        whole.wait(10)
    assert split_text.choices[0].text == alone["choices"][0]["text"]
    assert split_text.usage is not None and split_text.usage.completion_tokens == alone["usage"]["completion_tokens"]


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_split_serves_every_dialect(cluster: InferenceCluster, split: dict, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=DEMO_MODEL_ID, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in (chat.choices[0].message.content or "")
    responses = client.responses.create(model=DEMO_MODEL_ID, input=ASKED, max_output_tokens=24)
    assert "Paris" in responses.output_text
    claude = anthropic.Anthropic(base_url=cluster.api, api_key="unused", max_retries=0)
    message = claude.messages.create(model=DEMO_MODEL_ID, max_tokens=24, messages=QUESTION)  # type: ignore[arg-type]
    assert "Paris" in "".join(block.text for block in message.content if block.type == "text")
    llama = ollama.Client(host=cluster.api)
    answer = llama.chat(model=DEMO_MODEL_ID, messages=QUESTION, options={"temperature": 0, "num_predict": 24})
    assert "Paris" in (answer.message.content or "")
    # Embeddings need a second llama-server, which a helper (one client at a time) cannot serve too: refused, clearly.
    with pytest.raises(openai.APIStatusError, match="split across nodes"):
        client.embeddings.create(model=DEMO_MODEL_ID, input="Paris")


@pytest.mark.parametrize("victim", ["ggml-rpc-server", "helper runner"])
def test_a_killed_helper_ends_every_open_stream_with_an_error_and_the_instance_heals(
    cluster: InferenceCluster, split: dict, client: openai.OpenAI, victim: str
) -> None:
    instance_id = split["instance_id"]
    cluster.wait_instance(instance_id, "ready")
    generation = cluster.get(f"/instances/{instance_id}")["generation"]
    since = cluster.last_seq()
    helper = next(p for p in cluster.runners_of(instance_id) if runner_spec(p).plan.rank == 1)
    rpc_server = next(c for c in helper.children(recursive=True) if "rpc-server" in c.name())
    leader = next(p for p in cluster.runners_of(instance_id) if runner_spec(p).plan.rank == 0)
    llama_server = next(c for c in leader.children(recursive=True) if "llama-server" in c.name())

    streams = [
        client.chat.completions.create(
            model=DEMO_MODEL_ID,
            messages=[{"role": "user", "content": f"Tell me a long story about a {animal}."}],
            stream=True,
            max_tokens=2000,
            temperature=0,
        )
        for animal in ("cat", "dog")
    ]
    for stream in streams:
        assert next(stream).choices
    os.kill((rpc_server if victim == "ggml-rpc-server" else helper).pid, signal.SIGKILL)
    started = time.monotonic()
    for stream in streams:
        error = stream_error(stream, started, "its helper died")
        assert "llama" in str(error.message) or "stopped" in str(error.message), error

    restarting = cluster.wait_event(lambda e: isinstance(e, InstanceRestarting) and e.instance_id == instance_id, since)
    assert isinstance(restarting, InstanceRestarting) and restarting.generation == generation + 1
    cluster.wait_instance(instance_id, "ready", timeout=240, after_generation=generation)
    # Nothing of the old generation is left running: not the helper's server, not the leader's llama-server.
    for process in (rpc_server, llama_server):
        assert wait_for(functools.partial(_gone, process), timeout=30), process
    chat = client.chat.completions.create(model=DEMO_MODEL_ID, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in (chat.choices[0].message.content or "")


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_split_is_shown_in_status(cluster: InferenceCluster, split: dict) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "jetshard", "status", "--api", cluster.api],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "240"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "(leader)" in shown.stdout and "GGUF (llama.cpp RPC) weights" in shown.stdout, shown.stdout


DRAFT_MODEL = "jetshard-test/split-draft"


def test_a_split_drafts_on_its_leader_and_answers_as_without_drafting(
    cluster: InferenceCluster, split: dict, client: openai.OpenAI, tmp_path: Path
) -> None:
    """Last here: the split makes room for one that drafts. The draft (the demo's GGUF in a Hub repo of its own,
    fetched for the leader) runs on the leader's CPU beside its layers, never on the helper's RPC device."""
    prompts = [ASKED, "Write a short poem about the sea."]

    def greedy(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, max_tokens=48, temperature=0)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""

    without = [greedy(prompt) for prompt in prompts]
    repo = tmp_path / "draft-repo"
    repo.mkdir()
    gguf = next((cluster.root / "node-a" / "models").rglob("model.gguf"), None)
    (repo / "draft.gguf").symlink_to((gguf or next((cluster.root / "node-b" / "models").rglob("model.gguf"))).resolve())
    cluster.hub.add_repo(DRAFT_MODEL, repo)
    added = httpx.post(f"{cluster.api}/models", json={"model_id": DRAFT_MODEL, "gguf_file": "draft.gguf"}, timeout=60)
    assert added.status_code == 201, added.text
    assert httpx.delete(f"{cluster.api}/instances/{split['instance_id']}", timeout=60).status_code < 300
    serving = {"draft": DRAFT_MODEL, "max_batch": 2, "prefix_cache_bytes": 0}
    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 2, "serving": serving}
    placed = httpx.post(f"{cluster.api}/instances", json=body, timeout=60)
    assert placed.status_code == 201, placed.text
    drafting = cluster.wait_instance(placed.json()["instance_id"], timeout=240)
    leader = drafting["shards"][0]
    assert leader["leader"] and len(drafting["shards"]) == 2
    servers = [
        p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if "--model-draft" in (p.info["cmdline"] or [])
    ]
    (server,) = servers
    assert "--rpc" in server and server[server.index("--device-draft") + 1] == "none"
    leader_name = next(name for name, node_id in cluster.node_ids.items() if node_id == leader["node_id"])
    assert server[server.index("--model-draft") + 1].startswith(str(cluster.root / leader_name))
    assert [greedy(prompt) for prompt in prompts] == without

    def drafted() -> float:
        lines = httpx.get(f"{cluster.api}/metrics", timeout=10).text.splitlines()
        mine = [line for line in lines if line.startswith("jetshard_draft_accepted_tokens_total{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in mine)

    assert wait_for(lambda: drafted() > 0, timeout=30)
