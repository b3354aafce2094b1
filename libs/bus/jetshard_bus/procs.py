"""Child processes that never outlive their parent (`jetshard_bus.lifeline`), each in a process group of its own
(signalled as one, helpers included): `jetshard up`'s services and its nats-server, and the worker's runners."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from jetshard_bus.lifeline import lifeline_command


def spawn(
    args: Sequence[str],
    log_file: Path | None,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    parent_death_signal: signal.Signals = signal.SIGTERM,
) -> subprocess.Popen[bytes]:
    """Start `args` in a new process group that gets `parent_death_signal` when this process dies; it inherits
    `pass_fds` (no other descriptor of ours)."""
    command = lifeline_command(args, parent_death_signal)
    if log_file is None:
        return _popen(command, subprocess.DEVNULL, env, pass_fds)
    with open(log_file, "ab") as log:  # the child has its own copy; ours would leak one per restart
        return _popen(command, log, env, pass_fds)


def _popen(
    args: Sequence[str], stdout: int | IO[bytes], env: dict[str, str] | None, pass_fds: Sequence[int]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(args), stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True, pass_fds=tuple(pass_fds)
    )


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_groups(processes: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM the processes' groups together, then SIGKILL whatever is left of them after `grace_s`.

    The SIGKILL goes to every group, also of leaders that exited in time: helpers in the group that
    outlived their leader would otherwise be left behind.
    """
    for process in processes:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        signal_group(process, signal.SIGKILL)
    for process in processes:
        process.wait()


def describe_exit(returncode: int) -> str:
    """How a child ended, for a person: `exited with status 1`, or `was killed by SIGKILL` (a negative return
    code: the signal that ended it)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
