"""The processes `jetshard up` runs: restarted with back-off when they die, stopped in order."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jetshard_bus.procs import describe_exit, signal_group, stop_groups

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 30.0
"""A process that ran this long before it died is restarted after the first delay again, not the last one."""


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
    start: Callable[[], subprocess.Popen[bytes]]
    """Starts (and restarts) the process; returns once it may be used."""
    stop_stage: int
    """Processes of the same stage stop together; lower stages stop first."""
    log_file: Path | None
    process: subprocess.Popen[bytes]
    restart_delay_s: float
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    """When the dead process is due to start again; None while it runs."""
    restarts: int = 0


class Supervisor:
    """Starts processes, each in a group of its own, restarts those that die, and stops them stage by stage."""

    def __init__(
        self,
        stop_grace_s: Sequence[float],
        report: Callable[[str], None] = print,
        first_restart_delay_s: float = FIRST_RESTART_DELAY_S,
        max_restart_delay_s: float = MAX_RESTART_DELAY_S,
    ) -> None:
        """`stop_grace_s[n]`: how long the processes of stop stage n get between SIGTERM and SIGKILL.
        `report` shows a line to the user (each line also goes to the process's log)."""
        self.stop_grace_s = stop_grace_s
        self.first_restart_delay_s = first_restart_delay_s
        self.max_restart_delay_s = max_restart_delay_s
        self.report = report
        self.managed: list[ManagedProcess] = []
        self.stopping = False

    def start(
        self, name: str, start: Callable[[], subprocess.Popen[bytes]], stop_stage: int, log_file: Path | None
    ) -> ManagedProcess:
        with stop_signals_deferred():
            managed = ManagedProcess(name, start, stop_stage, log_file, start(), self.first_restart_delay_s)
            self.managed.append(managed)
        return managed

    def retire(self, name: str) -> None:
        """Stop the process `name` for good: it is not restarted again."""
        retired = [m for m in self.managed if m.name == name]
        self.managed = [m for m in self.managed if m.name != name]
        if retired:
            stop_groups([m.process for m in retired], self.stop_grace_s[retired[0].stop_stage])

    def exited(self) -> ManagedProcess | None:
        """The first process that has exited, if one has."""
        return next((m for m in self.managed if m.process.poll() is not None), None)

    def tend(self) -> None:
        """Schedule a restart of each process that died, and restart those whose back-off has passed."""
        now = time.monotonic()
        for managed in self.managed:
            if self.stopping:
                return
            if managed.restart_at is None and managed.process.poll() is not None:
                # Helpers of the dead process (a worker's runners) must not outlive it next to its successor.
                signal_group(managed.process, signal.SIGKILL)
                self._schedule_restart(managed, describe_exit(managed.process.returncode), now)
            elif managed.restart_at is not None and now >= managed.restart_at:
                self._restart(managed, now)

    def _schedule_restart(self, managed: ManagedProcess, why: str, now: float) -> None:
        if now - managed.started_at >= STABLE_AFTER_S:
            managed.restart_delay_s = self.first_restart_delay_s
        delay_s = managed.restart_delay_s
        managed.restart_at = now + delay_s
        managed.restart_delay_s = min(delay_s * 2, self.max_restart_delay_s)
        line = f"{managed.name} {why}; restarting it in {delay_s:.1f} s"
        if delay_s >= self.max_restart_delay_s:
            line += f" (it keeps failing: {managed.restarts} restarts so far; see {managed.log_file})"
        self._tell(managed, line)

    def _restart(self, managed: ManagedProcess, now: float) -> None:
        managed.restart_at = None
        managed.started_at = now
        managed.restarts += 1
        try:
            with stop_signals_deferred():
                managed.process = managed.start()
        except Exception as error:  # e.g. nats-server's port still taken: try again later, as for a crash
            self._schedule_restart(managed, f"failed to start ({error})", now)
            return
        self._tell(managed, f"{managed.name} restarted (restart {managed.restarts})")

    def _tell(self, managed: ManagedProcess, line: str) -> None:
        self.report(line)
        if managed.log_file is not None:
            with open(managed.log_file, "a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} jetshard up: {line}\n")

    def stop(self) -> None:
        self.stopping = True
        for stage, grace_s in enumerate(self.stop_grace_s):
            processes = [m.process for m in self.managed if m.stop_stage == stage]
            if processes:
                stop_groups(processes, grace_s)
