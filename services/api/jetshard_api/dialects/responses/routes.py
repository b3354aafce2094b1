"""OpenAI's Responses API, stateless: `POST /v1/responses`.

The request translates into a chat TaskRequest (`types`) run through the shared request path
(`tasks`); its chunks become a response object, or with `stream` the Responses API's typed events. Errors take
the OpenAI shape, which is this dialect's too (the app-wide handler).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
from jetshard_schema.ids import new_task_id
from jetshard_schema.types import Chunk, TaskOutcome, TaskRequest, ToolCall
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.checks import requested_model_id
from jetshard_api.dialects.responses.types import (
    FunctionCallItem,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseRequest,
    call_item,
    image_urls,
    message_item,
    reasoning_item,
    response_task,
)
from jetshard_api.dialects.streaming import keep_alive_comment, streamed
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import INFERENCE_RESPONSES, ApiError, answering
from jetshard_api.images import load_image_urls
from jetshard_api.settings import InferenceSettings
from jetshard_api.tasks import answer, check_inputs

AnyRequest = Request[Any, Any, Any]


class ResponsesController(StrictController):
    path = "/v1/responses"
    tags = ["openai"]

    @post(status_code=200, responses=answering(ResponseObject, INFERENCE_RESPONSES))
    async def create(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[ResponseRequest],
        request: AnyRequest,
    ) -> Response[ResponseObject] | ServerSentEvent:
        """A model response to `input` (text, or messages with function calls and their outputs), as one JSON
        body or with `stream` as Server-Sent Events (`response.created` … `response.completed`). Nothing is
        stored: send the whole conversation each time, with `store` false or left out."""
        model_id = requested_model_id(data.model, param="model")
        loaded = await load_image_urls(image_urls(data), settings.images)
        task = response_task(new_task_id(), model_id, data, loaded)
        # Before the shared request path's own check, which names Chat Completions' `messages`.
        check_inputs(cluster.state, task, images_param="input")
        head = ResponseObject.head(_response_id(task), int(time.time()), task.model_id, data)
        if data.stream:
            return await streamed(cluster, settings, task, request.receive, _Events(head))
        result = await answer(cluster, settings, task, request.receive)
        choice = result.choices[0]
        output = _output(choice.reasoning, choice.text, choice.tool_calls, choice.finish_reason)
        # A Response, not the bare body: the route's media type would otherwise be JSON for the stream too.
        return Response(head.finished(output, result.usage, choice.finish_reason))


def _response_id(task: TaskRequest) -> str:
    return "resp_" + task.task_id.removeprefix("task-")


def _output(reasoning: str, text: str, calls: list[ToolCall], reason: TaskOutcome | None) -> list[OutputItem]:
    """A thinking model's reasoning, a message with the text (left out when the model only called functions), then
    one item per call."""
    items: list[OutputItem] = [reasoning_item(reasoning, "completed")] if reasoning else []
    if text or not calls:
        items.append(message_item(text, "incomplete" if reason is TaskOutcome.LENGTH else "completed"))
    items += [call_item(call, "completed") for call in calls]
    return items


class _Events:
    """The Responses API's events for one streamed response: each output item opens (`output_item.added`),
    fills (reasoning, text or argument deltas) and closes (`output_item.done`) in turn, and every event is
    numbered."""

    def __init__(self, head: ResponseObject) -> None:
        self.head = head
        self.output: list[OutputItem] = []
        """The items closed so far."""
        self._sequence = 0
        self._message: MessageItem | None = None
        """The message item open now: its text arrives in deltas, kept in `_text`."""
        self._text = ""
        self._reasoning: ReasoningItem | None = None
        """The reasoning item open now: its text arrives in deltas, kept in `_thought`."""
        self._thought = ""

    def event(self, type: str, **fields: Any) -> ServerSentEventMessage:
        data = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return ServerSentEventMessage(event=type, data=msgspec.json.encode(data).decode())

    def opening(self) -> Iterator[ServerSentEventMessage]:
        yield self.event("response.created", response=self.head)
        yield self.event("response.in_progress", response=self.head)

    def waiting(self, what: str) -> list[ServerSentEventMessage]:
        return keep_alive_comment(what)

    def chunk(self, chunk: Chunk) -> Iterator[ServerSentEventMessage]:
        if chunk.reasoning:
            if self._reasoning is None:
                yield from self._close_message("completed")
                yield from self._open_reasoning()
            yield self.event("response.reasoning_text.delta", delta=chunk.reasoning, **self._thought_place())
            self._thought += chunk.reasoning
        if chunk.text:
            yield from self._close_reasoning()
            if self._message is None:
                yield from self._open_message()
            yield self.event("response.output_text.delta", delta=chunk.text, logprobs=[], **self._text_place())
            self._text += chunk.text
        for call in chunk.tool_calls:
            yield from self._close_reasoning()
            yield from self._close_message("completed")
            yield from self._call(call)
        if chunk.usage is not None:
            cut = chunk.finish_reason is TaskOutcome.LENGTH
            yield from self._close_reasoning()
            if not any(isinstance(item, MessageItem | FunctionCallItem) for item in self.output) and not self._message:
                yield from self._open_message()  # a response always has an item; an empty answer, an empty text
            yield from self._close_message("incomplete" if cut else "completed")
            done = self.head.finished(self.output, chunk.usage, chunk.finish_reason)
            yield self.event("response.incomplete" if cut else "response.completed", response=done)

    def closing(self) -> list[ServerSentEventMessage]:
        """Nothing more: the last chunk (the one with the usage) completed the response."""
        return []

    def failed(self, error: ApiError) -> Iterator[ServerSentEventMessage]:
        """The error, then the response with what output there was (a message cut short: incomplete)."""
        output = list(self.output)
        if self._reasoning is not None:
            output.append(self._reasoning_done("incomplete"))
        if self._message is not None:
            cut = msgspec.structs.replace(self._message, status="incomplete", content=[OutputText(text=self._text)])
            output.append(cut)
        yield self.event("error", code=error.code, message=error.message, param=error.param)
        yield self.event("response.failed", response=self.head.failed(error, output))

    def _text_place(self) -> dict[str, Any]:
        assert self._message is not None
        return {"item_id": self._message.id, "output_index": len(self.output), "content_index": 0}

    def _thought_place(self) -> dict[str, Any]:
        assert self._reasoning is not None
        return {"item_id": self._reasoning.id, "output_index": len(self.output), "content_index": 0}

    def _open_reasoning(self) -> Iterator[ServerSentEventMessage]:
        self._reasoning, self._thought = reasoning_item(None, "in_progress"), ""
        yield self.event("response.output_item.added", output_index=len(self.output), item=self._reasoning)

    def _reasoning_done(self, status: ItemStatus) -> ReasoningItem:
        assert self._reasoning is not None
        return msgspec.structs.replace(self._reasoning, status=status, content=[ReasoningText(text=self._thought)])

    def _close_reasoning(self) -> Iterator[ServerSentEventMessage]:
        if self._reasoning is None:
            return
        yield self.event("response.reasoning_text.done", text=self._thought, **self._thought_place())
        item = self._reasoning_done("completed")
        yield self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self._reasoning = None

    def _open_message(self) -> Iterator[ServerSentEventMessage]:
        self._message, self._text = message_item(None, "in_progress"), ""
        yield self.event("response.output_item.added", output_index=len(self.output), item=self._message)
        yield self.event("response.content_part.added", part=OutputText(text=""), **self._text_place())

    def _close_message(self, status: ItemStatus) -> Iterator[ServerSentEventMessage]:
        if self._message is None:
            return
        part = OutputText(text=self._text)
        yield self.event("response.output_text.done", text=self._text, logprobs=[], **self._text_place())
        yield self.event("response.content_part.done", part=part, **self._text_place())
        item = msgspec.structs.replace(self._message, status=status, content=[part])
        yield self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self._message = None

    def _call(self, call: ToolCall) -> Iterator[ServerSentEventMessage]:
        index = len(self.output)
        item: FunctionCallItem = call_item(call, "in_progress")
        place = {"item_id": item.id, "output_index": index}
        yield self.event("response.output_item.added", output_index=index, item=item)
        # The runner hands over a call whole, once parsed: its arguments come as one delta.
        yield self.event("response.function_call_arguments.delta", delta=call.arguments, **place)
        yield self.event("response.function_call_arguments.done", arguments=call.arguments, **place)
        item = msgspec.structs.replace(item, arguments=call.arguments, status="completed")
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
