"""A child that never outlives its parent: `jetshard up`'s services and its nats-server (SIGTERM, so that a service
whose `up` died still shuts down cleanly: its last reports, a drained connection), and the worker's runners, their
tunnels and llama.cpp's servers (SIGKILL: a runner of a dead worker, or a llama-server of a dead runner, holds a
model's memory and has nobody to report to).

A child starts as `python -m jetshard_bus.lifeline PARENT_PID SIGNAL [--ignore-sigpipe] [--data-limit-bytes N]
PROGRAM ARG...` (`lifeline_command`), which arms the lifeline (and caps the child's heap) and then becomes PROGRAM
(exec: same process, same pid, PROGRAM's own command line). So the lifeline is armed before PROGRAM starts at all: a
runner's imports (mlx, transformers) take seconds, and a worker that dies meanwhile must take its runner along at
once, not leave it to load a model for nobody.

The child arms this itself, in its own process, rather than in a `preexec_fn`: that would run Python in the child of
a multi-threaded parent between fork and exec, where a lock another thread held at the fork stays locked for ever.
What is left of the window, this interpreter's start, is covered by the parent check.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


IGNORE_SIGPIPE = "--ignore-sigpipe"
DATA_LIMIT = "--data-limit-bytes"


def lifeline_command(
    args: Sequence[str],
    parent_death_signal: signal.Signals,
    ignore_sigpipe: bool = False,
    data_limit_bytes: int | None = None,
) -> list[str]:
    """The command that runs `args` as a child of this process that gets `parent_death_signal` when it dies; with
    `ignore_sigpipe`, a child that writes to a peer gone away gets an error rather than a signal that kills it; with
    `data_limit_bytes`, its heap and other private writable memory are capped there (RLIMIT_DATA: files it maps
    read-only, a model's weights, do not count), so that a runaway fails its own allocations instead of taking the
    machine's memory.

    On Linux the signal follows the thread that forks the child, not the process: fork from one that lives as long
    as the child must."""
    options = [IGNORE_SIGPIPE] if ignore_sigpipe else []
    if data_limit_bytes is not None:
        options += [DATA_LIMIT, str(data_limit_bytes)]
    return [sys.executable, "-m", __name__, str(os.getpid()), parent_death_signal.name, *options, *args]


def die_with_parent(parent_pid: int, parent_death_signal: signal.Signals) -> None:
    """Unblock every signal, and on Linux have the kernel send `parent_death_signal` to this process when its
    parent dies (kept across exec); exit at once if the parent is not `parent_pid` any more (it died before the
    signal was armed)."""
    # A blocked signal stays blocked across exec: a parent that held Ctrl-C back while starting this child would
    # leave it deaf to SIGTERM.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, parent_death_signal) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        raise SystemExit(f"the process (pid {parent_pid}) that started this one is gone")


def main() -> None:
    """`python -m jetshard_bus.lifeline PARENT_PID SIGNAL [--ignore-sigpipe] [--data-limit-bytes N] PROGRAM ARG...`:
    arm the lifeline, then exec PROGRAM."""
    parent_pid, signal_name, *program = sys.argv[1:]
    die_with_parent(int(parent_pid), signal.Signals[signal_name])
    ignore_sigpipe = program[0] == IGNORE_SIGPIPE
    if ignore_sigpipe:
        program = program[1:]
    if program[0] == DATA_LIMIT:
        limit = int(program[1])
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        program = program[2:]
    # This interpreter ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec: PROGRAM starts
    # with their defaults, as from subprocess, unless it is to ignore SIGPIPE.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN if ignore_sigpipe else signal.SIG_DFL)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
