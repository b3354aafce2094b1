"""The test cluster harness: service processes that never outlive a test, one poll helper, and the clusters
built from them.

* `Processes`: `python -m jetshard <service>` in process groups of their own, killed at teardown.
* `wait_for` / `until_sync` / `until`: the poll helper (whether it came; the time it took or an
  AssertionError saying what did not come, for synchronous and for async tests); the only place tests sleep
  to wait for something.
* `Cluster` (fixture `cluster`): a nats-server and a sequencer; nodes made present by the test itself
  (ReportNodeProfile plus the liveness key a worker would keep), services started on demand; the test
  follows State in-process.
* `InferenceCluster` (from `hub_cluster`): a whole cluster in subprocesses, nodes included, models served
  by a local Hugging Face-compatible server (`HubServer`) and added through `POST /models` like a user
  would. A node is a `worker` plus a `downloader` sharing a `JETSHARD_CONFIG_DIR` (hence a node id) and a
  `JETSHARD_DEFAULT_MODELS_DIR`; several nodes run side by side on this machine.

Registered as a pytest plugin by `conftest.py`, so its fixtures need no import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import pytest_asyncio
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import Liveness, keep_alive, node_id_for
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import stop_groups
from jetshard_schema.cards import ModelFormat
from jetshard_schema.codec import decode_event
from jetshard_schema.commands import AddCustomModelCard, Command, ReportNodeProfile
from jetshard_schema.events import CommandRejected, Event, EventEnvelope
from jetshard_schema.ids import ModelId, NodeId, new_command_id
from jetshard_schema.state import Download, State
from jetshard_schema.subjects import EVENTS_STREAM
from jetshard_schema.types import DownloadStatus, Engine, NodeProfile
from jetshard_worker.runner_spec import RunnerSpec

from helpers.cards import tiny_card
from helpers.hub_fixtures import use_hub
from helpers.hub_server import HubServer
from jetshard.up.natsserver import NatsServer, start_nats_server

GiB = 2**30
LOOPBACK = "127.0.0.1"


# ------------------------------------------------------------------------------------------------ polling


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `predicate()` until it is true or `timeout` passes; whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def until_sync(
    check: Callable[[], object], timeout_s: float, what: str | Callable[[], str], interval_s: float = 0.5
) -> float:
    """Seconds until `check()` is true (polled by `wait_for`); raises AssertionError saying `what` it waited for
    after `timeout_s`. An exception `check` raises ends the wait with it."""
    started = time.monotonic()
    if not wait_for(check, timeout_s, interval_s):
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what() if callable(what) else what}")
    return time.monotonic() - started


async def until(
    check: Callable[[], object],
    timeout_s: float = 30.0,
    what: str | Callable[[], str] = "",
    interval_s: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
) -> float:
    """Seconds until `check()` (awaited when it returns an awaitable) is true; raises AssertionError after
    `timeout_s`. Exceptions of `retry_on` count as "not yet" (a service restarting)."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(*retry_on):
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return time.monotonic() - started
        if time.monotonic() - started >= timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")
        await asyncio.sleep(interval_s)


async def api_until(
    http: httpx.AsyncClient, predicate: Callable[[Any], bool], path: str = "/downloads", timeout_s: float = 10.0
) -> Any:
    """GET `path` until `predicate(json)`; the last body. The API's State replica may be a moment behind."""
    last: Any = None

    async def matched() -> bool:
        nonlocal last
        last = (await http.get(path)).json()
        return predicate(last)

    await until(matched, timeout_s, lambda: f"{path} to match, last {last}", interval_s=0.1)
    return last


# ---------------------------------------------------------------------------------------------- processes


class Processes:
    """Service processes started by a test, each in its own process group, all killed at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "jetshard", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "JETSHARD_LOG_LEVEL": "INFO", **(env or {})},
                start_new_session=True,
            )
        self.started.append(process)
        return process

    def start_api(self, name: str, *args: str, env: dict[str, str] | None = None) -> str:
        """Start an API on a free port and return its URL once it listens (it writes its port file then)."""
        port_file = self.log_dir.parent / f"{name}.port"
        port_file.unlink(missing_ok=True)
        process = self.start(name, "api", "--port", "0", "--port-file", str(port_file), *args, env=env)

        def listening() -> bool:
            assert process.poll() is None, self.log(name)
            return port_file.exists() and port_file.read_text().strip().isdigit()

        assert wait_for(listening, timeout=60), "the API did not start:\n" + self.log(name)
        return f"http://{LOOPBACK}:{int(port_file.read_text())}"

    def kill(self, process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        process.wait(30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def logs(self, tail: int = 3000) -> str:
        """The end of every service's log, for a failure message."""
        paths = sorted(self.log_dir.glob("*.log"))
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}" for path in paths)

    def stop_all(self) -> None:
        stop_groups(self.started, 10)


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 and up): a port the kernel hands out would soon be
    the local end of some outgoing connection (the suite makes thousands), and a server started on it later
    would find it taken."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port


def run_async(coroutine: Any) -> Any:
    """Run a coroutine on a loop of its own in another thread, away from pytest-asyncio's loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result(timeout=60)


async def limit_message_size(nats_url: str, stream: str, limit: int) -> int:
    """Set `stream`'s largest message size; the limit it had. 1 makes it refuse every write (JetStream answers each
    publish with an error and stores nothing), as a stream that cannot take writes for a while does."""
    nc, js = await connect(NatsOptions(servers=(nats_url,)), "test-limits", declare_streams=False)
    try:
        config = (await js.stream_info(stream)).config
        before, config.max_msg_size = config.max_msg_size, limit
        await js.update_stream(config)
        return int(before or -1)
    finally:
        await nc.close()


async def stream_envelopes(nats_url: str, since: int = 1) -> list[tuple[int, EventEnvelope]]:
    """Every decodable event of the event stream from sequence `since` on, with its sequence."""
    client, js = await connect(NatsOptions(servers=(nats_url,)), "test-reader")
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


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own: an empty history."""
    server = start_nats_server(tmp_path / "nats", port=-1)
    yield server
    server.stop()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs = Processes(log_dir)
    yield procs
    procs.stop_all()


@pytest_asyncio.fixture
async def bus(fresh_nats: NatsServer) -> AsyncIterator[tuple[object, object]]:
    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test")
    yield client, js
    await client.close()


# ------------------------------------------------------------------------------- a sequencer, nodes by hand


@dataclass
class Cluster:
    nats: NatsServer
    js: Any
    follower: StateFollower
    processes: Processes
    env: dict[str, str]
    tmp: Path
    events: list[Event] = field(default_factory=list)
    heartbeats: list[tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=list)

    async def submit(self, command: Command, timeout_s: float = 60.0) -> list[Event]:
        command_id = new_command_id()
        outcome = self.follower.expect(command_id)
        await publish_command(self.js, command, command_id)
        try:
            return [e.event for e in await asyncio.wait_for(outcome, timeout_s)]
        except TimeoutError:
            # A command the sequencer finds nothing to do for (a report about a deleted instance) stores no event.
            raise AssertionError(
                f"no event of {type(command).__name__} within {timeout_s} s: the sequencer is down, or it was a "
                f"no-op\n{self.processes.logs()}"
            ) from None

    async def join(self, config_dir: Path, engines: tuple[Engine, ...] = (Engine.MLX,)) -> NodeId:
        """Make the node of `config_dir` present, as its worker would, running `engines`."""
        node_id = node_id_for(config_dir)
        stop = asyncio.Event()
        task = asyncio.create_task(keep_alive(self.js, node_id, "test-session", Liveness(10.0), stop))
        self.heartbeats.append((stop, task))
        profile = NodeProfile(
            hostname=node_id,
            os="test",
            cpu_cores=4,
            memory_total_bytes=64 * GiB,
            memory_available_bytes=32 * GiB,
            engines=engines,
        )
        await self.submit(ReportNodeProfile(node_id=node_id, session_id="test-session", profile=profile))
        return node_id

    async def add_card(self, model_id: str, num_layers: int, hidden_size: int = 64) -> None:
        card = tiny_card(
            model_id,
            num_layers=num_layers,
            hidden_size=hidden_size,
            vocab_size=512,
            storage_size_bytes=1000,
            storage_size_estimated=True,
        )
        events = await self.submit(AddCustomModelCard(card=card))
        assert not any(isinstance(e, CommandRejected) for e in events), events

    def start_downloader(self, name: str, config_dir: Path, *args: str, **env: str) -> Any:
        full = {**self.env, "JETSHARD_CONFIG_DIR": str(config_dir), "JETSHARD_NATS": self.nats.url, **env}
        return self.processes.start(name, "downloader", *args, env=full)

    def start_api(self) -> str:
        return self.processes.start_api("api", env={**self.env, "JETSHARD_NATS": self.nats.url})

    async def wait(self, predicate: Callable[[State], bool], timeout_s: float = 30.0, what: str = "") -> State:
        try:
            return await self.follower.wait_until(predicate, timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}\n{self.processes.logs()}") from None

    async def wait_download(
        self,
        node_id: NodeId,
        model_id: str,
        statuses: tuple[DownloadStatus, ...] = (DownloadStatus.COMPLETED, DownloadStatus.FAILED),
        timeout_s: float = 30.0,
    ) -> Download:
        """The node's download of `model_id` once its status is one of `statuses` (by default: once it has ended)."""
        state = await self.wait(
            lambda s: (d := s.download(node_id, ModelId(model_id))) is not None and d.progress.status in statuses,
            timeout_s,
            f"{model_id} on {node_id} to be {statuses}",
        )
        download = state.download(node_id, ModelId(model_id))
        assert download is not None
        return download

    async def wait_download_of(
        self, node_id: NodeId, model_id: str, form: ModelFormat, timeout_s: float = 30.0
    ) -> Download:
        """The node's download of `model_id` once it holds `form`; AssertionError naming the reason if it fails."""
        state = await self.wait(
            lambda s: (
                (d := s.download(node_id, ModelId(model_id))) is not None
                and (d.progress.holds(form) or d.progress.status is DownloadStatus.FAILED)
            ),
            timeout_s,
            f"{model_id} on {node_id} in {form}",
        )
        download = state.download(node_id, ModelId(model_id))
        assert download is not None and download.progress.holds(form), download
        return download


@pytest_asyncio.fixture
async def cluster(
    fresh_nats: NatsServer, processes: Processes, hf_env: dict[str, str], tmp_path: Path
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


# ------------------------------------------------------------------------------- every service a process


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

    def start_api(self, api_args: Sequence[str] = (), name: str = "api", env: dict[str, str] | None = None) -> str:
        """Start an API (with `env` added to the cluster's); the first one named "api" is `self.api`."""
        env = {**self.base_env, **(env or {})}
        url = self.processes.start_api(name, *api_args, env=env)
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

    def runners_of(self, instance_id: str) -> list[psutil.Process]:
        """The runner subprocesses of one instance, on any node."""
        found = []
        for process in self.runner_processes():
            try:
                if runner_spec(process).plan.key.instance_id == instance_id:
                    found.append(process)
            except (psutil.Error, msgspec.DecodeError, IndexError):
                continue
        return found

    # --- HTTP --------------------------------------------------------------------------------------------

    def get(self, path: str, api: str | None = None) -> Any:
        response = httpx.get(f"{api or self.api}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def add_model(self, model_id: str) -> None:
        response = httpx.post(f"{self.api}/models", json={"model_id": model_id}, timeout=60)
        assert response.status_code in (200, 201), response.text

    def place(self, model_id: str, min_nodes: int = 2, parallelism: str = "pipeline") -> str:
        body = {"model_id": model_id, "min_nodes": min_nodes, "parallelism": parallelism}
        response = httpx.post(f"{self.api}/instances", json=body, timeout=60)
        assert response.status_code == 201, response.text
        return str(response.json()["instance_id"])

    def serve_one_node(self, model_id: str, env: dict[str, str] | None = None) -> None:
        """One node serving `model_id` on one runner: a node started (`env` added to its environment), the model
        added, placed and ready."""
        self.start_node("node-a", env)
        self.wait_nodes(1)
        self.add_model(model_id)
        self.wait_instance(self.place(model_id, min_nodes=1))

    def wait_instance(
        self,
        instance_id: str,
        status: str = "ready",
        timeout: float = 180,
        seen: list[str] | None = None,
        after_generation: int | None = None,
    ) -> dict[str, Any]:
        """Poll GET /instances/{id} until `status`; record every distinct status in `seen`. With
        `after_generation`, until a later generation has it (the API's replica may still show that one ready)."""
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
            later = after_generation is None or last["generation"] > after_generation
            return bool(last["status"] == status and later)

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
        runners = [
            f"--- {path.relative_to(self.root)}\n{path.read_text(errors='replace')[-tail:]}"
            for path in sorted(self.root.glob("*/tmp/jetshard-runners-*/*.log"))
        ]
        return "\n".join([self.processes.logs(tail), *runners])

    # --- events ------------------------------------------------------------------------------------------

    def envelopes(self, since: int = 1) -> list[tuple[int, EventEnvelope]]:
        return run_async(stream_envelopes(self.nats.url, since))

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


@contextlib.contextmanager
def hub_cluster(
    root: Path, env: dict[str, str] | None = None, nats_servers: Sequence[NatsServer] = ()
) -> Iterator[InferenceCluster]:
    """The prelude of a module's cluster: service logs, a nats-server (or `nats_servers`, all stopped at the
    end), a fake Hub with huggingface_hub pointed at it; the services' environment names both, plus `env`.
    Starts no service: the module starts those it needs, and every one is stopped at the end."""
    (root / "logs").mkdir(exist_ok=True)
    processes = Processes(root / "logs")
    servers = list(nats_servers) or [start_nats_server(root / "nats", port=-1)]
    try:
        with HubServer() as hub, pytest.MonkeyPatch.context() as monkeypatch:
            hub_env = use_hub(hub.url, root / "hf_home", monkeypatch)
            base = {**hub_env, "JETSHARD_NATS": " ".join(s.url for s in servers), **(env or {})}
            try:
                yield InferenceCluster(root=root, nats=servers[0], hub=hub, processes=processes, base_env=base)
            finally:
                processes.stop_all()
    finally:
        stop_groups([s.process for s in servers], 5)


def runner_spec(process: psutil.Process) -> RunnerSpec:
    """What a runner was started to do: the spec its worker passes as its last argument."""
    return msgspec.json.decode(process.cmdline()[-1], type=RunnerSpec)


def _is_runner(process: psutil.Process) -> bool:
    try:
        return "jetshard_worker.runner" in process.cmdline()
    except psutil.Error:
        return False


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


class ChunkTap:
    """Listens on `jetshard.chunks.>` in a thread of its own: every chunk of every task."""

    def __init__(self, nats_url: str) -> None:
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
