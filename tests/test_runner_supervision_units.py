"""The pieces of runner supervision, each on its own: which scratch directories are stale, the retry of a report
JetStream refused (a real nats-server), the port a worker holds for a rank (real sockets), a runner dying with its
worker and a worker's stop leaving no runner behind (real processes), and the reason quoted for a runner's death.
The whole, in a cluster: tests/test_inference_failures.py and test_requests_never_hang.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from helpers.harness import free_port, until
from helpers.slow_imports import slow_runner_imports
from helpers.states import downloaded, fold
from jetshard_bus.lifeline import lifeline_command
from jetshard_bus.options import NatsOptions
from jetshard_bus.scratch import DOWNLOADER_PREFIX, WORKER_PREFIX, stale_scratch_dirs
from jetshard_schema.codec import decode_command
from jetshard_schema.commands import ReportRunnerStatus
from jetshard_schema.events import InstancePlaced, RunnerEndpointReported
from jetshard_schema.ids import InstanceId, ModelId, NodeId
from jetshard_schema.state import State
from jetshard_schema.subjects import COMMANDS_STREAM
from jetshard_schema.types import Endpoint, RunnerReport, RunnerStatus, ShardAssignment
from jetshard_worker.planning import RunnerKey, RunnerPlan
from jetshard_worker.publishing import LAST_RETRY_S, publish_until_stored, retry_delay_s
from jetshard_worker.runner_spec import RunnerSpec
from jetshard_worker.runners import RunnerSupervisor, failure_reason, hold_ring_port

from jetshard.up.natsserver import NatsServer

# ------------------------------------------------------------------------------------------ stale directories


def test_scratch_dirs_of_dead_workers_and_of_this_pid_are_stale() -> None:
    names = [
        f"{WORKER_PREFIX}100-abc",  # a live worker's
        f"{WORKER_PREFIX}200-def",  # a dead worker's
        f"{WORKER_PREFIX}300-ghi",  # made by an earlier process with this one's pid (a container's pid 1)
        f"{WORKER_PREFIX}xyz",  # no pid: an older worker's, owner unknown
        f"{WORKER_PREFIX}12x-abc",
        "jetshard-blas-200-abc",  # not a scratch directory
        f"{DOWNLOADER_PREFIX}200-jkl",  # a dead downloader's: its own next start removes it
        "unrelated",
    ]
    stale = stale_scratch_dirs(names, WORKER_PREFIX, own_pid=300, alive=lambda pid: pid in (100, 300))
    assert stale == [f"{WORKER_PREFIX}200-def", f"{WORKER_PREFIX}300-ghi"]


# ------------------------------------------------------------------------------------------ report retries


def test_retry_delays_double_up_to_a_ceiling() -> None:
    delays = [retry_delay_s(attempt) for attempt in range(12)]
    assert delays[:3] == [0.1, 0.2, 0.4]
    assert delays == sorted(delays)
    assert max(delays) == LAST_RETRY_S


async def commands_stored(js: Any) -> int:
    return int((await js.stream_info(COMMANDS_STREAM)).state.messages)


@pytest.fixture
async def refusing_commands(bus: tuple[Any, Any]) -> AsyncIterator[Any]:
    """JETSHARD_COMMANDS refusing every publish (a limit on message size no command fits), until the test calls
    the yielded `accept()`; restored anyway at the end."""
    _, js = bus
    config = (await js.stream_info(COMMANDS_STREAM)).config
    limit = config.max_msg_size

    async def accept() -> None:
        config.max_msg_size = limit
        await js.update_stream(config)

    config.max_msg_size = 1
    await js.update_stream(config)
    yield accept
    await accept()


async def test_a_report_jetstream_refused_is_stored_once_it_accepts(
    bus: tuple[Any, Any], refusing_commands: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, js = bus
    report = ReportRunnerStatus(
        instance_id=InstanceId("i1"),
        generation=0,
        runner=RunnerReport(node_id=NodeId("n1"), rank=0, worker_session="s", status=RunnerStatus.FAILED),
    )
    before = await commands_stored(js)
    caplog.set_level(logging.WARNING, "jetshard_worker.publishing")
    sending = asyncio.create_task(publish_until_stored(js, report))
    await until(lambda: len(caplog.records) >= 2, 10, "two refused tries")
    assert not sending.done() and await commands_stored(js) == before
    await refusing_commands()
    await asyncio.wait_for(sending, LAST_RETRY_S + 5)
    assert await commands_stored(js) == before + 1


# ------------------------------------------------------------------------------------------ ring ports


def test_a_held_ring_port_is_taken_by_a_listener_like_mlxs_and_by_nothing_else() -> None:
    held = hold_ring_port("127.0.0.1")
    port = held.getsockname()[1]
    with held, socket.socket() as plain, socket.socket() as listener:
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        # mlx's ring backend sets SO_REUSEADDR (and SO_REUSEPORT) on its listener: mlx/distributed/utils.cpp
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = listener.accept()
            accepted.close()


# ------------------------------------------------------------------------------------------ dying with the worker

# A "worker" that starts a "runner" through its lifeline, as `launch_runner` does, and sleeps; the worker says which
# pid it started, the runner which pid it runs as (the same: the lifeline becomes the runner).
WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from jetshard_bus.lifeline import lifeline_command
    runner = [sys.executable, "-c", "import os, time; print('armed', os.getpid(), flush=True); time.sleep(60)"]
    started = subprocess.Popen(lifeline_command(runner, signal.SIGKILL), start_new_session=True)
    print('started', started.pid, flush=True)
    time.sleep(60)
    """
)


def assert_dies_with(runner: psutil.Process, worker: subprocess.Popen[str]) -> None:
    """Kills `worker`: `runner` must be gone within seconds."""
    worker.kill()
    worker.wait()
    assert psutil.wait_procs([runner], timeout=10)[1] == [], "the runner outlived its worker"


def test_a_runner_dies_with_its_worker() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        said = dict(worker.stdout.readline().split() for _ in range(2))
        assert said["armed"] == said["started"], "the runner is not the process the worker started"
        runner = psutil.Process(int(said["armed"]))
        assert_dies_with(runner, worker)
    finally:
        worker.kill()
        worker.wait()


def test_a_runner_whose_worker_is_already_gone_exits() -> None:
    not_its_parent = os.getpid() + 1
    gone = subprocess.run(
        [sys.executable, "-m", "jetshard_bus.lifeline", str(not_its_parent), "SIGKILL", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert gone.returncode == 1
    assert f"the process (pid {not_its_parent}) that started this one is gone" in gone.stderr


def test_a_child_through_the_lifeline_takes_sigpipe_as_asked() -> None:
    """A program started through the lifeline dies of SIGPIPE when it writes to a peer gone away, as from subprocess;
    ggml-rpc-server, started to ignore it, gets an error it returns from instead (a leader that left must not kill
    the helper). The kernel's view of the program's ignored signals says which."""
    sigpipe_bit = 1 << (signal.SIGPIPE - 1)
    for ignore_sigpipe in (False, True):
        command = lifeline_command(["grep", "SigIgn", "/proc/self/status"], signal.SIGKILL, ignore_sigpipe)
        ignored = int(subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.split()[1], 16)
        assert bool(ignored & sigpipe_bit) is ignore_sigpipe


def test_a_child_through_the_lifeline_cannot_grow_its_heap_past_its_limit() -> None:
    """llama-server starts with its heap capped: a runaway (a chat template that builds gigabytes) fails its own
    allocation instead of taking the machine's memory. Here a Python child asks for 256 MiB under a 128 MiB cap."""
    allocate = [sys.executable, "-c", "bytearray(256 * 2**20)"]
    assert subprocess.run(lifeline_command(allocate, signal.SIGKILL), timeout=30).returncode == 0
    capped = subprocess.run(
        lifeline_command(allocate, signal.SIGKILL, data_limit_bytes=128 * 2**20),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert capped.returncode != 0 and "MemoryError" in capped.stderr


# ------------------------------------------------------------------------------------------ stopping the worker

NODE = NodeId("node-here")
INSTANCE = InstanceId("inst-stopping")
MODEL = ModelId("test/tiny")
SLOW_START_S = 120
"""How long each runner of these tests takes to import its module (`slow_runner_imports`): far longer than any test
waits."""


def runner_processes() -> list[psutil.Process]:
    """This test's runners: started by a RunnerSupervisor here, or by a worker this test started; not those of the
    session's shared clusters, whose workers (`jetshard worker` services) also descend from this process."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = process.parent()
            parent_args = parent.cmdline() if parent is not None else []
            of_a_service = " -m jetshard worker" in " " + " ".join(parent_args[1:4])
            if "jetshard_worker.runner" in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                if not of_a_service:
                    found.append(process)
    return found


def placed_here(model_dir: Path) -> State:
    """An instance of one rank on this node, its files in `model_dir`: the worker is to start its runner."""
    return fold(
        InstancePlaced(
            instance_id=INSTANCE,
            model_id=MODEL,
            shards=(ShardAssignment(node_id=NODE, rank=0, start_layer=0, end_layer=2),),
        ),
        downloaded(NODE, MODEL, 0, 2, str(model_dir)),
        RunnerEndpointReported(
            instance_id=INSTANCE, generation=0, node_id=NODE, rank=0, endpoint=Endpoint("127.0.0.1", free_port())
        ),
    )


async def test_a_worker_stopping_as_state_changes_leaves_no_runner_running(
    bus: tuple[Any, Any], fresh_nats: NatsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A State change that reaches the worker as it begins to stop (an event and Ctrl-C together) wakes its runner
    supervision for one more pass; the runner it stopped must not be started again behind the stop's back."""
    for name, value in slow_runner_imports(tmp_path / "slow", SLOW_START_S).items():
        monkeypatch.setenv(name, value)
    _, js = bus
    state = placed_here(tmp_path)
    supervisor = RunnerSupervisor(js, NODE, "s", NatsOptions(servers=(fresh_nats.url,)), start_timeout_s=300)
    try:
        await supervisor.start(state)
        await until(lambda: len(runner_processes()) == 1, 30, "the runner started")
        supervisor.on_state(state)
        await supervisor.shutdown()
        assert runner_processes() == [], "runners outlived their worker's stop"
    finally:
        for process in runner_processes():
            os.killpg(process.pid, signal.SIGKILL)


# A "worker" that launches a runner as the worker does, says its pid on stdout, and sleeps.
LAUNCHING_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import msgspec
    from jetshard_worker.runner_spec import RunnerSpec
    from jetshard_worker.runners import launch_runner
    runner = launch_runner(msgspec.json.decode(sys.argv[1], type=RunnerSpec), Path(sys.argv[2]), os.environ)
    print(runner.pid, flush=True)
    time.sleep(60)
    """
)


def test_a_runner_still_starting_dies_with_its_worker(tmp_path: Path) -> None:
    """The runner's imports take seconds before its own code runs; a worker that dies meanwhile takes it along."""
    spec = RunnerSpec(
        nats=NatsOptions(),
        plan=RunnerPlan(
            key=RunnerKey(INSTANCE, 0),
            model_id=MODEL,
            rank=0,
            world_size=1,
            start_layer=0,
            end_layer=2,
            model_dir=str(tmp_path),
            endpoints=("127.0.0.1:1",),
        ),
        node_id=NODE,
        worker_session="s",
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING_WORKER, msgspec.json.encode(spec).decode(), str(tmp_path / "runner.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **slow_runner_imports(tmp_path / "slow", SLOW_START_S)},
    )
    try:
        assert worker.stdout is not None
        runner = psutil.Process(int(worker.stdout.readline()))
        assert_dies_with(runner, worker)
    finally:
        worker.kill()
        worker.wait()
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(runner.pid).kill()


# ------------------------------------------------------------------------------------------ why a runner died


async def runner_reports(js: Any) -> list[ReportRunnerStatus]:
    stored = await commands_stored(js)
    commands = [decode_command((await js.get_msg(COMMANDS_STREAM, seq)).data) for seq in range(1, stored + 1)]
    return [c for c in commands if isinstance(c, ReportRunnerStatus)]


async def test_a_runner_that_failed_to_load_is_reported_failed_with_its_own_error(
    bus: tuple[Any, Any], fresh_nats: NatsServer, tmp_path: Path
) -> None:
    """The worker quotes the error the runner died of, not whatever its log ended with (an import's warning)."""
    _, js = bus
    missing = tmp_path / "no-model-here"
    supervisor = RunnerSupervisor(js, NODE, "s", NatsOptions(servers=(fresh_nats.url,)), start_timeout_s=300)
    await supervisor.start(placed_here(missing))
    try:

        async def reported_by_worker() -> list[ReportRunnerStatus]:
            return [r for r in await runner_reports(js) if r.runner.reason.startswith("runner exited")]

        await until(reported_by_worker, 60, "the worker's report of its runner's death")
    finally:
        await supervisor.shutdown()
    (report,) = await reported_by_worker()
    assert report.runner.status is RunnerStatus.FAILED
    error = f"FileNotFoundError: [Errno 2] No such file or directory: '{missing / 'config.json'}'"
    assert report.runner.reason == f"runner exited with status 1: {error}"


LOGGED = "2025-01-02 03:04:05,678 runner/0   {level:<7} jetshard_worker.runner: {message}"


def test_the_reason_quoted_for_a_runners_death_is_its_last_error_not_a_later_warning(tmp_path: Path) -> None:
    log_path = tmp_path / "runner.log"
    log_path.write_text(
        "\n".join(
            [
                LOGGED.format(level="INFO", message="loading layers [0, 2)"),
                LOGGED.format(level="ERROR", message="runner failed"),
                "Traceback (most recent call last):",
                '  File "engine.py", line 1, in run',
                "RuntimeError: the engine failed",
                LOGGED.format(level="ERROR", message="runner stopping: the engine failed"),
                "[transformers] PyTorch was not found. Models won't be available.",
                LOGGED.format(level="WARNING", message="chunk publisher slow"),
            ]
        )
    )
    assert failure_reason(log_path) == "runner stopping: the engine failed"


def test_the_reason_for_a_runner_that_died_of_an_uncaught_exception_is_that_exception(tmp_path: Path) -> None:
    log_path = tmp_path / "runner.log"
    log_path.write_text(
        "Traceback (most recent call last):\n  File \"runner.py\", line 3\nModuleNotFoundError: No module named 'mlx'\n"
    )
    assert failure_reason(log_path) == "ModuleNotFoundError: No module named 'mlx'"


def test_a_runner_that_logged_no_error_is_quoted_by_what_it_wrote_beside_its_routine_records(tmp_path: Path) -> None:
    """As one a native library aborted (SIGABRT): its exit status says how it died, what the library printed why."""
    routine = [
        LOGGED.format(level="INFO", message=f'HTTP Request: GET /health "HTTP/1.1 200 OK" ({n})') for n in range(4)
    ]
    routine.append("0.03.129.613 I slot get_availabl: id  7 | task -1 | selected slot by LRU")  # its llama-server's
    routine.append("0.06.855.701 W slot   operator(): id  0 | task 38 | n_past was set to 41")
    log_path = tmp_path / "runner.log"
    log_path.write_text("\n".join(routine))
    assert failure_reason(log_path) == ""  # killed from outside: nothing in its log says why
    aborted = ["terminate called without an active exception", "Fatal Python error: Aborted"]
    log_path.write_text("\n".join([routine[0], aborted[0], *routine[1:], aborted[1]]))
    assert failure_reason(log_path) == " | ".join(aborted)


def test_a_llama_cpp_runner_starts_without_importing_mlx() -> None:
    """MLX's modules (mlx, mlx-lm, transformers, llguidance) take seconds to import and hundreds of MB: a runner of a
    llama.cpp instance, which never uses them, loads its engine without them."""
    script = textwrap.dedent(
        """
        import sys
        from jetshard_schema.types import Engine
        from jetshard_worker.runner import engine_loader
        engine_loader(Engine.LLAMA_CPP)
        print(sorted(m for m in ("mlx", "mlx_lm", "transformers", "llguidance") if m in sys.modules))
        """
    )
    imported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert imported.stdout.strip() == "[]"
