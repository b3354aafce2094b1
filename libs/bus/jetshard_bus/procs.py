"""Child processes that never outlive their parent, for `jetshard up` (its services) and the worker (its
runners)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

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
