"""Child processes that never outlive their parent, for `jetshard up` (its services and the embedded
nats-server) and the worker (its runners): own process group, and a parent-death signal on Linux."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1

# Resolved here, before any fork: the child of a multi-threaded parent runs between fork and exec, where loading a
# library (a lock another thread held at the fork stays locked for ever) is not safe; calling a resolved function is.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _prepare_child() -> None:
    """Runs in the child between fork and exec (`start_new_session` already made it a group leader, so the group
    can be signalled as one): block no signal, and on Linux get SIGTERM when the parent dies, so a service whose
    `jetshard up` died still shuts down cleanly (its last reports, a drained connection)."""
    # A blocked signal stays blocked across exec: a parent that held Ctrl-C back while starting the child would
    # leave it deaf to SIGTERM.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    args: Sequence[str], log_file: Path | None, env: dict[str, str] | None = None, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start `args` in a new process group that is signalled when this process dies; it inherits `pass_fds`
    (no other descriptor of ours)."""
    if log_file is None:
        return _popen(args, subprocess.DEVNULL, env, pass_fds)
    with open(log_file, "ab") as log:  # the child has its own copy; ours would leak one per restart
        return _popen(args, log, env, pass_fds)


def _popen(
    args: Sequence[str], stdout: int | IO[bytes], env: dict[str, str] | None, pass_fds: Sequence[int]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(args),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_prepare_child,
        pass_fds=tuple(pass_fds),
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


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
