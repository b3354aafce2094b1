"""One request path for every dialect (OpenAI, Ollama, Anthropic, Responses): a `TaskRequest`'s inputs are checked
against its model's card, its model placed and waited for, the task submitted and read back as chunks, and a
client that leaves cancels it. The routes only translate their request into a TaskRequest and the chunks into
their answer.

The API names the ready instance with the fewest tasks in flight (`admission.route`), stores the request (the
prompt) for the node of that instance's leader alone, and submits the task as a `SubmitTask` command naming that
instance; the sequencer assigns it there, and the leader's runner reads the request once and streams chunks on
`jetshard.chunks.<node id>.<task id>`. The API subscribes to the task's chunks from any
node before it submits, keeps only the leader's node's, checks the running index (a gap is an error) and treats
silence as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from jetshard_schema import commands
from jetshard_schema.admission import route
from jetshard_schema.cards import ModelCard
from jetshard_schema.codec import decode_chunk
from jetshard_schema.commands import CancelTask, SubmitTask
from jetshard_schema.events import InstanceChosen, InstancePlaced, TaskAssigned, TaskFinished
from jetshard_schema.ids import InstanceId, ModelId, NodeId, new_instance_id
from jetshard_schema.models import find_card
from jetshard_schema.state import Instance, State, ready_instances, ready_models
from jetshard_schema.subjects import chunk_sender, task_chunks
from jetshard_schema.types import Chunk, ModelFormat, PromptProgress, RejectCode, TaskOutcome, TaskRequest, Usage
from litestar.types import Receive

from jetshard_api.answers import Answer, Choice
from jetshard_api.cluster import Cluster
from jetshard_api.disconnect import stopped, unless_disconnected
from jetshard_api.errors import ApiError
from jetshard_api.images import has_images
from jetshard_api.settings import InferenceSettings, default_keep_alive_ms

log = logging.getLogger(__name__)

BROKER_CHECK_S = 1.0
"""How often a request waiting for chunks checks that NATS is still reachable."""
LOST_CHUNK_GRACE_S = 5.0
"""Once the task has finished, how long its remaining chunks may take: they were published before its
TaskFinished, over core NATS, which drops them when a server fails; past this they are lost."""

SUBMIT_ATTEMPTS = 3
"""How often a task is named for an instance and submitted: again after the sequencer refused it for the one named
because another could take it (this API's State was behind), once more for a second race."""

STALLED_QUEUE_SLACK = 2.0
"""An admitted task waits for its turn however slow its instance has become (the sequencer promised it a
start, and refuses, with 429, what it can no longer start in time), but not behind an instance that samples
nothing: one that reports no token for this many times `start_timeout_s` has stalled."""

REQUEST_ERRORS = frozenset(
    {"context_length_exceeded", "invalid_prompt", "invalid_schema", "invalid_request", "unsupported_by_engine"}
)
"""A runner's error codes that are the request's fault: 400, not 502."""


class ChunkStream:
    """The chunks of one task in index order; raises ApiError on a gap, an error chunk, or silence."""

    def __init__(self, cluster: Cluster, request: TaskRequest, settings: InferenceSettings) -> None:
        self._cluster = cluster
        self._request = request
        self._settings = settings
        self._queue: asyncio.Queue[tuple[str, bytes] | TaskFinished | None] = asyncio.Queue()
        """Chunks as they arrive, with the node that sent each; then, once the task leaves State, its TaskFinished,
        or None if it left without finishing."""
        self._leader_node: NodeId | None = None
        """The node whose runner runs the task: only its chunks are the task's output."""
        self._subscription: Any = None
        self._next_index = 0
        self._last_index: int | None = None
        self._instance_id: InstanceId | None = None
        self._generation = 0
        self._watcher: asyncio.Task[None] | None = None
        self.finished = False
        self._submitted = False
        self._submitted_at = 0.0
        self._output_started = False
        self.prompt_progress: PromptProgress | None = None
        """How far a long prompt is processed, before the output starts."""
        self._started_at: float | None = None
        """When this API first saw the task started (or gone from State): its first-chunk deadline runs from
        there, not from its time in the queue."""
        self._closed = False
        self._timer = cluster.metrics.token_timer(request.model_id)

    async def __aenter__(self) -> ChunkStream:
        async def on_chunk(msg: Any) -> None:
            self._queue.put_nowait((chunk_sender(msg.subject), msg.data))

        self._cluster.require_broker()
        # Before the task exists, so that no chunk can come before the subscription; from any node, since which
        # one runs the task is known only once it is assigned.
        self._subscription = await self._cluster.subscribe(task_chunks(self._request.task_id), on_chunk)
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
            self._cluster.publish_soon(CancelTask(task_id=self._request.task_id))
        self._cluster.forget_finish(self._request.task_id)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            await subscription.unsubscribe()

    async def submit(self) -> None:
        """Store the task's request and submit the task, or raise ApiError (429: the sequencer found its model's
        queues full, or too slow to start it within `start_timeout_s`)."""
        self._timer.start()
        finishing = self._cluster.expect_finish(self._request.task_id)
        self._submitted = True
        self._submitted_at = time.monotonic()
        start_within_ms = int(self._settings.start_timeout_s * 1000)
        task = self._cluster.task_ref(self._request)
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            instance = await self._route(start_within_ms)
            with self._cluster.naming_for(instance.instance_id):
                # Stored before the task exists, for the node of the instance named: its runner reads it once, when
                # the task is assigned to it.
                await self._cluster.store_request(self._request, instance)
                try:
                    events = await self._cluster.submit(
                        SubmitTask(task=task, instance_id=instance.instance_id, start_within_ms=start_within_ms)
                    )
                    break
                except ApiError as error:
                    # The instance named filled or left before the sequencer took the task: this API's State now
                    # holds what the sequencer decided on, so the next one named is the sequencer's choice.
                    if error.code != RejectCode.NO_CAPACITY or attempt == SUBMIT_ATTEMPTS:
                        raise
        assigned = next(e for e in events if isinstance(e, TaskAssigned))
        self._instance_id, self._generation = assigned.instance_id, assigned.generation
        self._leader_node = instance.leader_node
        self._watcher = asyncio.create_task(self._watch(finishing))

    async def _route(self, start_within_ms: int) -> Instance:
        """The ready instance this task is named for; waits for one to be ready where none is (the one that takes
        the place of an instance that left: moved to a faster engine, deleted, its node lost)."""
        model_id = self._request.model_id
        cluster = self._cluster
        while (
            instance := route(cluster.state, model_id, start_within_ms, int(time.time() * 1000), cluster.naming)
        ) is None:
            await ensure_ready(self._cluster, model_id, self._settings)
        return instance

    async def _watch(self, finishing: asyncio.Future[TaskFinished]) -> None:
        """Tell the reader when the task leaves State: with its TaskFinished (the index of its last chunk), or
        with None when it left without finishing (its instance restarted, failed or was deleted, or someone
        cancelled it), so the stream ends now instead of waiting for silence."""
        task_id = self._request.task_id
        await self._cluster.wait_until(lambda s: task_id not in s.tasks, float("inf"))
        self._queue.put_nowait(finishing.result() if finishing.done() else None)

    def _gone_error(self) -> ApiError:
        state = self._cluster.state
        instance = state.instances.get(self._instance_id) if self._instance_id else None
        if instance is None:
            reason = self._cluster.deletion_reason(self._instance_id) if self._instance_id else None
            why = f"its instance was deleted: {reason}" if reason else "its instance was deleted"
        elif instance.failed:
            why = f"its instance failed: {instance.failed_reason}"
        elif instance.generation != self._generation:
            why = f"its instance restarted: {instance.failed_reason}"
        else:
            why = "it was cancelled"
        return ApiError(502, f"the generation stopped: {why}", "runner_failed")

    def _deadline(self, waiting_since: float) -> tuple[float, ApiError]:
        """When the wait for the next chunk gives up, and with which error. A task still queued waits while its
        instance samples tokens, and gives up once it has sampled none for `start_timeout_s` (with slack); the
        first chunk of a started one
        `first_chunk_timeout_s` from its start; any later chunk `chunk_silence_s` from the one before."""
        settings = self._settings
        if self._output_started:
            silence = settings.chunk_silence_s
            return waiting_since + silence, ApiError(
                504, f"the runner sent nothing for {silence:.0f} s", "runner_timeout"
            )
        task = self._cluster.state.tasks.get(self._request.task_id)
        if task is not None and not task.started:
            stalled = settings.start_timeout_s * STALLED_QUEUE_SLACK
            progressed = max(self._submitted_at, self._cluster.stats.sampled_at(task.instance_id))
            return progressed + stalled, ApiError(
                504,
                f"the task waited in its instance's queue while the instance sampled nothing for {stalled:.0f} s",
                "queue_timeout",
            )
        if self._started_at is None:
            self._started_at = time.monotonic()
        first = settings.first_chunk_timeout_s
        return self._started_at + first, ApiError(
            504, f"the runner sent nothing for {first:.0f} s after the task started", "runner_timeout"
        )

    async def _indexed(self) -> Chunk:
        """The next chunk, in index order: a gap is an error."""
        chunk = decode_chunk(await self._receive())
        if chunk.index != self._next_index:
            raise ApiError(502, f"chunk {self._next_index} of the output was lost (got {chunk.index})", "chunk_gap")
        self._next_index += 1
        return chunk

    async def _receive(self) -> bytes:
        """The next chunk's bytes; raises ApiError when the task left without finishing, or on silence."""
        waiting_since = time.monotonic()
        grace_until = None if self._last_index is None else waiting_since + LOST_CHUNK_GRACE_S
        while True:
            deadline, timed_out = self._deadline(waiting_since)
            if grace_until is not None:
                deadline = min(deadline, grace_until)
            try:
                item = await asyncio.wait_for(
                    self._queue.get(), max(0, min(BROKER_CHECK_S, deadline - time.monotonic()))
                )
            except TimeoutError as error:
                # Chunks travel over NATS: without it none can come, so say so now rather than at the deadline.
                self._cluster.require_broker()
                if time.monotonic() < deadline:
                    continue
                if self._last_index is not None:
                    self.finished = True
                    lost = f"chunks {self._next_index}..{self._last_index} of the output were lost"
                    raise ApiError(502, lost, "chunk_gap") from error
                raise timed_out from error
            if item is None:
                self.finished = True
                raise self._gone_error()
            if isinstance(item, TaskFinished):
                # Finished, and chunks travel apart from events: the ones up to its last are still on their way.
                self._last_index = item.last_chunk_index
                grace_until = time.monotonic() + LOST_CHUNK_GRACE_S
                continue
            sender, data = item
            if sender != self._leader_node:
                log.warning("chunk of %s from node %s, which does not run it: dropped", self._request.task_id, sender)
                continue
            return data

    async def next(self) -> Chunk:
        """The next chunk of output; a long prompt's progress before it is kept in `prompt_progress`."""
        chunk = await self._indexed()
        while chunk.prompt_progress is not None:
            self.prompt_progress = chunk.prompt_progress
            self._started_at = time.monotonic()  # the first output is awaited from the prompt's latest progress
            chunk = await self._indexed()
        self._output_started = True
        if chunk.error is not None:
            self.finished = True
            status = 400 if chunk.error_code in REQUEST_ERRORS else 502
            raise ApiError(status, chunk.error, chunk.error_code or "runner_error")
        if chunk.finish_reason is TaskOutcome.CANCELLED:
            # The runner's last chunk of a task cancelled on the bus may come before this API sees the task leave
            # State: its client hears the same end either way.
            self.finished = True
            raise self._gone_error()
        # The one end of a stream: the task's last chunk, which carries its usage. A task that left State
        # without it (its TaskFinished came, then silence; or none came) fails in `_receive` instead.
        self.finished = chunk.usage is not None
        self._timer.chunk(chunk)
        return chunk


def check_inputs(state: State, task: TaskRequest, images_param: str = "messages") -> None:
    """A 400 naming `images_param`, the request field that carries the images, for images sent to a model whose
    card says it takes none (it would see only their placeholders)."""
    if not has_images(task):
        return
    card = find_card(state, task.model_id)
    if card is not None and not card.vision:
        raise ApiError(
            400, f"{task.model_id} takes no images: {_why_blind(card)}", "model_takes_no_images", images_param
        )


def _why_blind(card: ModelCard) -> str:
    """Why a model without vision takes no images. A GGUF model sees on llama.cpp only through the projector file
    that is added with it (a text GGUF and a vision one look alike otherwise): say so, and how to add one."""
    if ModelFormat.GGUF not in card.formats:
        return "it is not a vision model"
    return (
        "it has no image projector (mmproj), through which llama.cpp sees images; a GGUF model that sees is added "
        "with its projector: `jetshard models import-gguf FILE --mmproj PROJECTOR`, or `mmproj_file` beside "
        "`gguf_file` for a Hub repo"
    )


async def ensure_ready(cluster: Cluster, model_id: ModelId, settings: InferenceSettings) -> None:
    """Place an instance of `model_id` if none is alive (auto-place), then wait until one is ready."""
    coming = await ensure_placed(cluster, model_id, settings)
    if coming:
        await wait_ready(cluster, model_id, coming, settings)


async def ensure_placed(cluster: Cluster, model_id: ModelId, settings: InferenceSettings) -> frozenset[InstanceId]:
    """The instances of `model_id` on their way to ready (none: one is ready now). With auto-place and none
    alive, the sequencer places one, or names the one that a concurrent request placed first. Raises ApiError
    (404, or placement refused) before any streaming starts."""
    state = cluster.state
    if ready_instances(state, model_id):
        return frozenset()
    if find_card(state, model_id) is None:
        raise ApiError(
            404,
            f"unknown model {model_id}; ready models: {_listed(ready_models(state))}",
            "model_not_found",
            "model",
        )
    alive = frozenset(i.instance_id for i in state.instances.values() if i.model_id == model_id and not i.failed)
    if alive:
        return alive
    if not settings.auto_place:
        raise ApiError(
            404,
            f"{model_id} has no instance and auto-placement is off; ready models: {_listed(ready_models(state))}",
            "model_not_found",
            "model",
        )
    events = await cluster.submit(
        commands.EnsureInstance(
            instance_id=new_instance_id(),
            model_id=model_id,
            serving=settings.serving,
            keep_alive_ms=default_keep_alive_ms(state, settings),
        )
    )
    return frozenset(e.instance_id for e in events if isinstance(e, InstancePlaced | InstanceChosen))


async def wait_ready(
    cluster: Cluster, model_id: ModelId, coming: frozenset[InstanceId], settings: InferenceSettings
) -> None:
    """Until an instance of `model_id` is ready; 503 as soon as every instance in `coming` failed or left and none
    took its place (the sequencer replaces an instance in the command that removes it: one moved to a faster
    engine, one whose node was lost)."""

    def ready_or_hopeless(s: State) -> bool:
        if ready_instances(s, model_id):
            return True
        return not any(i.model_id == model_id and not i.failed for i in s.instances.values())

    try:
        state = await cluster.wait_until(ready_or_hopeless, settings.ready_timeout_s)
    except TimeoutError as error:
        raise ApiError(
            504, f"{model_id} did not become ready in {settings.ready_timeout_s:.0f} s", "instance_timeout"
        ) from error
    if not ready_instances(state, model_id):
        # Another request's placement may have replaced those that failed (`EnsureInstance`): its failure says why.
        failed = [state.instances[i].failed_reason for i in sorted(coming) if i in state.instances] or [
            i.failed_reason for i in state.instances.values() if i.model_id == model_id and i.failed
        ]
        raise ApiError(
            503, f"{model_id} is unavailable: {'; '.join(failed) or 'its instance was removed'}", "model_unavailable"
        )


def waiting_for(state: State, request: TaskRequest, progress: PromptProgress | None = None) -> str:
    """What a streaming request is waiting for, said in its keep-alive comments: with a long prompt's `progress`
    once it is processed."""
    task = state.tasks.get(request.task_id)
    if task is None:
        return "submitting" if ready_instances(state, request.model_id) else "waiting for the model to be ready"
    if task.started and progress is not None:
        return f"processing the prompt: {progress.done_tokens} of {progress.total_tokens} tokens"
    if task.started:
        return "processing the prompt"
    queued = state.unstarted_tasks(task.instance_id, task.generation)
    ahead = sum(1 for t in queued if t.assigned_seq < task.assigned_seq)
    return f"queued; {ahead} queued before this one"


async def answer(cluster: Cluster, settings: InferenceSettings, task: TaskRequest, receive: Receive) -> Answer:
    """The whole output of a task, its model placed and ready first; the task is cancelled if the client leaves."""
    return await unless_disconnected(receive, _collect(cluster, settings, task))


async def _collect(cluster: Cluster, settings: InferenceSettings, task: TaskRequest) -> Answer:
    cluster.require_broker()
    check_inputs(cluster.state, task)
    await ensure_ready(cluster, task.model_id, settings)
    choices = [Choice() for _ in range(max(task.n, len(task.inputs)))]
    usage = Usage(prompt_tokens=0, completion_tokens=0)
    async with ChunkStream(cluster, task, settings) as chunks:
        await chunks.submit()
        while not chunks.finished:
            chunk = await chunks.next()
            choices[chunk.choice].add(chunk)
            usage = chunk.usage or usage
    return Answer(choices, usage)


@dataclass(frozen=True)
class Waiting:
    """A streaming task has not started yet: what it waits for, for a keep-alive."""

    what: str


class LiveTask:
    """A streaming task: `items()` yields `Waiting` while it waits, then its chunks. Opening it places the model
    and, for a task that starts at once, submits it, so those errors (unknown model, full queue, over-long
    prompt) come before the response starts; later ones are raised from `items()`. The response closes it in
    its background step (`close`), whether or not the stream was ever iterated."""

    def __init__(self, cluster: Cluster, settings: InferenceSettings, task: TaskRequest) -> None:
        self.task = task
        self._cluster = cluster
        self._settings = settings
        # Everything the stream holds open (the chunk subscription, the task starting) is on this stack. A
        # client that leaves while the stream waits to send cancels the sending task, not the generator (its
        # clean-up would wait for garbage collection), and a generator never iterated never cleans up.
        self._resources = AsyncExitStack()
        self._chunks = ChunkStream(cluster, task, settings)
        self._starting: asyncio.Task[Chunk] | None = None

    @classmethod
    async def open(cls, cluster: Cluster, settings: InferenceSettings, task: TaskRequest, receive: Receive) -> LiveTask:
        cluster.require_broker()
        live = cls(cluster, settings, task)
        try:
            await live._open(receive)
        except BaseException:
            await live.close()
            raise
        return live

    async def _open(self, receive: Receive) -> None:
        check_inputs(self._cluster.state, self.task)
        await self._resources.enter_async_context(self._chunks)
        coming = await unless_disconnected(receive, ensure_placed(self._cluster, self.task.model_id, self._settings))

        async def first_chunk() -> Chunk:
            if coming:
                await wait_ready(self._cluster, self.task.model_id, coming, self._settings)
            await self._chunks.submit()
            return await self._chunks.next()

        self._starting = starting = asyncio.create_task(first_chunk())
        self._resources.push_async_callback(stopped, starting)
        if not coming:
            # A task that starts at once answers a full queue or an over-long prompt with a plain HTTP error
            # too; one that waits longer than a keep-alive gets its stream started, and any error in it.
            await unless_disconnected(receive, asyncio.wait({starting}, timeout=self._settings.stream_ping_s))
            if starting.done():
                starting.result()

    async def items(self) -> AsyncIterator[Waiting | Chunk]:
        starting = self._starting
        assert starting is not None
        while not starting.done():
            # At once (the client sees the response start), then every few seconds.
            yield Waiting(waiting_for(self._cluster.state, self.task, self._chunks.prompt_progress))
            await asyncio.wait({starting}, timeout=self._settings.stream_ping_s)
        chunk = starting.result()
        while True:
            yield chunk
            if self._chunks.finished:
                return
            chunk = await self._chunks.next()

    async def close(self) -> None:
        await self._resources.aclose()

    async def __aenter__(self) -> LiveTask:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _listed(model_ids: Iterable[ModelId]) -> str:
    return ", ".join(sorted(model_ids)) or "none"
