"""The llama.cpp engine: each choice of a task is one streamed request to the instance's llama-server, run as a
task on the runner's event loop. At most `slots` are in flight, as many as llama-server has slots, so a request
sent is a request llama.cpp starts at once: the runner's "started" and the queue the API admits against stay
true. Closing a request's stream is how a choice is cancelled: llama-server stops that slot."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httpx
from jetshard_schema.types import TaskOutcome

from jetshard_worker.engines.figures import EngineFigures
from jetshard_worker.engines.llamacpp.requests import Ending, LlamaRequest, Piece, ServerError, StreamState, parse_event
from jetshard_worker.engines.llamacpp.server import UNRESPONSIVE_S, LlamaServer, ServerDied
from jetshard_worker.text.toolcalls import ToolCallParsed

log = logging.getLogger(__name__)

OnStarted = Callable[[str], None]
OnPiece = Callable[[str, Piece], None]
OnFinished = Callable[[str, Ending, list[ToolCallParsed]], None]
OnFailed = Callable[[str, str, str], None]
"""A row's id, the message and our error code."""


class OutputFailed(Exception):
    """The runner failed to turn a streamed piece into output: the row's task fails (it never hangs)."""


class LlamaCppEngine:
    def __init__(
        self,
        server: LlamaServer,
        slots: int,
        *,
        on_started: OnStarted,
        on_piece: OnPiece,
        on_finished: OnFinished,
        on_failed: OnFailed,
        unresponsive_s: float = UNRESPONSIVE_S,
    ) -> None:
        self.server = server
        self._unresponsive_s = unresponsive_s
        self.stats = EngineFigures()
        self._client = server.client()
        self._slots = asyncio.Semaphore(slots)
        self._rows: dict[str, asyncio.Task[None]] = {}
        self._endings: dict[str, TaskOutcome] = {}
        self._on_started = on_started
        self._on_piece = on_piece
        self._on_finished = on_finished
        self._on_failed = on_failed

    def submit(self, request: LlamaRequest) -> None:
        self.stats.queued_rows += 1
        self._rows[request.row_id] = asyncio.get_running_loop().create_task(self._serve(request))

    def cancel(self, row_id: str) -> None:
        self.finish(row_id, TaskOutcome.CANCELLED)

    def finish(self, row_id: str, reason: TaskOutcome) -> None:
        """End the row now (its output said so: a stop string; or its task was cancelled)."""
        task = self._rows.get(row_id)
        if task is not None and row_id not in self._endings:
            self._endings[row_id] = reason
            task.cancel()

    async def serve(self) -> None:
        """Returns never: raises `ServerDied` once llama-server exits (killed, crashed) or stops answering (hung,
        stopped: `LlamaServer.watch`), which ends the runner with that reason, and its instance restarts."""
        raise ServerDied(await self.server.watch(self._unresponsive_s))

    async def close(self) -> None:
        for task in list(self._rows.values()):
            task.cancel()
        await self._client.aclose()
        await self.server.stop()

    async def _serve(self, request: LlamaRequest) -> None:
        row = request.row_id
        state = StreamState(top_logprobs=request.top_logprobs, echo=request.echo)
        started = False
        try:
            async with self._slots:
                self.stats.queued_rows -= 1
                started = True
                self._running(+1)
                self._on_started(row)
                ending = await self._stream(request, state)
        except asyncio.CancelledError:
            ending = state.cut(self._endings.get(row, TaskOutcome.CANCELLED))
        except ServerError as error:
            self._on_failed(row, str(error), error.code)
            return
        except OutputFailed as error:
            log.exception("the output of %s failed", row)
            self._on_failed(row, f"the output could not be made: {error}", "engine_error")
            return
        except (httpx.HTTPError, ValueError) as error:
            # The server died or answered what is not its protocol: the runner's watch on the process ends the
            # instance (it restarts); this task's client hears why now.
            self._on_failed(row, f"llama.cpp stopped answering: {type(error).__name__}: {error}", "engine_error")
            return
        finally:
            if started:
                self._running(-1)
            else:
                self.stats.queued_rows -= 1
            self._rows.pop(row, None)
            self._endings.pop(row, None)
        if ending.cached_tokens:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += ending.cached_tokens
        self.stats.drafted_tokens += ending.drafted_tokens
        self.stats.accepted_tokens += ending.accepted_tokens
        try:
            self._on_finished(row, ending, state.parsed_calls())
        except Exception as error:  # the runner could not make the output's end: its task ends, never hangs
            log.exception("ending %s failed", row)
            self._on_failed(row, f"the output could not be completed: {type(error).__name__}: {error}", "engine_error")

    async def _stream(self, request: LlamaRequest, state: StreamState) -> Ending:
        ending: Ending | None = None
        async with self._client.stream("POST", request.path, json=request.body) as response:
            if response.status_code != 200:
                body = await response.aread()
                try:
                    raise ServerError.of(json.loads(body))
                except ValueError:
                    message = f"llama.cpp answered {response.status_code}: {body[:200]!r}"
                    raise ServerError(message, "engine_error") from None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                piece, end = parse_event(request.path, line[len("data: ") :], state)
                if piece is not None:
                    self.stats.tokens += piece.tokens
                    try:
                        self._on_piece(request.row_id, piece)
                    except Exception as error:
                        raise OutputFailed(f"{type(error).__name__}: {error}") from error
                if end is not None:
                    ending = end
        if ending is None:
            # The stream ended without llama-server's last event: it stopped (killed between two events, whose
            # chunks were whole). An answer cut short must not pass for a finished one.
            raise ServerError("llama-server's stream ended before the answer did (llama.cpp stopped?)", "engine_error")
        return ending

    def _running(self, change: int) -> None:
        self.stats.running_rows += change
        self.stats.batch_size = self.stats.running_rows
        self.stats.max_rows = max(self.stats.max_rows, self.stats.running_rows)
