"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

A request becomes a `SubmitTask` command; the sequencer routes it to the ready instance with the fewest
tasks in flight; the runner streams chunks on `jetshard.chunks.<task id>`. The API subscribes to that
subject before it submits, checks the running index (a gap is an error) and treats silence as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import msgspec
from jetshard_schema.cards import ModelCard
from jetshard_schema.codec import decode_chunk
from jetshard_schema.commands import CancelTask, SubmitTask
from jetshard_schema.events import TaskAssigned, TaskFinished
from jetshard_schema.ids import InstanceId, ModelId, new_task_id
from jetshard_schema.models import all_cards, find_card
from jetshard_schema.sampling import documented_defaults
from jetshard_schema.state import State
from jetshard_schema.subjects import chunk_subject
from jetshard_schema.types import Chunk, TaskKind, TaskRequest, Usage
from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from litestar.types import Receive

from jetshard_api.cluster import Cluster
from jetshard_api.disconnect import stopped, unless_disconnected
from jetshard_api.errors import ERROR_RESPONSES, INFERENCE_RESPONSES, ApiError, error_body
from jetshard_api.openai_types import (
    Answer,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelList,
    ModelObject,
    UsageBody,
    chat_task,
    completion_task,
    strictly_decoded,
)
from jetshard_api.route_steps import (
    InferenceSettings,
    checked_model_id,
    ensure_placed,
    ensure_ready,
    ready_models,
    wait_ready,
)

log = logging.getLogger(__name__)
AnyRequest = Request[Any, Any, Any]
A = TypeVar("A", bound=Answer)

BROKER_CHECK_S = 1.0
LOST_CHUNK_GRACE_S = 5.0
"""Once the task has finished, how long its remaining chunks may take: they were published before its
TaskFinished, over core NATS, which drops them when a server fails; past this they are lost."""
"""How often a request waiting for chunks checks that NATS is still reachable."""


class ChunkStream:
    """The chunks of one task in index order; raises ApiError on a gap, an error chunk, or silence."""

    def __init__(self, cluster: Cluster, request: TaskRequest, settings: InferenceSettings) -> None:
        self._cluster = cluster
        self._request = request
        self._settings = settings
        self._queue: asyncio.Queue[bytes | TaskFinished | None] = asyncio.Queue()
        """Chunks as they arrive; then, once the task leaves State, its TaskFinished, or None if it left
        without finishing."""
        self._subscription: Any = None
        self._next_index = 0
        self._last_index: int | None = None
        self._instance_id: InstanceId | None = None
        self._generation = 0
        self._watcher: asyncio.Task[None] | None = None
        self.finished = False
        self._submitted = False
        self._closed = False

    async def __aenter__(self) -> ChunkStream:
        async def on_chunk(msg: Any) -> None:
            self._queue.put_nowait(msg.data)

        self._cluster.require_broker()
        self._subscription = await self._cluster.client.subscribe(chunk_subject(self._request.task_id), cb=on_chunk)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening; cancel the task unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._submitted and not self.finished:
            # The client went away or we failed: stop generation at the runner's next step. Scheduled before
            # any await, which a cancelled caller (a disconnected client) would not get past.
            task = asyncio.create_task(self._cluster.publish(CancelTask(task_id=self._request.task_id)))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._cluster.forget_finish(self._request.task_id)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            await subscription.unsubscribe()

    async def submit(self) -> None:
        """Submit the task, or raise ApiError (429: its model's queue is full) having published nothing."""
        with self._cluster.queue_place(self._request.model_id):
            task = await self._cluster.store_request(self._request)
            finishing = self._cluster.expect_finish(self._request.task_id)
            self._submitted = True
            events = await self._cluster.submit(SubmitTask(task=task))
        assigned = next((e for e in events if isinstance(e, TaskAssigned)), None)
        if assigned is not None:
            self._instance_id, self._generation = assigned.instance_id, assigned.generation
        self._watcher = asyncio.create_task(self._watch(finishing))

    async def _watch(self, finishing: asyncio.Future[TaskFinished]) -> None:
        """Tell the reader when the task leaves State: with its TaskFinished (the index of its last chunk), or
        with None when it left without finishing (its instance restarted, failed or was deleted, or someone
        cancelled it), so the stream ends now instead of waiting for silence."""
        task_id = self._request.task_id
        await self._cluster.follower.wait_until(lambda s: task_id not in s.tasks, float("inf"))
        self._queue.put_nowait(finishing.result() if finishing.done() else None)

    def _gone_error(self) -> ApiError:
        state = self._cluster.state
        instance = state.instances.get(self._instance_id) if self._instance_id else None
        if instance is None:
            why = "its instance was deleted"
        elif instance.failed:
            why = f"its instance failed: {instance.failed_reason}"
        elif instance.generation != self._generation:
            why = f"its instance restarted: {instance.failed_reason}"
        else:
            why = "it was cancelled"
        return ApiError(502, f"the generation stopped: {why}", "runner_failed")

    async def _receive(self) -> bytes:
        """The next chunk's bytes; raises ApiError when the task left without finishing, or on silence."""
        timeout = self._settings.first_chunk_timeout_s if self._next_index == 0 else self._settings.chunk_silence_s
        deadline = time.monotonic() + (timeout if self._last_index is None else LOST_CHUNK_GRACE_S)
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), min(BROKER_CHECK_S, deadline - time.monotonic()))
            except TimeoutError as error:
                # Chunks travel over NATS: without it none can come, so say so now rather than at the deadline.
                self._cluster.require_broker()
                if time.monotonic() < deadline:
                    continue
                if self._last_index is not None:
                    self.finished = True
                    lost = f"chunks {self._next_index}..{self._last_index} of the output were lost"
                    raise ApiError(502, lost, "chunk_gap") from error
                raise ApiError(504, f"the runner sent nothing for {timeout:.0f} s", "runner_timeout") from error
            if item is None:
                self.finished = True
                raise self._gone_error()
            if isinstance(item, TaskFinished):
                # Finished, and chunks travel apart from events: the ones up to its last are still on their way.
                self._last_index = item.last_chunk_index
                deadline = min(deadline, time.monotonic() + LOST_CHUNK_GRACE_S)
                continue
            return item

    async def next(self) -> Chunk:
        chunk = decode_chunk(await self._receive())
        if chunk.index != self._next_index:
            raise ApiError(502, f"chunk {self._next_index} of the output was lost (got {chunk.index})", "chunk_gap")
        self._next_index += 1
        if chunk.error is not None:
            self.finished = True
            status = 400 if chunk.error_code == "context_length_exceeded" else 502
            raise ApiError(status, chunk.error, chunk.error_code or "runner_error")
        if chunk.finish_reason is not None or chunk.index == self._last_index:
            self.finished = True
        return chunk


def _sse(payload: object) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=payload if isinstance(payload, str) else msgspec.json.encode(payload).decode())


class OpenAIController(Controller):
    path = "/v1"
    tags = ["openai"]

    @get("/models", responses=ERROR_RESPONSES)
    async def models(self, cluster: Cluster) -> ModelList:
        state = cluster.state
        ready = ready_models(state)
        data = [_model_object(model_id, card, ready) for model_id, card in all_cards(state).items()]
        data.sort(key=lambda m: (not m.ready, m.id))
        return ModelList(data=data)

    @get("/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(self, cluster: Cluster, model_id: str) -> ModelObject:
        """One model, as `client.models.retrieve("org/name")` asks for it."""
        checked = checked_model_id(model_id.lstrip("/"), param="model")
        card = find_card(cluster.state, checked)
        if card is None:
            raise ApiError(404, f"unknown model {checked}", "model_not_found", "model")
        return _model_object(checked, card, ready_models(cluster.state))

    @post("/chat/completions", status_code=200, responses=INFERENCE_RESPONSES)
    async def chat_completions(
        self,
        cluster: Cluster,
        settings: InferenceSettings,
        data: ChatCompletionRequest,
        request: AnyRequest,
    ) -> Response[ChatCompletion] | ServerSentEvent:
        """The answer as one JSON body, or with `stream` as Server-Sent Events of `chat.completion.chunk`s."""
        data = strictly_decoded(await request.body(), ChatCompletionRequest)
        task = chat_task(new_task_id(), checked_model_id(data.model, param="model"), data)

        def body(content: str, finish: str | None, head: dict[str, Any]) -> ChatCompletion:
            message = AssistantMessage(content=content)
            return ChatCompletion(**head, choices=[ChatChoice(finish_reason=finish, message=message)])

        return await _answer(cluster, settings, request, task, data, body)

    @post("/completions", status_code=200, responses=INFERENCE_RESPONSES)
    async def completions(
        self, cluster: Cluster, settings: InferenceSettings, data: CompletionRequest, request: AnyRequest
    ) -> Response[Completion] | ServerSentEvent:
        """The answer as one JSON body, or with `stream` as Server-Sent Events of `text_completion`s."""
        data = strictly_decoded(await request.body(), CompletionRequest)
        task = completion_task(new_task_id(), checked_model_id(data.model, param="model"), data)

        def body(text: str, finish: str | None, head: dict[str, Any]) -> Completion:
            return Completion(**head, choices=[CompletionChoice(finish_reason=finish, text=text)])

        return await _answer(cluster, settings, request, task, data, body)


async def _answer(
    cluster: Cluster,
    settings: InferenceSettings,
    request: AnyRequest,
    task: TaskRequest,
    data: ChatCompletionRequest | CompletionRequest,
    body: Callable[[str, str | None, dict[str, Any]], A],
) -> Response[A] | ServerSentEvent:
    """Both routes' steps once the task is built: stream it, or collect it into the body `body` makes from the
    text, the finish reason and the fields every answer has."""
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    if data.stream:
        return await _stream(cluster, settings, task, include_usage, request.receive)
    text, finish, usage = await unless_disconnected(request.receive, _collect(cluster, settings, task))
    head = {"id": _response_id(task), "created": int(time.time()), "model": task.model_id, "usage": UsageBody.of(usage)}
    # A Response, not the bare body: the route's media type would otherwise be JSON for the stream too.
    return Response(body(text, finish, head))


def _model_object(model_id: ModelId, card: ModelCard, ready: set[ModelId]) -> ModelObject:
    return ModelObject(
        id=model_id,
        owned_by=model_id.split("/")[0],
        ready=model_id in ready,
        placeable=model_id not in ready,
        generation_defaults=documented_defaults(card.generation),
    )


def _waiting_for(state: State, request: TaskRequest) -> str:
    """What a streaming request is waiting for, said in its keep-alive comments."""
    task = state.tasks.get(request.task_id)
    if task is None:
        return "submitting" if request.model_id in ready_models(state) else "waiting for the model to be ready"
    if task.started:
        return "processing the prompt"
    queued = state.unstarted_tasks(task.instance_id, task.generation)
    ahead = sum(1 for t in queued if t.ref.request_seq < task.ref.request_seq)
    return f"queued; {ahead} queued before this one"


def _response_id(task: TaskRequest) -> str:
    return ("chatcmpl-" if task.kind is TaskKind.CHAT else "cmpl-") + task.task_id.removeprefix("task-")


async def _stream(
    cluster: Cluster,
    settings: InferenceSettings,
    task: TaskRequest,
    include_usage: bool,
    receive: Receive,
) -> ServerSentEvent:
    cluster.require_broker()
    chat = task.kind is TaskKind.CHAT
    base = {
        "id": _response_id(task),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": task.model_id,
    }
    # Everything the stream holds open (the chunk subscription, the task starting) is on this stack, which
    # the generator owns from its first step. A client that leaves while the stream waits to send cancels the
    # sending task, not the generator (its clean-up would wait for garbage collection), and a generator never
    # iterated never cleans up: the response's background step closes the stack for sure.
    resources = AsyncExitStack()
    chunks = await resources.enter_async_context(ChunkStream(cluster, task, settings))
    coming: frozenset[InstanceId] = frozenset()

    async def first_chunk() -> Chunk:
        if coming:
            await wait_ready(cluster, task.model_id, coming, settings)
        await chunks.submit()
        return await chunks.next()

    try:
        # Unknown model, auto-place off, placement refused: a plain HTTP error, before the stream starts.
        coming = await unless_disconnected(receive, ensure_placed(cluster, task.model_id, settings))
        starting = asyncio.create_task(first_chunk())
        resources.push_async_callback(stopped, starting)
        if not coming:
            # A task that starts at once answers a full queue or an over-long prompt with a plain HTTP error
            # too; one that waits longer than a keep-alive gets its stream started, and any error in it.
            await unless_disconnected(receive, asyncio.wait({starting}, timeout=settings.keep_alive_s))
            if starting.done():
                starting.result()
    except BaseException:
        await resources.aclose()
        raise

    async def events() -> AsyncIterator[ServerSentEventMessage]:
        async with resources:
            try:
                while not starting.done():
                    # At once (the client sees the response start), then every few seconds.
                    yield ServerSentEventMessage(comment=_waiting_for(cluster.state, task), data=None)
                    await asyncio.wait({starting}, timeout=settings.keep_alive_s)
                pending = starting.result()
                if chat:
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                            ],
                        }
                    )
                while True:
                    finish = str(pending.finish_reason) if pending.finish_reason else None
                    if pending.text or finish:
                        piece = (
                            {"delta": {"content": pending.text} if pending.text else {}}
                            if chat
                            else {"text": pending.text}
                        )
                        yield _sse(
                            {**base, "choices": [{"index": 0, **piece, "finish_reason": finish, "logprobs": None}]}
                        )
                    if chunks.finished:
                        if include_usage:
                            yield _sse({**base, "choices": [], "usage": UsageBody.of(pending.usage)})
                        break
                    pending = await chunks.next()
            except ApiError as error:
                yield _sse(error_body(error.status, error.message, error.code, error.param))
        yield _sse("[DONE]")

    return ServerSentEvent(events(), background=BackgroundTask(resources.aclose))


async def _collect(
    cluster: Cluster, settings: InferenceSettings, task: TaskRequest
) -> tuple[str, str | None, Usage | None]:
    """The whole answer of a non-streaming request: its text, finish reason and usage."""
    cluster.require_broker()
    await ensure_ready(cluster, task.model_id, settings)
    text, finish, usage = [], None, None
    async with ChunkStream(cluster, task, settings) as chunks:
        await chunks.submit()
        while not chunks.finished:
            chunk = await chunks.next()
            text.append(chunk.text)
            finish, usage = chunk.finish_reason, chunk.usage
    return "".join(text), str(finish) if finish else None, usage
