"""A runner: one process hosting one shard of an instance. `python -m jetshard_worker.runner SPEC_JSON`, started
through its lifeline (`jetshard_worker.lifeline`), which has it die with its worker (the spec holds no secret: a NATS
password or token comes in the environment).

Every rank loads its layers, joins the ring, and reports its status. The last rank is the leader: it
takes the tasks assigned to its instance from the event stream, renders and tokenizes prompts, drives the
engine, and publishes the generated text on `jetshard.chunks.<node id>.<task id>`.

The leader's request reader, chunk publisher and reports run in one task group with its main work: one that
fails ends the process (exit status 1, the reason last in its log), so its worker reports it FAILED and the
instance restarts, rather than a runner that says READY while its clients wait for chunks that never come.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx
import msgspec
import nats.errors
import numpy as np
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.service import run_service
from jetshard_bus.stats import publish_stats
from jetshard_bus.tracing import enabled as tracing_enabled
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.codec import decode_task_request, encode
from jetshard_schema.commands import Command, ReportRunnerStatus, ReportTaskFinished, ReportTaskStarted
from jetshard_schema.events import (
    EventEnvelope,
    InstanceDeleted,
    InstanceFailed,
    InstanceRestarting,
    TaskAssigned,
    TaskCancelled,
)
from jetshard_schema.ids import TaskId
from jetshard_schema.sampling import generation_config_defaults, resolve_sampling
from jetshard_schema.state import State
from jetshard_schema.stats import RunnerStats
from jetshard_schema.subjects import chunk_subject
from jetshard_schema.types import (
    Chunk,
    Engine,
    Parallelism,
    RunnerReport,
    RunnerStatus,
    ServingCounters,
    TaskKind,
    TaskOutcome,
    TaskRef,
    TaskRequest,
    ToolChoice,
    Usage,
    WeightsDtype,
)
from nats.js import JetStreamContext

from jetshard_worker.chat import render_chat, tool_spec
from jetshard_worker.constrained import JsonConstraint, SchemaError, grammar_tokenizer
from jetshard_worker.engines.llamacpp import requests as llama_requests
from jetshard_worker.engines.llamacpp.engine import LlamaCppEngine
from jetshard_worker.engines.llamacpp.probe import ready_build
from jetshard_worker.engines.llamacpp.requests import Ending, Piece
from jetshard_worker.engines.llamacpp.server import LlamaServer, ServerSettings
from jetshard_worker.engines.mlx import GenerationRequest, PipelineEngine, TokenScores, init_ring, load_shard
from jetshard_worker.library_boundary import (
    hf_tokenizer_of,
    load_tokenizer,
    prompt_inputs,
    think_markers_of,
    vision_processor,
)
from jetshard_worker.output import ChoiceOutput, TaskOutput, row_id, split_row_id
from jetshard_worker.publishing import NATS_ERRORS, publish_until_stored
from jetshard_worker.reasoning import ReasoningText, ReasoningTokens, ThinkMarkers, opens_in_reasoning
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.runner_test_seams import RunnerTestSeams
from jetshard_worker.task_requests import REQUEST_WAIT_S, TaskRequests
from jetshard_worker.task_spans import TaskSpans
from jetshard_worker.textstream import StopText
from jetshard_worker.toolcalls import ToolCallSplitter, forced_call_schema

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5
GGUF_FILE = "model.gguf"
"""Where a GGUF model's directory holds its weights (the downloader's contract)."""
MMPROJ_FILE = "mmproj.gguf"
"""And a vision model's image projector, beside it."""
LLAMA_SERVER_LOAD_TIMEOUT_S = 600.0
_HELD_AS = {WeightsDtype.FLOAT32: mx.float32, WeightsDtype.BFLOAT16: mx.bfloat16, WeightsDtype.FLOAT16: mx.float16}
"""The dtypes a shard converts its weights to; the others (NATIVE, and AUTO in placements made before it was
resolved) keep the checkpoint's."""


class Runner:
    def __init__(self, spec: RunnerSpec, js: JetStreamContext, client: Any) -> None:
        self.spec = spec
        self.plan = spec.plan
        self._js = js
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._engine_lock = threading.Lock()
        self._engine_calls: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self._engine_wake_pending = False
        self._outbox: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()  # None: text is held
        self._holding: list[TaskOutput] = []
        self._outputs: dict[TaskId, TaskOutput] = {}
        self._embeddings: dict[str, list[float]] = {}
        self.test_seams = RunnerTestSeams.from_environ(os.environ)
        self.tasks: asyncio.TaskGroup | None = None
        """The task group of the runner's work while it serves (run_runner); reports sent later join it."""
        self._taken: set[TaskId] = set()
        self._requests: asyncio.Queue[TaskRef] = asyncio.Queue()
        self.requests = TaskRequests(client, js, spec.node_id, self.plan.key.instance_id)
        self._spans = TaskSpans(self.plan.key.instance_id) if tracing_enabled() else None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.think_markers: ThinkMarkers | None = None
        self.processor: Any = None
        """A vision model's processor (its images' pixels and tokens); None for a text model."""
        self.context_length = 4096
        self.model_generation = GenerationDefaults()
        self._template_takes_tools = False
        """On llama.cpp: the model's chat template renders tools (its `chat_template_caps`)."""
        self.done = asyncio.Event()
        self._tokens_seen = (time.monotonic(), 0)
        """When the stats last counted the engine's tokens, and how many there were: tokens/s between two."""

    async def report(self, status: RunnerStatus, **fields: Any) -> None:
        await publish_command(
            self._js,
            ReportRunnerStatus(
                instance_id=self.plan.key.instance_id,
                generation=self.plan.key.generation,
                runner=RunnerReport(
                    node_id=self.spec.node_id,
                    rank=self.plan.rank,
                    worker_session=self.spec.worker_session,
                    status=status,
                    **fields,
                ),
            ),
        )

    @property
    def on_llama_cpp(self) -> bool:
        return self.plan.serving.engine is Engine.LLAMA_CPP

    async def load(self) -> None:
        if self.on_llama_cpp:
            await self._start_llama_server()
            return
        total = self.plan.end_layer - self.plan.start_layer
        last_report = 0.0

        def on_progress(done: int, of: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S or done == of:
                last_report = now
                asyncio.run_coroutine_threadsafe(
                    self.report(RunnerStatus.LOADING, layers_loaded=done, layers_total=of), self._loop
                )

        await self.report(RunnerStatus.LOADING, layers_loaded=0, layers_total=total)
        model_dir = Path(self.plan.model_dir)
        # Placement resolves AUTO; an instance placed before it did keeps the checkpoint's dtype.
        dtype = _HELD_AS.get(self.plan.weights)
        # A tensor-parallel rank needs the ring to know which slice of each layer it keeps; a pipeline rank joins it
        # once loaded.
        tensor = self.plan.serving.parallelism is Parallelism.TENSOR
        group = await self._join_ring() if tensor else None
        shard = await asyncio.to_thread(
            load_shard,
            model_dir,
            self.plan.start_layer,
            self.plan.end_layer,
            on_progress,
            dtype=dtype,
            tensor_group=group,
        )
        if not tensor:
            group = await self._join_ring()
        self.engine = PipelineEngine(
            shard,
            group,
            on_started=self._on_started,
            on_token=self._on_token,
            on_finished=self._on_finished,
            on_embedding=self._on_embedding,
            max_batch=self.plan.serving.max_batch,
            prefix_cache_bytes=self.plan.serving.prefix_cache_bytes,
        )
        if self.engine.is_leader:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir, None, sorted(shard.eos_token_ids))
            markers = think_markers_of(self.tokenizer)
            self.think_markers = None if markers is None else ThinkMarkers(*markers)
            if shard.takes_images:
                self.processor = await asyncio.to_thread(vision_processor, model_dir)
            self.context_length = int(shard.config.get("max_position_embeddings") or self.context_length)
            self.model_generation = _read_generation_config(model_dir)

    async def _start_llama_server(self) -> None:
        """Start the instance's llama-server on its GGUF and wait until it has loaded it. llama.cpp reports no
        progress while it loads: the runner reports none loaded, then all."""
        total = self.plan.end_layer - self.plan.start_layer
        await self.report(RunnerStatus.LOADING, layers_loaded=0, layers_total=total)
        build = ready_build()
        if build is None:
            raise RuntimeError("llama.cpp is not built on this node: run `jetshard engines build llama.cpp`")
        model_dir = Path(self.plan.model_dir)
        mmproj = model_dir / MMPROJ_FILE
        settings = ServerSettings(
            binary=build.llama_server,
            working_dir=build.build.root,
            # Resolved: llama.cpp finds a split model's other parts beside the first part's own name.
            model=(model_dir / GGUF_FILE).resolve(),
            slots=self.plan.serving.max_batch,
            context_per_slot=self.spec.context_per_slot,
            prompt_cache_bytes=self.plan.serving.prefix_cache_bytes,
            mmproj=mmproj if mmproj.is_file() else None,
        )
        if not settings.model.is_file():
            raise RuntimeError(f"{settings.model} is missing: the model's GGUF file did not reach this node")
        server = LlamaServer(settings)
        await server.start(LLAMA_SERVER_LOAD_TIMEOUT_S)
        self.engine = LlamaCppEngine(
            server,
            settings.slots,
            on_started=self._llama_started,
            on_piece=self._llama_piece,
            on_finished=self._llama_finished,
            on_failed=self._llama_failed,
        )
        self.context_length = settings.context_per_slot
        self.model_generation = _read_generation_config(Path(self.plan.model_dir))
        self._template_takes_tools = await server.template_takes_tools()

    async def _join_ring(self) -> mx.distributed.Group | None:
        """The ring of the instance's ranks, None for a single rank. Blocks until both ring neighbours are up; the
        worker kills us if that takes too long."""
        if self.plan.world_size == 1:
            return None
        assert self.spec.hostfile is not None
        group = await asyncio.to_thread(init_ring, self.plan.rank, Path(self.spec.hostfile))
        if self.spec.ring_socket_fd is not None:
            os.close(self.spec.ring_socket_fd)  # held the port until the ring's listener bound it
        return group

    async def report_ready(self, counters: ServingCounters | None = None) -> None:
        total = self.plan.end_layer - self.plan.start_layer
        if self.on_llama_cpp:
            tensors, held_as = (), "GGUF (llama.cpp)"
        else:
            tensors, held_as = tuple(sorted(self.engine.shard.loaded_tensors)), self.engine.shard.weights_dtype
        await self.report(
            RunnerStatus.READY,
            layers_loaded=total,
            layers_total=total,
            loaded_tensors=tensors,
            counters=counters,
            weights_dtype=held_as,
        )

    async def report_counters(self) -> None:
        """The leader's counters, every 10 s (`RunnerTestSeams.counters_interval_s`) while they change: State sees
        prefix-cache hits and batch sizes without an event per request."""
        reported = None
        while True:
            await asyncio.sleep(self.test_seams.counters_interval_s)
            counters = self.counters()
            if counters != reported:
                try:
                    await self.report_ready(counters)
                except NATS_ERRORS as error:  # the next interval sends them again
                    log.warning("counters not reported: %s", error)
                    continue
                reported = counters

    def counters(self) -> ServingCounters:
        return msgspec.convert(dataclasses.asdict(self.engine.stats), ServingCounters)

    def stats(self, interval_s: float) -> RunnerStats:
        """The leader's figures for `jetshard.stats`, every few seconds."""
        engine = self.engine.stats
        now, tokens = time.monotonic(), engine.tokens
        then, before = self._tokens_seen
        self._tokens_seen = (now, tokens)
        return RunnerStats(
            interval_s=interval_s,
            node_id=self.spec.node_id,
            instance_id=self.plan.key.instance_id,
            model_id=self.plan.model_id,
            counters=self.counters(),
            tokens_per_s=round((tokens - before) / (now - then), 2) if now > then else 0.0,
            batch_size=engine.batch_size,
            running_rows=engine.running_rows,
            queued_rows=engine.queued_rows,
        )

    # --- leader: tasks in, chunks out ------------------------------------------------------------------

    def on_event(self, envelope: EventEnvelope, state: State, live: bool) -> None:
        if not live:
            return
        match envelope.event:
            case TaskAssigned(task=task, instance_id=instance_id, generation=generation) if (
                instance_id == self.plan.key.instance_id and generation == self.plan.key.generation
            ):
                self._take(task)
            case TaskCancelled(task_id=task_id) if task_id in self._outputs:
                for choice in range(len(self._outputs[task_id].choices)):
                    self.engine.cancel(row_id(task_id, choice))
            case TaskCancelled(task_id=task_id) if task_id in self._taken:
                self._taken.discard(task_id)
                self.requests.abandon(task_id)
            case InstanceDeleted(instance_id=i) | InstanceFailed(instance_id=i) if i == self.plan.key.instance_id:
                self.done.set()
            case InstanceRestarting(instance_id=i) if i == self.plan.key.instance_id:
                self.done.set()

    def pick_up(self, state: State) -> None:
        """Take every task State assigned to this generation that no runner started: one assigned before
        this follower saw events live would otherwise wait forever."""
        for task in state.unstarted_tasks(self.plan.key.instance_id, self.plan.key.generation):
            self._take(task.ref)

    def _take(self, task: TaskRef) -> None:
        if task.task_id not in self._taken:  # seen live and again in State while starting
            self._taken.add(task.task_id)
            if self._spans is not None:
                self._spans.assigned(task)
            self._requests.put_nowait(task)

    async def read_requests(self) -> None:
        """One reader, so tasks start in the order they were assigned: each request (the prompt) comes from
        JETSHARD_TASKS, where the API stored it for this node alone; events and State never hold it."""
        while True:
            task = await self._requests.get()
            if task.task_id not in self._taken:
                continue  # cancelled before its turn
            stored = await self.requests.take(task.task_id)
            if task.task_id not in self._taken:
                continue  # cancelled while it waited for its request
            try:
                request = decode_task_request(stored.data) if stored is not None else None
            except Exception as error:
                log.warning("request of %s unreadable: %s", task.task_id, error)
                request = None
            if stored is None or request is None or request.task_id != task.task_id:
                self._fail_task(
                    task.task_id,
                    f"the task's request did not reach its runner within {REQUEST_WAIT_S:.0f} s of its assignment",
                    "request_lost",
                )
                continue
            if self._spans is not None:
                self._spans.requested(task.task_id, stored.headers)
            await self._start_task(request)

    async def _start_task(self, request: TaskRequest) -> None:
        if self.on_llama_cpp:
            self._start_llama_task(request)
            return
        try:
            prompts, images = await self._prompts(request)
        except Exception as error:  # a template that rejects the conversation, an unreadable image, for instance
            self._fail_task(request.task_id, f"could not build the prompt: {error}", "invalid_prompt")
            return
        if request.task_id not in self._taken:
            return  # cancelled while its images were prepared
        for tokens in prompts:
            if len(tokens) >= self.context_length:
                self._fail_task(
                    request.task_id,
                    f"the prompt has {len(tokens)} tokens; the model's context is {self.context_length}",
                    "context_length_exceeded",
                )
                return
        if request.kind is TaskKind.EMBEDDING:
            empty = next((i for i, tokens in enumerate(prompts) if not tokens), None)
            if empty is not None:
                self._fail_task(request.task_id, f"input {empty} is empty", "invalid_request")
                return
            # Token ids a client gave index the embedding: one outside it would fail the model, not the request.
            vocab_size = self._vocab_size
            unknown = next(((i, t) for i, tokens in enumerate(prompts) for t in tokens if t >= vocab_size), None)
            if unknown is not None:
                i, token = unknown
                message = f"input {i} holds token id {token}; the model's vocabulary has ids 0 to {vocab_size - 1}"
                self._fail_task(request.task_id, message, "invalid_request")
                return
            rows = [
                GenerationRequest(task_id=row_id(request.task_id, i), prompt_tokens=tokens, max_tokens=1, embed=True)
                for i, tokens in enumerate(prompts)
            ]
            output = TaskOutput(request.task_id, [ChoiceOutput(detokenizer=None) for _ in rows], *self._io)
        else:
            try:
                output, rows = self._generation(request, prompts[0], images)
            except (ValueError, SchemaError) as error:  # values no API would pass on, a schema we cannot follow
                code = "invalid_schema" if isinstance(error, SchemaError) else "invalid_request"
                self._fail_task(request.task_id, str(error), code)
                return
        self._outputs[request.task_id] = output
        for row in rows:
            self.engine.submit(row)

    def _start_llama_task(self, request: TaskRequest) -> None:
        """A task as llama-server requests, one per choice: llama.cpp renders the chat with the model's own
        template, tokenizes, samples (a JSON schema as its grammar) and parses tool calls and reasoning."""
        if request.kind is TaskKind.EMBEDDING:
            self._fail_task(
                request.task_id,
                "the llama.cpp engine serving this instance makes no embeddings of a chat model; "
                'place the model on the mlx engine (`"engine": "mlx"`) for embeddings',
                "unsupported_by_engine",
            )
            return
        if self.engine.server.settings.mmproj is None and any(message.images for message in request.messages):
            self._fail_task(
                request.task_id,
                "the llama.cpp engine serving this instance has no image projector for this model",
                "unsupported_by_engine",
            )
            return
        resolved = resolve_sampling(request.sampling, self.model_generation, self.spec.card_generation)
        seed = request.sampling.seed
        max_tokens, takes_tools, window = (
            min(resolved.max_tokens, self.context_length),
            self._template_takes_tools,
            self.context_length,
        )
        rows, choices = [], []
        for i in range(request.n):
            choice_id = row_id(request.task_id, i)
            # Each choice its own draw; a seeded request stays reproducible.
            choice_seed = None if seed is None else (seed + i) % 2**64
            if request.kind is TaskKind.CHAT:
                rows.append(
                    llama_requests.chat_request(
                        choice_id,
                        request,
                        resolved,
                        max_tokens=max_tokens,
                        seed=choice_seed,
                        window=window,
                        template_takes_tools=takes_tools,
                    )
                )
            else:
                rows.append(
                    llama_requests.completion_request(
                        choice_id,
                        request,
                        resolved,
                        max_tokens=max_tokens,
                        seed=choice_seed,
                        window=self.context_length,
                    )
                )
            forced, splitter = llama_requests.tool_call_parsing(request, takes_tools)
            schema = forced if forced is not None else request.output_schema
            # A constrained document (a schema's, a forced call's) must not be cut by a stop string: it closes itself.
            stop = () if schema is not None else request.sampling.stop
            choices.append(
                ChoiceOutput(
                    detokenizer=None,
                    stop=StopText(stop),
                    splitter=splitter,
                    forced_calls=forced is not None,
                    grammar_schema=schema,
                )
            )
        self._outputs[request.task_id] = TaskOutput(request.task_id, choices, *self._io)
        for row in rows:
            self.engine.submit(row)

    def _llama_started(self, row: str) -> None:
        task_id, choice = split_row_id(row)
        if choice == 0:
            # llama.cpp counts the prompt's tokens as it prefills them; they come with the task's usage.
            self._started(task_id, 0)

    def _llama_piece(self, row: str, piece: Piece) -> None:
        task_id, choice = split_row_id(row)
        if self._spans is not None:
            self._spans.token(task_id)
        output = self._outputs.get(task_id)
        if output is None:
            return
        ending = output.text(choice, piece.reasoning, piece.text, piece.logprobs, piece.tokens, piece.reasoning_tokens)
        if ending is not None:
            self.engine.finish(row, ending)

    def _llama_finished(self, row: str, ending: Ending, calls: list[Any]) -> None:
        self._finish(row, ending.reason, ending.prompt_tokens, calls, ending.completion_tokens)

    def _llama_failed(self, row: str, message: str, code: str) -> None:
        task_id, _ = split_row_id(row)
        output = self._outputs.pop(task_id, None)
        if output is None:
            return
        for other in range(len(output.choices)):
            self.engine.cancel(row_id(task_id, other))
        self._fail_task(task_id, message, code, output)

    @property
    def _io(self) -> tuple[Any, Any, Any]:
        return self._token_text, self._publish_chunk, self._hold

    def _hold(self, output: TaskOutput) -> None:
        """`output` holds text: the publisher flushes it when it is ready for more (see publish_chunks)."""
        self._holding.append(output)
        self._outbox.put_nowait(None)

    def _generation(
        self, request: TaskRequest, tokens: list[int], images: dict[str, np.ndarray] | None
    ) -> tuple[TaskOutput, list[GenerationRequest]]:
        """A chat's or completion's rows, one per choice, and the output they feed; `images`: a vision prompt's
        image arrays."""
        resolved = resolve_sampling(request.sampling, self.model_generation, self.spec.card_generation)
        max_tokens = min(resolved.max_tokens, self.context_length - len(tokens))
        tools = request.tools
        forced = tools is not None and tools.choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION)
        schema = request.output_schema
        if forced:
            assert tools is not None
            specs = [tool_spec(tool) for tool in tools.functions]
            schema = forced_call_schema(specs, tools.function, tools.parallel)
        seed = request.sampling.seed
        markers = self.think_markers if request.kind is TaskKind.CHAT else None
        thinking = markers is not None and opens_in_reasoning(markers, self._turn_opening(request, tokens))
        choices, rows = [], []
        for i in range(request.n):
            constraint = None if schema is None else self._constraint(schema, max_tokens)
            processors = () if constraint is None else (constraint.process,)
            reasoning = None
            if markers is not None:
                reasoning = (ReasoningText(markers, thinking), ReasoningTokens(markers, thinking))
                # The engine thread's own follower of the tokens: it ends the reasoning at the budget, and keeps
                # the constraint to the answer.
                steering = ReasoningTokens(
                    markers, thinking, request.thinking_budget, None if constraint is None else constraint.process
                )
                processors = (steering.process,) if steering.steers else ()
            splitter = None
            if tools is not None and tools.choice is ToolChoice.AUTO and schema is None:
                wrapper = self.tokenizer
                splitter = ToolCallSplitter(
                    wrapper.tool_call_start if wrapper.has_tool_calling else None,
                    wrapper.tool_call_end if wrapper.has_tool_calling else None,
                    wrapper.tool_parser if wrapper.has_tool_calling else None,
                    [tool_spec(tool) for tool in tools.functions],
                    tools.parallel,
                )
            # A constrained document must not be cut by a stop string: it closes itself.
            stop = () if constraint is not None else request.sampling.stop
            choices.append(
                ChoiceOutput(
                    detokenizer=self.tokenizer.detokenizer,
                    stop=StopText(stop),
                    splitter=splitter,
                    forced_calls=forced,
                    constraint=constraint,
                    reasoning=reasoning,
                )
            )
            rows.append(
                GenerationRequest(
                    task_id=row_id(request.task_id, i),
                    prompt_tokens=tokens,
                    max_tokens=max_tokens,
                    temperature=resolved.temperature,
                    top_p=resolved.top_p,
                    top_k=resolved.top_k,
                    min_p=resolved.min_p,
                    repetition_penalty=resolved.repetition_penalty,
                    presence_penalty=resolved.presence_penalty,
                    frequency_penalty=resolved.frequency_penalty,
                    repeat_last_n=request.sampling.repeat_last_n,
                    # Each choice its own draw; a seeded request stays reproducible.
                    seed=None if seed is None else (seed + i) % 2**64,
                    logits_processors=processors,
                    top_logprobs=request.top_logprobs,
                    images=images,
                )
            )
        return TaskOutput(request.task_id, choices, *self._io), rows

    @property
    def _vocab_size(self) -> int:
        """The model's token ids: its embedding's rows and its logits' width (the tokenizer's size for a config
        that does not say)."""
        return int(self.engine.shard.config.get("vocab_size") or len(hf_tokenizer_of(self.tokenizer)))

    def _constraint(self, schema: dict[str, Any], max_tokens: int) -> JsonConstraint:
        hf_tokenizer = hf_tokenizer_of(self.tokenizer)
        return JsonConstraint(
            grammar_tokenizer(hf_tokenizer, self._vocab_size),
            schema,
            max_tokens,
            lambda text: list(hf_tokenizer.encode(text, add_special_tokens=False)),
        )

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _turn_opening(self, request: TaskRequest, tokens: list[int]) -> list[int]:
        """The prompt's tokens after the conversation: what the template opens the assistant's turn with (`<think>`
        in a template that opens the reasoning there). A think marker a user wrote in a message is the
        conversation's, and opens nothing. The whole prompt where the conversation alone is not its beginning."""
        conversation = render_chat(
            self.tokenizer, request.messages, request.tools, request.chat_template_kwargs, add_generation_prompt=False
        )
        start = list(self.tokenizer.encode(conversation, add_special_tokens=False))
        return tokens[len(start) :] if tokens[: len(start)] == start else tokens

    async def _prompts(self, request: TaskRequest) -> tuple[list[list[int]], dict[str, np.ndarray] | None]:
        """The token ids the engine prefills: one prompt, or one per embedding input; and a chat's images as the
        model's processor made them (its arrays besides the token ids), if it has any. The images are decoded
        and resized off the event loop, which meanwhile publishes the other tasks' chunks; only this one reader
        uses the processor."""
        match request.kind:
            case TaskKind.CHAT:
                vision = self.engine.shard.vision_config
                rendered = render_chat(
                    self.tokenizer,
                    request.messages,
                    request.tools,
                    request.chat_template_kwargs,
                    content_parts=vision is not None,
                )
                pictures = [image for message in request.messages for image in message.images]
                if not pictures:
                    return [list(self.tokenizer.encode(rendered, add_special_tokens=False))], None
                if vision is None:
                    raise ValueError("this model takes no images")
                image_token = self.engine.shard.image_token_id
                inputs = await asyncio.to_thread(prompt_inputs, self.processor, rendered, pictures, image_token)
                return [inputs.pop("input_ids")[0].tolist()], inputs
            case TaskKind.EMBEDDING:
                # Token ids a client gave are embedded as they are: tokenizing is what they stand in for.
                given = request.inputs
                return [list(self.tokenizer.encode(i)) if isinstance(i, str) else list(i) for i in given], None
        return [list(self.tokenizer.encode(request.prompt))], None

    def _fail_task(self, task_id: TaskId, message: str, code: str, output: TaskOutput | None = None) -> None:
        """End the task with an error chunk: its first, or the one after what `output` has published (what it held
        back goes first, so the client sees every chunk before the error)."""
        index = 0
        if output is not None:
            output.flush()
            index = output.last_index + 1
        if self._spans is not None:
            self._spans.finished(task_id, TaskOutcome.ERROR, None, code)
        self._publish_chunk(
            Chunk(task_id=task_id, index=index, error=message, error_code=code, finish_reason=TaskOutcome.ERROR)
        )
        self._report_finished(task_id, TaskOutcome.ERROR, Usage(prompt_tokens=0, completion_tokens=0), index, message)

    def _on_started(self, row: str, prompt_tokens: int) -> None:
        """Engine thread: a queued row's prefill begins; the task has started with its first."""
        task_id, choice = split_row_id(row)
        if choice == 0:
            self._from_engine(self._started, task_id, prompt_tokens)

    def _on_token(
        self, row: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None
    ) -> None:
        """Engine thread: one sampled token (the one that reaches max_tokens too, as in mlx-lm)."""
        self._from_engine(self._token, row, token, scores)

    def _on_embedding(self, row: str, vector: list[float]) -> None:
        """Engine thread: an input's embedding, just before its row finishes."""
        self._from_engine(self._embeddings.__setitem__, row, vector)

    def _on_finished(self, row: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        """Engine thread: a row ended (EOS, length, stop string or cancel)."""
        self._from_engine(self._finish, row, reason, prompt_tokens)

    def _from_engine(self, callback: Callable[..., object], *args: object) -> None:
        """Engine thread: run `callback(*args)` on the loop, after everything handed over before it. A decode
        step hands over a token per row at once: the loop is woken once for them all, not once a row."""
        with self._engine_lock:
            self._engine_calls.append((callback, args))
            if self._engine_wake_pending:
                return
            self._engine_wake_pending = True
        self._loop.call_soon_threadsafe(self._run_engine_calls)

    def _run_engine_calls(self) -> None:
        with self._engine_lock:
            calls, self._engine_calls = self._engine_calls, []
            self._engine_wake_pending = False
        for callback, args in calls:
            try:
                callback(*args)
            except Exception:  # as the loop does for a callback of its own: the others still run
                log.exception("handling the engine's %s failed", getattr(callback, "__name__", "call"))

    def _started(self, task_id: TaskId, prompt_tokens: int) -> None:
        if self._spans is not None:
            self._spans.started(task_id, prompt_tokens)
        report = ReportTaskStarted(
            node_id=self.spec.node_id,
            task_id=task_id,
            instance_id=self.plan.key.instance_id,
            prompt_tokens=prompt_tokens,
        )
        self._send_later(report)

    def _token(self, row: str, token: int, scores: TokenScores | None) -> None:
        task_id, choice = split_row_id(row)
        if self._spans is not None:
            self._spans.token(task_id)
        output = self._outputs.get(task_id)
        if output is not None and (ending := output.token(choice, token, scores)) is not None:
            self.engine.finish(row, ending)

    def _finish(
        self,
        row: str,
        reason: TaskOutcome,
        prompt_tokens: int,
        engine_calls: list[Any] | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        task_id, choice = split_row_id(row)
        output = self._outputs.get(task_id)
        if output is None:
            return
        vector = self._embeddings.pop(row, None)
        if vector is not None:
            usage = output.embedding(choice, vector, prompt_tokens)
        else:
            if reason is TaskOutcome.CANCELLED:
                for other in range(len(output.choices)):
                    self.engine.cancel(row_id(task_id, other))
            usage = output.finish(choice, reason, prompt_tokens, engine_calls, completion_tokens)
        if usage is None:
            return
        del self._outputs[task_id]
        outcome = output.outcome
        if self._spans is not None:
            self._spans.finished(task_id, outcome, usage)
        self._report_finished(task_id, outcome, usage, output.last_index)

    def _report_finished(
        self, task_id: TaskId, outcome: TaskOutcome, usage: Usage, last_chunk_index: int, error: str = ""
    ) -> None:
        self._send_later(
            ReportTaskFinished(
                node_id=self.spec.node_id,
                task_id=task_id,
                instance_id=self.plan.key.instance_id,
                outcome=outcome,
                usage=usage,
                error=error,
                last_chunk_index=last_chunk_index,
            )
        )

    def _publish_chunk(self, chunk: Chunk) -> None:
        if self.test_seams.drops(chunk.index):
            return
        data = encode(chunk)
        if self.test_seams.oversizes(chunk.index):
            data += b" " * self._client.max_payload  # trailing blanks: still the chunk's JSON, only too big
        self._outbox.put_nowait((chunk_subject(self.spec.node_id, chunk.task_id), data))

    def _send_later(self, report: Command) -> None:
        """Publish `report` (until stored) without holding up the loop, in the runner's task group."""
        if self.tasks is None:
            # The runner is stopping: its instance restarts or is gone, and State drops the task with it.
            log.info("not sending %s: the runner is stopping", type(report).__name__)
            return
        self.tasks.create_task(_named(f"sending {type(report).__name__}", publish_until_stored(self._js, report)))

    async def publish_chunks(self) -> None:
        """One publisher, so chunks leave in the order they were made. Each round publishes what is queued and
        what the outputs hold, then waits for NATS to have it all: text made meanwhile leaves in one chunk per
        choice next round, so a busy engine makes fewer, larger chunks, not a backlog. A chunk the client
        refuses to publish (connection closed for good, payload too big) ends the runner."""
        while True:
            queued = [await self._outbox.get()]
            holding, self._holding = self._holding, []
            for output in holding:
                output.flush()  # into the outbox, after every chunk it made before
            while not self._outbox.empty():
                queued.append(self._outbox.get_nowait())
            for item in queued:
                if item is not None:
                    await self._client.publish(*item)
            # The round trip paces the publisher. A reconnection drops the ping in flight and the flush times
            # out; what the client buffered meanwhile goes out once it is connected again.
            with contextlib.suppress(nats.errors.FlushTimeoutError):
                await self._client.flush()


def _read_generation_config(model_dir: Path) -> GenerationDefaults:
    """The sampling defaults in the model's generation_config.json; a missing or unreadable file sets none
    (it is optional, and a broken one must not keep the model from serving)."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, ValueError) as error:
        log.warning("ignoring %s/generation_config.json: %s", model_dir, error)
        return GenerationDefaults()
    return generation_config_defaults(config)


async def _named(what: str, work: Coroutine[Any, Any, None]) -> None:
    """`work`, its failure saying which part of the runner failed."""
    try:
        await work
    except Exception as error:
        raise RunnerPartFailed(f"{what} failed: {type(error).__name__}: {error}") from error


class RunnerPartFailed(Exception):
    """A part of the runner (its chunk publisher, its request reader, a report) failed; the message names it."""


class _Stopped(Exception):
    """Ends the task group once the runner's main work is over: its other tasks are cancelled."""


def _exit_failed(failed: BaseExceptionGroup[Exception]) -> NoReturn:
    """Log why the runner failed, ending with one line that says it (the worker's report quotes the log's last
    lines), and exit with status 1 at once: the engine thread may still run, and its mlx state would abort an
    orderly interpreter exit (see engine.run_forever)."""
    for error in failed.exceptions:
        log.error("runner failed", exc_info=error)
    log.error("runner stopping: %s", "; ".join(str(error) for error in failed.exceptions))
    logging.shutdown()
    os._exit(1)


async def run_runner(spec: RunnerSpec, stop: asyncio.Event) -> None:
    client, js = await connect(
        spec.nats, f"jetshard-runner {spec.plan.key.instance_id}/{spec.plan.rank}", declare_streams=False
    )
    runner = Runner(spec, js, client)
    try:
        await runner.load()
    except Exception as error:
        log.exception("runner failed to start")
        await runner.report(RunnerStatus.FAILED, reason=f"rank {spec.plan.rank} failed to start: {error}")
        await client.drain()
        sys.exit(1)
    if isinstance(runner.engine, LlamaCppEngine):
        engine_runs: Coroutine[Any, Any, None] = _named("llama.cpp", runner.engine.serve())
    else:
        engine_thread = threading.Thread(target=runner.engine.run_forever, name="engine", daemon=True)
        engine_thread.start()
        engine_runs = asyncio.to_thread(engine_thread.join)
    follower = StateFollower(js) if runner.engine.is_leader else None
    try:
        async with asyncio.TaskGroup() as tasks:
            runner.tasks = tasks
            await _serve(runner, follower, client, stop, engine_runs)
            raise _Stopped
    except* _Stopped:
        pass
    except* Exception as failed:
        _exit_failed(failed)
    finally:
        runner.tasks = None
    if isinstance(runner.engine, LlamaCppEngine):
        await runner.engine.close()
    elif runner.engine.is_leader:
        runner.engine.shutdown()
    with contextlib.suppress(Exception):
        await runner.report(RunnerStatus.STOPPED, reason="stopped")
    if follower is not None:
        await follower.stop()
    await client.drain()


async def _serve(
    runner: Runner,
    follower: StateFollower | None,
    client: Any,
    stop: asyncio.Event,
    engine_runs: Coroutine[Any, Any, None],
) -> None:
    """Report ready and serve until asked to stop, the instance is over, or the engine ended; the leader's
    reader, publisher and reports run meanwhile in `runner.tasks`."""
    assert runner.tasks is not None
    if follower is not None:
        # Follow before reporting ready: tasks are assigned once every rank is ready, and each of them
        # must reach this follower as a live event (or be in State for pick_up below).
        follower.add_listener(runner.on_event)
        await asyncio.sleep(runner.test_seams.follow_delay_s)
        await follower.start()
        runner.tasks.create_task(_named("the chunk publisher", runner.publish_chunks()))
        runner.tasks.create_task(_named("the request reader", runner.read_requests()))
        await runner.requests.subscribe()
    await runner.report_ready()
    if follower is not None:
        runner.pick_up(follower.state)
        runner.tasks.create_task(_named("the counters report", runner.report_counters()))
        runner.tasks.create_task(_named("the stats publisher", publish_stats(client, runner.stats)))
    waiters = [
        asyncio.create_task(stop.wait()),
        asyncio.create_task(runner.done.wait()),
        asyncio.create_task(engine_runs),
    ]
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in done:
            waiter.result()  # the engine's end, when it failed (llama-server died), fails the runner with its reason
    finally:
        for waiter in waiters:
            waiter.cancel()


def main() -> None:
    time.sleep(RunnerTestSeams.from_environ(os.environ).start_delay_s)
    spec = msgspec.json.decode(sys.argv[1], type=RunnerSpec)
    spec = msgspec.structs.replace(spec, nats=spec.nats.with_secrets(os.environ))
    run_service(f"runner/{spec.plan.rank}", lambda stop: run_runner(spec, stop))


if __name__ == "__main__":
    main()
