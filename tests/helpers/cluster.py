"""A cluster for tests of node services: a real nats-server and sequencer, nodes made present by the
test itself (ReportNodeProfile plus the liveness key a worker would keep), and services started as
processes on demand."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import keep_alive, node_id_for
from jetshard_bus.options import NatsOptions
from jetshard_schema.cards import ModelCard
from jetshard_schema.commands import (
    AddCustomModelCard,
    Command,
    ReportNodeProfile,
)
from jetshard_schema.events import (
    CommandRejected,
    Event,
    EventEnvelope,
)
from jetshard_schema.ids import ModelId, NodeId, new_command_id
from jetshard_schema.state import Download, State
from jetshard_schema.types import DownloadStatus, NodeProfile

from jetshard.natsserver import NatsServer

GiB = 2**30


# --------------------------------------------------------------------------------------------------- harness


@dataclass
class Cluster:
    nats: NatsServer
    js: Any
    follower: StateFollower
    processes: Any
    env: dict[str, str]
    tmp: Path
    events: list[Event] = field(default_factory=list)
    heartbeats: list[tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=list)

    async def submit(self, command: Command, timeout_s: float = 15.0) -> list[Event]:
        command_id = new_command_id()
        outcome = self.follower.expect(command_id)
        await publish_command(self.js, command, command_id)
        return [e.event for e in await asyncio.wait_for(outcome, timeout_s)]

    async def join(self, config_dir: Path) -> NodeId:
        """Make the node of `config_dir` present, as its worker would."""
        node_id = node_id_for(config_dir)
        stop = asyncio.Event()
        task = asyncio.create_task(keep_alive(self.js, node_id, "test-session", 10.0, stop))
        self.heartbeats.append((stop, task))
        profile = NodeProfile(
            hostname=node_id, os="test", cpu_cores=4, memory_total_bytes=64 * GiB, memory_available_bytes=32 * GiB
        )
        await self.submit(ReportNodeProfile(node_id=node_id, session_id="test-session", profile=profile))
        return node_id

    async def add_card(self, model_id: str, num_layers: int, hidden_size: int = 64) -> None:
        card = ModelCard(
            model_id=ModelId(model_id),
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            architecture="llama",
            storage_size_bytes=1000,
            storage_size_estimated=True,
        )
        events = await self.submit(AddCustomModelCard(card=card))
        assert not any(isinstance(e, CommandRejected) for e in events), events

    def start_downloader(self, name: str, config_dir: Path, *args: str, **env: str) -> Any:
        full = {**self.env, "JETSHARD_CONFIG_DIR": str(config_dir), "JETSHARD_NATS": self.nats.url, **env}
        return self.processes.start(name, "downloader", *args, env=full)

    def start_api(self) -> str:
        port_file = self.tmp / "api.port"
        self.processes.start(
            "api", "api", "--port", "0", "--port-file", str(port_file), env={**self.env, "JETSHARD_NATS": self.nats.url}
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if port_file.exists() and port_file.read_text().strip():
                return f"http://127.0.0.1:{port_file.read_text().strip()}"
            time.sleep(0.05)
        raise AssertionError("the API did not start:\n" + self.processes.log("api"))

    async def wait(self, predicate: Callable[[State], bool], timeout_s: float = 30.0, what: str = "") -> State:
        try:
            return await self.follower.wait_until(predicate, timeout_s)
        except TimeoutError:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                for p in sorted(self.processes.log_dir.glob("*.log"))
            )
            raise AssertionError(f"timed out waiting for {what}\n{logs}") from None

    async def wait_download(
        self, node_id: NodeId, model_id: str, statuses: tuple[DownloadStatus, ...], timeout_s: float = 30.0
    ) -> Download:
        state = await self.wait(
            lambda s: (d := s.download(node_id, ModelId(model_id))) is not None and d.progress.status in statuses,
            timeout_s,
            f"{model_id} on {node_id} to be {statuses}",
        )
        download = state.download(node_id, ModelId(model_id))
        assert download is not None
        return download


@pytest_asyncio.fixture
async def cluster(
    fresh_nats: NatsServer, processes: Any, hf_env: dict[str, str], tmp_path: Path
) -> AsyncIterator[Cluster]:
    processes.start("sequencer", "sequencer", env={**hf_env, "JETSHARD_NATS": fresh_nats.url})
    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test")
    follower = StateFollower(js)
    result = Cluster(fresh_nats, js, follower, processes, hf_env, tmp_path)

    def record(envelope: EventEnvelope, state: State, live: bool) -> None:
        result.events.append(envelope.event)

    follower.add_listener(record)
    await follower.start()
    yield result
    for stop, task in result.heartbeats:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
    processes.stop_all()
    await follower.stop()
    await client.close()


async def poll(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def api_until(
    http: httpx.AsyncClient, predicate: Callable[[Any], bool], path: str = "/downloads", timeout_s: float = 10.0
) -> Any:
    """GET `path` until `predicate(json)`: the API's State replica may be a moment behind the test's."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = (await http.get(path)).json()
        if predicate(body):
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.1)
