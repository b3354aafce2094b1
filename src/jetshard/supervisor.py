"""The processes `jetshard up` runs, and the order in which they stop."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from jetshard.procs import spawn, stop_groups

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C back while a process starts, so that a started process is always one we know of."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen[bytes]
    stop_stage: int
    """Processes of the same stage stop together; lower stages stop first."""
    log_file: Path | None


class Supervisor:
    """Starts processes, each in a group of its own, and stops them stage by stage."""

    def __init__(self, stop_grace_s: Sequence[float]) -> None:
        """`stop_grace_s[n]`: how long the processes of stop stage n get between SIGTERM and SIGKILL."""
        self.stop_grace_s = stop_grace_s
        self.managed: list[ManagedProcess] = []

    def start(
        self, name: str, args: Sequence[str], stop_stage: int, log_file: Path, env: dict[str, str]
    ) -> ManagedProcess:
        with stop_signals_deferred():
            managed = ManagedProcess(name, spawn(args, log_file, env), stop_stage, log_file)
            self.managed.append(managed)
        return managed

    def adopt(self, name: str, process: subprocess.Popen[bytes], stop_stage: int, log_file: Path | None) -> None:
        self.managed.append(ManagedProcess(name, process, stop_stage, log_file))

    def exited(self) -> ManagedProcess | None:
        """The first process that has exited, if one has."""
        return next((m for m in self.managed if m.process.poll() is not None), None)

    def stop(self) -> None:
        for stage, grace_s in enumerate(self.stop_grace_s):
            processes = [m.process for m in self.managed if m.stop_stage == stage]
            if processes:
                stop_groups(processes, grace_s)
