"""A service's scratch directory (the worker's runner hostfiles, logs and library links; a downloader's TLS key): a
temporary directory named after the service's pid, so that the next one to start removes what a killed one left
behind."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from jetshard_bus.procs import pid_alive

log = logging.getLogger(__name__)

WORKER_PREFIX = "jetshard-runners-"
DOWNLOADER_PREFIX = "jetshard-downloader-"


def make_scratch_dir(prefix: str) -> Path:
    """A new scratch directory named `<prefix><pid>-…`, once those that services gone left under `prefix` are
    removed. One such service per process: a directory named after this process's pid is taken for a previous
    life's (see `stale_scratch_dirs`)."""
    parent = Path(tempfile.gettempdir())
    for name in stale_scratch_dirs((entry.name for entry in parent.iterdir()), prefix, os.getpid(), pid_alive):
        log.info("removing %s, left behind by a process that is gone", parent / name)
        shutil.rmtree(parent / name, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def stale_scratch_dirs(names: Iterable[str], prefix: str, own_pid: int, alive: Callable[[int], bool]) -> list[str]:
    """Which of `names` (entries of the temporary directory) are scratch directories under `prefix` of services that
    are gone: named after a pid that runs no process, or after `own_pid`, which the service that made it had before
    this process did (in a container a service is pid 1 every time). A name without a pid is left alone: its owner
    is unknown."""
    stale = []
    for name in names:
        pid, sep, _ = name.removeprefix(prefix).partition("-")
        if not name.startswith(prefix) or not sep or not pid.isdigit():
            continue
        if int(pid) == own_pid or not alive(int(pid)):
            stale.append(name)
    return stale
