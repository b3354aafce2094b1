"""Child processes that never outlive their parent: own process group, and a parent-death signal on Linux."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(args: Sequence[str], log_file: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `args` in a new process group that is signalled when this process dies."""
    log = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            os.killpg(process.pid, signal.SIGKILL)  # runners in the group that outlived their leader
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return
