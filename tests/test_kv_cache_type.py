"""A quantized KV cache on llama.cpp (`serving.kv_cache_type`): the demo GGUF, imported a second time under another
name, placed with its cache in 8 bits beside the demo as it ships. Placement counts the smaller cache, llama-server
stores it so, and greedy answers begin as the demo's do: their first `SAME_START` tokens at least.
Asked of MLX, or with a type llama.cpp's names do not have, it is a clear 400."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from helpers.llamacpp_cluster import LlamaCppCluster
from jetshard_downloader.convert import packaged_gguf_path
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.ids import ModelId, model_dir_name

pytestmark = pytest.mark.timeout(300)

Q8_MODEL = "local/demo-kv-q8"
SAME_START = 8
"""Greedy answers begin with at least this many tokens as with the 16-bit cache. Measured on these prompts with the
demo (a 135M model in 4 bits): the first answer whole, the others part after 10 to 30 tokens; rounding differs a
little at every step, and one near-tie then picks another word."""
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain in two sentences what a CPU does.",
    "List three fruits and their colours.",
]


@pytest.fixture(scope="module")
def q8_instance(llamacpp_cluster: LlamaCppCluster) -> Iterator[dict[str, object]]:
    cluster = llamacpp_cluster.cluster
    gguf, _ = packaged_gguf_path(builtin_cards()[DEMO_MODEL_ID])
    body = {"node_id": cluster.node_ids["node-a"], "model_id": Q8_MODEL, "path": str(gguf)}
    response = httpx.post(f"{llamacpp_cluster.api}/models/import", json=body, timeout=120)
    assert response.status_code == 201, response.text
    instance_id = ""
    try:
        instance_id = llamacpp_cluster.place(Q8_MODEL, serving={"kv_cache_type": "q8_0"})
        yield cluster.wait_instance(instance_id, timeout=240)
    finally:
        if instance_id:
            httpx.delete(f"{llamacpp_cluster.api}/instances/{instance_id}", timeout=30)
        httpx.delete(f"{llamacpp_cluster.api}/models/{Q8_MODEL}", timeout=30)


def reserved_bytes(instance: dict[str, object]) -> int:
    """What placement reserved for the instance on its nodes."""
    return sum(shard["memory_bytes"] for shard in instance["shards"])  # type: ignore[attr-defined,index,misc]


def serves(cmdline: list[str], model_id: str) -> bool:
    """Whether `cmdline` is a llama-server's on `model_id`'s model directory."""
    directory = model_dir_name(ModelId(model_id))
    return bool(cmdline) and cmdline[0].endswith("llama-server") and any(directory in part for part in cmdline)


def greedy_tokens(client: openai.OpenAI, model: str, prompt: str) -> list[str]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0, logprobs=True
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    return [entry.token for entry in logprobs.content]


def test_an_8_bit_kv_cache_takes_less_memory_and_answers_as_16_bits_do(
    q8_instance: dict[str, object], llamacpp_cluster: LlamaCppCluster
) -> None:
    demo = llamacpp_cluster.cluster.get(f"/instances/{llamacpp_cluster.instance_id}")
    assert q8_instance["serving"]["kv_cache_type"] == "q8_0" and demo["serving"]["kv_cache_type"] == "auto"  # type: ignore[index]
    assert q8_instance["serving"]["max_batch"] == demo["serving"]["max_batch"]  # type: ignore[index]
    assert reserved_bytes(q8_instance) < reserved_bytes(demo)
    (server,) = [p.cmdline() for p in psutil.process_iter(["cmdline"]) if serves(p.info["cmdline"] or [], Q8_MODEL)]
    assert server[server.index("--cache-type-k") + 1] == server[server.index("--cache-type-v") + 1] == "q8_0"

    client = openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)
    for prompt in PROMPTS:
        as_shipped = greedy_tokens(client, DEMO_MODEL_ID, prompt)
        in_8_bits = greedy_tokens(client, Q8_MODEL, prompt)
        alike = next((i for i, pair in enumerate(zip(as_shipped, in_8_bits, strict=False)) if pair[0] != pair[1]), None)
        assert alike is None or alike >= SAME_START, (prompt, as_shipped, in_8_bits)


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ({"engine": "mlx", "serving": {"kv_cache_type": "q8_0"}}, "kv_cache_type q8_0 is llama.cpp's"),
        ({"serving": {"kv_cache_type": "q3_k"}}, "kv_cache_type"),
    ],
)
def test_a_kv_cache_type_that_cannot_be_is_a_clear_400(
    llamacpp_cluster: LlamaCppCluster, asked: dict[str, object], says: str
) -> None:
    body = {"model_id": DEMO_MODEL_ID, "min_nodes": 1, **asked}
    response = httpx.post(f"{llamacpp_cluster.api}/instances", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert says in response.text
