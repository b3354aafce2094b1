"""GGUF files as people download them, served by llama.cpp: tiny qwen3 and gemma3 K-quants and a llama Q4_0,
generated with gguf-py and quantized with the suite's llama.cpp build, imported through the node's downloader,
placed (placement picks llama.cpp: no MLX form of a K-quant), and asked through every dialect's official client.

Their weights are random, so the answers are gibberish: the tests assert what the cluster guarantees (a card read
from the file, an answer of the asked length with its usage, a call the grammar holds to its schema), not words.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from helpers.gguf_fixtures import TinyGGUFs
from helpers.llamacpp_cluster import LlamaCppCluster

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "qwen3": ("local/tiny-qwen3", "Q4_K_M"),
    "gemma3": ("local/tiny-gemma3", "Q4_K_M"),
    "llama": ("local/tiny-llama", "Q4_0"),
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(llamacpp_cluster: LlamaCppCluster, tiny_ggufs: TinyGGUFs) -> Iterator[dict[str, dict[str, object]]]:
    """Each tiny model imported on the node and placed by placement's own choice: its card and instance."""
    cluster = llamacpp_cluster.cluster
    node = cluster.node_ids["node-a"]
    cards, instances = {}, []
    try:
        for arch, (model_id, file_type) in MODELS.items():
            path = tiny_ggufs.get(arch, file_type)
            body = {"node_id": node, "model_id": model_id, "path": str(path)}
            response = httpx.post(f"{llamacpp_cluster.api}/models/import", json=body, timeout=120)
            assert response.status_code == 201, response.text
            cards[arch] = response.json() | {"file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            placed = httpx.post(f"{llamacpp_cluster.api}/instances", json={"model_id": model_id}, timeout=60)
            assert placed.status_code == 201, placed.text
            instances.append(placed.json()["instance_id"])
        cluster.watch_until_ready(instances, timeout=240)
        yield cards
    finally:
        for instance_id in instances:
            httpx.delete(f"{llamacpp_cluster.api}/instances/{instance_id}", timeout=30)
        for model_id, _ in MODELS.values():
            httpx.delete(f"{llamacpp_cluster.api}/models/{model_id}", timeout=30)


def test_each_card_comes_from_its_gguf_and_placement_picks_llama_cpp(
    served: dict[str, dict[str, object]], llamacpp_cluster: LlamaCppCluster
) -> None:
    assert {arch: (card["architecture"], card["file_type"]) for arch, card in served.items()} == {
        "qwen3": ("qwen3", "Q4_K_M"),
        "gemma3": ("gemma3", "Q4_K_M"),
        "llama": ("llama", "Q4_0"),
    }
    assert served["qwen3"]["formats"] == ["gguf"]  # a K-quant MLX cannot hold: llama.cpp only
    assert "thinking" in served["qwen3"]["capabilities"] and "tools" in served["qwen3"]["capabilities"]
    for model_id, _ in MODELS.values():
        (instance,) = llamacpp_cluster.cluster.instances_of(model_id)
        assert instance["engine"] == "llama.cpp", instance


def test_ollama_lists_an_imported_gguf_by_its_files_sha256(
    served: dict[str, dict[str, object]], llamacpp_cluster: LlamaCppCluster
) -> None:
    """`ollama ls` shows a model's ID from its digest: an imported file's is its real sha256, read as it was
    stored, as Ollama's own is its blob's."""
    listed = {m.model: m.digest for m in ollama.Client(host=llamacpp_cluster.api).list().models}
    for arch, (model_id, _) in MODELS.items():
        assert served[arch]["source_sha256"] == served[arch]["file_sha256"]
        assert listed[f"{model_id}:latest"] == served[arch]["file_sha256"]


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_dialect_answers_from_a_downloaded_gguf(
    arch: str, served: object, llamacpp_cluster: LlamaCppCluster
) -> None:
    api, model = llamacpp_cluster.api, MODELS[arch][0]
    ask = [{"role": "user", "content": "Hello there"}]
    client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=model, messages=ask, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens > 0 and 1 <= chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=model,
        messages=ask,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=NO_THINKING,  # type: ignore[arg-type]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    message = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0).messages.create(
        model=model,
        max_tokens=8,
        messages=ask,
        extra_body=NO_THINKING,  # type: ignore[arg-type]
    )
    assert message.usage.output_tokens >= 1
    answer = ollama.Client(host=api).chat(
        model=model, messages=ask, think=False, options={"temperature": 0, "num_predict": 8}
    )
    assert answer.eval_count is not None and answer.eval_count >= 1
    response = client.responses.create(model=model, input="Hello there", max_output_tokens=8, temperature=0)
    assert response.usage is not None and response.usage.output_tokens >= 1


def test_a_qwen3_template_renders_the_tools_it_is_given(served: object, llamacpp_cluster: LlamaCppCluster) -> None:
    """The model's own template takes the tools (llama.cpp parses its calls): the prompt grows by their
    description. Random weights never write a call; a forced call is shown on the demo, whose template takes none
    (test_llamacpp_dialects), and llama.cpp's grammar for Qwen3's format lets such a model write newlines for ever."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    client = openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", max_retries=0, timeout=120)

    def prompt_tokens(**tools: object) -> int:
        reply = client.chat.completions.create(
            model=MODELS["qwen3"][0],
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            max_tokens=1,
            temperature=0,
            extra_body=NO_THINKING,
            **tools,  # type: ignore[arg-type]
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    assert prompt_tokens(tools=[weather]) > prompt_tokens() + 20


def test_structured_output_on_a_k_quant_follows_its_schema(served: object, llamacpp_cluster: LlamaCppCluster) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODELS["gemma3"][0],
        messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
