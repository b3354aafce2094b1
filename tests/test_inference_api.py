"""Pipeline-parallel inference behind the OpenAI-compatible API, end to end.

One cluster per module, all real processes: nats-server, a sequencer, an API, and two full nodes (a worker
and a downloader each, with their own config and model directories). Tiny llama and qwen3 models, split
over several safetensors files with an index, are served by the local Hub server, added with
`POST /models` and placed with `min_nodes: 2`, so every request runs through two ranks joined by MLX's
ring backend. Clients are the official `openai` package.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from helpers.harness import ChunkTap, InferenceCluster, assert_layer_ranges, hub_cluster, wait_for
from helpers.tiny_models import make_tiny_model
from helpers.tiny_vlm import data_url, image_question, make_tiny_vlm, mlx_vlm_greedy, png
from jetshard_schema.events import TaskCancelled, TaskFinished
from jetshard_schema.types import TaskOutcome

ORG = "jetshard-test"
LLAMA = f"{ORG}/tiny-llama"
QWEN = f"{ORG}/tiny-qwen3"
UNPLACED = f"{ORG}/tiny-unplaced"
VISION = f"{ORG}/tiny-vlm"
MODELS = {LLAMA: "llama", QWEN: "qwen3"}
MAX_TOKENS = 20
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick brown fox"}],
    [{"role": "user", "content": "a"}],
    [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and three plus three?"},
    ],
    [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm."}],
]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("inference")
    dirs = {
        model_id: make_tiny_model(root / "repos" / arch, arch=arch, num_layers=4, num_files=3)
        for model_id, arch in MODELS.items()
    }
    dirs[UNPLACED] = make_tiny_model(root / "repos" / "unplaced", arch="llama", num_layers=2, num_files=2, seed=3)
    dirs[VISION] = make_tiny_vlm(root / "repos" / "vlm", split=True)
    with hub_cluster(root, env={"JETSHARD_COUNTERS_INTERVAL_S": "0.5"}) as c:
        for model_id, path in dirs.items():
            c.hub.add_repo(model_id, path)
        c.model_dirs = dirs  # type: ignore[attr-defined]
        c.start_core()
        for node in ("node-a", "node-b"):
            c.start_node(node)
        c.wait_nodes(2)
        for model_id in dirs:
            c.add_model(model_id)
        c.instance_ids = {m: c.place(m, min_nodes=2) for m in MODELS}  # type: ignore[attr-defined]
        c.vision_instance = c.place(VISION, min_nodes=2)  # type: ignore[attr-defined]
        seen = c.watch_until_ready([*c.instance_ids.values(), c.vision_instance])  # type: ignore[attr-defined]
        c.statuses = {m: seen[i] for m, i in c.instance_ids.items()}  # type: ignore[attr-defined]
        yield c


@pytest.fixture(scope="module")
def client(cluster: InferenceCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def mlx_models(cluster: InferenceCluster) -> dict[str, tuple[Any, Any]]:
    from mlx_lm import load

    return {m: load(str(cluster.model_dirs[m])) for m in MODELS}  # type: ignore[attr-defined]


def generate(loaded: tuple[Any, Any], ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    """Single-process mlx-lm greedy output on the same weights."""
    from mlx_lm.generate import stream_generate

    model, tokenizer = loaded
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens))


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


@pytest.fixture(scope="module")
def references(mlx_models: dict[str, tuple[Any, Any]]) -> dict[str, list[str]]:
    """mlx-lm's greedy output for every conversation, per model."""
    return {
        m: [generate(loaded, chat_ids(loaded[1], messages)) for messages in CONVERSATIONS]
        for m, loaded in mlx_models.items()
    }


def chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, **kwargs)  # type: ignore[arg-type]


def stream_text(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    **kwargs: Any,
) -> tuple[str, list[Any]]:
    chunks = list(chat(client, model, messages, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ------------------------------------------------------------------------------------------- placement


def test_instances_span_both_nodes(cluster: InferenceCluster) -> None:
    for model_id, instance_id in cluster.instance_ids.items():  # type: ignore[attr-defined]
        shown = cluster.get(f"/instances/{instance_id}")
        assert shown["status"] == "ready"
        shards = sorted(shown["shards"], key=lambda s: s["rank"])
        assert len(shards) == 2
        assert {s["node_id"] for s in shards} == set(cluster.node_ids.values())
        assert shards[0]["start_layer"] == 0 and shards[0]["end_layer"] == shards[1]["start_layer"]
        assert shards[1]["end_layer"] == 4
        # Both nodes compute on their CPU with the reference BLAS (the suite's JETSHARD_BLAS=0): AUTO kept the
        # checkpoint's dtype, and each runner says what it holds.
        assert shown["serving"]["weights"] == "native"
        assert [s["weights_dtype"] for s in shards] == ["float32", "float32"]
        assert [(s["weights"], s["device"]) for s in shards] == [("native", "cpu"), ("native", "cpu")]
        seen = cluster.statuses[model_id]  # type: ignore[attr-defined]
        assert seen[-1] == "ready"
        order = ["downloading", "waiting", "loading", "ready"]
        assert [order.index(s) for s in seen] == sorted(order.index(s) for s in seen), seen
        assert "downloading" in seen or "loading" in seen, seen
        assert_layer_ranges(cluster.get("/state"), instance_id)


# ------------------------------------------------------------------------------------------- equality


def test_a_vision_model_over_two_nodes_answers_a_picture_as_mlx_vlm(
    cluster: InferenceCluster, client: openai.OpenAI
) -> None:
    """The node of rank 0 downloads and runs the vision tower and projector; the other only its layers."""
    from mlx_vlm.utils import load_processor

    model_dir = cluster.model_dirs[VISION]  # type: ignore[attr-defined]
    question, picture = "What is in this picture?", png(20, 30, seed=2)
    expected = mlx_vlm_greedy(model_dir, question, picture, MAX_TOKENS)
    reply = chat(client, VISION, image_question(data_url(picture), question), temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == load_processor(model_dir).tokenizer.decode(expected)

    instance = cluster.get("/state")["instances"][cluster.vision_instance]  # type: ignore[attr-defined]
    first, second = (set(instance["runners"][rank]["loaded_tensors"]) for rank in ("0", "1"))
    assert {name.split(".")[0] for name in first} == {"model", "vision_model", "connector"}
    assert {name.split(".")[0] for name in second} == {"model", "lm_head"}


@pytest.mark.parametrize("model_id", list(MODELS))
def test_greedy_output_equals_mlx_lm(
    cluster: InferenceCluster, client: openai.OpenAI, references: dict[str, list[str]], model_id: str
) -> None:
    for messages, expected in zip(CONVERSATIONS, references[model_id], strict=True):
        response = chat(client, model_id, messages, temperature=0, max_tokens=MAX_TOKENS)
        assert response.choices[0].message.content == expected, messages
        streamed, _ = stream_text(client, model_id, messages, temperature=0, max_tokens=MAX_TOKENS)
        assert streamed == expected, messages
    assert any(references[model_id]), "the tiny model generated nothing at all"


def test_concurrent_requests_batch_and_each_equals_mlx_lm(
    cluster: InferenceCluster, client: openai.OpenAI, references: dict[str, list[str]]
) -> None:
    with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        answers = list(
            pool.map(
                lambda messages: chat(client, LLAMA, messages, temperature=0, max_tokens=MAX_TOKENS),
                CONVERSATIONS,
            )
        )
    assert [a.choices[0].message.content for a in answers] == references[LLAMA]

    # The leader reports what it served now and then (every 0.5 s here): the requests shared decode steps, and
    # asking a conversation again started from its saved prompt cache.
    chat(client, LLAMA, CONVERSATIONS[4], temperature=0, max_tokens=MAX_TOKENS)

    def leader_counters() -> dict[str, Any]:
        instance = cluster.get("/state")["instances"][cluster.instance_ids[LLAMA]]  # type: ignore[attr-defined]
        leader = instance["runners"][str(len(instance["shards"]) - 1)]
        return leader.get("counters") or {}

    assert wait_for(lambda: leader_counters().get("max_rows", 0) > 1 and leader_counters()["prefix_hits"] > 0, 30)


def test_completions_equal_mlx_lm(client: openai.OpenAI, mlx_models: dict[str, tuple[Any, Any]]) -> None:
    for prompt in ("once upon a time", "the cat sat on the", "x"):
        loaded = mlx_models[QWEN]
        expected = generate(loaded, list(loaded[1].encode(prompt)))
        response = client.completions.create(model=QWEN, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        assert response.choices[0].text == expected
        assert response.object == "text_completion"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=QWEN, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
            )
            if c.choices
        )
        assert streamed == expected


# ------------------------------------------------------------------------------------------- OpenAI surface


def test_stream_ends_with_done_and_a_usage_chunk(cluster: InferenceCluster) -> None:
    body = {
        "model": LLAMA,
        "messages": CONVERSATIONS[0],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{cluster.api}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data:")) for line in lines[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    usage_chunk = payloads[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p or p["usage"] is None for p in payloads[:-1])


def test_include_usage_with_the_openai_client(client: openai.OpenAI) -> None:
    chunks = list(
        chat(
            client,
            QWEN,
            CONVERSATIONS[1],
            stream=True,
            max_tokens=4,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert not chunks[-1].choices
    without = list(chat(client, QWEN, CONVERSATIONS[1], stream=True, max_tokens=4, temperature=0))
    assert all(c.usage is None for c in without)


def test_usage_and_finish_reason_length(client: openai.OpenAI) -> None:
    response = chat(client, LLAMA, CONVERSATIONS[2], max_tokens=6, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"


def test_max_completion_tokens(client: openai.OpenAI, references: dict[str, list[str]]) -> None:
    response = chat(client, LLAMA, CONVERSATIONS[0], max_completion_tokens=3, temperature=0)
    assert response.usage is not None and response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"
    assert references[LLAMA][0].startswith(response.choices[0].message.content or "")


def _stop_string(text: str) -> str:
    """Three ASCII letters from the middle of `text`: several tokens, so the match spans chunks."""
    for start in range(2, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.isascii() and candidate.isalpha() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("model_id", list(MODELS))
def test_stop_strings(client: openai.OpenAI, references: dict[str, list[str]], model_id: str) -> None:
    for messages, full in list(zip(CONVERSATIONS, references[model_id], strict=True))[:3]:
        stop = _stop_string(full)
        expected = full[: full.index(stop)]
        response = chat(client, model_id, messages, temperature=0, max_tokens=MAX_TOKENS, stop=[stop, "@@@@"])
        assert response.choices[0].message.content == expected
        assert response.choices[0].finish_reason == "stop"
        streamed, chunks = stream_text(client, model_id, messages, temperature=0, max_tokens=MAX_TOKENS, stop=stop)
        assert streamed == expected
        assert stop not in streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    messages = CONVERSATIONS[4]
    first = chat(client, QWEN, messages, temperature=1.0, seed=1234, max_tokens=MAX_TOKENS)
    second = chat(client, QWEN, messages, temperature=1.0, seed=1234, max_tokens=MAX_TOKENS)
    assert first.choices[0].message.content == second.choices[0].message.content
    streamed, _ = stream_text(client, QWEN, messages, temperature=1.0, seed=1234, max_tokens=MAX_TOKENS)
    assert streamed == first.choices[0].message.content
    others = {
        chat(client, QWEN, messages, temperature=1.0, seed=s, max_tokens=MAX_TOKENS).choices[0].message.content
        for s in (1, 2, 3)
    }
    assert len(others | {first.choices[0].message.content}) > 1, "the seed changes nothing"


def test_content_as_text_parts_and_neutral_parameters(client: openai.OpenAI, references: dict[str, list[str]]) -> None:
    text_parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    parts = [{"role": "user", "content": text_parts}]
    response = chat(
        client,
        LLAMA,
        parts,
        temperature=0,
        max_tokens=MAX_TOKENS,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        top_p=1,
    )
    assert response.choices[0].message.content == references[LLAMA][0]


WIDE = {"type": "object", "properties": {"p": {"enum": [*range(400)]}}, "required": ["p"]}
"""400 choices: three functions of it offer more than a schema may."""


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {"42": 5}},
        {"presence_penalty": 2.5},
        {"n": 17},
        {"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}]},
        {"tool_choice": {"type": "function", "function": {"name": "absent"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"top_logprobs": 21},
        # a call's arguments are an object, as OpenAI requires
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        # more choices than llama.cpp's grammar sampler walks in a fraction of a second a token
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [*range(1001)]}}}},
        {"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": WIDE}} for i in range(3)]},
        # OpenAI's deprecated forms of tools and tool_choice would change the answer: refused, not ignored
        {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
        {"function_call": "auto"},
    ],
)
def test_unsupported_or_invalid_parameters_are_refused(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, LLAMA, CONVERSATIONS[0], max_tokens=3, stream=stream, **extra)
        error = caught.value
        assert error.status_code == 400
        assert isinstance(error.body, dict) and error.body["message"], error.body
        assert error.body["type"] == "invalid_request_error"
        assert error.body["param"].startswith(next(iter(extra)))


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("temperature", "0"), ("seed", -1), ("seed", 2**64), ("seed", "7")],
)
def test_a_value_of_the_wrong_type_or_range_is_refused(
    cluster: InferenceCluster, client: openai.OpenAI, field: str, value: Any
) -> None:
    bodies = {
        "chat/completions": {"model": LLAMA, "messages": CONVERSATIONS[0], "max_tokens": 3},
        "completions": {"model": LLAMA, "prompt": "hello", "max_tokens": 3},
    }
    for route, body in bodies.items():
        response = httpx.post(f"{cluster.api}/v1/{route}", json={**body, field: value}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == field and error["message"], error
    largest_seed = chat(client, LLAMA, CONVERSATIONS[0], max_tokens=2, temperature=1.0, seed=2**64 - 1)
    assert largest_seed.usage is not None and largest_seed.usage.completion_tokens == 2


def test_a_request_without_sampling_values_gets_the_models_own(
    client: openai.OpenAI, references: dict[str, list[str]]
) -> None:
    """The tiny models' generation_config.json says `do_sample: false`: greedy unless the request says not."""
    response = chat(client, LLAMA, CONVERSATIONS[0], max_tokens=MAX_TOKENS)
    assert response.choices[0].message.content == references[LLAMA][0]


def test_a_prompt_longer_than_the_context_is_refused(client: openai.OpenAI) -> None:
    long_prompt = " ".join(["zq"] * 3000)  # the model's context is 2048 tokens
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, QWEN, [{"role": "user", "content": long_prompt}], max_tokens=3, stream=stream)
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as completion_error:
        client.completions.create(model=QWEN, prompt=long_prompt, max_tokens=3)
    assert isinstance(completion_error.value.body, dict)
    assert completion_error.value.body["code"] == "context_length_exceeded"
    assert chat(client, QWEN, CONVERSATIONS[0], max_tokens=2).usage is not None  # still serving


def test_models_lists_ready_and_placeable(client: openai.OpenAI, cluster: InferenceCluster) -> None:
    listed = {m.id: m for m in client.models.list()}
    assert {LLAMA, QWEN, UNPLACED} <= set(listed)
    raw = {m["id"]: m for m in cluster.get("/v1/models")["data"]}
    assert raw[LLAMA]["ready"] and raw[QWEN]["ready"]
    assert not raw[UNPLACED]["ready"] and raw[UNPLACED]["placeable"]
    assert (raw[LLAMA]["engines"], raw[UNPLACED]["engines"]) == (["mlx"], [])  # what serves it, once ready
    order = list(raw)
    assert order.index(LLAMA) < order.index(UNPLACED) and order.index(QWEN) < order.index(UNPLACED)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as caught:
            chat(client, f"{ORG}/no-such-model", CONVERSATIONS[0], max_tokens=3, stream=stream)
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "model_not_found"
        assert LLAMA in caught.value.body["message"]


# ------------------------------------------------------------------------------------------- disconnects


def _task_id(chunk_id: str) -> str:
    return "task-" + chunk_id.removeprefix("chatcmpl-")


def test_disconnect_mid_stream_cancels_the_task(
    cluster: InferenceCluster, client: openai.OpenAI, references: dict[str, list[str]]
) -> None:
    max_tokens = 1500
    since = cluster.last_seq()
    with ChunkTap(cluster.nats.url) as tap:
        stream = chat(client, LLAMA, CONVERSATIONS[4], stream=True, max_tokens=max_tokens, temperature=0)
        seen = [next(stream) for _ in range(4)]
        stream.close()
        task_id = _task_id(seen[0].id)
        cancelled = cluster.wait_event(lambda e: isinstance(e, TaskCancelled) and e.task_id == task_id, since)
        assert isinstance(cancelled, TaskCancelled)
        assert wait_for(lambda: tap.final(task_id) is not None, timeout=60), tap.chunks.get(task_id)
        final = tap.final(task_id)
    assert final.finish_reason == TaskOutcome.CANCELLED
    assert final.usage is not None and final.usage.completion_tokens < max_tokens
    assert sum(c.token_count for c in tap.chunks[task_id]) < max_tokens
    assert not any(
        isinstance(e, TaskFinished) and e.task_id == task_id and e.outcome != TaskOutcome.CANCELLED
        for _, e in cluster.events(since)
    )
    # The next request is served, with the same output as before.
    response = chat(client, LLAMA, CONVERSATIONS[0], temperature=0, max_tokens=MAX_TOKENS)
    assert response.choices[0].message.content == references[LLAMA][0]


def test_cancel_at_random_steps_keeps_serving(
    cluster: InferenceCluster, client: openai.OpenAI, references: dict[str, list[str]]
) -> None:
    rng = random.Random(7)
    task_ids = []
    for i in range(20):
        model_id = (LLAMA, QWEN)[i % 2]
        stream = chat(
            client,
            model_id,
            CONVERSATIONS[i % len(CONVERSATIONS)],
            stream=True,
            max_tokens=1000,
            temperature=rng.choice([0, 0.8]),
            seed=i,
        )
        for _ in range(rng.randint(1, 12)):
            chunk = next(stream)
            task_ids.append(_task_id(chunk.id))
        stream.close()
    for model_id in MODELS:
        response = chat(client, model_id, CONVERSATIONS[0], temperature=0, max_tokens=MAX_TOKENS)
        assert response.choices[0].message.content == references[model_id][0]
    # Every cancelled task is gone from State: nothing keeps generating for a client that left.
    assert wait_for(lambda: not set(task_ids) & set(cluster.get("/state")["tasks"]), timeout=60)
