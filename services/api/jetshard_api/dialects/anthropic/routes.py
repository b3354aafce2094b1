"""Anthropic's Messages API: POST /v1/messages (an answer, or its Server-Sent Events) and
/v1/messages/count_tokens, for the `anthropic` clients and tools built on them.

Each route translates its body into a TaskRequest (`types`) and the task's chunks into Anthropic's
answer; placement, queueing and cancellation are the shared request path's (`tasks`). Errors take
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the HTTP status: the API key
middleware's 401 too, since Litestar routes a request before its middleware runs and so picks this
controller's handlers. The `anthropic-version` and `anthropic-beta` headers are accepted and not read.
"""

from __future__ import annotations

from typing import Any

import msgspec
from jetshard_schema.ids import new_task_id
from jetshard_schema.types import Chunk, SamplingParams, TaskOutcome, TaskRequest, ToolCall, Usage
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.anthropic.types import (
    CountTokensRequest,
    ErrorBody,
    ErrorDetail,
    MessageBody,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    UsageBody,
    content_blocks,
    message_sampling,
    messages_task,
    stop_reason,
    thinks,
    tool_use_block,
)
from jetshard_api.dialects.checks import requested_model_id
from jetshard_api.dialects.streaming import streamed
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ApiError, answering, error_handlers_answering, inference_responses_in
from jetshard_api.model_steps import can_think
from jetshard_api.settings import InferenceSettings
from jetshard_api.tasks import answer

AnyRequest = Request[Any, Any, Any]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error types by status; any other (500, 502, 504) is an `api_error`."""

RESPONSES = inference_responses_in(ErrorBody)


def _error_body(status: int, message: str) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(type=_ERROR_TYPES.get(status, "api_error"), message=message))


def _event(name: str, payload: dict[str, Any]) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=name, data=msgspec.json.encode({"type": name, **payload}).decode())


class AnthropicController(StrictController):
    path = "/v1/messages"
    tags = ["anthropic"]
    exception_handlers = error_handlers_answering(_error_body)

    @post("/", status_code=200, responses=answering(MessageBody, RESPONSES))
    async def messages(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[MessagesRequest],
        request: AnyRequest,
    ) -> Response[MessageBody] | ServerSentEvent:
        """The answer as one message, or with `stream` as Anthropic's named events: a thinking model's reasoning
        (`thinking`), text, and tool calls (`tools`, `tool_choice`; a forced call is decoded to follow the tool's
        `input_schema`)."""
        task = _thinking_checked(cluster, data, _task(data, message_sampling(data)))
        if data.stream:
            return await streamed(cluster, settings, task, request.receive, _Events(task))
        result = await answer(cluster, settings, task, request.receive)
        (choice,) = result.choices
        message = MessageBody(
            id=_message_id(task),
            model=task.model_id,
            content=content_blocks(choice),
            stop_reason=stop_reason(choice.finish_reason, choice.stop_sequence),
            stop_sequence=choice.stop_sequence,
            usage=_usage(result.usage),
        )
        # A Response, not the bare body: the route's media type would otherwise be JSON for the stream too.
        return Response(message)

    @post("/count_tokens", status_code=200, responses=RESPONSES)
    async def count_tokens(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[CountTokensRequest],
        request: AnyRequest,
    ) -> TokenCount:
        """The prompt's tokens, as the model's tokenizer and chat template make them. Those live where the model
        runs, not in the API: the prompt is run with `max_tokens` 1 and its usage reported. That costs one
        prefill, which the runner's prefix cache keeps for the request that follows."""
        task = _thinking_checked(cluster, data, _task(data, SamplingParams(max_tokens=1)))
        result = await answer(cluster, settings, task, request.receive)
        return TokenCount(input_tokens=result.usage.prompt_tokens)


def _thinking_checked(cluster: Cluster, data: CountTokensRequest, task: TaskRequest) -> TaskRequest:
    """`task`, unless it asks a model that does not think to think: counting its tokens too, as Anthropic refuses
    both."""
    if thinks(data) and not can_think(cluster.state, task.model_id):
        raise ApiError(400, f"{task.model_id} does not support thinking", "thinking_unsupported", "thinking")
    return task


def _task(data: CountTokensRequest, sampling: SamplingParams) -> TaskRequest:
    return messages_task(new_task_id(), requested_model_id(data.model, param="model"), data, sampling)


def _message_id(task: TaskRequest) -> str:
    return "msg_" + task.task_id.removeprefix("task-")


def _usage(usage: Usage | None) -> UsageBody:
    usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
    return UsageBody(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)


class _Blocks:
    """A streamed message's content blocks: a thinking or a text block stays open while its kind of text comes
    (a thinking block ends with its `signature_delta`, empty here); each tool call is a block of its own, its
    input sent whole as one `input_json_delta` (the runner hands out calls complete)."""

    def __init__(self) -> None:
        self._index = 0
        self._open: str | None = None
        """The kind of the open block: "thinking" or "text"."""

    def thinking(self, text: str) -> list[ServerSentEventMessage]:
        return self._delta("thinking", ThinkingBlock(thinking=""), {"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> list[ServerSentEventMessage]:
        return self._delta("text", TextBlock(text=""), {"type": "text_delta", "text": text})

    def _delta(self, kind: str, empty: object, delta: dict[str, str]) -> list[ServerSentEventMessage]:
        if not delta[kind]:
            return []
        events = [] if self._open == kind else [*self.close(), self._event("content_block_start", content_block=empty)]
        self._open = kind
        return [*events, self._event("content_block_delta", delta=delta)]

    def tool_use(self, call: ToolCall) -> list[ServerSentEventMessage]:
        block = tool_use_block(call)
        partial = {"type": "input_json_delta", "partial_json": msgspec.json.encode(block.input).decode()}
        events = [
            *self.close(),
            self._event("content_block_start", content_block=msgspec.structs.replace(block, input={})),
            self._event("content_block_delta", delta=partial),
            self._event("content_block_stop"),
        ]
        self._index += 1
        return events

    def close(self) -> list[ServerSentEventMessage]:
        """End the open block, if any."""
        if self._open is None:
            return []
        events = [self._event("content_block_stop")]
        if self._open == "thinking":
            events.insert(0, self._event("content_block_delta", delta={"type": "signature_delta", "signature": ""}))
        self._index, self._open = self._index + 1, None
        return events

    def _event(self, name: str, **payload: Any) -> ServerSentEventMessage:
        return _event(name, {"index": self._index, **payload})


class _Events:
    """Anthropic's events: `message_start`, then per content block `content_block_start`, its deltas and
    `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`; `ping` while the task
    waits. The prompt's token count is known only at the end: `message_start` says 0 input tokens and
    `message_delta` the count (the `anthropic` clients take both from there)."""

    def __init__(self, task: TaskRequest) -> None:
        self._task = task
        self._blocks = _Blocks()
        self._reason: TaskOutcome | None = None
        self._stop_sequence: str | None = None
        self._usage: Usage | None = None

    def opening(self) -> list[ServerSentEventMessage]:
        task = self._task
        start = MessageBody(id=_message_id(task), model=task.model_id, content=[], stop_reason=None, usage=_usage(None))
        return [_event("message_start", {"message": start})]

    def waiting(self, what: str) -> list[ServerSentEventMessage]:
        return [_event("ping", {})]

    def chunk(self, chunk: Chunk) -> list[ServerSentEventMessage]:
        self._reason = chunk.finish_reason or self._reason
        self._stop_sequence = chunk.stop_sequence or self._stop_sequence
        self._usage = chunk.usage or self._usage
        blocks = self._blocks
        return [
            *blocks.thinking(chunk.reasoning),
            *blocks.text(chunk.text),
            *(e for c in chunk.tool_calls for e in blocks.tool_use(c)),
        ]

    def closing(self) -> list[ServerSentEventMessage]:
        delta = {"stop_reason": stop_reason(self._reason, self._stop_sequence), "stop_sequence": self._stop_sequence}
        return [
            *self._blocks.close(),
            _event("message_delta", {"delta": delta, "usage": _usage(self._usage)}),
            _event("message_stop", {}),
        ]

    def failed(self, error: ApiError) -> list[ServerSentEventMessage]:
        return [_event("error", {"error": _error_body(error.status, error.message).error})]
