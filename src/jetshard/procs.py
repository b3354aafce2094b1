"""Child processes that never outlive their parent: own process group, and a parent-death signal on Linux."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from jetshard_bus.procs import die_with_parent

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
