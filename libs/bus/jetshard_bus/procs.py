"""Child processes that never outlive their parent, for `jetshard up` (its services and the embedded
nats-server) and the worker (its runners): own process group, and a parent-death signal on Linux."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_death_signal: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child leads a process group of its own (so the group can be
    signalled as one), blocks no signal, and on Linux gets `parent_death_signal` when its parent dies."""

    def prepare_child() -> None:
        os.setsid()
        # A blocked signal stays blocked across exec: a parent that held Ctrl-C back while starting the child
        # would leave it deaf to SIGTERM.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if sys.platform == "linux":
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, parent_death_signal)

    return prepare_child


# SIGTERM: a service whose `jetshard up` died still shuts down cleanly (its last reports, a drained connection).
_die_with_parent = die_with_parent(signal.SIGTERM)


def spawn(args: Sequence[str], log_file: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `args` in a new process group that is signalled when this process dies."""
    if log_file is None:
        return subprocess.Popen(
            list(args), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
    with open(log_file, "ab") as log:  # the child has its own copy; ours would leak one per restart
        return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


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
