"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models.

Each route translates its body into a TaskRequest (`types`) and the task's chunks into OpenAI's
answer; placement, queueing and cancellation are the shared request path's (`tasks`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from jetshard_schema.cards import ModelCard
from jetshard_schema.ids import ModelId, new_task_id
from jetshard_schema.models import all_cards, find_card
from jetshard_schema.sampling import documented_defaults
from jetshard_schema.state import State
from jetshard_schema.types import Chunk, Engine, TaskKind, TaskRequest
from jetshard_schema.view import model_unloads_at_ms
from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.checks import requested_model_id
from jetshard_api.dialects.openai.types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    EmbeddingBody,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ModelList,
    ModelObject,
    StreamOptions,
    UsageBody,
    chat_task,
    completion_task,
    embedding_task,
    finish_reason,
    image_urls,
)
from jetshard_api.dialects.streaming import keep_alive_comment, streamed
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ERROR_RESPONSES, INFERENCE_RESPONSES, ApiError, answering, error_body
from jetshard_api.images import load_image_urls
from jetshard_api.model_steps import engines_serving
from jetshard_api.settings import InferenceSettings
from jetshard_api.tasks import answer

AnyRequest = Request[Any, Any, Any]


def _sse(payload: object) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=payload if isinstance(payload, str) else msgspec.json.encode(payload).decode())


class OpenAIController(StrictController):
    path = "/v1"
    tags = ["openai"]

    @get("/models", responses=ERROR_RESPONSES)
    async def models(self, cluster: NamedDependency[Cluster]) -> ModelList:
        state = cluster.state
        serving = engines_serving(state)
        data = [_model_object(state, model_id, card, serving) for model_id, card in all_cards(state).items()]
        data.sort(key=lambda m: (not m.ready, m.id))
        return ModelList(data=data)

    @get("/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(self, cluster: NamedDependency[Cluster], model_id: FromPath[str]) -> ModelObject:
        """One model, as `client.models.retrieve("org/name")` asks for it."""
        checked = requested_model_id(model_id.lstrip("/"), param="model")
        card = find_card(cluster.state, checked)
        if card is None:
            raise ApiError(404, f"unknown model {checked}", "model_not_found", "model")
        return _model_object(cluster.state, checked, card, engines_serving(cluster.state))

    @post("/chat/completions", status_code=200, responses=answering(ChatCompletion, INFERENCE_RESPONSES))
    async def chat_completions(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[ChatCompletionRequest],
        request: AnyRequest,
    ) -> Response[ChatCompletion] | ServerSentEvent:
        """The answer as one JSON body, or with `stream` as Server-Sent Events of `chat.completion.chunk`s:
        text, tool calls (`tools`, `tool_choice`), JSON that follows a schema (`response_format`), logprobs,
        `n` choices."""
        model_id = requested_model_id(data.model, param="model")
        loaded = await load_image_urls(image_urls(data), settings.images)
        task = chat_task(new_task_id(), model_id, data, loaded)
        if data.stream:
            return await streamed(cluster, settings, task, request.receive, _Events(task, data.stream_options))
        result = await answer(cluster, settings, task, request.receive)
        choices = [ChatChoice.of(i, c, data.logprobs) for i, c in enumerate(result.choices)]
        # A Response, not the bare body: the route's media type would otherwise be JSON for the stream too.
        return Response(ChatCompletion(**_head(task, result.usage), choices=choices))

    @post("/completions", status_code=200, responses=answering(Completion, INFERENCE_RESPONSES))
    async def completions(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[CompletionRequest],
        request: AnyRequest,
    ) -> Response[Completion] | ServerSentEvent:
        """The answer as one JSON body, or with `stream` as Server-Sent Events of `text_completion`s."""
        task = completion_task(new_task_id(), requested_model_id(data.model, param="model"), data)
        if data.stream:
            return await streamed(cluster, settings, task, request.receive, _Events(task, data.stream_options))
        result = await answer(cluster, settings, task, request.receive)
        choices = [CompletionChoice.of(i, c, data.logprobs is not None) for i, c in enumerate(result.choices)]
        return Response(Completion(**_head(task, result.usage), choices=choices))

    @post("/embeddings", status_code=200, responses=INFERENCE_RESPONSES)
    async def embeddings(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[EmbeddingRequest],
        request: AnyRequest,
    ) -> EmbeddingList:
        """One vector per input: the mean of the model's last hidden states over the input's tokens, L2-normalised.
        Meant for models trained to embed that way (e5-mistral, gte-Qwen2, Qwen3-Embedding use last-token or mean
        pooling of a decoder); any chat model answers too, with vectors that are only roughly semantic."""
        task = embedding_task(new_task_id(), requested_model_id(data.model, param="model"), data)
        result = await answer(cluster, settings, task, request.receive)
        usage = result.usage.prompt_tokens
        return EmbeddingList(
            data=[EmbeddingBody.of(i, c.embedding, data.encoding_format) for i, c in enumerate(result.choices)],
            model=task.model_id,
            usage=EmbeddingUsage(prompt_tokens=usage, total_tokens=usage),
        )


def _model_object(
    state: State, model_id: ModelId, card: ModelCard, serving: dict[ModelId, list[Engine]]
) -> ModelObject:
    unloads_at_ms = model_unloads_at_ms(state, model_id, int(time.time() * 1000)) if model_id in serving else None
    return ModelObject(
        id=model_id,
        owned_by=model_id.split("/")[0],
        ready=model_id in serving,
        unloads_at=None if unloads_at_ms is None else unloads_at_ms // 1000,
        placeable=model_id not in serving,
        engines=[str(engine) for engine in serving.get(model_id, [])],
        capabilities=[str(capability) for capability in card.capabilities],
        generation_defaults=documented_defaults(card.generation),
    )


def _response_id(task: TaskRequest) -> str:
    return ("chatcmpl-" if task.kind is TaskKind.CHAT else "cmpl-") + task.task_id.removeprefix("task-")


def _head(task: TaskRequest, usage: Any) -> dict[str, Any]:
    return {"id": _response_id(task), "created": int(time.time()), "model": task.model_id, "usage": UsageBody.of(usage)}


class _Events:
    """OpenAI's `chat.completion.chunk`s (or legacy `text_completion`s): the assistant's role per choice before
    the first output, a piece per chunk with output, the usage last if asked for, then `[DONE]`; an error is
    sent in the error shape before `[DONE]`."""

    def __init__(self, task: TaskRequest, options: StreamOptions | None) -> None:
        self._task = task
        self._chat = task.kind is TaskKind.CHAT
        self._include_usage = bool(options and options.include_usage)
        self._base = {
            "id": _response_id(task),
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": int(time.time()),
            "model": task.model_id,
        }
        self._logprobs = task.top_logprobs is not None
        self._tool_calls_sent = [0] * task.n
        self._text_sent = [0] * task.n
        """Characters of each choice's text sent: where a completion chunk's tokens start (`text_offset`)."""
        self._started = False

    def opening(self) -> list[ServerSentEventMessage]:
        return []

    def waiting(self, what: str) -> list[ServerSentEventMessage]:
        return keep_alive_comment(what)

    def chunk(self, chunk: Chunk) -> list[ServerSentEventMessage]:
        events = []
        if self._chat and not self._started:
            roles = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(self._task.n)
            ]
            events.append(_sse({**self._base, "choices": roles}))
        self._started = True
        entry = self._piece(chunk)
        if entry is not None:
            events.append(_sse({**self._base, "choices": [entry]}))
        if chunk.usage is not None and self._include_usage:
            events.append(_sse({**self._base, "choices": [], "usage": UsageBody.of(chunk.usage)}))
        return events

    def closing(self) -> list[ServerSentEventMessage]:
        return [_sse("[DONE]")]

    def failed(self, error: ApiError) -> list[ServerSentEventMessage]:
        return [_sse(error_body(error.status, error.message, error.code, error.param)), *self.closing()]

    def _piece(self, chunk: Chunk) -> dict[str, Any] | None:
        reason = finish_reason(chunk.finish_reason)
        if not (chunk.text or chunk.reasoning or chunk.tool_calls or chunk.logprobs or reason):
            return None
        entry: dict[str, Any] = {"index": chunk.choice, "finish_reason": reason, "logprobs": None}
        if self._chat:
            delta: dict[str, Any] = {"reasoning_content": chunk.reasoning} if chunk.reasoning else {}
            if chunk.text:
                delta["content"] = chunk.text
            if chunk.tool_calls:
                first = self._tool_calls_sent[chunk.choice]
                self._tool_calls_sent[chunk.choice] += len(chunk.tool_calls)
                delta["tool_calls"] = [
                    {
                        "index": first + i,
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for i, c in enumerate(chunk.tool_calls)
                ]
            entry["delta"] = delta
            if self._logprobs:
                entry["logprobs"] = ChoiceLogprobs.of(chunk.logprobs)
        else:
            entry["text"] = chunk.text
            if self._logprobs:
                entry["logprobs"] = CompletionLogprobs.of(chunk.logprobs, self._text_sent[chunk.choice])
            self._text_sent[chunk.choice] += len(chunk.text)
        return entry
