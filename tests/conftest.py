"""Shared fixtures: a real nats-server per session, temporary homes, and processes that never outlive a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from helpers.cluster import cluster  # noqa: F401  (fixture)
from helpers.hub_fixtures import hf_env, hub_server  # noqa: F401  (fixtures)

from jetshard.natsserver import NatsServer, start_nats_server

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No test reads or writes the real HOME, XDG dirs or Hugging Face cache."""
    home = tmp_path_factory.mktemp("home")
    saved = dict(os.environ)
    os.environ.update(
        {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "HF_HOME": str(home / ".cache/huggingface"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            # Runners must compute exactly what in-process mlx_lm does for the equality tests.
            "JETSHARD_PRELOAD_OPENBLAS": "0",
        }
    )
    for name in ("HF_HUB_OFFLINE", "JETSHARD_OFFLINE", "HF_TOKEN"):
        os.environ.pop(name, None)
    yield home
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats_server(tmp_path_factory.mktemp("nats"), port=-1)
    yield server
    server.stop()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own, for tests that need an empty history."""
    server = start_nats_server(tmp_path / "nats", port=-1)
    yield server
    server.stop()


class Processes:
    """Service processes started by a test, each in its own process group, all killed at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "jetshard", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "JETSHARD_LOG_LEVEL": "INFO", **(env or {})},
            start_new_session=True,
        )
        self.started.append(process)
        return process

    def kill(self, process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        process.wait(30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs = Processes(log_dir)
    yield procs
    procs.stop_all()


@pytest_asyncio.fixture
async def bus(fresh_nats: NatsServer) -> AsyncIterator[tuple[object, object]]:
    from jetshard_bus.connect import connect
    from jetshard_bus.options import NatsOptions

    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test")
    yield client, js
    await client.close()
