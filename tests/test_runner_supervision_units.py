"""The pieces of runner supervision, each on its own: which scratch directories are stale, the retry of a report
JetStream refused (a real nats-server), the port a worker holds for a rank (real sockets), and a runner dying with
its worker (real processes). The whole, in a cluster: tests/test_inference_failures.py and test_requests_never_hang.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest
from helpers.harness import until
from jetshard_schema.commands import ReportRunnerStatus
from jetshard_schema.ids import InstanceId, NodeId
from jetshard_schema.subjects import COMMANDS_STREAM
from jetshard_schema.types import RunnerReport, RunnerStatus
from jetshard_worker.publishing import LAST_RETRY_S, publish_until_stored, retry_delay_s
from jetshard_worker.runners import hold_ring_port
from jetshard_worker.scratch import PREFIX, stale_scratch_dirs

# ------------------------------------------------------------------------------------------ stale directories


def test_scratch_dirs_of_dead_workers_and_of_this_pid_are_stale() -> None:
    names = [
        f"{PREFIX}100-abc",  # a live worker's
        f"{PREFIX}200-def",  # a dead worker's
        f"{PREFIX}300-ghi",  # made by an earlier process with this one's pid (a container's pid 1)
        f"{PREFIX}xyz",  # no pid: an older worker's, owner unknown
        f"{PREFIX}12x-abc",
        "jetshard-blas-200-abc",  # not a scratch directory
        "unrelated",
    ]
    stale = stale_scratch_dirs(names, own_pid=300, alive=lambda pid: pid in (100, 300))
    assert stale == [f"{PREFIX}200-def", f"{PREFIX}300-ghi"]


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

# A "worker" that starts a "runner" (which arms its lifeline as runner.main does) and sleeps; both say so on stdout.
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    runner = "from jetshard_worker.lifeline import die_with_worker; import os, sys, time; "
    runner += "die_with_worker(int(sys.argv[1])); print('armed', os.getpid(), flush=True); time.sleep(60)"
    subprocess.Popen([sys.executable, "-c", runner, str(os.getpid())], start_new_session=True)
    time.sleep(60)
    """
)


def test_a_runner_dies_with_its_worker() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        armed, pid = worker.stdout.readline().split()
        assert armed == "armed"
        runner = psutil.Process(int(pid))
        worker.kill()
        worker.wait()
        assert psutil.wait_procs([runner], timeout=10)[1] == [], "the runner outlived its worker"
    finally:
        worker.kill()
        worker.wait()


def test_a_runner_whose_worker_is_already_gone_exits() -> None:
    not_its_parent = os.getpid() + 1
    gone = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from jetshard_worker.lifeline import die_with_worker; die_with_worker({not_its_parent})",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert gone.returncode == 1
    assert f"the worker (pid {not_its_parent}) that started this runner is gone" in gone.stderr
