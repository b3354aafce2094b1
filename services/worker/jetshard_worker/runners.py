"""Runner supervision: a thin shell that carries out `planning.plan` — reports endpoints, starts runner
processes (each in its own process group, dying with the worker), kills those no longer wanted, and
reports runners that died or did not join their peers in time. A report that NATS did not store is sent
again on the next pass. Its shutdown stops every runner it started, and starts none after."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import psutil
from jetshard_bus.commands import publish_command
from jetshard_bus.node import MemoryTaken, mlx_cuda_installed
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import describe_exit, spawn
from jetshard_bus.scratch import WORKER_PREFIX, make_scratch_dir
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.commands import ReportRunnerEndpoint, ReportRunnerStatus
from jetshard_schema.ids import CommandId, NodeId, ValidInstanceId, new_command_id
from jetshard_schema.models import find_card
from jetshard_schema.placement import LLAMA_CPP_SLOT_CONTEXT, llama_cpp_slot_context
from jetshard_schema.state import State
from jetshard_schema.types import Endpoint, RunnerReport, RunnerStatus
from nats.js import JetStreamContext

from jetshard_worker.blas import blas_candidates, blas_threads, runner_environment
from jetshard_worker.cuda import cuda_runner_environment
from jetshard_worker.peer_tunnel import PeerIdentity
from jetshard_worker.planning import RunnerKey, RunnerPlan, plan, runners_on_machine
from jetshard_worker.publishing import NATS_ERRORS
from jetshard_worker.runner_spec import PeerIdentityFiles, RunnerSpec

log = logging.getLogger(__name__)


def hold_ring_port(host: str) -> socket.socket:
    """A socket bound to a port the kernel picks on `host`, for a rank's ring listener; it only binds, so it takes no
    connection. The port is never free from now on: the worker holds the socket until it starts the runner, the
    runner until mlx's listener has bound the same port, which SO_REUSEADDR on both sockets allows (mlx sets it on
    its listener) as long as this one does not listen. Another process can neither be handed the port by the kernel
    nor bind it without SO_REUSEADDR."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def launch_runner(spec: RunnerSpec, log_path: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start the runner process of `spec`, writing to `log_path`, in a process group of its own (killed as one). Its
    lifeline is armed before it imports the runner's module, which takes seconds: a worker that dies meanwhile
    takes it along (`jetshard_bus.lifeline`)."""
    return spawn(
        [sys.executable, "-m", "jetshard_worker.runner", msgspec.json.encode(spec).decode()],
        log_path,
        # Import-time warnings (transformers': "PyTorch was not found") are noise in a log read for failures.
        env={"TRANSFORMERS_VERBOSITY": "error", **env},
        pass_fds=() if spec.ring_socket_fd is None else (spec.ring_socket_fd,),
        parent_death_signal=signal.SIGKILL,
    )


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
        self._endpoints_stored: set[RunnerKey] = set()
        self._ring_ports: dict[RunnerKey, socket.socket] = {}
        """The port each endpoint reported names, held until its runner starts (`hold_ring_port`)."""
        self._unsent: dict[tuple[RunnerKey, int], tuple[CommandId, ReportRunnerStatus]] = {}
        """Status reports not stored yet, the latest per (instance, generation, rank), oldest first."""
        self._failed: set[RunnerKey] = set()
        """Runners that exited on their own or did not load in time, reported FAILED: never started again, as their
        instance restarts as a new generation. Without this, one was started again on every pass until State showed
        the report (every two seconds while JetStream was away and the report could not be stored)."""
        self._state = State()
        self._scratch: Path | None = None
        self._identity: PeerIdentity | None = None
        """This session's certificate on the tunnels between ranks: made at start, named in every endpoint."""
        self._watching: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        """Set when shutdown begins: from then on no runner starts, as shutdown would neither stop nor wait for it."""
        self.memory_moved = asyncio.Event()
        """Set when a runner has stopped or exited, and (by the worker) when an instance here is ready: the node's
        memory report goes out at once, so that placement sees a model loaded, or the memory it gave back."""

    async def start(self, state: State) -> None:
        blas_candidates()  # a JETSHARD_BLAS naming no file stops the worker here, not each runner's start
        self._scratch = make_scratch_dir(WORKER_PREFIX)
        self._identity = PeerIdentity.create(self._scratch, self.node_id)
        self._watching = asyncio.create_task(self._watch())
        self.on_state(state)

    def on_state(self, state: State) -> None:
        self._state = state
        self._wake.set()

    async def _watch(self) -> None:
        # Not only cancelled: on Python 3.11, asyncio.wait_for loses a cancellation that comes as its wait ends.
        while not self._stopping:
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
        wanted = plan(state, self.node_id, self.session_id, frozenset(self._running) | self._failed, now_ms)
        self._failed &= wanted.keep
        for key in list(self._running):
            if key not in wanted.keep:
                await self._stop(key)
        for key in set(self._ring_ports) - wanted.keep:
            self._ring_ports.pop(key).close()
        self._endpoints_stored &= wanted.keep
        for key in wanted.report_endpoint:
            if key not in self._endpoints_stored:
                await self._report_endpoint(state, key)
        hosted = max(len(self._running) + len(wanted.start), runners_on_machine(state, self.node_id))
        for runner_plan in wanted.start:
            self._spawn(runner_plan, hosted)
        await self._check_health(state)
        await self._send_reports()

    async def _report_endpoint(self, state: State, key: RunnerKey) -> None:
        """Report the port this node's rank will listen on; recorded as reported only once JetStream stored it."""
        if key not in self._ring_ports:
            self._ring_ports[key] = hold_ring_port(self._host)
        shard = state.instances[key.instance_id].shard_for(self.node_id)
        assert shard is not None
        assert self._identity is not None, "start() makes the identity"
        port = int(self._ring_ports[key].getsockname()[1])
        endpoint = Endpoint(self._host, port, certificate_pem=self._identity.certificate_pem)
        report = ReportRunnerEndpoint(
            instance_id=key.instance_id,
            generation=key.generation,
            node_id=self.node_id,
            rank=shard.rank,
            endpoint=endpoint,
        )
        try:
            await publish_command(self._js, report)
        except NATS_ERRORS as error:
            log.warning("endpoint of %s not stored (%s); trying again on the next pass", key.instance_id, error)
            return
        self._endpoints_stored.add(key)

    def _spawn(self, runner_plan: RunnerPlan, hosted: int) -> None:
        """Start a runner; `hosted` runners (this one included) will share the machine's cores. None once shutdown
        began (a pass it failed to cancel may still be under way)."""
        if self._stopping:
            return
        key = runner_plan.key
        ring_socket = self._ring_ports.pop(key, None)
        try:
            self._start_process(runner_plan, hosted, ring_socket)
        finally:
            if ring_socket is not None:
                ring_socket.close()  # the runner has its own copy now

    def _start_process(self, runner_plan: RunnerPlan, hosted: int, ring_socket: socket.socket | None) -> None:
        key = runner_plan.key
        hostfile = None
        if runner_plan.world_size > 1:
            # Where the rank writes its own ring hostfile, naming its tunnels (`rank_tunnels`).
            hostfile = str(self._scratch_file(key, f"-rank{runner_plan.rank}-ring.json"))
        # A port held by an earlier life of this worker is gone with it: the runner's listener binds it afresh.
        ring_fd = None
        if hostfile is not None and ring_socket is not None:
            port = str(ring_socket.getsockname()[1])
            if runner_plan.endpoints[runner_plan.rank].rpartition(":")[2] == port:
                ring_fd = ring_socket.fileno()
        card = find_card(self._state, runner_plan.model_id)
        nats, nats_secrets = self._nats.without_secrets()
        assert self._identity is not None, "start() makes the identity"
        identity = PeerIdentityFiles(str(self._identity.certificate_path), str(self._identity.key_path))
        spec = RunnerSpec(
            identity=identity,
            nats=nats,
            plan=runner_plan,
            node_id=self.node_id,
            worker_session=self.session_id,
            hostfile=hostfile,
            ring_socket_fd=ring_fd,
            card_generation=card.generation if card is not None else GenerationDefaults(),
            context_per_slot=llama_cpp_slot_context(card) if card is not None else LLAMA_CPP_SLOT_CONTEXT,
        )
        log_path = self._scratch_file(key, f"-rank{runner_plan.rank}.log")
        # On mlx's CUDA build the runner computes on the GPU; on its CPU build, with the fastest BLAS that works.
        env = (
            cuda_runner_environment()
            if mlx_cuda_installed()
            else runner_environment(blas_threads(os.cpu_count() or 1, hosted))
        )
        process = launch_runner(spec, log_path, {**env, **nats_secrets})
        log.info(
            "started runner rank %d of %s (generation %d), pid %d, log %s",
            runner_plan.rank,
            key.instance_id,
            key.generation,
            process.pid,
            log_path,
        )
        self._running[key] = RunningRunner(runner_plan, process, time.monotonic(), log_path)

    def memory_taken(self) -> MemoryTaken:
        """The memory of this worker's runners and what they started (llama-server, ggml-rpc-server): resident,
        and what placement reserved for each beyond that."""
        held = unfilled = 0
        for runner in list(self._running.values()):
            resident = 0
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(runner.process.pid)
                for member in (process, *process.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        resident += member.memory_info().rss
            held += max(resident, runner.plan.reserved_bytes)
            unfilled += max(0, runner.plan.reserved_bytes - resident)
        return MemoryTaken(held_bytes=held, unfilled_bytes=unfilled)

    def _scratch_dir(self) -> Path:
        assert self._scratch is not None, "start() makes the scratch directory"
        return self._scratch

    def _scratch_file(self, key: RunnerKey, suffix: str) -> Path:
        # Ids are validated when decoded; a State built in code is not, so the name is checked again here.
        instance_id = msgspec.convert(key.instance_id, ValidInstanceId)
        return self._scratch_dir() / f"{instance_id}-{key.generation}{suffix}"

    async def _stop(self, key: RunnerKey) -> None:
        runner = self._running[key]
        log.info("stopping runner of %s (generation %d)", key.instance_id, key.generation)
        _kill_group(runner.process)
        await _exited(runner.process)
        del self._running[key]  # only now: a shutdown that cancelled this wait waits for the runner itself
        self.memory_moved.set()

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
                self.memory_moved.set()
                if reported is None or reported.status is not RunnerStatus.STOPPED:
                    why = failure_reason(runner.log_path)
                    self._report(
                        runner.plan,
                        RunnerStatus.FAILED,
                        f"runner {describe_exit(exit_code)}" + (f": {why}" if why else ""),
                    )
            elif not ready and time.monotonic() - runner.started_at > self._start_timeout_s:
                await self._stop(key)
                self._report(
                    runner.plan,
                    RunnerStatus.FAILED,
                    f"did not load and join its peers within {self._start_timeout_s:.0f} s",
                )

    def _report(self, runner_plan: RunnerPlan, status: RunnerStatus, reason: str) -> None:
        """Queue a status report of the planned runner for `_send_reports`; it replaces another of the same runner
        not stored yet (the same report again, as each pass makes for a stale runner, keeps its place and command
        id)."""
        if status is RunnerStatus.FAILED:
            self._failed.add(runner_plan.key)
        report = ReportRunnerStatus(
            instance_id=runner_plan.key.instance_id,
            generation=runner_plan.key.generation,
            runner=RunnerReport(
                node_id=self.node_id,
                rank=runner_plan.rank,
                worker_session=self.session_id,
                status=status,
                reason=reason,
            ),
        )
        runner = (runner_plan.key, runner_plan.rank)
        unsent = self._unsent.get(runner)
        if unsent is not None and unsent[1] == report:
            return
        self._unsent.pop(runner, None)
        self._unsent[runner] = (new_command_id(), report)

    async def _send_reports(self) -> None:
        """Publish the queued status reports, oldest first. The first that fails stops this pass (NATS is away, the
        others would wait out their timeouts too); it and those after it are sent on the next pass, each with the
        command id of its first try, so one stored although its ack was lost is stored once."""
        for runner, (command_id, report) in list(self._unsent.items()):
            try:
                await publish_command(self._js, report, command_id)
            except NATS_ERRORS as error:
                log.warning("runner report not stored (%s); trying again on the next pass", error)
                return
            del self._unsent[runner]

    async def shutdown(self) -> None:
        """Stop every runner this worker started and wait for each to exit; none starts from here on."""
        self._stopping = True
        if self._watching is not None:
            # The pass under way ends first, so that no runner is being started or stopped behind our back.
            self._watching.cancel()
            await asyncio.wait([self._watching])
        stopping = list(self._running.values())
        self._running.clear()
        for runner in stopping:
            _kill_group(runner.process)
        for runner in stopping:
            await _exited(runner.process)
            self._report(runner.plan, RunnerStatus.STOPPED, "the worker stopped")
        # Briefly: a worker asked to stop exits within seconds (run_service), sent or not.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._send_reports(), 2)
        for ring_socket in self._ring_ports.values():
            ring_socket.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


async def _exited(process: subprocess.Popen[bytes]) -> int:
    """The exit status of `process`, waited for on a thread: on the event loop, Popen.wait() would hold up
    everything else, the worker's heartbeat included, until the kernel has torn the runner down."""
    return await asyncio.to_thread(process.wait)


_LOGGED_ERROR = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ \S+\s+(?:ERROR|CRITICAL)\s+\S+: (?P<message>.*)")
"""A record the runner logged at ERROR or above (`jetshard_bus.service.configure_logging`'s format)."""
_LOGGED_ROUTINE = re.compile(r"^(?:\d{4}-\d\d-\d\d [\d:,]+ \S+\s+(?:DEBUG|INFO)|\d+\.\d+\.\d+\.\d+ [DIW])\s")
"""A record of what the runner did, or its llama-server (`0.03.129.613 I slot ...`; its warnings too, which it gives
for routine things: "n_past was set to 41"), which says nothing of why it died."""
_UNCAUGHT = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?:: .*)?$")
"""The last line of a traceback: the exception and its message."""


def failure_reason(log_path: Path, lines: int = 3) -> str:
    """Why a runner died, as its log tells: the last error it logged or the exception it died of; failing that, the
    last `lines` lines it wrote that are not routine records (what a native library printed as it aborted, a
    warning). A runner killed from outside may have written none: its exit status says it all."""
    try:
        logged = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    for line in reversed(logged):
        if (record := _LOGGED_ERROR.match(line)) is not None:
            return record["message"]
        if _UNCAUGHT.match(line):
            return line
    return " | ".join([line for line in logged if not _LOGGED_ROUTINE.match(line)][-lines:])
