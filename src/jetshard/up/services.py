"""The four services `jetshard up` runs, each `python -m jetshard <service>` under the supervisor: their
environment and arguments, passed on from `up`'s flags, and their starts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jetshard_bus.procs import spawn
from jetshard_schema.ids import new_id

from jetshard.up.nats import UpNats
from jetshard.up.supervisor import Supervisor

SERVICE_STOP_STAGES = {"sequencer": 0, "api": 0, "worker": 1, "downloader": 2}
"""Started in this order; stopped by stage: the sequencer and what serves users first, then what runs models,
NATS last. The sequencer goes before the nodes: a stopping worker deletes its liveness key, and a sequencer still
running would record its node as lost, deleting every instance on it (the hand-placed ones for good). The nodes'
last reports wait in the command stream for the next start; in a LAN cluster another machine's sequencer takes
them, and the node's loss, over."""


def services_environment(nats_url: str, offline: bool, model_dirs: Mapping[str, str]) -> dict[str, str]:
    """What every service starts with: this environment, the NATS to join, `--offline`, and the model
    directories given to `up` (`model_dir_environment`)."""
    environment = {**os.environ, "JETSHARD_NATS": nats_url, **({"JETSHARD_OFFLINE": "1"} if offline else {})}
    return {**environment, **model_dirs}


def service_arguments(host: str, port: int, api_args: list[str], advertise_host: str | None) -> dict[str, list[str]]:
    """The flags of the services that take some from `up`; `api_args`: its API serving flags'
    (`api_serving_flags_passed_on`)."""
    return {
        "api": ["--host", host, "--port", str(port), *api_args],
        "worker": ["--advertise-host", advertise_host] if advertise_host else [],
        "downloader": ["--advertise-host", advertise_host] if advertise_host else [],
    }


@dataclass
class Services:
    """Starts each service under the supervisor; a restart starts it the same way. Each start of the worker is
    a session of its own: a restarted worker must not pass for its predecessor, whose runners died with it."""

    nats: UpNats
    environment: Mapping[str, str]
    arguments: Mapping[str, list[str]]
    api_key: str | None
    logs: Path
    worker_sessions: list[str] = field(default_factory=list)

    def start(self, supervisor: Supervisor) -> None:
        for name, stage in SERVICE_STOP_STAGES.items():
            supervisor.start(name, self._starter(name), stage, self.logs / f"{name}.log")

    def worker_session(self) -> str:
        """The session of the worker's latest start."""
        return self.worker_sessions[-1]

    def _starter(self, name: str) -> Callable[[], subprocess.Popen[bytes]]:
        args = [sys.executable, "-m", "jetshard", name, *self.arguments.get(name, [])]
        log_file = self.logs / f"{name}.log"
        environment = dict(self.environment)
        if self.nats.identities:
            environment["JETSHARD_NATS_NKEY"] = str(self.nats.identities[name].seed_file)
        if name == "api":
            # The key travels in the environment: a command line is visible to every user of the machine.
            environment["JETSHARD_API_KEY"] = self.api_key or ""

        def start() -> subprocess.Popen[bytes]:
            if name != "worker":
                return spawn(args, log_file, environment)
            self.worker_sessions.append(new_id()[:12])
            return spawn(args, log_file, {**environment, "JETSHARD_WORKER_SESSION": self.worker_sessions[-1]})

        return start
