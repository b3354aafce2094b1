"""The llama.cpp engine behind the runner's seam (`engines.base`): the instance's llama-server started on its GGUF,
and a task as llama-server requests, one per choice. llama.cpp renders the chat with the model's own template,
tokenizes, samples (a JSON schema as its grammar) and parses tool calls and reasoning; its streamed pieces go to
the task's output here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import httpx
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.sampling import resolve_sampling
from jetshard_schema.types import TaskKind, TaskOutcome, TaskRequest, ToolChoice

from jetshard_worker.engines.base import Admitted, OnProgress, Refused, RowEvents
from jetshard_worker.engines.model_dir import read_generation_config
from jetshard_worker.peer_tunnel import Tunnel
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.schema_check import json_schema_errors
from jetshard_worker.text.output import ChoiceOutput, RowEnd, choice_seed, row_id
from jetshard_worker.text.textstream import StopText
from jetshard_worker.text.toolcalls import ToolCallParsed

from . import requests as llama_requests
from . import rpc_helper
from .embeddings import Embedder, EmbeddingRow, embedding_settings
from .engine import LlamaCppEngine
from .probe import ready_build
from .requests import Ending, LlamaRequest, Piece
from .server import LlamaServer, ServerSettings

GGUF_FILE = "model.gguf"
"""Where a GGUF model's directory holds its weights (the downloader's contract)."""
MMPROJ_FILE = "mmproj.gguf"
"""And a vision model's image projector, beside it."""
LLAMA_SERVER_LOAD_TIMEOUT_S = 600.0
LLAMA_SERVER_MEMORY_ROOM_BYTES = 2**30
"""What llama-server may hold beyond what placement counted for its instance (`ServerSettings.memory_limit_bytes`):
its compute buffers, a projector, a draft model's cache. The demo's, at 8 slots, holds about 1.1 GB of the 1.6 GB
counted (its weights, mapped, count in the one and not the other)."""


async def load(
    spec: RunnerSpec, events: RowEvents, on_progress: OnProgress
) -> LlamaCppServing | rpc_helper.RpcHelperServing:
    """Start the instance's llama-server on its GGUF and wait until it has loaded it (on the leader), or this
    rank's share of it (`rpc_helper`). llama.cpp reports no progress while it loads: the runner reports none
    loaded, then all."""
    build = ready_build()
    if build is None:
        raise RuntimeError("llama.cpp is not built on this node: run `jetshard engines build llama.cpp`")
    model_dir = Path(spec.plan.model_dir)
    if spec.plan.rank != spec.plan.leader_rank:
        return await rpc_helper.load(spec, build, model_dir / GGUF_FILE, on_progress)
    mmproj = model_dir / MMPROJ_FILE
    settings = ServerSettings(
        binary=build.llama_server,
        working_dir=build.build.root,
        # Resolved: llama.cpp finds a split model's other parts beside the first part's own name.
        model=(model_dir / GGUF_FILE).resolve(),
        slots=spec.plan.serving.max_batch,
        context_per_slot=spec.context_per_slot,
        prompt_cache_bytes=spec.plan.serving.prefix_cache_bytes,
        kv_cache_type=spec.plan.serving.kv_cache_type,
        draft=spec.plan.serving.draft,
        draft_model=(Path(spec.plan.draft_dir) / GGUF_FILE).resolve() if spec.plan.draft_dir else None,
        mmproj=mmproj if mmproj.is_file() else None,
        memory_limit_bytes=counted + LLAMA_SERVER_MEMORY_ROOM_BYTES if (counted := spec.plan.reserved_bytes) else None,
    )
    for gguf in (settings.model, settings.draft_model):
        if gguf is not None and not gguf.is_file():
            raise RuntimeError(f"{gguf} is missing: the model's GGUF file did not reach this node")
    tunnels = await rpc_helper.reach_helpers(spec, LLAMA_SERVER_LOAD_TIMEOUT_S)
    try:
        if tunnels:
            helper_layers = tuple(end - start for start, end in spec.plan.layer_ranges[1:])
            rpc_servers = tuple(f"127.0.0.1:{tunnel.port}" for tunnel in tunnels)
            settings = replace(settings, rpc_servers=rpc_servers, helper_layers=helper_layers)
        server = LlamaServer(settings)
        await server.start(LLAMA_SERVER_LOAD_TIMEOUT_S)
    except BaseException:
        for tunnel in tunnels:
            await tunnel.close()
        raise
    return LlamaCppServing(
        server,
        tunnels,
        events,
        card_generation=spec.card_generation,
        model_generation=read_generation_config(model_dir),
        template_takes_tools=await server.template_takes_tools(),
        vocabulary_size=await server.vocabulary_size(),
    )


class LlamaCppServing(LlamaCppEngine):
    """An instance's `LlamaCppEngine` as the runner drives it (`engines.base.ServingEngine`): it admits tasks and
    hands its rows' pieces to their outputs."""

    is_leader = True
    """The instance's llama-server runs here, whatever the other ranks hold."""
    loaded_tensors: tuple[str, ...] = ()
    weights_held_as = "GGUF (llama.cpp)"

    def __init__(
        self,
        server: LlamaServer,
        tunnels: Sequence[Tunnel],
        events: RowEvents,
        *,
        card_generation: GenerationDefaults,
        model_generation: GenerationDefaults,
        template_takes_tools: bool,
        vocabulary_size: int,
    ) -> None:
        super().__init__(
            server,
            server.settings.slots,
            on_started=self._started,
            on_piece=self._piece,
            on_finished=self._finished,
            on_failed=events.failed,
        )
        self._events = events
        self._tunnels = tuple(tunnels)
        """To the ranks that hold the rest of the model, when it is split across nodes."""
        self._card_generation = card_generation
        self._model_generation = model_generation
        self._template_takes_tools = template_takes_tools
        """The model's chat template renders tools (its `chat_template_caps`)."""
        self._context_length = server.settings.context_per_slot
        self._vocabulary_size = vocabulary_size
        self._embedder = Embedder(
            embedding_settings(server.settings),
            LLAMA_SERVER_LOAD_TIMEOUT_S,
            on_started=events.started,
            on_embedded=events.embedded,
            on_cancelled=lambda row: events.finished(row, RowEnd(TaskOutcome.CANCELLED)),
            on_failed=events.failed,
        )

    def token_text(self, token: int) -> str:
        """Never asked: llama.cpp's logprobs come with their tokens' text (`Piece.logprobs`)."""
        raise TypeError("llama.cpp hands out text, never token ids")

    def submit(self, request: LlamaRequest | EmbeddingRow) -> None:  # type: ignore[override]
        if isinstance(request, EmbeddingRow):
            self._embedder.submit(request)
        else:
            super().submit(request)

    def cancel(self, row_id: str) -> None:
        self._embedder.cancel(row_id)
        super().cancel(row_id)

    async def close(self) -> None:
        await self._embedder.close()
        await super().close()
        for tunnel in self._tunnels:
            await tunnel.close()

    async def admit(self, request: TaskRequest) -> Admitted[LlamaRequest | EmbeddingRow] | Refused:
        if request.kind is TaskKind.EMBEDDING:
            return await self._embedding(request)
        if self.server.settings.mmproj is None and any(message.images for message in request.messages):
            return Refused(
                "the llama.cpp engine serving this instance has no image projector for this model",
                "unsupported_by_engine",
            )
        if (unreadable := llama_requests.unreadable_image(request)) is not None:
            return Refused(unreadable, "unsupported_by_engine")
        if (contradiction := _schema_contradiction(request)) is not None:
            return Refused(contradiction, "invalid_schema")
        if request.top_logprobs is not None and self.server.settings.draft is not None:
            # Its stream leaves out the logprobs of the drafted tokens it keeps: an answer with holes, never given.
            return Refused(
                "logprobs are not available from an instance that drafts tokens (llama.cpp streams none for the "
                "drafted tokens it keeps): ask without logprobs, or place the model without serving.draft",
                "unsupported_by_engine",
            )
        resolved = resolve_sampling(request.sampling, self._model_generation, self._card_generation)
        seed = request.sampling.seed
        max_tokens, window = min(resolved.max_tokens, self._context_length), self._context_length
        forced = llama_requests.forced_call(request, self._template_takes_tools)
        schema = forced if forced is not None else request.output_schema
        # A constrained document (a schema's, a forced call's) must not be cut by a stop string: it closes itself.
        stop = () if schema is not None else request.sampling.stop
        choice_request = (
            partial(llama_requests.chat_request, template_takes_tools=self._template_takes_tools)
            if request.kind is TaskKind.CHAT
            else llama_requests.completion_request
        )
        rows: list[LlamaRequest | EmbeddingRow] = []
        choices = []
        for i in range(request.n):
            rows.append(
                choice_request(
                    row_id(request.task_id, i),
                    request,
                    resolved,
                    max_tokens=max_tokens,
                    seed=choice_seed(seed, i),
                    window=window,
                )
            )
            choices.append(
                ChoiceOutput(
                    detokenizer=None,
                    stop=StopText(stop),
                    splitter=llama_requests.call_splitter(request, self._template_takes_tools),
                    forced_calls=forced is not None,
                    grammar_schema=schema,
                )
            )
        return Admitted(choices, rows)

    async def _embedding(self, request: TaskRequest) -> Admitted[LlamaRequest | EmbeddingRow] | Refused:
        """One row per input, its token ids checked here: llama-server would fail a whole request on one of them."""
        if self._tunnels:
            # The embedding server is a second llama-server; each helper's ggml-rpc-server serves one at a time.
            return Refused(
                "embeddings are not served by a llama.cpp instance split across nodes: place the model on one node "
                "for embeddings",
                "unsupported_by_engine",
            )
        rows: list[LlamaRequest | EmbeddingRow] = []
        limit = self._embedder.context_length
        for i, given in enumerate(request.inputs):
            # Token ids a client gave are embedded as they are: tokenizing is what they stand in for.
            try:
                tokens = await self._tokenize(given) if isinstance(given, str) else list(given)
            except (httpx.HTTPError, ValueError, LookupError, TypeError) as error:
                return Refused(f"llama.cpp could not tokenize input {i}: {error}", "engine_error")
            if not tokens:
                return Refused(f"input {i} is empty", "invalid_request")
            if len(tokens) > limit:
                return Refused(
                    f"input {i} has {len(tokens)} tokens; embeddings on llama.cpp take at most {limit}",
                    "context_length_exceeded",
                )
            unknown = next((t for t in tokens if t >= self._vocabulary_size), None)
            if unknown is not None:
                message = (
                    f"input {i} holds token id {unknown}; the model's vocabulary has ids 0 to "
                    f"{self._vocabulary_size - 1}"
                )
                return Refused(message, "invalid_request")
            rows.append(EmbeddingRow(row_id(request.task_id, i), tokens))
        return Admitted([ChoiceOutput(detokenizer=None) for _ in rows], rows)

    async def _tokenize(self, text: str) -> list[int]:
        """The text's tokens as llama-server's embedding tokenizes it: with the model's special tokens (its BOS)."""
        response = await self._client.post("/tokenize", json={"content": text, "add_special": True})
        response.raise_for_status()
        return [int(token) for token in response.json()["tokens"]]

    def _started(self, row: str) -> None:
        # llama.cpp counts the prompt's tokens as it prefills them; they come with the task's usage.
        self._events.started(row, 0)

    def _piece(self, row: str, piece: Piece) -> None:
        if piece.prompt_progress is not None:
            self._events.prefilling(row, *piece.prompt_progress)
            if not piece.has_output:
                return
        produced = self._events.produced(row)
        if produced is None:
            return
        output, choice = produced
        ending = output.text(choice, piece.reasoning, piece.text, piece.logprobs, piece.tokens, piece.reasoning_tokens)
        if ending is not None:
            self.finish(row, ending)

    def _finished(self, row: str, ending: Ending, calls: list[ToolCallParsed]) -> None:
        self._events.finished(row, RowEnd(ending.reason, ending.prompt_tokens, calls, ending.completion_tokens))


def _schema_contradiction(request: TaskRequest) -> str | None:
    """What is wrong with a schema llama.cpp would build a grammar of (the output's, each tool's parameters), as
    llguidance finds it. llama-server aborts on a grammar no value meets (a minimum above the maximum), and every
    request in flight on it fails with it, so such a schema never reaches it."""
    schemas = [("the response format", request.output_schema)] if request.output_schema is not None else []
    if request.tools is not None and request.tools.choice is not ToolChoice.NONE:
        schemas += [(f"function {tool.name!r}'s parameters", tool.parameters) for tool in request.tools.functions]
    for what, schema in schemas:
        if errors := json_schema_errors(schema):
            return f"the JSON schema of {what} is invalid: {'; '.join(errors)}"
    return None
