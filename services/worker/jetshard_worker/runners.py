"""Runner supervision: a thin shell that carries out `planning.plan` — reports endpoints, starts runner
processes (each in its own process group, dying with the worker), kills those no longer wanted, and
reports runners that died or did not join their peers in time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from jetshard_bus.commands import publish_command
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import die_with_parent
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.commands import ReportRunnerEndpoint, ReportRunnerStatus
from jetshard_schema.ids import InstanceId, NodeId, ValidInstanceId
from jetshard_schema.models import find_card
from jetshard_schema.state import State
from jetshard_schema.types import Endpoint, RunnerReport, RunnerStatus
from nats.js import JetStreamContext

from jetshard_worker.blas import blas_candidates, blas_threads, runner_environment
from jetshard_worker.engine.distributed import write_hostfile
from jetshard_worker.planning import RunnerKey, RunnerPlan, plan, runners_on_machine
from jetshard_worker.runner_spec import RunnerSpec

log = logging.getLogger(__name__)

# SIGKILL, as the worker stops its runners: a runner of a dead worker holds a model's memory and has nothing
# to report.
_die_with_parent = die_with_parent(signal.SIGKILL)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningRunner:
    plan: RunnerPlan
    process: subprocess.Popen[bytes]
    started_at: float
    log_path: Path


class RunnerSupervisor:
    def __init__(
        self,
        js: JetStreamContext,
        node_id: NodeId,
        session_id: str,
        nats: NatsOptions,
        start_timeout_s: float,
        advertise_host: str = "127.0.0.1",
    ) -> None:
        self._js = js
        self.node_id = node_id
        self.session_id = session_id
        self._nats = nats
        self._start_timeout_s = start_timeout_s
        self._host = advertise_host
        self._running: dict[RunnerKey, RunningRunner] = {}
        self._reported: set[RunnerKey] = set()
        self._state = State()
        self._scratch: Path | None = None
        self._watching: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self, state: State) -> None:
        blas_candidates()  # a JETSHARD_BLAS naming no file stops the worker here, not each runner's start
        self._scratch = Path(tempfile.mkdtemp(prefix="jetshard-runners-"))
        self._watching = asyncio.create_task(self._watch())
        self.on_state(state)

    def on_state(self, state: State) -> None:
        self._state = state
        self._wake.set()

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            try:
                await self._reconcile()
            except Exception:
                log.exception("runner reconciliation failed")

    async def _reconcile(self) -> None:
        state = self._state
        now_ms = int(time.time() * 1000)
        wanted = plan(state, self.node_id, self.session_id, frozenset(self._running), now_ms)
        for instance_id, generation, rank in wanted.stale:
            await self._report(
                instance_id,
                generation,
                rank,
                RunnerStatus.STOPPED,
                "its worker restarted; the runner of its previous life is gone",
            )
        for key in list(self._running):
            if key not in wanted.keep:
                self._stop(key)
        for key in wanted.report_endpoint:
            if key in self._reported:
                continue
            self._reported.add(key)
            shard = state.instances[key.instance_id].shard_for(self.node_id)
            assert shard is not None
            await publish_command(
                self._js,
                ReportRunnerEndpoint(
                    instance_id=key.instance_id,
                    generation=key.generation,
                    node_id=self.node_id,
                    rank=shard.rank,
                    endpoint=Endpoint(self._host, free_port(self._host)),
                ),
            )
        hosted = max(len(self._running) + len(wanted.start), runners_on_machine(state, self.node_id))
        for runner_plan in wanted.start:
            self._spawn(runner_plan, hosted)
        await self._check_health(state)

    def _spawn(self, runner_plan: RunnerPlan, hosted: int) -> None:
        """Start a runner; `hosted` runners (this one included) will share the machine's cores."""
        key = runner_plan.key
        hostfile = None
        if runner_plan.world_size > 1:
            hostfile = str(write_hostfile(self._scratch_file(key, ".json"), runner_plan.endpoints))
        card = find_card(self._state, runner_plan.model_id)
        nats, nats_secrets = self._nats.without_secrets()
        spec = RunnerSpec(
            nats=nats,
            plan=runner_plan,
            node_id=self.node_id,
            worker_session=self.session_id,
            hostfile=hostfile,
            card_generation=card.generation if card is not None else GenerationDefaults(),
        )
        log_path = self._scratch_file(key, f"-rank{runner_plan.rank}.log")
        env = runner_environment(self._scratch_dir(), blas_threads(os.cpu_count() or 1, hosted))
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "jetshard_worker.runner", msgspec.json.encode(spec).decode()],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**env, **nats_secrets},
                preexec_fn=_die_with_parent,
            )
        log.info(
            "started runner rank %d of %s (generation %d), pid %d, log %s",
            runner_plan.rank,
            key.instance_id,
            key.generation,
            process.pid,
            log_path,
        )
        self._running[key] = RunningRunner(runner_plan, process, time.monotonic(), log_path)

    def _scratch_dir(self) -> Path:
        assert self._scratch is not None, "start() makes the scratch directory"
        return self._scratch

    def _scratch_file(self, key: RunnerKey, suffix: str) -> Path:
        # Ids are validated when decoded; a State built in code is not, so the name is checked again here.
        instance_id = msgspec.convert(key.instance_id, ValidInstanceId)
        return self._scratch_dir() / f"{instance_id}-{key.generation}{suffix}"

    def _stop(self, key: RunnerKey) -> None:
        runner = self._running.pop(key)
        log.info("stopping runner of %s (generation %d)", key.instance_id, key.generation)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.process.pid, signal.SIGKILL)
        runner.process.wait()

    async def _check_health(self, state: State) -> None:
        for key, runner in list(self._running.items()):
            instance = state.instances.get(key.instance_id)
            reported = instance.runners.get(runner.plan.rank) if instance else None
            ready = (
                reported is not None
                and reported.status is RunnerStatus.READY
                and (reported.worker_session == self.session_id)
            )
            exit_code = runner.process.poll()
            if exit_code is not None:
                del self._running[key]
                if reported is None or reported.status is not RunnerStatus.STOPPED:
                    await self._report(
                        key.instance_id,
                        key.generation,
                        runner.plan.rank,
                        RunnerStatus.FAILED,
                        f"runner exited with {exit_code}: {_tail(runner.log_path)}",
                    )
            elif not ready and time.monotonic() - runner.started_at > self._start_timeout_s:
                self._stop(key)
                await self._report(
                    key.instance_id,
                    key.generation,
                    runner.plan.rank,
                    RunnerStatus.FAILED,
                    f"did not load and join its peers within {self._start_timeout_s:.0f} s",
                )

    async def _report(
        self, instance_id: InstanceId, generation: int, rank: int, status: RunnerStatus, reason: str
    ) -> None:
        await publish_command(
            self._js,
            ReportRunnerStatus(
                instance_id=instance_id,
                generation=generation,
                runner=RunnerReport(
                    node_id=self.node_id, rank=rank, worker_session=self.session_id, status=status, reason=reason
                ),
            ),
        )

    async def shutdown(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        for key in list(self._running):
            runner = self._running[key]
            self._stop(key)
            with contextlib.suppress(Exception):
                await self._report(
                    key.instance_id, key.generation, runner.plan.rank, RunnerStatus.STOPPED, "the worker stopped"
                )
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
