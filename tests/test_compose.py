"""compose.yaml as Docker Compose renders it, and its credentials step run for real: the configuration
`jetshard credentials` writes starts nats-server, which then admits the services with their seeds (as the
compose services start, only on this machine's loopback instead of a compose network: no Docker engine runs
here) and refuses a client without one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
import yaml
from helpers.harness import Processes, free_port, wait_for
from jetshard_bus.procs import spawn, stop_groups

from jetshard.up.natsserver import nats_server_binary

ROOT = Path(__file__).resolve().parent.parent
SHARED_ENV = {"JETSHARD_NATS": "nats://nats:4222", "JETSHARD_LOG_LEVEL": "INFO"}


def test_every_service_gets_the_shared_environment_and_its_own_identity() -> None:
    docker_compose = shutil.which("docker-compose")
    if docker_compose is None:
        pytest.fail("docker-compose renders compose.yaml here: apt-get install docker-compose (tests/run does)")
    rendered = subprocess.run(
        [docker_compose, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    services = yaml.safe_load(rendered.stdout)["services"]
    jetshard = {name: service for name, service in services.items() if name != "nats"}
    assert set(jetshard) == {"credentials", "sequencer", "api", "worker", "downloader"}
    for name, service in jetshard.items():
        assert SHARED_ENV.items() <= service["environment"].items(), name
    for name in ("sequencer", "api"):
        assert jetshard[name]["environment"]["JETSHARD_NATS_NKEY"] == f"/creds/{name}.nk"
    for name in ("worker", "downloader", "credentials"):
        assert jetshard[name]["environment"]["JETSHARD_CONFIG_DIR"] == "/config"
    for name in ("worker", "downloader"):
        # `$$` is Compose's escape for the `$` the container's shell expands.
        assert f"--nats-nkey /creds/{name}-$$(cat /config/node_id).nk" in " ".join(jetshard[name]["command"])
    assert jetshard["downloader"]["environment"]["JETSHARD_DEFAULT_MODELS_DIR"] == "/models"
    # NATS runs with what the credentials step made of deploy/nats.conf: the next test starts it, durable.
    assert services["nats"]["command"] == ["-c", "/creds/nats.conf"]
    assert f"{ROOT / 'deploy' / 'nats.conf'}:/etc/jetshard/nats.conf:ro" in jetshard["credentials"]["volumes"]
    assert services["nats"]["depends_on"]["credentials"]["condition"] == "service_completed_successfully"


def test_the_credentials_step_makes_a_durable_nats_that_admits_the_services_and_no_one_else(tmp_path: Path) -> None:
    port, monitor_port = free_port(), free_port()
    template = tmp_path / "nats.conf"
    # deploy/nats.conf with this test's ports and store.
    deployed = (ROOT / "deploy" / "nats.conf").read_text()
    template.write_text(
        deployed.replace("0.0.0.0:4222", f"127.0.0.1:{port}")
        .replace("0.0.0.0:8222", f"127.0.0.1:{monitor_port}")
        .replace("/data", json.dumps(str(tmp_path / "store")))
    )
    creds, config = tmp_path / "creds", tmp_path / "config"
    env = {**os.environ, "JETSHARD_CONFIG_DIR": str(config)}
    command = [sys.executable, "-m", "jetshard", "credentials", str(creds), "--server-config", str(template)]
    made = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=True)
    node_id = (config / "node_id").read_text().strip()
    assert f"worker-{node_id}.nk" in made.stdout
    seeds = sorted(p.name for p in creds.glob("*.nk"))
    assert seeds == sorted(
        [
            "admin.nk",
            "api.nk",
            "sequencer.nk",
            "system.nk",
            "viewer.nk",
            f"worker-{node_id}.nk",
            f"downloader-{node_id}.nk",
        ]
    )
    assert all(p.stat().st_mode & 0o077 == 0 for p in creds.glob("*.nk"))
    # A second run keeps every identity.
    before = {p.name: p.read_bytes() for p in creds.glob("*.nk")}
    subprocess.run(command, capture_output=True, env=env, timeout=60, check=True)
    assert before == {p.name: p.read_bytes() for p in creds.glob("*.nk")}

    server = spawn([str(nats_server_binary()), "-c", str(creds / "nats.conf")], tmp_path / "nats.log")
    (tmp_path / "logs").mkdir()
    processes = Processes(tmp_path / "logs")
    try:
        url = f"nats://127.0.0.1:{port}"
        assert wait_for(lambda: _listening(port), timeout=20), (tmp_path / "nats.log").read_text()
        # What the server runs with, as it reports it: a SIGKILL keeps the page cache, so no crash test here
        # could tell whether acknowledged writes were synced.
        jetstream = httpx.get(f"http://127.0.0.1:{monitor_port}/varz", timeout=5).json()["jetstream"]["config"]
        assert jetstream["sync_always"] is True, jetstream
        services = {**env, "JETSHARD_NATS": url}
        processes.start("sequencer", "sequencer", env={**services, "JETSHARD_NATS_NKEY": str(creds / "sequencer.nk")})
        api = processes.start_api("api", env={**services, "JETSHARD_NATS_NKEY": str(creds / "api.nk")})
        for role in ("worker", "downloader"):
            processes.start(role, role, "--nats-nkey", str(creds / f"{role}-{node_id}.nk"), env=services)
        assert wait_for(lambda: node_id in httpx.get(f"{api}/state", timeout=5).text, timeout=60), processes.logs()
        assert asyncio.run(_refused(url)), "a client without the cluster's credentials was admitted"
    finally:
        processes.stop_all()
        stop_groups([server], 10)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def _refused(url: str) -> bool:
    try:
        client = await nats.connect(url, connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False)
    except (nats.errors.Error, OSError):
        return True
    await client.close()
    return False
