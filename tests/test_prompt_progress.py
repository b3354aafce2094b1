"""A long prompt says how far it is processed, on both engines: before the output, its runner sends progress chunks
(tokens done of the prompt's total) that arrive in order and end at the total, and a streaming client that waits is
told so in its keep-alive comments. A short prompt sends none."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import httpx
import pytest
from helpers.dialects import DialectCluster
from helpers.llamacpp_cluster import LlamaCppCluster
from jetshard_api.tasks import waiting_for
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_schema.codec import decode_chunk
from jetshard_schema.ids import InstanceId, ModelId, TaskId
from jetshard_schema.state import State, Task
from jetshard_schema.subjects import CHUNK_PREFIX
from jetshard_schema.types import PromptProgress, TaskKind, TaskRef, TaskRequest
from jetshard_worker.text.output import PROGRESS_FROM_TOKENS

pytestmark = pytest.mark.timeout(300)


async def progress_of(nats_url: str, api: str, model: str, words: int) -> tuple[list[tuple[int, int, int]], int]:
    """Ask `model` about a prompt of `words` words: the progress chunks its task sent (index, done, total), and
    the prompt's tokens as the answer's usage counts them."""
    client, _ = await connect(NatsOptions(servers=(nats_url,)), "test-progress")
    chunks: dict[str, list[tuple[int, int, int]]] = defaultdict(list)

    async def on_chunk(msg: Any) -> None:
        chunk = decode_chunk(msg.data)
        if chunk.prompt_progress is not None:
            progress = chunk.prompt_progress
            chunks[chunk.task_id].append((chunk.index, progress.done_tokens, progress.total_tokens))

    subscription = await client.subscribe(f"{CHUNK_PREFIX}.>", cb=on_chunk)
    try:
        prompt = "Summarise this: " + " ".join(f"word{n % 50}" for n in range(words))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0}
        async with httpx.AsyncClient(base_url=api, timeout=240) as http:
            answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        await asyncio.sleep(0.5)  # deliberate: chunks and the answer travel apart; the last ones are on their way
    finally:
        await subscription.unsubscribe()
        await client.close()
    assert len(chunks) <= 1, chunks
    return next(iter(chunks.values()), []), answer.json()["usage"]["prompt_tokens"]


def assert_in_order_to_the_total(progress: list[tuple[int, int, int]], prompt_tokens: int) -> None:
    assert progress, "a long prompt sent no progress"
    assert [index for index, _, _ in progress] == list(range(len(progress)))  # before any output
    done = [d for _, d, _ in progress]
    assert done == sorted(done) and {t for _, _, t in progress} == {prompt_tokens}
    assert done[-1] == prompt_tokens


async def test_mlx_tells_how_far_a_long_prompt_is(dialect_cluster: DialectCluster) -> None:
    cluster = dialect_cluster.cluster
    progress, prompt_tokens = await progress_of(cluster.nats.url, cluster.api, dialect_cluster.model, 330)
    assert PROGRESS_FROM_TOKENS <= prompt_tokens < 2048, prompt_tokens  # the tiny model's context
    assert_in_order_to_the_total(progress, prompt_tokens)
    short, _ = await progress_of(cluster.nats.url, cluster.api, dialect_cluster.model, 20)
    assert short == []


async def test_llama_cpp_tells_how_far_a_long_prompt_is(llamacpp_cluster: LlamaCppCluster) -> None:
    cluster = llamacpp_cluster.cluster
    progress, prompt_tokens = await progress_of(cluster.nats.url, cluster.api, llamacpp_cluster.model, 1100)
    assert prompt_tokens >= 2 * PROGRESS_FROM_TOKENS, prompt_tokens
    assert_in_order_to_the_total(progress, prompt_tokens)
    assert len(progress) >= 2  # llama.cpp processes it in batches of 2048 tokens: at least one before the end


def test_a_waiting_client_is_told_how_far_its_prompt_is() -> None:
    request = TaskRequest(task_id=TaskId("t1"), model_id=ModelId("org/m"), kind=TaskKind.CHAT, prompt="hi")
    ref = TaskRef(task_id=request.task_id, model_id=request.model_id, kind=TaskKind.CHAT)
    task = Task(ref=ref, instance_id=InstanceId("i1"), generation=1, started=True)
    state = State(tasks={request.task_id: task})
    assert waiting_for(state, request) == "processing the prompt"
    progress = PromptProgress(done_tokens=2048, total_tokens=5000)
    assert waiting_for(state, request, progress) == "processing the prompt: 2048 of 5000 tokens"
