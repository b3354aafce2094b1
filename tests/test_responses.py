"""OpenAI's Responses API (`POST /v1/responses`), stateless: the translation of its input into a chat task, then
the official `openai` client against a live cluster (the session's `dialect_cluster`: a tiny llama model on one
runner) — plain and streamed responses, function calls and their outputs, structured output, and the stored
state jetshard refuses.

The tiny model writes gibberish, so these tests assert structure and what constrained decoding guarantees (a
valid call, a document that validates), not words.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import openai
import pytest
from helpers.dialects import WEATHER_PARAMETERS, DialectCluster
from jetshard_api.dialects.responses.types import ResponseRequest, response_task
from jetshard_api.errors import ApiError
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.types import ChatMessage, ToolCall, ToolChoice

pytestmark = pytest.mark.timeout(240)

WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
FORCE_WEATHER: Any = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"
MAX_CALL_TOKENS = 120
"""Room for the tiny model's forced call to close by itself (it takes ~60 tokens): a budget that cuts it gets
a call the constraint closed, in a response that says `incomplete`."""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def task_of(**body: Any) -> Any:
    request = msgspec.convert({"model": "org/model", **body}, ResponseRequest)
    return response_task(TaskId("task-1"), ModelId("org/model"), request)


# --- the translation, without a cluster ----------------------------------------------------------------------


def test_instructions_and_input_items_become_the_chat() -> None:
    task = task_of(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]},
        ],
        max_output_tokens=7,
        temperature=0.5,
        store=False,
        metadata={"k": "v"},
        user="u",
    )
    calls = (
        ToolCall(id="call_a", name="get_weather", arguments="{}"),
        ToolCall(id="call_b", name="get_time", arguments="{}"),
    )
    assert task.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="system", content="Use metric units."),
        ChatMessage(role="user", content=QUESTION),
        ChatMessage(role="assistant", content="Let me look.", tool_calls=calls),
        ChatMessage(role="tool", content="21 C", tool_call_id="call_a", name="get_weather"),
        ChatMessage(role="tool", content="noon", tool_call_id="call_b", name="get_time"),
    )
    assert (task.sampling.max_tokens, task.sampling.temperature) == (7, 0.5)


def test_tools_tool_choice_and_text_format() -> None:
    task = task_of(input="hi", tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER, parallel_tool_calls=False)
    assert task.tools is not None and task.tools.functions[0].parameters == WEATHER_PARAMETERS
    assert (task.tools.choice, task.tools.function, task.tools.parallel) == (ToolChoice.FUNCTION, "get_weather", False)
    assert task_of(input="hi", tools=[WEATHER_TOOL], tool_choice="required").tools.choice is ToolChoice.REQUIRED
    schema = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    assert task_of(input="hi", text=schema).output_schema == PERSON
    assert task_of(input="hi", text={"format": {"type": "json_object"}}).output_schema == {"type": "object"}
    assert task_of(input="hi", text={"format": {"type": "text"}}).output_schema is None
    assert task_of(input="hi", reasoning={"effort": None}).output_schema is None  # a null reasoning is neutral


def test_reasoning_effort_reaches_the_template_and_earlier_reasoning_is_dropped() -> None:
    assert task_of(input="hi", reasoning={"effort": "high"}).chat_template_kwargs == {"reasoning_effort": "high"}
    assert task_of(input="hi", reasoning={"effort": "none"}).chat_template_kwargs == {"enable_thinking": False}
    earlier = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    assert [m.content for m in task_of(input=earlier).messages] == ["hi", "hello", "again"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content"),
    ],
)
def test_what_jetshard_cannot_do_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        task_of(**{"input": "hi", **body})
    assert (caught.value.status, caught.value.param) == (400, param)


# --- live, with the openai client ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(dialect_cluster: DialectCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dialect_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def test_a_response_says_incomplete_when_max_output_tokens_cut_it(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    response = client.responses.create(
        model=dialect_cluster.model, input=QUESTION, instructions="Answer.", max_output_tokens=3, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == message.content[0].text != ""  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.usage.total_tokens == response.usage.input_tokens + 3
    assert (response.model, response.max_output_tokens, response.temperature) == (dialect_cluster.model, 3, 0)
    assert response.tool_choice == "auto" and response.error is None


def test_json_schema_output_parses_validates_and_completes(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = client.responses.create(
        model=dialect_cluster.model, input="Describe a person.", text=text, max_output_tokens=60, temperature=1
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.status == "completed" and response.incomplete_details is None
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_text(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    events = list(
        client.responses.create(model=dialect_cluster.model, input=QUESTION, max_output_tokens=8, stream=True)
    )
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text == events[-2].item.content[0].text  # type: ignore[union-attr]
    assert final.id == events[0].response.id and final.usage.output_tokens == 8  # type: ignore[union-attr]


def test_a_forced_call_and_its_output_make_a_round_trip(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    first = client.responses.create(
        model=dialect_cluster.model,
        input=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=FORCE_WEATHER,
        max_output_tokens=MAX_CALL_TOKENS,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert first.output_text == ""

    conversation: Any = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]
    second = client.responses.create(
        model=dialect_cluster.model, input=conversation, tools=[WEATHER_TOOL], max_output_tokens=5, temperature=0
    )
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_streamed_call_assembles_from_its_argument_deltas(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    with client.responses.stream(
        model=dialect_cluster.model,
        input=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=FORCE_WEATHER,
        max_output_tokens=MAX_CALL_TOKENS,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert events[-1].type == "response.completed"


def test_stored_state_is_refused_and_an_unknown_model_is_a_404(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=dialect_cluster.model, input="hi", previous_response_id="resp_123")
    assert caught.value.code == "unsupported_parameter" and "whole conversation" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=dialect_cluster.model, input="hi", store=True)
    assert "store: false" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=dialect_cluster.model, input="hi", tools=[{"type": "web_search"}])
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="nobody/nothing", input="hi", stream=stream)
