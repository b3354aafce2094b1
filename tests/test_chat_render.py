"""How a conversation with tools reaches the model: through its own template when the template knows tools
(here a Hermes/Qwen-style one, for which mlx-lm picks its `json_tools` parser), else described in a system
message in the JSON form the fallback parser reads. Real tokenizers (mlx-lm's loader), no cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import make_tiny_model
from helpers.tiny_vlm import SMOLVLM_TEMPLATE
from jetshard_schema.types import ChatMessage, Tool, ToolCall, ToolChoice, Tools
from jetshard_worker.library_boundary import load_tokenizer
from jetshard_worker.text.chat import render_chat

# The shape of Qwen2.5's template, cut down: tools in the system turn, calls in <tool_call> tags.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    '</tools>\nFor each call return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = Tools(
    functions=(
        Tool(
            name="get_weather",
            description="The weather in a city",
            parameters={"type": "object", "properties": {"city": {"type": "string"}}},
        ),
    )
)
CONVERSATION = (
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(
        role="assistant", tool_calls=(ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),)
    ),
    ChatMessage(role="tool", content='{"celsius": 21}', tool_call_id="call_1", name="get_weather"),
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "tiny", num_layers=1, num_files=1)


def tokenizer_with(model_dir: Path, template: str | None) -> Any:
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template is not None:
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
    return load_tokenizer(model_dir)


def test_a_template_that_knows_tools_renders_them_and_the_earlier_calls(model_dir: Path) -> None:
    tokenizer = tokenizer_with(model_dir, TOOLS_TEMPLATE)
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"

    prompt = render_chat(tokenizer, CONVERSATION, TOOLS)

    assert '"name": "get_weather"' in prompt.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert prompt.endswith('{"celsius": 21}<|im_end|>\n<|im_start|>assistant\n')
    # tool_choice none: the model is not told about the tools at all.
    without = Tools(functions=TOOLS.functions, choice=ToolChoice.NONE)
    assert "<tools>" not in render_chat(tokenizer, CONVERSATION, without)


def test_a_template_without_tools_gets_them_described_in_a_system_message(model_dir: Path) -> None:
    tokenizer = tokenizer_with(model_dir, None)  # the tiny model's plain ChatML
    assert not tokenizer.has_tool_calling

    prompt = render_chat(tokenizer, CONVERSATION, TOOLS)

    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call these functions:")
    assert '"name": "get_weather"' in system
    # The earlier call is written in the JSON form the model is asked to use.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert render_chat(tokenizer, CONVERSATION[:1], None) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_continued_last_message_is_left_open_for_the_answer(model_dir: Path) -> None:
    """Anthropic's prefill, Ollama's trailing assistant message: the answer goes on from the caller's text, in the
    same turn, instead of a new turn after it."""
    tokenizer = tokenizer_with(model_dir, None)  # the tiny model's plain ChatML
    prefilled = (*CONVERSATION[:1], ChatMessage(role="assistant", content="It is"))
    assert render_chat(tokenizer, prefilled, None, continue_final=True) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nIt is"
    )
    assert render_chat(tokenizer, prefilled, None).endswith("It is<|im_end|>\n<|im_start|>assistant\n")


def test_a_requests_template_values_reach_the_template_but_not_the_renderings_own(model_dir: Path) -> None:
    """`chat_template_kwargs` come from a stored request (untrusted): values the template reads pass, the arguments
    the rendering sets itself are refused."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}|{{ greeting | default('none') }}"
    tokenizer = tokenizer_with(model_dir, template)
    assert render_chat(tokenizer, CONVERSATION[:1], None, {"greeting": "hello"}) == "Weather in Paris?|hello"
    assert render_chat(tokenizer, CONVERSATION[:1], None) == "Weather in Paris?|none"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_chat(tokenizer, CONVERSATION[:1], None, {"add_generation_prompt": False})


def test_a_vision_template_gets_each_turns_images_then_its_text_as_parts(model_dir: Path) -> None:
    """SmolVLM's template reads content as parts; the tools' system message, added first, keeps the images with the
    turns they came with."""
    tokenizer = tokenizer_with(model_dir, SMOLVLM_TEMPLATE)
    conversation = (
        ChatMessage(role="user", content="Which is bigger?", images=(b"first", b"second")),
        ChatMessage(role="assistant", content="The first."),
        ChatMessage(role="user", content="", images=(b"third",)),
    )

    prompt = render_chat(tokenizer, conversation, None, content_parts=True)

    assert prompt == (
        "<|im_start|>User:<image><image>Which is bigger?<end_of_utterance>\n"
        "Assistant: The first.<end_of_utterance>\n"
        "User:<image><end_of_utterance>\n"
        "Assistant:"
    )
    described = render_chat(tokenizer, conversation, TOOLS, content_parts=True)
    assert described.startswith("<|im_start|>System: You can call these functions:")
    assert described.endswith(prompt.removeprefix("<|im_start|>"))
