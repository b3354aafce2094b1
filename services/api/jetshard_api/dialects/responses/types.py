"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), and the translation of a
request into a TaskRequest.

jetshard keeps no responses: every request carries its whole conversation in `input`, so `store: true`,
`previous_response_id`, `conversation` and `background` are refused with a 400 that says so. Fields at their
neutral values are accepted; fields that would change the output and are not supported are refused, never
silently ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.types import ChatMessage, TaskKind, TaskOutcome, TaskRequest, ToolCall, ToolChoice, Tools, Usage

from jetshard_api.dialects import checks
from jetshard_api.dialects.openai.types import Sampling, effort_template_kwargs
from jetshard_api.errors import ApiError
from jetshard_api.images import check_images

NO_STORAGE = "jetshard keeps no responses: send the whole conversation in `input` each time"


class InputItem(msgspec.Struct, frozen=True, kw_only=True):
    """One item of `input`, in one flat shape for the three kinds jetshard reads: a message (`type`
    "message", or left out as the easy form has it), a `function_call` the model made, and the
    `function_call_output` answering it. Items copied from an earlier response's `output` carry `id`,
    `status` and annotations too: accepted, and not needed."""

    type: str = "message"
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool: flat (`name` beside `type`, unlike chat completions' `function` object). Only `function`
    tools run here; OpenAI's hosted tools (web_search, file_search…) are refused."""

    type: str = "function"
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    name: str


class TextFormat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: TextFormat = TextFormat(type="text")
    verbosity: str | None = None
    """A hint for reasoning models; accepted, with no effect."""


class Reasoning(msgspec.Struct, frozen=True, kw_only=True):
    effort: str | None = None
    """Passed to the chat template as `reasoning_effort`; "none" turns a thinking model's reasoning off. A
    summary is not made: a thinking model's reasoning comes whole, as a `reasoning` item's content."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """OpenAI's values are accepted and change nothing (no summary is made); another is refused."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_obfuscation: bool | None = None
    """OpenAI pads deltas against side channels; jetshard's deltas carry no padding."""


class ResponseRequest(Sampling, frozen=True, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    """A system message before the input."""
    max_output_tokens: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    """OpenAI stores by default and its client leaves this out: absent is fine, only `true` is refused."""
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """jetshard never truncates: an input longer than the model's context is a 400 either way."""
    max_tool_calls: int | None = None
    """A bound on hosted tool calls, of which there are none here."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


def image_urls(request: ResponseRequest) -> list[tuple[str, str]]:
    """The file and web addresses of the request's images, each with the field that names it."""
    if isinstance(request.input, str):
        return []
    return [
        url
        for i, item in enumerate(request.input)
        if item.type == "message"
        for url in checks.image_urls(item.content, f"input[{i}].content")
    ]


def response_task(
    task_id: TaskId, model_id: ModelId, request: ResponseRequest, loaded: Mapping[str, bytes] | None = None
) -> TaskRequest:
    """`loaded`: the images the request names by file or web address (`image_urls`), as the API read them."""
    _refuse_stored_state(request)
    sampling = request.checked(request.max_output_tokens, names={"max_tokens": "max_output_tokens"})
    messages = _messages(request.input, loaded or {})
    check_images(messages, "input")
    if request.instructions:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    return TaskRequest(
        task_id=task_id,
        model_id=model_id,
        kind=TaskKind.CHAT,
        messages=tuple(messages),
        sampling=sampling,
        tools=_tools(request),
        output_schema=_output_schema(request.text),
        chat_template_kwargs=effort_template_kwargs(
            None, request.reasoning.effort if request.reasoning else None, "reasoning.effort"
        ),
    )


def _refuse_stored_state(request: ResponseRequest) -> None:
    """The fields that need a response kept on the server, or features jetshard does not have."""
    if request.store:
        message = f"{NO_STORAGE}, with store: false (or no store)"
        raise ApiError(400, message, "unsupported_parameter", "store")
    if request.previous_response_id is not None:
        message = f"{NO_STORAGE} instead of previous_response_id"
        raise ApiError(400, message, "unsupported_parameter", "previous_response_id")
    if request.conversation is not None:
        raise ApiError(400, f"{NO_STORAGE} instead of a conversation", "unsupported_parameter", "conversation")
    if request.background:
        raise checks.unsupported("background", "(it needs a stored response to poll)")
    if request.prompt is not None:
        raise checks.unsupported("prompt", "(stored prompt templates)")
    if request.include:
        raise checks.unsupported("include")
    if request.top_logprobs:
        raise checks.unsupported("top_logprobs")


def _messages(input: str | list[InputItem], loaded: Mapping[str, bytes]) -> list[ChatMessage]:
    if isinstance(input, str):
        return [ChatMessage(role="user", content=input)]
    if not input:
        raise checks.invalid("input", "input must not be empty")
    messages: list[ChatMessage] = []
    call_names: dict[str, str] = {}
    for i, item in enumerate(input):
        param = f"input[{i}]"
        if item.type == "message":
            messages.append(_message(item, param, loaded))
        elif item.type == "function_call":
            call = _call(item, param)
            call_names[call.id] = call.name
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # Calls after an assistant's text, or after other calls, are that one turn's, as a chat
                # template expects them.
                messages[-1] = msgspec.structs.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=(call,)))
        elif item.type == "function_call_output":
            if item.call_id not in call_names:
                message = f"{param}: no function_call in input has call_id {item.call_id!r}"
                raise checks.invalid(f"{param}.call_id", message)
            output = checks.text_content(item.output, f"{param}.output")
            messages.append(
                ChatMessage(role="tool", content=output, tool_call_id=item.call_id, name=call_names[item.call_id])
            )
        elif item.type != "reasoning":  # an earlier turn's reasoning: templates of thinking models drop it
            message = f"{param} is a {item.type!r} item; jetshard reads message, function_call and function_call_output"
            raise ApiError(400, message, "unsupported_parameter", f"{param}.type")
    return messages


def _message(item: InputItem, param: str, loaded: Mapping[str, bytes]) -> ChatMessage:
    role = "system" if item.role == "developer" else item.role
    if role not in ("system", "user", "assistant"):
        raise checks.invalid(f"{param}.role", f"{param}.role must be user, assistant, system or developer")
    content, images = checks.chat_content(item.content, f"{param}.content", loaded)
    return ChatMessage(role=role, content=content, images=images)


def _call(item: InputItem, param: str) -> ToolCall:
    for field in ("call_id", "name", "arguments"):
        if getattr(item, field) is None:
            raise checks.invalid(f"{param}.{field}", f"{param}: a function_call needs {field}")
    assert item.call_id is not None and item.name is not None and item.arguments is not None
    return ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)


def _tools(request: ResponseRequest) -> Tools | None:
    functions = []
    for i, tool in enumerate(request.tools or ()):
        if tool.type != "function":
            message = f"tools[{i}] is a {tool.type!r} tool; jetshard runs function tools only"
            raise ApiError(400, message, "unsupported_parameter", f"tools[{i}].type")
        functions.append((tool.name, tool.description or "", tool.parameters))
    choice, function = ToolChoice.AUTO, None
    if isinstance(request.tool_choice, FunctionToolChoice):
        choice, function = ToolChoice.FUNCTION, request.tool_choice.name
    elif request.tool_choice is not None:
        choice = ToolChoice(request.tool_choice)
    return checks.tools(functions, choice, function, request.parallel_tool_calls)


def _output_schema(text: TextConfig | None) -> dict[str, Any] | None:
    format = (text or TextConfig()).format
    if format.type == "json_object":
        return {"type": "object"}
    if format.type == "json_schema":
        if format.schema is None:
            raise checks.invalid("text.format.schema", "text.format json_schema needs a schema")
        return checks.output_schema(format.schema, "text.format.schema")
    return None


# --- response bodies ---------------------------------------------------------------------------------------


class OutputText(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[dict[str, Any]] = msgspec.field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ReasoningText(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="reasoning"):
    """A thinking model's reasoning, before its answer: whole in `content`, with no summary."""

    id: str
    status: ItemStatus
    summary: list[dict[str, Any]] = msgspec.field(default_factory=list)
    content: list[ReasoningText]


class MessageItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


def reasoning_item(text: str | None, status: ItemStatus) -> ReasoningItem:
    """A reasoning item: with no text (its stream has only begun), no content yet."""
    content = [] if text is None else [ReasoningText(text=text)]
    return ReasoningItem(id=f"rs_{uuid.uuid4().hex}", status=status, content=content)


def message_item(text: str | None, status: ItemStatus) -> MessageItem:
    """A message item: with no text (its stream has only begun), no content part yet."""
    content = [] if text is None else [OutputText(text=text)]
    return MessageItem(id=f"msg_{uuid.uuid4().hex}", status=status, content=content)


def call_item(call: ToolCall, status: ItemStatus) -> FunctionCallItem:
    arguments = call.arguments if status == "completed" else ""
    return FunctionCallItem(
        id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name, arguments=arguments, status=status
    )


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        )


class IncompleteDetails(msgspec.Struct, frozen=True):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(msgspec.Struct, frozen=True, kw_only=True):
    """A response, as `client.responses.create` returns it and `response.completed` carries it; it echoes the
    request's settings, as OpenAI's does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[FunctionTool]
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice
    parallel_tool_calls: bool
    text: TextConfig
    metadata: dict[str, str]
    user: str | None
    store: bool = False
    background: bool = False
    previous_response_id: None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] = "disabled"

    @classmethod
    def head(cls, response_id: str, created_at: int, model: str, request: ResponseRequest) -> ResponseObject:
        """The response as it starts: in progress, with no output yet."""
        return cls(
            id=response_id,
            created_at=created_at,
            status="in_progress",
            model=model,
            output=[],
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls,
            text=request.text or TextConfig(),
            metadata=request.metadata or {},
            user=request.user,
            truncation=request.truncation or "disabled",
            reasoning=request.reasoning,
        )

    def finished(self, output: list[OutputItem], usage: Usage, reason: TaskOutcome | None) -> ResponseObject:
        """This response with its output: incomplete when the output hit `max_output_tokens`."""
        cut = reason is TaskOutcome.LENGTH
        return msgspec.structs.replace(
            self,
            status="incomplete" if cut else "completed",
            incomplete_details=IncompleteDetails() if cut else None,
            output=output,
            usage=ResponseUsage.of(usage),
        )

    def failed(self, error: ApiError, output: list[OutputItem]) -> ResponseObject:
        code = {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(error.status, "server_error")
        return msgspec.structs.replace(
            self, status="failed", error=ResponseError(code=code, message=error.message), output=output
        )
