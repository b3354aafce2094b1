"""compose.yaml as Docker Compose renders it: every jetshard service gets the shared settings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED_ENV = {"JETSHARD_NATS": "nats://nats:4222", "JETSHARD_LOG_LEVEL": "INFO"}


def test_every_service_gets_the_shared_environment() -> None:
    docker_compose = shutil.which("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    rendered = subprocess.run(
        [docker_compose, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    services = yaml.safe_load(rendered.stdout)["services"]
    jetshard = {name: service for name, service in services.items() if name != "nats"}
    assert set(jetshard) == {"sequencer", "api", "worker", "downloader"}
    for name, service in jetshard.items():
        assert SHARED_ENV.items() <= service["environment"].items(), name
    for name in ("worker", "downloader"):
        assert jetshard[name]["environment"]["JETSHARD_CONFIG_DIR"] == "/config"
    assert jetshard["downloader"]["environment"]["JETSHARD_DEFAULT_MODELS_DIR"] == "/models"
