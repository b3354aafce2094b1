"""A runner: one process hosting one shard of an instance. `python -m jetshard_worker.runner SPEC_JSON`, started
through its lifeline (`jetshard_bus.lifeline`), which has it die with its worker (the spec holds no secret: a NATS
password or token comes in the environment).

Every rank loads its engine (the one its placement chose: `engine_loader`) and reports its status. One rank is the
leader (`Instance.leader_node`: the last on MLX, the first on llama.cpp, whose other ranks serve their layers
through llama.cpp's RPC backend): it takes the tasks assigned to its instance from the event stream, has its engine
admit each (the
engine renders and tokenizes the prompt, and samples: `engines.base` is all the runner knows of it), and
publishes what the engine makes on `jetshard.chunks.<node id>.<task id>`.

The leader's request reader, chunk publisher and reports run in one task group with its main work: one that
fails ends the process (exit status 1, the reason last in its log), so its worker reports it FAILED and the
instance restarts, rather than a runner that says READY while its clients wait for chunks that never come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Coroutine
from functools import partial
from operator import contains
from typing import Any, NoReturn

import msgspec
import nats.errors
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect, disconnect
from jetshard_bus.follower import StateFollower
from jetshard_bus.service import run_service
from jetshard_bus.stats import interval_s, publish_stats
from jetshard_bus.tracing import enabled as tracing_enabled
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
from jetshard_schema.state import State
from jetshard_schema.stats import RunnerStats
from jetshard_schema.subjects import chunk_subject
from jetshard_schema.types import (
    Chunk,
    Engine,
    RunnerReport,
    RunnerStatus,
    ServingCounters,
    TaskOutcome,
    TaskRef,
    TaskRequest,
    Usage,
)
from nats.js import JetStreamContext

from jetshard_worker.engines.base import LoadEngine, Refused, ServingEngine
from jetshard_worker.publishing import NATS_ERRORS, publish_until_stored
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.task_requests import RequestLost, read_request
from jetshard_worker.task_spans import TaskSpans
from jetshard_worker.text.output import RowEnd, TaskOutput, row_id, split_row_id

log = logging.getLogger(__name__)

CHUNK_BACKLOG_BYTES = 256 * 1024
"""Unwritten chunk bytes past which the publisher waits for NATS before its next round."""
PROGRESS_INTERVAL_S = 0.5
COUNTERS_INTERVAL_ENV = "JETSHARD_COUNTERS_INTERVAL_S"
DEFAULT_COUNTERS_INTERVAL_S = 10.0
"""How often a leader reports its serving counters while they change. Each report is a command and an event kept
for good, hence far less often than the stats (`JETSHARD_STATS_INTERVAL_S`), which are never stored."""


def engine_loader(engine: Engine) -> LoadEngine:
    """How a runner loads `engine`, its modules imported only by the runners that run it: MLX's (mlx, mlx-lm,
    transformers, llguidance) take seconds and hundreds of MB, which a llama.cpp runner does without."""
    match engine:
        case Engine.MLX:
            from jetshard_worker.engines.mlx import tasks as mlx_tasks

            return mlx_tasks.load
        case Engine.LLAMA_CPP:
            from jetshard_worker.engines.llamacpp import tasks as llamacpp_tasks

            return llamacpp_tasks.load


class Runner:
    def __init__(self, spec: RunnerSpec, js: JetStreamContext, client: Any) -> None:
        self.spec = spec
        self.plan = spec.plan
        self._js = js
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()  # None: text is held
        self._holding: list[TaskOutput] = []
        self._outputs: dict[TaskId, TaskOutput] = {}
        self.tasks: asyncio.TaskGroup | None = None
        """The task group of the runner's work while it serves (run_runner); reports sent later join it."""
        self._taken: set[TaskId] = set()
        self._requests: asyncio.Queue[TaskRef] = asyncio.Queue()
        self._spans = TaskSpans(self.plan.key.instance_id) if tracing_enabled() else None
        self.engine_kind = self.plan.serving.engine or Engine.MLX
        """An instance placed before placement chose an engine runs on MLX."""
        self._engine: ServingEngine[Any] | None = None
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
    def engine(self) -> ServingEngine[Any]:
        assert self._engine is not None, "the runner's engine is not loaded yet"
        return self._engine

    async def load(self) -> None:
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
        self._engine = await engine_loader(self.engine_kind)(self.spec, self, on_progress)

    async def report_ready(self, counters: ServingCounters | None = None) -> None:
        total = self.plan.end_layer - self.plan.start_layer
        await self.report(
            RunnerStatus.READY,
            layers_loaded=total,
            layers_total=total,
            loaded_tensors=self.engine.loaded_tensors,
            counters=counters,
            weights_dtype=self.engine.weights_held_as,
        )

    async def report_counters(self) -> None:
        """The leader's counters, every `JETSHARD_COUNTERS_INTERVAL_S` (default 10 s) while they change: State sees
        prefix-cache hits and batch sizes without an event per request."""
        reported = None
        interval = interval_s(COUNTERS_INTERVAL_ENV, DEFAULT_COUNTERS_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            counters = self.counters()
            if counters != reported:
                try:
                    await self.report_ready(counters)
                except NATS_ERRORS as error:  # the next interval sends them again
                    log.warning("counters not reported: %s", error)
                    continue
                reported = counters

    def counters(self) -> ServingCounters:
        return msgspec.convert(self.engine.stats, ServingCounters, from_attributes=True)

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
        JETSHARD_TASKS, where the API stored it for this node alone before it submitted the task; events and
        State never hold it."""
        while True:
            task = await self._requests.get()
            task_id = task.task_id
            try:
                wanted = partial(contains, self._taken, task_id)
                stored = await read_request(self._js, self.spec.node_id, self.plan.key.instance_id, task_id, wanted)
                request = decode_task_request(stored.data) if stored is not None else None
            except RequestLost as error:
                self._fail_task(task_id, f"the task's request did not reach its runner: {error}", "request_lost")
                continue
            except Exception as error:  # a hostile or corrupt message: the task fails, the runner lives on
                log.warning("request of %s unreadable: %s", task_id, error)
                self._fail_task(task_id, "the task's request is unreadable", "request_lost")
                continue
            if stored is None or request is None or task_id not in self._taken:
                continue  # cancelled before or while its request was read
            if request.task_id != task_id:
                self._fail_task(task_id, "the task's stored request is another task's", "request_lost")
                continue
            if self._spans is not None:
                self._spans.requested(task_id, stored.headers)
            await self._start_task(request)

    async def _start_task(self, request: TaskRequest) -> None:
        admission = await self.engine.admit(request)
        if request.task_id not in self._taken:
            return  # cancelled while the engine admitted it (its images were prepared, for instance)
        if isinstance(admission, Refused):
            self._fail_task(request.task_id, admission.message, admission.code)
            return
        output = TaskOutput(request.task_id, admission.choices, self.engine.token_text, self._publish_chunk, self._hold)
        self._outputs[request.task_id] = output
        for row in admission.rows:
            self.engine.submit(row)

    def _hold(self, output: TaskOutput) -> None:
        """`output` holds text: the publisher flushes it when it is ready for more (see publish_chunks)."""
        self._holding.append(output)
        self._outbox.put_nowait(None)

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

    # --- what the engine tells of its rows (`engines.base.RowEvents`) -----------------------------------

    def started(self, row: str, prompt_tokens: int) -> None:
        """A row's prefill begins; the task has started with its first."""
        task_id, choice = split_row_id(row)
        if choice != 0:
            return
        if self._spans is not None:
            self._spans.started(task_id, prompt_tokens)
        report = ReportTaskStarted(
            node_id=self.spec.node_id,
            task_id=task_id,
            instance_id=self.plan.key.instance_id,
            prompt_tokens=prompt_tokens,
        )
        self._send_later(report)

    def prefilling(self, row: str, done_tokens: int, total_tokens: int) -> None:
        """A long prompt's progress goes to its client (its first choice's; the others share the prompt)."""
        task_id, choice = split_row_id(row)
        output = self._outputs.get(task_id)
        if choice == 0 and output is not None:
            output.prompt_progress(done_tokens, total_tokens)

    def produced(self, row: str) -> tuple[TaskOutput, int] | None:
        task_id, choice = split_row_id(row)
        if self._spans is not None:
            self._spans.token(task_id)
        output = self._outputs.get(task_id)
        return None if output is None else (output, choice)

    def finished(self, row: str, end: RowEnd) -> None:
        task_id, choice = split_row_id(row)
        output = self._outputs.get(task_id)
        if output is None:
            return
        if end.reason is TaskOutcome.CANCELLED:
            for other in range(len(output.choices)):
                self.engine.cancel(row_id(task_id, other))
        self._ended(task_id, output, output.finish(choice, end))

    def embedded(self, row: str, vector: list[float], prompt_tokens: int) -> None:
        task_id, choice = split_row_id(row)
        output = self._outputs.get(task_id)
        if output is not None:
            self._ended(task_id, output, output.embedding(choice, vector, prompt_tokens))

    def failed(self, row: str, message: str, code: str) -> None:
        task_id, _ = split_row_id(row)
        output = self._outputs.pop(task_id, None)
        if output is None:
            return
        for other in range(len(output.choices)):
            self.engine.cancel(row_id(task_id, other))
        self._fail_task(task_id, message, code, output)

    def _ended(self, task_id: TaskId, output: TaskOutput, usage: Usage | None) -> None:
        """A row of `output` ended; `usage`, once every row has: the task is over."""
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
        self._outbox.put_nowait((chunk_subject(self.spec.node_id, chunk.task_id), encode(chunk)))

    def _send_later(self, report: Command) -> None:
        """Publish `report` (until stored) without holding up the loop, in the runner's task group."""
        if self.tasks is None:
            # The runner is stopping: its instance restarts or is gone, and State drops the task with it.
            log.info("not sending %s: the runner is stopping", type(report).__name__)
            return
        self.tasks.create_task(_named(f"sending {type(report).__name__}", publish_until_stored(self._js, report)))

    async def publish_chunks(self) -> None:
        """One publisher, so chunks leave in the order they were made. Each round publishes what is queued and
        what the outputs hold, then yields once so the client's flusher writes it: text made meanwhile leaves in
        one chunk per choice next round, so a busy engine makes fewer, larger chunks. Only when the client holds
        more than `CHUNK_BACKLOG_BYTES` unwritten (the server or the socket is not keeping up) does a round wait
        for the server's answer to a ping; a ping after every round cost a third of the runner's time per token.
        A chunk the client refuses to publish (connection closed for good, payload too big) ends the runner."""
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
            if self._client.pending_data_size <= CHUNK_BACKLOG_BYTES:
                await asyncio.sleep(0)
                continue
            # A reconnection drops the ping in flight and the flush times out; what the client buffered
            # meanwhile goes out once it is connected again.
            with contextlib.suppress(nats.errors.FlushTimeoutError):
                await self._client.flush()


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
        await disconnect(client)
        sys.exit(1)
    engine_runs = _named(runner.engine_kind.value, runner.engine.serve())
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
    await runner.engine.close()
    with contextlib.suppress(Exception):
        await runner.report(RunnerStatus.STOPPED, reason="stopped")
    if follower is not None:
        await follower.stop()
    await disconnect(client)


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
        await follower.start()
        runner.tasks.create_task(_named("the chunk publisher", runner.publish_chunks()))
        runner.tasks.create_task(_named("the request reader", runner.read_requests()))
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
    spec = msgspec.json.decode(sys.argv[1], type=RunnerSpec)
    spec = msgspec.structs.replace(spec, nats=spec.nats.with_secrets(os.environ))
    run_service(f"runner/{spec.plan.rank}", lambda stop: run_runner(spec, stop))


if __name__ == "__main__":
    main()
