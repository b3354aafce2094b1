"""A runner never outlives its worker: a runner of a dead worker holds a model's memory and has nobody to report to.

The worker starts a runner as `python -m jetshard_worker.lifeline WORKER_PID jetshard_worker.runner SPEC_JSON`, which
arms the lifeline before the runner's module is even imported: those imports (mlx, transformers) take seconds, and a
worker that dies meanwhile must take its runner along at once, not leave it to load a model for nobody.

The runner arms this itself, in its own process, rather than in a `preexec_fn`: that would run Python (and load libc
with ctypes) in the child of a multi-threaded worker between fork and exec, where a lock another thread held at the
fork stays locked for ever. What is left of the window, the interpreter's start, is covered by the parent check.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_worker(worker_pid: int) -> None:
    """Unblock every signal, and on Linux have the kernel SIGKILL this process when its parent dies; exit at once if
    the parent is not `worker_pid` any more (the worker died before the signal was armed)."""
    # A blocked signal stays blocked across exec: a worker that held Ctrl-C back while starting this runner would
    # leave it deaf to SIGTERM.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != worker_pid:
        raise SystemExit(f"the worker (pid {worker_pid}) that started this runner is gone")


def main() -> None:
    """`python -m jetshard_worker.lifeline WORKER_PID MODULE ARG...`: arm the lifeline, then run MODULE as
    `python -m MODULE ARG...` would."""
    worker_pid, module, *args = sys.argv[1:]
    die_with_worker(int(worker_pid))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
