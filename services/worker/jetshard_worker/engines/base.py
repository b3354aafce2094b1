"""The seam between a runner and the engine it drives.

The runner owns the engine-neutral work: tasks from the event stream, their requests from JETSHARD_TASKS, chunks
out through each task's `TaskOutput`, reports, counters, stats and spans. An engine owns the weights, prompts,
batching and sampling: it admits a `TaskRequest` as the rows it runs (one per choice, or per embedding input) and
the task's choices, and tells the runner about each row through `RowEvents`. Constraints reach an engine as the
request's JSON schema and thinking budget; how it holds the output to them is its own (MLX's logits processors,
llama.cpp's grammar).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from jetshard_schema.types import TaskOutcome, TaskRequest

from jetshard_worker.engines.figures import EngineFigures
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.text.output import ChoiceOutput, RowEnd, TaskOutput

Row = TypeVar("Row")


@dataclass(frozen=True)
class Admitted(Generic[Row]):
    """A task the engine takes: its choices' outputs and the rows that feed them, submitted once the runner holds
    the task's output."""

    choices: list[ChoiceOutput]
    rows: list[Row]


@dataclass(frozen=True)
class Refused:
    """A task the engine cannot run: it fails with this message and error code, before any row starts."""

    message: str
    code: str


class RowEvents(Protocol):
    """What an engine tells its runner about its rows (ids made by `output.row_id`), on the runner's event loop."""

    def started(self, row: str, prompt_tokens: int) -> None:
        """The row's prefill begins (`prompt_tokens`: 0 where the engine counts them only at the end)."""

    def prefilling(self, row: str, done_tokens: int, total_tokens: int) -> None:
        """The row's prompt is processed this far (an engine tells it of prompts processed in several steps)."""

    def produced(self, row: str) -> tuple[TaskOutput, int] | None:
        """The row made output: its task's output and its choice there, for the engine to hand it on; None once the
        task is over."""

    def finished(self, row: str, end: RowEnd) -> None:
        """The row ended (see `TaskOutput.finish`)."""

    def embedded(self, row: str, vector: list[float], prompt_tokens: int) -> None:
        """An embedding row ended with its input's vector."""

    def failed(self, row: str, message: str, code: str) -> None:
        """The row failed: its task ends with this error after the chunks it already published."""


class ServingEngine(Protocol[Row]):
    """An engine as its runner drives it."""

    @property
    def is_leader(self) -> bool:
        """Whether this rank takes tasks; the others only run their share of the leader's steps."""

    @property
    def stats(self) -> EngineFigures: ...

    @property
    def loaded_tensors(self) -> tuple[str, ...]:
        """What the ready report says this rank holds."""

    @property
    def weights_held_as(self) -> str:
        """How it holds its weights (a dtype, or a format), for the ready report."""

    async def admit(self, request: TaskRequest) -> Admitted[Row] | Refused: ...

    def token_text(self, token: int) -> str:
        """A token id's text (its logprobs name it so)."""

    def submit(self, row: Row) -> None: ...

    def cancel(self, row_id: str) -> None: ...

    def finish(self, row_id: str, reason: TaskOutcome) -> None:
        """End the row now: its output said so (a stop string, a closed document)."""

    def serve(self) -> Coroutine[Any, Any, None]:
        """Start serving; what it returns is awaited until the engine ends (raising why, where it failed)."""

    async def close(self) -> None: ...


OnProgress = Callable[[int, int], None]
"""Layers loaded, of how many: called from any thread."""

LoadEngine = Callable[[RunnerSpec, RowEvents, OnProgress], Awaitable[ServingEngine[Any]]]
"""Load a runner's engine for its plan, the engine telling the runner about its rows through `RowEvents`."""
