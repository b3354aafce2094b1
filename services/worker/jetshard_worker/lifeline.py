"""A runner never outlives its worker: a runner of a dead worker holds a model's memory and has nobody to report to.

The runner arms this itself, first thing in its own process, rather than in a `preexec_fn`: that would run Python
(and load libc with ctypes) in the child of a multi-threaded worker between fork and exec, where a lock another
thread held at the fork stays locked for ever.
"""

from __future__ import annotations

import ctypes
import os
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
