"""Anthropic's Messages API, with the official `anthropic` client against a live cluster (the session's
`dialect_cluster`: a tiny llama model on one runner): messages and their event streams, forced tool calls and
their results, structured output, token counts, and errors in Anthropic's shape.

The tiny model writes gibberish, so these tests assert structure and what constrained decoding guarantees (a
call whose input validates), not words.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import msgspec
import ollama
import pytest
from helpers.dialects import WEATHER_PARAMETERS, DialectCluster
from jetshard_api.app import create_app
from jetshard_api.cluster import Cluster
from jetshard_api.dialects.anthropic.types import CountTokensRequest, messages_task
from jetshard_api.safety import HttpSafety
from jetshard_bus.follower import StateFollower
from jetshard_schema.ids import new_task_id, parse_model_id
from jetshard_schema.types import ChatMessage, SamplingParams, ToolCall, ToolChoice
from litestar.testing import TestClient

pytestmark = pytest.mark.timeout(240)

WEATHER_TOOL: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED: Any = {"type": "tool", "name": "get_weather"}
BUDGET = 200
"""Tokens for a constrained document: the tiny model writes its strings in odd characters of several tokens each,
and a document the budget would cut is closed early and ends as `max_tokens`."""


@pytest.fixture(scope="module")
def client(dialect_cluster: DialectCluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=dialect_cluster.api, api_key="unused", timeout=120, max_retries=0)


def test_a_message_and_its_stream_agree(client: anthropic.Anthropic, dialect_cluster: DialectCluster) -> None:
    request: Any = {
        "model": dialect_cluster.model,
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": QUESTION,
        "extra_body": {"temperature": 0},  # this client has no sampling arguments left; older ones and tools send them
    }
    message = client.messages.create(**request)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == dialect_cluster.model
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8

    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == message.stop_reason
    assert final.usage.input_tokens == message.usage.input_tokens
    assert final.usage.output_tokens == message.usage.output_tokens

    kinds = [event.type for event in client.messages.create(**request, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_a_stop_sequence_that_ends_the_answer_is_named(
    client: anthropic.Anthropic, dialect_cluster: DialectCluster
) -> None:
    request: Any = {
        "model": dialect_cluster.model,
        "max_tokens": 24,
        "messages": QUESTION,
        "extra_body": {"temperature": 0},
    }
    whole = client.messages.create(**request).content[0].text  # type: ignore[union-attr]
    stop = whole[len(whole) // 2 :][:2]  # greedy: the same answer again meets it halfway
    assert stop.strip(), whole
    expected = whole[: whole.index(stop)]
    request["stop_sequences"] = ["a stop it never writes", stop]
    message = client.messages.create(**request)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in message.content if block.type == "text") == expected
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (text, final.stop_reason, final.stop_sequence) == (expected, "stop_sequence", stop)


def test_a_forced_tool_call_and_its_result(client: anthropic.Anthropic, dialect_cluster: DialectCluster) -> None:
    message = client.messages.create(
        model=dialect_cluster.model, max_tokens=BUDGET, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=FORCED
    )
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_PARAMETERS)

    conversation: Any = [
        *QUESTION,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"}]},
    ]
    answer = client.messages.create(
        model=dialect_cluster.model, max_tokens=5, messages=conversation, tools=[WEATHER_TOOL]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens > message.usage.input_tokens


def test_a_forced_call_streams_as_input_json_deltas(
    client: anthropic.Anthropic, dialect_cluster: DialectCluster
) -> None:
    with client.messages.stream(
        model=dialect_cluster.model,
        max_tokens=BUDGET,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        partial = "".join(
            event.delta.partial_json
            for event in stream
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert json.loads(partial) == call.input
    jsonschema.validate(call.input, WEATHER_PARAMETERS)


def test_structured_output_follows_its_schema(client: anthropic.Anthropic, dialect_cluster: DialectCluster) -> None:
    schema = WEATHER_PARAMETERS
    message = client.messages.create(
        model=dialect_cluster.model,
        max_tokens=BUDGET,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


def test_count_tokens_counts_the_prompt_a_message_would_have(
    client: anthropic.Anthropic, dialect_cluster: DialectCluster
) -> None:
    request: Any = {
        "model": dialect_cluster.model,
        "system": "Be brief.",
        "messages": QUESTION,
        "tools": [WEATHER_TOOL],
    }
    count = client.messages.count_tokens(**request)
    message = client.messages.create(**request, max_tokens=1)
    assert count.input_tokens == message.usage.input_tokens > 0


def test_refusals_are_anthropic_errors(client: anthropic.Anthropic, dialect_cluster: DialectCluster) -> None:
    model = dialect_cluster.model
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=model, messages=QUESTION, max_tokens=anthropic.NOT_GIVEN)
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    for wrong in ({"temperature": 1.5}, {"top_k": -1}, {"thinking": {"type": "enabled", "budget_tokens": 1024}}):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=model, messages=QUESTION, max_tokens=5, extra_body=wrong)
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.create(model="nobody/nothing", messages=QUESTION, max_tokens=5, stream=stream)
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_a_prefill_is_continued(client: anthropic.Anthropic, dialect_cluster: DialectCluster) -> None:
    """An assistant's message last is the start of the answer, as Anthropic takes it: the same continuation as
    Ollama's for a trailing assistant message (tests/test_ollama.py checks what that continuation is)."""
    prefill: Any = [*QUESTION, {"role": "assistant", "content": "{"}]
    greedy = {"top_k": 1}
    message = client.messages.create(model=dialect_cluster.model, messages=prefill, max_tokens=5, extra_body=greedy)
    continued = ollama.Client(host=dialect_cluster.api).chat(
        model=dialect_cluster.model, messages=prefill, options={**greedy, "num_predict": 5}
    )
    assert message.content[0].text == continued.message.content  # type: ignore[union-attr]


def test_an_unknown_field_in_thinking_is_refused_naming_it(
    client: anthropic.Anthropic, dialect_cluster: DialectCluster
) -> None:
    """The top level takes other servers' extras (tests/test_dialect_conventions.py); `thinking` is Anthropic's own
    object, and a field there that nothing reads would be a way of thinking asked for and silently not had."""
    model = dialect_cluster.model
    for thinking, named in (
        ({"type": "disabled", "budget": 10}, "`budget`"),
        ({"type": "adaptive", "display": "omitted"}, "thinking.display"),  # not honoured: the reasoning comes whole
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=model, messages=QUESTION, max_tokens=2, thinking=thinking)  # type: ignore[arg-type]
        body: Any = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert named in body["error"]["message"] and "thinking" in body["error"]["message"]
    # The client's own fields pass: `display` as it is summarized by default.
    thinking: Any = {"type": "disabled", "display": "summarized"}
    assert client.messages.create(model=model, messages=QUESTION, max_tokens=2, thinking=thinking).content


def test_a_wrong_api_key_is_an_authentication_error() -> None:
    """The key middleware answers before the route's handler, in the route's error shape. No NATS is needed:
    the request never gets that far."""
    unconnected = Cluster(None, None, StateFollower(None), command_timeout_s=1, liveness_ttl_s=15)  # type: ignore[arg-type]
    app = create_app(unconnected, safety=HttpSafety(api_key="the-key", allowed_hosts=frozenset("*")))
    request = {"model": "org/model", "max_tokens": 5, "messages": QUESTION}
    with TestClient(app) as http:
        response = http.post("/v1/messages", json=request, headers={"x-api-key": "wrong", "anthropic-version": "1"})
    assert response.status_code == 401
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "authentication_error"


def test_a_conversation_with_tool_results_becomes_chat_messages() -> None:
    body = {
        "model": "org/model",
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            *QUESTION,
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }
    request = msgspec.convert(body, CountTokensRequest)
    task = messages_task(new_task_id(), parse_model_id("org/model"), request, SamplingParams(max_tokens=1))
    calls = (
        ToolCall(id="toolu_1", name="get_weather", arguments='{"city": "Paris"}'),
        ToolCall(id="toolu_2", name="get_weather", arguments='{"city": "Rome"}'),
    )
    assert task.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="What is the weather in Paris?"),
        ChatMessage(role="assistant", content="Looking.", tool_calls=calls),
        ChatMessage(role="tool", content="21", tool_call_id="toolu_1", name="get_weather"),
        ChatMessage(role="tool", content="Error: no such city", tool_call_id="toolu_2", name="get_weather"),
        ChatMessage(role="user", content="And tomorrow?"),
    )
    assert task.tools is not None and task.tools.choice is ToolChoice.REQUIRED and not task.tools.parallel
