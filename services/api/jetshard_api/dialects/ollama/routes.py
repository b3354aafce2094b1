"""Ollama-compatible routes under /api: chat, generate, embed (and the legacy embeddings), the model list,
show, ps, version, pull and delete, answering the way Ollama does (streams of JSON lines by default, errors
as `{"error": message}`), so Ollama's clients can use the cluster.

Model names are `org/name`, with or without `:latest` (this cluster has no other tags). Inference goes
through the shared request path (`tasks`); `pull` and `delete` are the cluster's steps of getting a model's
files onto its nodes and deleting them (`model_steps`).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from jetshard_schema.cards import ModelCard
from jetshard_schema.commands import SetInstanceKeepAlive
from jetshard_schema.ids import ModelId, NodeId, new_task_id
from jetshard_schema.models import all_cards, find_card
from jetshard_schema.placement import served_context
from jetshard_schema.state import State, ready_instances
from jetshard_schema.types import Chunk, TaskRequest, TokenLogprob, Usage
from jetshard_schema.view import model_unloads_at_ms
from litestar import Request, Response, delete, get, head, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from litestar.params import JSONBody
from litestar.response import Stream
from litestar.types import ExceptionHandlersMap

from jetshard_api.answers import Choice
from jetshard_api.cluster import Cluster
from jetshard_api.dialects.ollama.types import (
    OLLAMA_VERSION,
    AssistantMessage,
    ChatAnswer,
    ChatRequest,
    EmbedAnswer,
    EmbeddingAnswer,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateAnswer,
    GenerateRequest,
    GenerationRequest,
    ListedModel,
    ModelInfo,
    ModelList,
    ModelRequest,
    OllamaError,
    Progress,
    PullRequest,
    RunningList,
    RunningModel,
    ShowRequest,
    ToolCallBody,
    Version,
    chat_task,
    done_reason,
    embed_task,
    file_sha256,
    generate_task,
    model_id_of,
    now,
    shortened,
    thinks,
    tool_call_bodies,
)
from jetshard_api.dialects.openai.types import TokenLogprobBody
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.disconnect import unless_disconnected
from jetshard_api.errors import ApiError, answering, error_handlers_answering, inference_responses_in, routed
from jetshard_api.model_steps import can_think, checked_keep_alive, delete_everywhere, pulling, start_pull, until_pulled
from jetshard_api.settings import InferenceSettings
from jetshard_api.tasks import LiveTask, Waiting, answer, ensure_ready

AnyRequest = Request[Any, Any, Any]
NDJSON = "application/x-ndjson"

Shape = Callable[[dict[str, Any], str, str, list[ToolCallBody] | None], ChatAnswer | GenerateAnswer]
"""Builds a chat's or a generation's line from its common fields, its text, its reasoning and its tool calls."""


def _chat_shape(head: dict[str, Any], text: str, thinking: str, calls: list[ToolCallBody] | None) -> ChatAnswer:
    message = AssistantMessage(role="assistant", content=text, thinking=thinking or None, tool_calls=calls)
    return ChatAnswer(**head, message=message)


def _generate_shape(head: dict[str, Any], text: str, thinking: str, calls: list[ToolCallBody] | None) -> GenerateAnswer:
    return GenerateAnswer(**head, response=text, thinking=thinking or None)


def _line(body: msgspec.Struct) -> bytes:
    return msgspec.json.encode(body) + b"\n"


OLLAMA_RESPONSES = inference_responses_in(OllamaError)


def _ollama_error(status: int, message: str) -> OllamaError:
    return OllamaError(message)


_IMPORT_INSTEAD = (
    "creating a model ('ollama create') is not offered here: import a GGUF file on a node with "
    "'jetshard models import-gguf' (POST /models/import), or add a model's card with POST /models"
)
NOT_OFFERED = {
    "create": _IMPORT_INSTEAD,
    "blobs": _IMPORT_INSTEAD,
    "copy": "copying a model ('ollama cp') is not offered here: a model has one name in this cluster",
    "push": "pushing a model ('ollama push') is not offered here: this cluster has no registry to push to",
}
"""Ollama's endpoints this cluster does not have, each with what to do instead (by the path's part after /api/)."""


def _ollama_error_handlers() -> ExceptionHandlersMap:
    """Errors in Ollama's shape; an endpoint of Ollama's that is not here says so (the app's handlers answer a path
    under /api that no route takes with these, `error_handlers_by_path`)."""
    handlers = error_handlers_answering(_ollama_error)
    shaped = handlers[HTTPException]

    def http_error(request: AnyRequest, error: HTTPException) -> Response[Any]:
        endpoint = request.url.path.removeprefix(f"{OllamaController.path}/").partition("/")[0]
        if not routed(request) and endpoint in NOT_OFFERED:
            return Response(OllamaError(NOT_OFFERED[endpoint]), status_code=404)
        return shaped(request, error)

    return {**handlers, HTTPException: http_error}


class _Clock:
    """Ollama's durations, in nanoseconds: loading the model, then the prompt (until the first output), then
    the output."""

    def __init__(self) -> None:
        self.started = self.loaded = self.first = time.monotonic_ns()
        self._output = False

    def mark_loaded(self) -> None:
        self.loaded = self.first = time.monotonic_ns()

    def mark_output(self) -> None:
        if not self._output:
            self._output = True
            self.first = time.monotonic_ns()

    def done(self, usage: Usage | None) -> dict[str, int]:
        end = time.monotonic_ns()
        usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
        return {
            "total_duration": end - self.started,
            "load_duration": self.loaded - self.started,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": self.first - self.loaded,
            "eval_count": usage.completion_tokens,
            "eval_duration": end - self.first,
        }


async def _loaded(cluster: Cluster, settings: InferenceSettings, model_id: ModelId, request: AnyRequest) -> _Clock:
    """Wait (placing the model if need be) until `model_id` is ready: Ollama reports the load's time apart."""
    clock = _Clock()
    await unless_disconnected(request.receive, ensure_ready(cluster, model_id, settings))
    clock.mark_loaded()
    return clock


class _Reply:
    """A task's output as Ollama's lines: one per chunk when streaming, else one for the whole answer."""

    def __init__(self, name: str, task: TaskRequest, shape: Shape, clock: _Clock) -> None:
        self._name = name
        self._logprobs = task.top_logprobs is not None
        self._shape = shape
        self._clock = clock
        self._whole = Choice()

    def _head(
        self, logprobs: Sequence[TokenLogprob] = (), usage: Usage | None = None, done: bool = False
    ) -> dict[str, Any]:
        head: dict[str, Any] = {"model": self._name, "created_at": now(), "done": done}
        if self._logprobs:
            head["logprobs"] = [TokenLogprobBody.of(lp) for lp in logprobs]
        if done:
            head |= {"done_reason": done_reason(self._whole.finish_reason), **self._clock.done(usage)}
        return head

    def _add(self, chunk: Chunk) -> list[ToolCallBody] | None:
        self._clock.mark_output()
        calls = tool_call_bodies(chunk.tool_calls, len(self._whole.tool_calls)) or None
        self._whole.add(chunk)
        return calls

    def waiting(self) -> ChatAnswer | GenerateAnswer:
        """An empty line while the task waits, so that proxies keep the connection (Ollama has no keep-alive;
        its clients add up empty pieces as nothing)."""
        return self._shape(self._head(), "", "", None)

    def piece(self, chunk: Chunk) -> ChatAnswer | GenerateAnswer | None:
        calls = self._add(chunk)
        if chunk.usage is not None:
            return self._shape(self._head(chunk.logprobs, chunk.usage, done=True), chunk.text, chunk.reasoning, calls)
        if chunk.text or chunk.reasoning or calls or chunk.logprobs:
            return self._shape(self._head(chunk.logprobs), chunk.text, chunk.reasoning, calls)
        return None

    async def whole(self, live: LiveTask) -> ChatAnswer | GenerateAnswer:
        usage = None
        async for item in live.items():
            if isinstance(item, Chunk):
                self._add(item)
                usage = item.usage or usage
        calls = tool_call_bodies(self._whole.tool_calls) or None
        whole = self._whole
        return self._shape(self._head(whole.logprobs, usage, done=True), whole.text, whole.reasoning, calls)


async def _answer(
    cluster: Cluster,
    settings: InferenceSettings,
    task: TaskRequest,
    request: AnyRequest,
    stream: bool,
    name: str,
    shape: Shape,
) -> Response[Any] | Stream:
    """One JSON object, or with `stream` a line per piece of output and a last one with the counts."""
    clock = await _loaded(cluster, settings, task.model_id, request)
    live = await LiveTask.open(cluster, settings, task, request.receive)
    reply = _Reply(name, task, shape, clock)
    if not stream:
        async with live:
            return Response(await unless_disconnected(request.receive, reply.whole(live)))

    async def lines() -> AsyncIterator[bytes]:
        async with live:
            try:
                async for item in live.items():
                    line = reply.waiting() if isinstance(item, Waiting) else reply.piece(item)
                    if line is not None:
                        yield _line(line)
            except ApiError as error:
                yield _line(OllamaError(error.message))

    return Stream(lines(), media_type=NDJSON, background=BackgroundTask(live.close))


_DURATION_PART = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
"""One number and unit of a Go duration ("1h30m" is two), ASCII digits only, as Go's parser takes them."""
_SECONDS_PER_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_of(value: float | str | None) -> int | None:
    """Ollama's `keep_alive` as the cluster's (ms, or `KEEP_LOADED`); None when not given. A number is seconds, a
    string a Go duration ("5m", "1h30m", "0"); negative keeps the model loaded. Anything else is a 400."""
    if value is None:
        return None
    if isinstance(value, str):
        sign = -1.0 if value.startswith("-") else 1.0
        body = value[1:] if value[:1] in ("-", "+") else value
        parts = _DURATION_PART.findall(body)
        if body == "0":
            seconds = 0.0
        elif not parts or "".join(number + unit for number, unit in parts) != body:
            raise ApiError(
                400,
                f'keep_alive {value!r} is not a duration (such as "5m" or "1h30m")',
                "invalid_request",
                "keep_alive",
            )
        else:
            seconds = sign * sum(float(number) * _SECONDS_PER_UNIT[unit] for number, unit in parts)
    else:
        seconds = float(value)
    return checked_keep_alive(seconds, "keep_alive")


async def _load(
    cluster: Cluster,
    settings: InferenceSettings,
    task: TaskRequest,
    request: AnyRequest,
    name: str,
    shape: Shape,
) -> Response[Any]:
    """A request with nothing to answer loads its model, as Ollama's clients ask before a conversation, for its
    `keep_alive` if it gives one. With `keep_alive` 0 they ask to unload it: its instances unload as soon as they
    are idle (a model not loaded is not loaded for that)."""
    if task.keep_alive_ms == 0:
        await _keep_alive(cluster, task.model_id, 0)
        unloading = {"model": name, "created_at": now(), "done": True, "done_reason": "unload"}
        return Response(shape(unloading, "", "", None))
    await _loaded(cluster, settings, task.model_id, request)
    if task.keep_alive_ms is not None:
        await _keep_alive(cluster, task.model_id, task.keep_alive_ms)
    return Response(shape({"model": name, "created_at": now(), "done": True, "done_reason": "load"}, "", "", None))


async def _keep_alive(cluster: Cluster, model_id: ModelId, keep_alive_ms: int) -> None:
    """Every live instance of `model_id` stays loaded `keep_alive_ms` once idle, from now."""
    for instance in list(cluster.state.instances.values()):
        if instance.model_id == model_id and not instance.failed:
            await cluster.submit(SetInstanceKeepAlive(instance_id=instance.instance_id, keep_alive_ms=keep_alive_ms))


async def _generated(
    cluster: Cluster,
    settings: InferenceSettings,
    request: AnyRequest,
    data: GenerationRequest,
    task: TaskRequest,
    shape: Shape,
    has_input: bool,
) -> Response[Any] | Stream:
    """A chat's or a generation's answer (`_answer`), or with no input its model loaded (`_load`). Thinking asked
    of a model that does not think is refused, as Ollama refuses it."""
    if thinks(data) and not can_think(cluster.state, task.model_id):
        raise ApiError(400, f'"{data.model}" does not support thinking', "thinking_unsupported", "think")
    task = msgspec.structs.replace(task, keep_alive_ms=keep_alive_of(data.keep_alive))
    if not has_input:
        return await _load(cluster, settings, task, request, data.model, shape)
    return await _answer(cluster, settings, task, request, data.stream, data.model, shape)


def _context_length(state: State, model_id: ModelId) -> int | None:
    card = find_card(state, model_id)
    return card.context_length if card else None


def _card(state: State, name: str) -> ModelCard:
    card = find_card(state, model_id_of(name))
    if card is None:
        raise ApiError(404, f"model {name!r} not found", "model_not_found", "model")
    return card


class OllamaController(StrictController):
    path = "/api"
    tags = ["ollama"]
    exception_handlers = _ollama_error_handlers()

    @post("/chat", status_code=200, responses=answering(ChatAnswer, OLLAMA_RESPONSES))
    async def chat(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[ChatRequest],
        request: AnyRequest,
    ) -> Response[ChatAnswer] | Stream:
        """The assistant's next message: text, tool calls (`tools`; the model decides, Ollama has no
        tool_choice), JSON (`format`: "json" or a schema), logprobs. Streams JSON lines unless `stream` is
        false; no messages: load the model."""
        model_id = model_id_of(data.model)
        task = chat_task(new_task_id(), model_id, data, _context_length(cluster.state, model_id))
        return await _generated(cluster, settings, request, data, task, _chat_shape, bool(data.messages))

    @post("/generate", status_code=200, responses=answering(GenerateAnswer, OLLAMA_RESPONSES))
    async def generate(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[GenerateRequest],
        request: AnyRequest,
    ) -> Response[GenerateAnswer] | Stream:
        """The answer to `prompt` (with `system`) through the model's chat template, or with `raw` the
        continuation of the prompt as it is. Streams JSON lines unless `stream` is false; no prompt: load
        the model."""
        model_id = model_id_of(data.model)
        task = generate_task(new_task_id(), model_id, data, _context_length(cluster.state, model_id))
        return await _generated(cluster, settings, request, data, task, _generate_shape, bool(data.prompt))

    @post("/embed", status_code=200, responses=OLLAMA_RESPONSES)
    async def embed(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[EmbedRequest],
        request: AnyRequest,
    ) -> EmbedAnswer:
        """One L2-normalised vector per input: the mean of the model's last hidden states (see
        `/v1/embeddings`); `dimensions` keeps the first ones, normalised again. No input: load the model and
        answer no vector (how Ollama's clients load one)."""
        if not data.input:
            clock = await _loaded(cluster, settings, model_id_of(data.model), request)
            loaded = clock.done(None)
            return EmbedAnswer(
                model=data.model,
                embeddings=[],
                total_duration=loaded["total_duration"],
                load_duration=loaded["load_duration"],
                prompt_eval_count=0,
            )
        task = embed_task(new_task_id(), model_id_of(data.model), data.input)
        task = msgspec.structs.replace(task, keep_alive_ms=keep_alive_of(data.keep_alive))
        clock = await _loaded(cluster, settings, task.model_id, request)
        result = await answer(cluster, settings, task, request.receive)
        done = clock.done(result.usage)
        return EmbedAnswer(
            model=data.model,
            embeddings=[shortened(c.embedding, data.dimensions) for c in result.choices],
            total_duration=done["total_duration"],
            load_duration=done["load_duration"],
            prompt_eval_count=result.usage.prompt_tokens,
        )

    @post("/embeddings", status_code=200, responses=OLLAMA_RESPONSES)
    async def embeddings(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[EmbeddingsRequest],
        request: AnyRequest,
    ) -> EmbeddingAnswer:
        """The legacy form: one prompt, one vector (normalised, as `/api/embed`'s); no prompt: load the model
        and answer an empty vector."""
        model_id = model_id_of(data.model)
        if not data.prompt:
            await _loaded(cluster, settings, model_id, request)
            return EmbeddingAnswer([])
        task = embed_task(new_task_id(), model_id, data.prompt)
        task = msgspec.structs.replace(task, keep_alive_ms=keep_alive_of(data.keep_alive))
        result = await answer(cluster, settings, task, request.receive)
        return EmbeddingAnswer(list(result.choices[0].embedding))

    @get("/tags", responses=OLLAMA_RESPONSES)
    async def list_models(self, cluster: NamedDependency[Cluster]) -> ModelList:
        """Every model the cluster has a card for, as `org/name:latest`."""
        return ModelList([ListedModel.of(card) for card in all_cards(cluster.state).values()])

    @get("/ps", responses=OLLAMA_RESPONSES)
    async def ps(self, cluster: NamedDependency[Cluster]) -> RunningList:
        """The models with a ready instance, and when each unloads if nothing more comes for it."""
        state, now_ms = cluster.state, int(time.time() * 1000)
        engines = {instance.model_id: instance.engine for instance in ready_instances(state)}
        return RunningList(
            [
                RunningModel.running(
                    card, model_unloads_at_ms(state, model_id, now_ms), served_context(card, engines[model_id])
                )
                for model_id, card in all_cards(state).items()
                if model_id in engines
            ]
        )

    @post("/show", status_code=200, responses=OLLAMA_RESPONSES)
    async def show(self, cluster: NamedDependency[Cluster], data: JSONBody[ShowRequest]) -> ModelInfo:
        """A model's card in Ollama's terms: details, `model_info` (GGUF-style keys), default parameters and
        capabilities."""
        return ModelInfo.of(_card(cluster.state, data.model_name))

    @get("/version", responses=OLLAMA_RESPONSES)
    async def version(self) -> Version:
        return Version(OLLAMA_VERSION)

    @head(["/version", "/tags"])
    async def alive(self) -> None:
        """Ollama's clients ask whether the server is up with a HEAD request (the `ollama` CLI before each
        command), as Ollama answers it on these routes and on `/`."""

    @post("/pull", status_code=200, responses=OLLAMA_RESPONSES)
    async def pull(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[PullRequest],
        request: AnyRequest,
    ) -> Response[Progress] | Stream:
        """Make a model ready to place: add its card from the Hub if the cluster has none, then download the
        layers that placing it now would put on each node. Streams progress lines unless `stream` is false.
        A client that leaves does not stop the downloads (`POST /downloads/cancel` does)."""
        model_id = model_id_of(data.model_name)
        nodes = await start_pull(cluster, model_id, settings.serving)
        if not data.stream:
            await unless_disconnected(request.receive, until_pulled(cluster, model_id, nodes, settings.stream_ping_s))
            return Response(Progress(status="success"))

        async def lines() -> AsyncIterator[bytes]:
            yield _line(Progress(status="pulling manifest"))
            try:
                async for progress in _pulling(cluster, model_id, nodes, settings.stream_ping_s):
                    yield _line(progress)
            except ApiError as error:
                yield _line(OllamaError(error.message))

        return Stream(lines(), media_type=NDJSON)

    @delete("/delete", status_code=200, responses=OLLAMA_RESPONSES)
    async def delete_model(self, cluster: NamedDependency[Cluster], data: JSONBody[ModelRequest]) -> None:
        """Delete a model's files from every node (409 while an instance uses them, or from a read-only
        directory), then its card if it is a custom one (a pulled model's): what `pull` did, undone."""
        if not await delete_everywhere(cluster, model_id_of(data.model_name)):
            raise ApiError(404, f"model {data.model_name!r} not found", "model_not_found", "model")


async def _pulling(cluster: Cluster, model_id: ModelId, nodes: list[NodeId], every_s: float) -> AsyncIterator[Progress]:
    """A line per node's download whenever one moves (and every `every_s`), then `success`. Where Ollama names the
    layer it pulls by its digest, a line names the node, and the file's real digest where the card knows it."""
    card = find_card(cluster.state, model_id)
    sha256 = file_sha256(card) if card is not None else msgspec.UNSET
    async for node, progress in pulling(cluster, model_id, nodes, every_s):
        yield Progress(
            status=f"pulling onto {node}",
            digest=f"sha256:{sha256}" if sha256 else None,
            total=progress.bytes_total,
            completed=progress.bytes_done,
        )
    yield Progress(status="success")
