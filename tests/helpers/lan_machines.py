"""Machines for the multi-machine tests: each a host of a network-namespace LAN (`netns.py`) with its own data,
config and model directories, running the real `jetshard up --lan`; `lan_probe.py` asks things from inside it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jetshard_bus.procs import stop_groups

from helpers.harness import until_sync
from helpers.netns import Host, Lan

PROBE = str(Path(__file__).parent / "lan_probe.py")
API_PORT = 52415
MONITOR_PORT = 8222
TOKEN = re.compile(r"jetshard up --lan --join-token (\S+)")


@dataclass
class Machine:
    host: Host
    root: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of everything run on the machine."""
    up: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "up.log"
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "JETSHARD_DATA_DIR": str(self.root / "data"),
            "JETSHARD_CONFIG_DIR": str(self.root / "config"),
            "JETSHARD_DEFAULT_MODELS_DIR": str(self.root / "models"),
            "HF_HOME": str(self.root / "hf"),
            **self.extra_env,
        }

    def start(self, *args: str) -> None:
        self.up = self.host.popen([sys.executable, "-m", "jetshard", "up", "--lan", *args], self.log, self.env)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, text: str, timeout_s: float) -> None:
        def seen() -> bool:
            assert self.up is not None
            if self.up.poll() is not None:
                raise AssertionError(f"up on {self.host.name} exited with {self.up.returncode}:\n{self.output()}")
            return text in self.output()

        until_sync(seen, timeout_s, lambda: f"{text!r} from up on {self.host.name}:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            stop_groups([self.up], 10)

    def probe(self, *args: str, timeout_s: float = 120) -> dict:
        result = self.host.run([sys.executable, PROBE, *args], timeout_s=timeout_s, env=self.env)
        if result.returncode != 0:
            raise AssertionError(f"probe {args} on {self.host.name}: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def get(self, path: str, port: int = API_PORT) -> object:
        answer = self.probe("http", "GET", f"http://127.0.0.1:{port}{path}")
        assert answer["status"] == 200, answer
        return answer["body"]

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{API_PORT}"

    @property
    def server_name(self) -> str:
        return (self.root / "config" / "node_id").read_text().strip()

    def jetshard(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.host.run([sys.executable, "-m", "jetshard", *args], timeout_s=60, env=self.env)

    def lan_servers(self) -> list[dict]:
        listed = self.jetshard("lan", "ls", "--json")
        assert listed.returncode == 0, listed
        return json.loads(listed.stdout)

    def route_names(self) -> set[str]:
        routez = self.get("/routez", MONITOR_PORT)
        assert isinstance(routez, dict)
        return {r["remote_name"] for r in routez.get("routes") or []}

    def routes_to(self, names: set[str]) -> bool:
        """Its NATS server routes to all of `names`; False while that server is not listening (starting, or
        restarting as the cluster forms: a busy machine makes that window seconds long)."""
        try:
            return names <= self.route_names()
        except AssertionError as error:
            if "ConnectionRefusedError" in str(error):
                return False
            raise


@dataclass
class LanCluster:
    net: Lan
    machines: list[Machine]
    token: str
    formed_s: float


@contextlib.contextmanager
def formed_cluster(
    net: Lan,
    root: Path,
    first_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    hosts: Sequence[Host] | None = None,
) -> Iterator[LanCluster]:
    """A `jetshard up --lan` on each of `hosts` (every host of `net`) as one cluster: the first started with
    `first_args` and the others joining it with its token (`--no-model`), each with `env` added; all stopped
    afterwards."""
    chosen = net.hosts if hosts is None else hosts
    machines = [Machine(host, root / f"m{n}", dict(env or {})) for n, host in enumerate(chosen, 1)]
    try:
        first = machines[0]
        first.start(*first_args)
        first.wait_for("Press Ctrl-C to stop.", 240)  # its model placed there and ready
        match = TOKEN.search(first.output())
        assert match, first.output()
        for machine in machines[1:]:
            machine.start("--join-token", match[1], "--no-model")

        def one_cluster() -> bool:
            if not all((m.root / "data" / "lan.json").exists() for m in machines):
                return False
            names = {m.server_name for m in machines}
            routed = all(m.routes_to(names - {m.server_name}) for m in machines)
            return routed and "the witness is retired" in first.output()

        formed_s = until_sync(
            one_cluster, 180, lambda: f"one cluster of {len(machines)}: {[m.output()[-1500:] for m in machines]}"
        )
        for machine in machines[1:]:
            machine.wait_for("Press Ctrl-C to stop.", 120)
        # While the streams moved to three replicas the cluster did not answer, and a busy machine's node may have
        # been lost meanwhile: its next profile report joins it again.
        until_sync(lambda: every_node_joined(first, machines), 120, lambda: f"every node in State: {first.output()}")
        yield LanCluster(net, machines, match[1], formed_s)
    finally:
        for machine in machines:
            machine.stop()


def served_state(machine: Machine) -> dict | None:
    """The State `machine`'s API serves; None while it answers 503 (its server rejoins the meta group)."""
    answer = machine.probe("http", "GET", f"{machine.api}/state")
    return answer["body"] if answer["status"] == 200 else None


def every_node_joined(machine: Machine, machines: Sequence[Machine]) -> bool:
    """Every one of `machines` is a node in the State `machine`'s API serves."""
    state = served_state(machine)
    return state is not None and {m.server_name for m in machines} <= set(state["nodes"])


def wait_ready(machine: Machine, instance_id: str, timeout_s: float) -> dict:
    found: dict = {}

    def ready() -> bool:
        nonlocal found
        found = next((i for i in machine.get("/instances") if i["instance_id"] == instance_id), {})  # type: ignore[union-attr]
        assert found.get("status") != "failed", found
        return found.get("status") == "ready"

    until_sync(ready, timeout_s, lambda: f"instance {instance_id} ready: {found}")
    return found


def place(machine: Machine, body: dict) -> dict:
    placed = machine.probe("http", "POST", f"{machine.api}/instances", json.dumps(body))
    assert placed["status"] == 201, placed
    return wait_ready(machine, placed["body"]["instance_id"], 300)


def caught_up(returned: Machine, other: Machine) -> bool:
    """`returned` is back: its API serves the same event stream position as `other`'s, and its node is in State."""
    theirs, ours = served_state(returned), served_state(other)
    if theirs is None or ours is None:
        return False
    return theirs["last_seq"] == ours["last_seq"] and returned.server_name in ours["nodes"]
