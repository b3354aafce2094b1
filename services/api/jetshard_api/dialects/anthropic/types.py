"""Request and response bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), and
the translation of a request into a TaskRequest.

What a chat template can carry is translated: text, tool definitions, earlier tool calls and their results;
`output_config.format` (a JSON schema) becomes constrained decoding. `thinking` switches a thinking model's
reasoning on (`enabled`, with its `budget_tokens`) or off (`disabled`, and by default, as Anthropic's models do);
`adaptive` leaves it to the model's own default; the reasoning comes back as a `thinking` block before the text.
Thinking blocks of earlier turns are dropped, as the chat templates of thinking models drop earlier reasoning.
Base64 image blocks go to a vision model. `top_k` cuts the sampling to the k most likely tokens. Fields that would
change the output and that jetshard cannot honour are refused with 400, never silently ignored: an assistant
message last (Anthropic continues such a "prefill"; a chat template starts a new turn after it), document blocks,
and image blocks other than base64 (a text model refuses base64 ones too, saying it takes no images).
`cache_control` markers, `metadata` and `output_config.effort` are accepted and ignored: they change nothing
in the output here, and the runner's prefix cache reuses any prompt start it has kept without breakpoints.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.types import ChatMessage, SamplingParams, TaskKind, TaskOutcome, TaskRequest, ToolCall, ToolChoice

from jetshard_api.answers import Choice
from jetshard_api.dialects import checks
from jetshard_api.images import base64_image, check_images

# --- content blocks, in requests and in answers -------------------------------------------------------------


class TextBlock(msgspec.Struct, frozen=True, kw_only=True, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, frozen=True, kw_only=True, tag="thinking", tag_field="type"):
    """A thinking model's reasoning, before its answer. The signature is empty: nothing here checks one."""

    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, frozen=True, kw_only=True, tag="tool_use", tag_field="type"):
    """A call the model made: in an answer, or in an earlier assistant turn the client sends back."""

    id: str
    name: str
    input: dict[str, Any]


class ImageSource(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    """`base64`; `url` and `file` sources are refused."""
    media_type: str | None = None
    data: str | None = None


class ImageBlock(msgspec.Struct, frozen=True, kw_only=True, tag="image", tag_field="type"):
    """A picture for a vision model, in a user turn."""

    source: ImageSource


class ToolResultBlock(msgspec.Struct, frozen=True, kw_only=True, tag="tool_result", tag_field="type"):
    """A call's result, in a user turn."""

    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


# --- requests ------------------------------------------------------------------------------------------------


class MessageParam(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ThinkingBlock | ImageBlock | ToolUseBlock | ToolResultBlock]


class ToolParam(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    input_schema: dict[str, Any]


class ToolChoiceParam(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The function `tool` forces."""
    disable_parallel_tool_use: bool = False


class ThinkingParam(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Unknown fields are refused here, as Anthropic refuses them, where the request's top level takes (and
    ignores) other servers' extras: a field here is a way to think the client expects to be honoured."""

    type: Literal["enabled", "disabled", "adaptive"]
    """`enabled` turns a thinking model's reasoning on, `disabled` off; `adaptive` leaves it to the model."""
    budget_tokens: int | None = None
    """With `enabled`, the most tokens the model reasons with (fewer than `max_tokens`)."""
    display: Literal["summarized", "omitted"] | None = None
    """`summarized` (the reasoning comes back whole here); `omitted` is refused."""


class OutputFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: OutputFormat | None = None
    """Structured output: the answer's text is decoded to follow the schema."""
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Passed to the chat template as `reasoning_effort`, for templates that take one; Anthropic's values only, as
    the other dialects take OpenAI's."""


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What makes the prompt: a Messages request without its sampling."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    max_tokens: int
    """Required, as Anthropic requires it."""
    stream: bool = False
    temperature: float | None = None
    """0 to 1, Anthropic's range; left out, the model's own default (its generation_config), not Anthropic's 1."""
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None


_CHOICES = {"auto": ToolChoice.AUTO, "any": ToolChoice.REQUIRED, "tool": ToolChoice.FUNCTION, "none": ToolChoice.NONE}


def message_sampling(request: MessagesRequest) -> SamplingParams:
    if request.temperature is not None and not 0 <= request.temperature <= 1:
        raise checks.invalid("temperature", "temperature must be between 0 and 1")
    if request.top_k is not None and request.top_k < 0:
        raise checks.invalid("top_k", "top_k must be 0 or more (0: no cut)")
    return checks.sampling(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=request.stop_sequences,
        names={"stop": "stop_sequences"},
    )


def thinks(request: CountTokensRequest) -> bool:
    return request.thinking is not None and request.thinking.type == "enabled"


def messages_task(
    task_id: TaskId, model_id: ModelId, request: CountTokensRequest, sampling: SamplingParams
) -> TaskRequest:
    thinking = request.thinking
    budget = None
    if thinking is not None and thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise checks.invalid("thinking.budget_tokens", "thinking of type enabled needs budget_tokens")
        # Counting tokens generates one: the answer's own max_tokens bounds the budget.
        max_tokens = request.max_tokens if isinstance(request, MessagesRequest) else None
        budget = checks.thinking_budget(thinking.budget_tokens, "thinking.budget_tokens", max_tokens)
    if thinking is not None and thinking.display == "omitted":
        raise checks.unsupported("thinking.display", "'omitted' (the reasoning comes back whole)")
    switch = None if thinking is not None and thinking.type == "adaptive" else thinks(request)
    effort = request.output_config.effort if request.output_config is not None else None
    if not request.messages:
        raise checks.invalid("messages", "messages must not be empty")
    system = _text(request.system or "")
    messages = [ChatMessage(role="system", content=system)] if system else []
    conversation = (*messages, *_conversation(request.messages))
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise checks.invalid("tool_choice.name", "tool_choice of type tool needs the tool's name")
    tools = checks.tools(
        [(tool.name, tool.description, tool.input_schema) for tool in request.tools or ()],
        _CHOICES[choice.type] if choice else ToolChoice.AUTO,
        choice.name if choice and choice.type == "tool" else None,
        not (choice and choice.disable_parallel_tool_use),
    )
    return TaskRequest(
        task_id=task_id,
        model_id=model_id,
        kind=TaskKind.CHAT,
        messages=conversation,
        sampling=sampling,
        tools=tools,
        output_schema=_output_schema(request.output_config),
        chat_template_kwargs=checks.template_kwargs(None, thinking=switch, effort=effort),
        thinking_budget=budget,
        continue_final_message=checks.continued(conversation),
    )


def _output_schema(config: OutputConfig | None) -> dict[str, Any] | None:
    if config is None or config.format is None:
        return None
    return checks.output_schema(config.format.schema, "output_config.format.schema")


def _text(content: str | list[TextBlock]) -> str:
    """Text blocks concatenated as they are (a client that splits a text, at a cache breakpoint say, gets it
    back whole), as the other dialects join their text parts."""
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _conversation(messages: list[MessageParam]) -> list[ChatMessage]:
    """Assistant turns carry their tool_use blocks as tool calls; a user turn's tool_result blocks become `tool`
    messages (named after the call they answer), its text a user message after them."""
    converted: list[ChatMessage] = []
    called: dict[str, str] = {}
    for i, message in enumerate(messages):
        blocks = [TextBlock(text=message.content)] if isinstance(message.content, str) else message.content
        text: list[str] = []
        images: list[bytes] = []
        calls: list[ToolCall] = []
        results: list[ChatMessage] = []
        for j, block in enumerate(blocks):
            param = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock):
                continue
            elif isinstance(block, ImageBlock):
                if message.role != "user":
                    raise checks.invalid(param, f"{param}: image blocks belong in user messages")
                images.append(_image(block.source, f"{param}.source"))
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise checks.invalid(param, f"{param}: tool_use blocks belong in assistant messages")
                calls.append(ToolCall(id=block.id, name=block.name, arguments=json.dumps(block.input)))
                called[block.id] = block.name
            else:
                if message.role != "user":
                    raise checks.invalid(param, f"{param}: tool_result blocks belong in user messages")
                results.append(_tool_message(block, called.get(block.tool_use_id)))
        converted += results
        if text or images or calls or not results:
            turn = ChatMessage(role=message.role, content="".join(text), images=tuple(images), tool_calls=tuple(calls))
            converted.append(turn)
    check_images(converted)
    return converted


def _image(source: ImageSource, param: str) -> bytes:
    if source.type != "base64":
        raise checks.unsupported(f"{param}.type", f"of {source.type!r} (send the image as base64)")
    if source.data is None:
        raise checks.invalid(f"{param}.data", f"{param}.data is required for a base64 image")
    return base64_image(source.data, f"{param}.data")


def _tool_message(block: ToolResultBlock, name: str | None) -> ChatMessage:
    """A failed call's result says so in its text: chat templates have no place for an error flag."""
    text = _text(block.content)
    return ChatMessage(
        role="tool",
        content=f"Error: {text}" if block.is_error else text,
        tool_call_id=block.tool_use_id,
        name=name,
    )


# --- answers ------------------------------------------------------------------------------------------------


class UsageBody(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int
    output_tokens: int


class MessageBody(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    """Always null: the runner does not say which stop sequence ended the output (see `stop_reason`)."""
    usage: UsageBody


class TokenCount(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    message: str


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "error"
    error: ErrorDetail


_STOP_REASONS = {TaskOutcome.LENGTH: "max_tokens", TaskOutcome.TOOL_CALLS: "tool_use"}


def stop_reason(outcome: TaskOutcome | None, stop_sequence: str | None) -> str | None:
    """Anthropic's name for why the output ended: `stop_sequence` where one of the request's ended it."""
    if stop_sequence is not None:
        return "stop_sequence"
    return None if outcome is None else _STOP_REASONS.get(outcome, "end_turn")


def tool_use_block(call: ToolCall) -> ToolUseBlock:
    """A call as Anthropic gives it: a `toolu_` id, its input an object (the runner hands out only calls whose
    arguments are a JSON object: `jetshard_worker.text.toolcalls`)."""
    arguments = msgspec.json.decode(call.arguments, type=dict[str, Any])
    return ToolUseBlock(id="toolu_" + call.id.removeprefix("call_"), name=call.name, input=arguments)


def content_blocks(choice: Choice) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
    blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if choice.reasoning:
        blocks.append(ThinkingBlock(thinking=choice.reasoning))
    if choice.text:
        blocks.append(TextBlock(text=choice.text))
    return blocks + [tool_use_block(call) for call in choice.tool_calls]
