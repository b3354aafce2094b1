"""The MLX engine behind the runner's seam (`engines.base`): loading a rank's shard and joining its ring; on the
leader, a task as the engine's rows — the prompt rendered and tokenized (a chat's images through the model's
processor), sampling resolved, a JSON schema followed by a logits processor, the reasoning steered within its
budget, tool calls split by the tokenizer's own markers — and the engine thread's news handed to the runner's
event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.sampling import resolve_sampling
from jetshard_schema.types import Drafting, Parallelism, TaskKind, TaskOutcome, TaskRequest, ToolChoice, WeightsDtype

from jetshard_worker.engines.base import Admitted, EngineFigures, OnProgress, Refused, RowEvents
from jetshard_worker.engines.model_dir import read_generation_config
from jetshard_worker.library_boundary import (
    hf_tokenizer_of,
    load_tokenizer,
    prompt_inputs,
    think_markers_of,
    vision_processor,
)
from jetshard_worker.rank_tunnels import RingTunnels, open_ring_tunnels
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.text.chat import render_chat, tool_spec
from jetshard_worker.text.constrained import JsonConstraint, SchemaError, grammar_tokenizer
from jetshard_worker.text.output import ChoiceOutput, RowEnd, choice_seed, row_id
from jetshard_worker.text.reasoning import ReasoningText, ReasoningTokens, ThinkMarkers, opens_in_reasoning
from jetshard_worker.text.textstream import StopText
from jetshard_worker.text.toolcalls import ToolCallSplitter, forced_call_schema

from .distributed import init_ring
from .drafting import Drafter, DraftModel, PromptLookup
from .engine import GenerationRequest, PipelineEngine, TokenScores
from .shard import Shard, load_shard

log = logging.getLogger(__name__)

_HELD_AS = {WeightsDtype.FLOAT32: mx.float32, WeightsDtype.BFLOAT16: mx.bfloat16, WeightsDtype.FLOAT16: mx.float16}
"""The dtypes a shard converts its weights to; the others (NATIVE, and AUTO in placements made before it was
resolved) keep the checkpoint's."""


async def load(spec: RunnerSpec, events: RowEvents, on_progress: OnProgress) -> MlxServing:
    """Load the rank's layers and join the instance's ring; the leader loads the tokenizer too (and a vision
    model's processor)."""
    plan = spec.plan
    model_dir = Path(plan.model_dir)
    # Placement resolves AUTO; an instance placed before it did keeps the checkpoint's dtype.
    dtype = _HELD_AS.get(plan.weights)
    # A tensor-parallel rank needs the ring to know which slice of each layer it keeps; a pipeline rank joins it
    # once loaded.
    tensor = plan.serving.parallelism is Parallelism.TENSOR
    group, tunnels = await _join_ring(spec) if tensor else (None, None)
    try:
        shard = await asyncio.to_thread(
            load_shard,
            model_dir,
            plan.start_layer,
            plan.end_layer,
            on_progress,
            dtype=dtype,
            tensor_group=group,
        )
        # Before a pipeline rank joins the ring, so that the leader loads its draft while the others load theirs.
        drafter = await asyncio.to_thread(_drafter, spec, shard)
        if not tensor:
            group, tunnels = await _join_ring(spec)
    except BaseException:
        if tunnels is not None:
            await tunnels.close()
        raise
    serving = MlxServing(spec, events, shard, group, tunnels, drafter)
    if serving.is_leader:
        serving.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir, None, sorted(shard.eos_token_ids))
        markers = think_markers_of(serving.tokenizer)
        serving.think_markers = None if markers is None else ThinkMarkers(*markers)
        if shard.takes_images:
            serving.processor = await asyncio.to_thread(vision_processor, model_dir)
        serving.context_length = int(shard.config.get("max_position_embeddings") or serving.context_length)
        serving.model_generation = read_generation_config(model_dir)
    return serving


def _drafter(spec: RunnerSpec, shard: Shard) -> Drafter | None:
    """How the leader drafts (`serving.draft`): by prompt lookup, or with the model the downloader put in the plan's
    `draft_dir` (only the leader's plan names one), loaded whole as stored."""
    if spec.plan.serving.draft == Drafting.NGRAM:
        return PromptLookup()
    if not spec.plan.draft_dir:
        return None
    return DraftModel(load_shard(Path(spec.plan.draft_dir), 0, None), shard.config.get("vocab_size"))


async def _join_ring(spec: RunnerSpec) -> tuple[mx.distributed.Group | None, RingTunnels | None]:
    """The ring of the instance's ranks and the tunnels it runs through (`jetshard_worker.rank_tunnels`), None for a
    single rank. Blocks until both ring neighbours are up; the worker kills us if that takes too long."""
    if spec.plan.world_size == 1:
        return None, None
    assert spec.hostfile is not None
    # This rank's own hostfile: its loopback listener and its forwarder to the right neighbour.
    hostfile = Path(spec.hostfile)
    tunnels = await open_ring_tunnels(spec, hostfile)
    try:
        group = await asyncio.to_thread(init_ring, spec.plan.rank, hostfile)
        tunnels.release_ring_port()  # held the port until the ring's listener bound it
        failure = tunnels.failure()
        if failure is not None:
            raise RuntimeError(f"rank {spec.plan.rank} joined a ring whose tunnels are gone: {failure}")
    except BaseException:
        await tunnels.close()
        raise
    return group, tunnels


ENGINE_STOP_S = 5.0
"""How long closing waits for the engine thread's end (the leader's STOP sent) before it closes the ring's tunnels."""


class MlxServing:
    """A rank's `PipelineEngine` as the runner drives it (`engines.base.ServingEngine`)."""

    def __init__(
        self,
        spec: RunnerSpec,
        events: RowEvents,
        shard: Shard,
        group: mx.distributed.Group | None,
        tunnels: RingTunnels | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self._spec = spec
        self._tunnels = tunnels
        """The ring's tunnels, open for as long as the engine serves."""
        self._engine_thread: threading.Thread | None = None
        self._events = events
        self._loop = asyncio.get_running_loop()
        self._engine_lock = threading.Lock()
        self._engine_calls: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self._engine_wake_pending = False
        self._embeddings: dict[str, list[float]] = {}
        self.shard = shard
        self.engine = PipelineEngine(
            shard,
            group,
            on_started=self._on_started,
            on_token=self._on_token,
            on_finished=self._on_finished,
            on_embedding=self._on_embedding,
            on_prefill=self._on_prefill,
            max_batch=spec.plan.serving.max_batch,
            prefix_cache_bytes=spec.plan.serving.prefix_cache_bytes,
            kv_bits=spec.plan.serving.kv_cache_type.quantized_bits,
            drafter=drafter,
        )
        self.tokenizer: Any = None
        self.think_markers: ThinkMarkers | None = None
        self.processor: Any = None
        """A vision model's processor (its images' pixels and tokens); None for a text model."""
        self.context_length = 4096
        self.model_generation = GenerationDefaults()

    @property
    def is_leader(self) -> bool:
        return self.engine.is_leader

    @property
    def stats(self) -> EngineFigures:
        return self.engine.stats

    @property
    def loaded_tensors(self) -> tuple[str, ...]:
        return tuple(sorted(self.shard.loaded_tensors))

    @property
    def weights_held_as(self) -> str:
        return self.shard.weights_dtype

    def submit(self, row: GenerationRequest) -> None:
        self.engine.submit(row)

    def cancel(self, row_id: str) -> None:
        self.engine.cancel(row_id)

    def finish(self, row_id: str, reason: TaskOutcome) -> None:
        self.engine.finish(row_id, reason)

    async def serve(self) -> None:
        """The engine runs on a thread of its own: mlx's work never holds up the event loop. Ends, failing, if the
        engine does (with its error: a rank whose peer is gone, say) or the ring's tunnels do."""
        failures: list[Exception] = []

        def run() -> None:
            try:
                self.engine.run_forever()
            except Exception as error:  # raised again below, on the event loop: the runner fails with it
                failures.append(error)

        engine_thread = threading.Thread(target=run, name="engine", daemon=True)
        self._engine_thread = engine_thread
        engine_thread.start()
        joined = asyncio.ensure_future(asyncio.to_thread(engine_thread.join))
        waiters = {joined} if self._tunnels is None else {joined, asyncio.ensure_future(self._tunnels.wait())}
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.cancel()
        if joined not in done:
            (tunnels_end,) = done
            raise RuntimeError(f"the ring between the ranks broke: {tunnels_end.result()}")
        if failures:
            raise failures[0]

    async def close(self) -> None:
        if self.engine.is_leader:
            self.engine.shutdown()
        if self._tunnels is not None:
            # The leader's STOP goes to the other ranks through the tunnels: let it leave first.
            if self._engine_thread is not None:
                await asyncio.to_thread(self._engine_thread.join, ENGINE_STOP_S)
            await self._tunnels.close()

    # --- tasks in ---------------------------------------------------------------------------------------

    async def admit(self, request: TaskRequest) -> Admitted[GenerationRequest] | Refused:
        try:
            prompts, images = await self._prompts(request)
        except Exception as error:  # a template that rejects the conversation, an unreadable image, for instance
            return Refused(f"could not build the prompt: {error}", "invalid_prompt")
        for tokens in prompts:
            if len(tokens) >= self.context_length:
                return Refused(
                    f"the prompt has {len(tokens)} tokens; the model's context is {self.context_length}",
                    "context_length_exceeded",
                )
        if request.kind is TaskKind.EMBEDDING:
            empty = next((i for i, tokens in enumerate(prompts) if not tokens), None)
            if empty is not None:
                return Refused(f"input {empty} is empty", "invalid_request")
            # Token ids a client gave index the embedding: one outside it would fail the model, not the request.
            vocab_size = self._vocab_size
            unknown = next(((i, t) for i, tokens in enumerate(prompts) for t in tokens if t >= vocab_size), None)
            if unknown is not None:
                i, token = unknown
                message = f"input {i} holds token id {token}; the model's vocabulary has ids 0 to {vocab_size - 1}"
                return Refused(message, "invalid_request")
            rows = [
                GenerationRequest(task_id=row_id(request.task_id, i), prompt_tokens=tokens, max_tokens=1, embed=True)
                for i, tokens in enumerate(prompts)
            ]
            return Admitted([ChoiceOutput(detokenizer=None) for _ in rows], rows)
        try:
            return self._generation(request, prompts[0], images)
        except (ValueError, SchemaError) as error:  # values no API would pass on, a schema we cannot follow
            code = "invalid_schema" if isinstance(error, SchemaError) else "invalid_request"
            return Refused(str(error), code)

    def _generation(
        self, request: TaskRequest, tokens: list[int], images: dict[str, np.ndarray] | None
    ) -> Admitted[GenerationRequest]:
        """A chat's or completion's rows, one per choice, and the output they feed; `images`: a vision prompt's
        image arrays."""
        resolved = resolve_sampling(request.sampling, self.model_generation, self._spec.card_generation)
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
            constraint = None if schema is None else self._constraint(schema, max_tokens, closes_at_budget=not forced)
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
                    sampling=resolved,
                    repeat_last_n=request.sampling.repeat_last_n,
                    seed=choice_seed(seed, i),
                    logits_processors=processors,
                    top_logprobs=request.top_logprobs,
                    images=images,
                )
            )
        return Admitted(choices, rows)

    @property
    def _vocab_size(self) -> int:
        """The model's token ids: its embedding's rows and its logits' width (the tokenizer's size for a config
        that does not say)."""
        return int(self.shard.config.get("vocab_size") or len(hf_tokenizer_of(self.tokenizer)))

    def _constraint(self, schema: dict[str, Any], max_tokens: int, closes_at_budget: bool) -> JsonConstraint:
        hf_tokenizer = hf_tokenizer_of(self.tokenizer)
        return JsonConstraint(
            grammar_tokenizer(hf_tokenizer, self._vocab_size),
            schema,
            max_tokens,
            lambda text: list(hf_tokenizer.encode(text, add_special_tokens=False)),
            closes_at_budget,
        )

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _turn_opening(self, request: TaskRequest, tokens: list[int]) -> list[int]:
        """The prompt's tokens after the conversation: what the template opens the assistant's turn with (`<think>`
        in a template that opens the reasoning there). A think marker a user wrote in a message is the
        conversation's, and opens nothing. The whole prompt where the conversation alone is not its beginning;
        nothing where the answer continues the caller's last message."""
        if request.continue_final_message:
            return []
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
                vision = self.shard.vision_config
                rendered = render_chat(
                    self.tokenizer,
                    request.messages,
                    request.tools,
                    request.chat_template_kwargs,
                    content_parts=vision is not None,
                    continue_final=request.continue_final_message,
                )
                pictures = [image for message in request.messages for image in message.images]
                if not pictures:
                    return [list(self.tokenizer.encode(rendered, add_special_tokens=False))], None
                if vision is None:
                    raise ValueError("this model takes no images")
                image_token = self.shard.image_token_id
                inputs = await asyncio.to_thread(prompt_inputs, self.processor, rendered, pictures, image_token)
                return [inputs.pop("input_ids")[0].tolist()], inputs
            case TaskKind.EMBEDDING:
                # Token ids a client gave are embedded as they are: tokenizing is what they stand in for.
                given = request.inputs
                return [list(self.tokenizer.encode(i)) if isinstance(i, str) else list(i) for i in given], None
        return [list(self.tokenizer.encode(request.prompt))], None

    # --- the engine thread's news, on the runner's loop ---------------------------------------------------

    def _on_started(self, row: str, prompt_tokens: int) -> None:
        """Engine thread: a queued row's prefill begins."""
        self._from_engine(self._events.started, row, prompt_tokens)

    def _on_prefill(self, row: str, done_tokens: int, total_tokens: int) -> None:
        """Engine thread: a prompt is processed this far."""
        self._from_engine(self._events.prefilling, row, done_tokens, total_tokens)

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
        self._from_engine(self._finished, row, reason, prompt_tokens)

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

    def _token(self, row: str, token: int, scores: TokenScores | None) -> None:
        produced = self._events.produced(row)
        if produced is None:
            return
        output, choice = produced
        if (ending := output.token(choice, token, scores)) is not None:
            self.engine.finish(row, ending)

    def _finished(self, row: str, reason: TaskOutcome, prompt_tokens: int) -> None:
        vector = self._embeddings.pop(row, None)
        if vector is not None:
            self._events.embedded(row, vector, prompt_tokens)
        else:
            self._events.finished(row, RowEnd(reason, prompt_tokens))
