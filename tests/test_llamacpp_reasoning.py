"""A thinking GGUF served by llama.cpp gives its thinking as reasoning in every dialect, as a thinking model on MLX
does (tests/test_reasoning.py): OpenAI chat's `reasoning_content`, the Responses API's `reasoning` item, Anthropic's
`thinking` block, Ollama's `message.thinking`; streamed and not, counted in the usage, turned off by each dialect's
switch; and Anthropic's `thinking.budget_tokens` ends the thinking, the answer following.

The split is llama-server's own: its chat parser prepends the generation prompt to what the model writes, so a
template whose generation prompt opens the reasoning (`<think>\\n`, as Qwen3-Thinking-2507's and DeepSeek-R1's do)
makes everything up to `</think>` reasoning. The model is the tiny qwen3 GGUF with such a template
(`QWEN3_OPEN_THINKING_TEMPLATE`): its random weights never write `</think>`, so, greedy, all it writes is
reasoning, until a budget forces the end marker. Every dialect renders "Is it?" to the same prompt, so each one's
reasoning is asserted equal to OpenAI chat's, word for word.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers.gguf_models import QWEN3_OPEN_THINKING_TEMPLATE, write_tiny_gguf
from helpers.llamacpp_cluster import LlamaCppCluster

pytestmark = pytest.mark.timeout(300)

THINKER = "local/tiny-thinker"
QUESTION = [{"role": "user", "content": "Is it?"}]
MAX_TOKENS = 8
GREEDY = {"temperature": 0}
"""The same tokens every time, in every dialect (the Anthropic client no longer takes `temperature` itself)."""


@pytest.fixture(scope="module")
def thinker(llamacpp_cluster: LlamaCppCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The thinking GGUF imported on the node and placed on llama.cpp; removed after."""
    path = tmp_path_factory.mktemp("thinker") / "tiny-thinker-F16.gguf"
    write_tiny_gguf(path, "qwen3", chat_template=QWEN3_OPEN_THINKING_TEMPLATE)
    api, node = llamacpp_cluster.api, llamacpp_cluster.cluster.node_ids["node-a"]
    body = {"node_id": node, "model_id": THINKER, "path": str(path)}
    imported = httpx.post(f"{api}/models/import", json=body, timeout=120)
    assert imported.status_code == 201, imported.text
    assert "thinking" in imported.json()["capabilities"]  # the card reads the think markers in the template
    instance = llamacpp_cluster.place(THINKER)
    try:
        llamacpp_cluster.cluster.wait_instance(instance, timeout=240)
        yield THINKER
    finally:
        httpx.delete(f"{api}/instances/{instance}", timeout=30)
        httpx.delete(f"{api}/models/{THINKER}", timeout=30)


@pytest.fixture(scope="module")
def openai_client(llamacpp_cluster: LlamaCppCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def reasoning_of(message: Any) -> Any:
    return (message.model_extra or {}).get("reasoning_content")


def chat(client: openai.OpenAI, model: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0, extra_body=extra or None
    )


@pytest.fixture(scope="module")
def thought(openai_client: openai.OpenAI, thinker: str) -> str:
    """What the model thinks in MAX_TOKENS tokens, as OpenAI chat gives it: the other dialects give the same."""
    reasoning = reasoning_of(chat(openai_client, thinker).choices[0].message)
    assert isinstance(reasoning, str) and len(reasoning.split()) == MAX_TOKENS, reasoning
    return reasoning


# --- OpenAI chat ----------------------------------------------------------------------------------------------


def test_openai_chat_gives_the_output_as_reasoning_and_counts_it(
    openai_client: openai.OpenAI, thinker: str, thought: str
) -> None:
    answer = chat(openai_client, thinker)
    choice = answer.choices[0]
    assert (reasoning_of(choice.message), choice.message.content) == (thought, "")
    assert choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens == answer.usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS

    stream = openai_client.chat.completions.create(
        model=thinker,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [(reasoning_of(c.choices[0].delta), c.choices[0].delta.content) for c in chunks if c.choices]
    assert "".join(r or "" for r, _ in deltas) == thought
    assert not "".join(t or "" for _, t in deltas)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS


def test_openai_thinking_switches_reach_the_template(openai_client: openai.OpenAI, thinker: str) -> None:
    """Off, the template closes the reasoning in the prompt (`<think>\\n\\n</think>`): all the model writes is its
    answer."""
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        answer = chat(openai_client, thinker, **extra)
        message = answer.choices[0].message
        assert reasoning_of(message) is None and message.content, extra
        assert answer.usage is not None and answer.usage.completion_tokens_details is not None
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0


# --- the Responses API ------------------------------------------------------------------------------------------


def test_responses_give_a_reasoning_item(openai_client: openai.OpenAI, thinker: str, thought: str) -> None:
    response = openai_client.responses.create(model=thinker, input="Is it?", max_output_tokens=MAX_TOKENS, **GREEDY)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [part.text for part in reasoning.content or []] == [thought]
    assert response.output_text == "" and response.status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == MAX_TOKENS

    events = list(
        openai_client.responses.create(
            model=thinker, input="Is it?", max_output_tokens=MAX_TOKENS, stream=True, **GREEDY
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [thought]
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
    assert not [e for e in events if e.type == "response.output_text.delta"]

    quiet = openai_client.responses.create(
        model=thinker, input="Is it?", max_output_tokens=MAX_TOKENS, reasoning={"effort": "none"}, **GREEDY
    )
    assert [item.type for item in quiet.output] == ["message"] and quiet.output_text


# --- Anthropic --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def anthropic_client(llamacpp_cluster: LlamaCppCluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=llamacpp_cluster.api, api_key="unused", timeout=120, max_retries=0)


def blocks(message: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_anthropic_thinking_is_a_thinking_block_and_off_unless_asked(
    anthropic_client: anthropic.Anthropic, thinker: str, thought: str
) -> None:
    request: Any = {"model": thinker, "max_tokens": MAX_TOKENS, "messages": QUESTION, "extra_body": GREEDY}
    adaptive = anthropic_client.messages.create(**request, thinking={"type": "adaptive"})  # the model's default
    assert blocks(adaptive) == [("thinking", thought)]
    assert adaptive.usage.output_tokens == MAX_TOKENS and adaptive.stop_reason == "max_tokens"

    # Anthropic's models think only when asked: without `thinking`, the template is told not to.
    plain = anthropic_client.messages.create(**request)
    ((kind, text),) = blocks(plain)
    assert kind == "text" and text
    assert anthropic_client.messages.create(**request, thinking={"type": "disabled"}).content == plain.content


BUDGET = 3
"""llama.cpp counts the budget from the start marker, here the template's: the newline the generation prompt writes
after `<think>` is its first token, so the model thinks BUDGET - 1 tokens of its own before `</think>` is forced."""


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(
    anthropic_client: anthropic.Anthropic, openai_client: openai.OpenAI, thinker: str
) -> None:
    first_thoughts = reasoning_of(chat(openai_client, thinker, max_tokens=BUDGET - 1).choices[0].message)
    request: Any = {
        "model": thinker,
        "max_tokens": MAX_TOKENS,
        "messages": QUESTION,
        "extra_body": GREEDY,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
    }
    message = anthropic_client.messages.create(**request)
    (kind, thinking), (answer_kind, answer) = blocks(message)
    assert (kind, thinking, answer_kind) == ("thinking", first_thoughts, "text")
    assert answer.strip() and "think>" not in answer
    assert message.usage.output_tokens == MAX_TOKENS

    with anthropic_client.messages.stream(**request) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(message)
    assert events.count("content_block_start") == 2 and "signature" in events


# --- Ollama -----------------------------------------------------------------------------------------------------


def test_ollama_think_gives_message_thinking(llamacpp_cluster: LlamaCppCluster, thinker: str, thought: str) -> None:
    client = ollama.Client(host=llamacpp_cluster.api, timeout=120)
    options = {"num_predict": MAX_TOKENS, **GREEDY}
    answer = client.chat(model=thinker, messages=QUESTION, think=True, options=options)
    assert (answer.message.thinking, answer.message.content) == (thought, "")
    assert answer.eval_count == MAX_TOKENS and answer.done_reason == "length"

    pieces = list(client.chat(model=thinker, messages=QUESTION, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in pieces) == thought
    assert not "".join(p.message.content or "" for p in pieces)
    assert pieces[-1].eval_count == MAX_TOKENS

    generated = client.generate(model=thinker, prompt="Is it?", think=True, options=options)
    assert (generated.thinking, generated.response) == (thought, "")

    quiet = client.chat(model=thinker, messages=QUESTION, think=False, options=options)
    assert quiet.message.thinking is None and quiet.message.content
