"""A whole jetshard cluster in subprocesses for inference tests: nats, sequencer, api and N full nodes.

A node is a `worker` plus a `downloader` sharing a `JETSHARD_CONFIG_DIR` (hence a node id) and a
`JETSHARD_DEFAULT_MODELS_DIR`; several nodes run side by side on this machine. Models come from a local
Hugging Face-compatible server (`HubServer`), added through `POST /models` like a user would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from conftest import Processes
from jetshard_schema.codec import decode_event
from jetshard_schema.events import Event, EventEnvelope
from jetshard_schema.subjects import EVENTS_STREAM

from helpers.hub_server import HubServer, wait_for
from jetshard.natsserver import NatsServer


@dataclass
class InferenceCluster:
    root: Path
    nats: NatsServer
    hub: HubServer
    processes: Processes
    base_env: dict[str, str]
    api: str = ""
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    downloaders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    node_ids: dict[str, str] = field(default_factory=dict)

    # --- processes ---------------------------------------------------------------------------------------

    def start_core(self, api_args: Sequence[str] = (), name: str = "api") -> str:
        self.processes.start("sequencer", "sequencer", env=self.base_env)
        return self.start_api(api_args, name)

    def start_api(self, api_args: Sequence[str] = (), name: str = "api") -> str:
        port_file = self.root / f"{name}.port"
        self.processes.start(name, "api", "--port", "0", "--port-file", str(port_file), *api_args, env=self.base_env)
        ready = wait_for(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), timeout=60)
        assert ready, self.processes.log(name)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        if name == "api":
            self.api = url
        return url

    def node_env(self, node: str) -> dict[str, str]:
        tmp = self.root / node / "tmp"  # the worker keeps its runners' logs in a temporary directory
        tmp.mkdir(parents=True, exist_ok=True)
        return {
            **self.base_env,
            "JETSHARD_CONFIG_DIR": str(self.root / node / "config"),
            "JETSHARD_DEFAULT_MODELS_DIR": str(self.root / node / "models"),
            "TMPDIR": str(tmp),
        }

    def start_node(self, node: str, env: dict[str, str] | None = None) -> None:
        """Start a worker and a downloader as one node; `env` adds to (or overrides) the node's environment."""
        env = {**self.node_env(node), **(env or {})}
        self.workers[node] = self.processes.start(f"{node}-worker", "worker", env=env)
        self.downloaders[node] = self.processes.start(f"{node}-downloader", "downloader", env=env)
        id_file = self.root / node / "config" / "node_id"
        assert wait_for(lambda: id_file.exists() and id_file.read_text().strip() != "", timeout=60), self.processes.log(
            f"{node}-worker"
        )
        self.node_ids[node] = id_file.read_text().strip()

    def wait_nodes(self, count: int, timeout: float = 90) -> None:
        def joined() -> bool:
            nodes = httpx.get(f"{self.api}/nodes", timeout=10).json()
            return len(nodes) >= count and all(n.get("model_dirs") for n in nodes)

        assert wait_for(joined, timeout=timeout), self.get("/nodes")

    def stop_worker(self, node: str, sig: signal.Signals = signal.SIGTERM) -> None:
        self.processes.kill(self.workers.pop(node), sig)

    def runner_processes(self, node: str | None = None) -> list[psutil.Process]:
        """Runner subprocesses (children of the workers), optionally of one node."""
        found = []
        for name, worker in self.workers.items():
            if node is not None and name != node:
                continue
            try:
                children = psutil.Process(worker.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            found += [c for c in children if _is_runner(c)]
        return found

    # --- HTTP --------------------------------------------------------------------------------------------

    def get(self, path: str, api: str | None = None) -> Any:
        response = httpx.get(f"{api or self.api}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def add_model(self, model_id: str) -> None:
        response = httpx.post(f"{self.api}/models", json={"model_id": model_id}, timeout=60)
        assert response.status_code in (200, 201), response.text

    def place(self, model_id: str, min_nodes: int = 2) -> str:
        response = httpx.post(f"{self.api}/instances", json={"model_id": model_id, "min_nodes": min_nodes}, timeout=60)
        assert response.status_code == 201, response.text
        return str(response.json()["instance_id"])

    def wait_instance(
        self, instance_id: str, status: str = "ready", timeout: float = 180, seen: list[str] | None = None
    ) -> dict[str, Any]:
        """Poll GET /instances/{id} until `status`; record every distinct status in `seen`."""
        last: dict[str, Any] = {}

        def reached() -> bool:
            nonlocal last
            response = httpx.get(f"{self.api}/instances/{instance_id}", timeout=10)
            if response.status_code != 200:
                return False
            last = response.json()
            if seen is not None and (not seen or seen[-1] != last["status"]):
                seen.append(last["status"])
            if last["status"] == "failed" and status != "failed":
                raise AssertionError(f"instance failed: {last}\n{self.logs()}")
            return bool(last["status"] == status)

        assert wait_for(reached, timeout=timeout, interval=0.05), f"{last}\n{self.logs()}"
        return last

    def watch_until_ready(self, instance_ids: Iterable[str], timeout: float = 180) -> dict[str, list[str]]:
        """Poll several instances together until all are ready; the distinct statuses each went through."""
        seen: dict[str, list[str]] = {i: [] for i in instance_ids}

        def all_ready() -> bool:
            for instance_id, statuses in seen.items():
                response = httpx.get(f"{self.api}/instances/{instance_id}", timeout=10)
                if response.status_code != 200:
                    continue
                status = response.json()["status"]
                if status == "failed":
                    raise AssertionError(f"instance failed: {response.json()}\n{self.logs()}")
                if not statuses or statuses[-1] != status:
                    statuses.append(status)
            return all(s and s[-1] == "ready" for s in seen.values())

        assert wait_for(all_ready, timeout=timeout, interval=0.02), f"{seen}\n{self.logs()}"
        return seen

    def instances_of(self, model_id: str) -> list[dict[str, Any]]:
        return [i for i in self.get("/instances") if i["model_id"] == model_id]

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.processes.log_dir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        for path in sorted(self.root.glob("*/tmp/jetshard-runners-*/*.log")):
            parts.append(f"--- {path.relative_to(self.root)}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # --- events ------------------------------------------------------------------------------------------

    def envelopes(self, since: int = 1) -> list[tuple[int, EventEnvelope]]:
        return run_async(_envelopes(self.nats.url, since))

    def events(self, since: int = 1) -> list[tuple[int, Event]]:
        return [(seq, envelope.event) for seq, envelope in self.envelopes(since)]

    def last_seq(self) -> int:
        return int(self.get("/state")["last_seq"])

    def wait_event(self, predicate: Callable[[Event], bool], since: int = 1, timeout: float = 60) -> Event:
        found: list[Event] = []

        def check() -> bool:
            found[:] = [e for _, e in self.events(since) if predicate(e)]
            return bool(found)

        assert wait_for(check, timeout=timeout, interval=0.25), self.logs()
        return found[0]


def _is_runner(process: psutil.Process) -> bool:
    try:
        return "jetshard_worker.runner" in process.cmdline()
    except psutil.Error:
        return False


def run_async(coroutine: Any) -> Any:
    """Run a coroutine on a loop of its own in another thread, away from pytest-asyncio's loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result(timeout=60)


async def _envelopes(nats_url: str, since: int) -> list[tuple[int, EventEnvelope]]:
    from jetshard_bus.connect import connect
    from jetshard_bus.options import NatsOptions

    client, js = await connect(NatsOptions(servers=(nats_url,)), "test-inference")
    try:
        info = await js.stream_info(EVENTS_STREAM)
        found = []
        for seq in range(max(since, info.state.first_seq), info.state.last_seq + 1):
            envelope = decode_event((await js.get_msg(EVENTS_STREAM, seq)).data)
            if envelope is not None:
                found.append((seq, envelope))
        return found
    finally:
        await client.close()


def assert_layer_ranges(state: dict[str, Any], instance_id: str) -> None:
    """Every runner of the instance loaded only tensors of its own layer range (plus embeddings/head)."""
    instance = state["instances"][instance_id]
    shards = {s["rank"]: s for s in instance["shards"]}
    assert set(instance["runners"]) == {str(r) for r in shards} or set(instance["runners"]) == set(shards)
    for rank, runner in instance["runners"].items():
        shard = shards[int(rank)]
        tensors = runner["loaded_tensors"]
        assert tensors, f"rank {rank} reported no tensors"
        layers = {int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")}
        assert layers == set(range(shard["start_layer"], shard["end_layer"])), (rank, shard, sorted(layers))
        others = [n for n in tensors if not n.startswith("model.layers.")]
        if shard["start_layer"] > 0 and int(rank) < len(shards) - 1:
            assert not any("embed_tokens" in n for n in others), others
        if int(rank) < len(shards) - 1:
            assert not any(n.startswith(("lm_head", "model.norm")) for n in others), others


def env_without(names: Iterable[str]) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in set(names)}


class ChunkTap:
    """Listens on `jetshard.chunks.>` in a thread of its own: every chunk of every task."""

    def __init__(self, nats_url: str) -> None:
        import threading

        self._url = nats_url
        self.chunks: dict[str, list[Any]] = {}
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> ChunkTap:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _run(self) -> None:
        import nats
        from jetshard_schema.codec import decode_chunk
        from jetshard_schema.subjects import CHUNK_PREFIX

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        client = await nats.connect(self._url)

        async def on_chunk(msg: Any) -> None:
            chunk = decode_chunk(msg.data)
            self.chunks.setdefault(chunk.task_id, []).append(chunk)

        await client.subscribe(f"{CHUNK_PREFIX}.>", cb=on_chunk)
        await client.flush()
        self._ready.set()
        await self._stop.wait()
        await client.close()

    def final(self, task_id: str) -> Any | None:
        return next((c for c in self.chunks.get(task_id, []) if c.finish_reason is not None), None)
