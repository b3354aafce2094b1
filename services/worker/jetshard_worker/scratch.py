"""The worker's scratch directory (its runners' hostfiles, logs and library links): a temporary directory named
after the worker's pid, so that the next worker to start removes what a killed one left behind."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from jetshard_bus.procs import pid_alive

log = logging.getLogger(__name__)

PREFIX = "jetshard-runners-"


def make_scratch_dir() -> Path:
    """A new scratch directory for this worker, once those of workers that are gone are removed. One worker per
    process: a directory named after this process's pid is taken for a previous life's (see `stale_scratch_dirs`)."""
    parent = Path(tempfile.gettempdir())
    for name in stale_scratch_dirs((entry.name for entry in parent.iterdir()), os.getpid(), pid_alive):
        log.info("removing %s, left behind by a worker that is gone", parent / name)
        shutil.rmtree(parent / name, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))


def stale_scratch_dirs(names: Iterable[str], own_pid: int, alive: Callable[[int], bool]) -> list[str]:
    """Which of `names` (entries of the temporary directory) are scratch directories of workers that are gone: named
    after a pid that runs no process, or after `own_pid`, which the worker that made it had before this process did
    (in a container the worker is pid 1 every time). A name without a pid is left alone: its owner is unknown."""
    stale = []
    for name in names:
        pid, sep, _ = name.removeprefix(PREFIX).partition("-")
        if not name.startswith(PREFIX) or not sep or not pid.isdigit():
            continue
        if int(pid) == own_pid or not alive(int(pid)):
            stale.append(name)
    return stale
