"""`jetshard up`: the whole cluster on this machine — embedded NATS plus the four services."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import click
import httpx
from jetshard_schema.catalogue import DEMO_MODEL_ID
from rich.console import Console

from jetshard.natsserver import NatsServer, start_nats_server
from jetshard.placing import place_and_wait
from jetshard.procs import spawn, stop_group

SERVICES = ("sequencer", "api", "worker", "downloader")


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(base) / "jetshard"


@click.command()
@click.option(
    "--nats",
    "nats_url",
    envvar="JETSHARD_NATS",
    default=None,
    help="join this NATS server instead of starting the embedded one",
)
@click.option(
    "--nats-port",
    envvar="JETSHARD_NATS_PORT",
    type=int,
    default=4222,
    show_default=True,
    help="port of the embedded NATS server (loopback only)",
)
@click.option("--host", envvar="JETSHARD_HOST", default="127.0.0.1", show_default=True, help="API address")
@click.option("--port", envvar="JETSHARD_PORT", type=int, default=52415, show_default=True, help="API port")
@click.option(
    "--data-dir",
    "state_dir",
    envvar="JETSHARD_DATA_DIR",
    type=click.Path(path_type=Path),
    default=None,
    help="where NATS keeps the cluster's history and services their logs",
)
@click.option("--offline", envvar="JETSHARD_OFFLINE", is_flag=True, help="make no network call at all")
@click.option(
    "--model",
    envvar="JETSHARD_MODEL",
    default=DEMO_MODEL_ID,
    show_default=True,
    help="model to place once the cluster is up",
)
@click.option("--no-model", is_flag=True, help="place no model")
@click.option(
    "--default-models-dir",
    envvar="JETSHARD_DEFAULT_MODELS_DIR",
    default=None,
    help="first writable model directory [default: XDG data dir/jetshard/models]",
)
@click.option(
    "--models-dirs",
    envvar="JETSHARD_MODELS_DIRS",
    default=None,
    help="more writable model directories, colon-separated, tried in order",
)
@click.option(
    "--models-read-only-dirs",
    envvar="JETSHARD_MODELS_READ_ONLY_DIRS",
    default=None,
    help="model directories searched but never written, colon-separated",
)
def up(
    nats_url: str | None,
    nats_port: int,
    host: str,
    port: int,
    state_dir: Path | None,
    offline: bool,
    model: str,
    no_model: bool,
    default_models_dir: str | None,
    models_dirs: str | None,
    models_read_only_dirs: str | None,
) -> None:
    """Start everything on this machine; Ctrl-C stops it all. Running it again keeps the history."""
    console = Console(highlight=False)
    signal.signal(signal.SIGTERM, _interrupt)
    root = state_dir or data_dir()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server: NatsServer | None = None
    if nats_url is None:
        server = start_nats_server(root / "nats", port=nats_port, log_file=logs / "nats-server.log")
        nats_url = server.url
    env = {**os.environ, "JETSHARD_NATS": nats_url}
    if offline:
        env["JETSHARD_OFFLINE"] = "1"
    for name, value in (
        ("JETSHARD_DEFAULT_MODELS_DIR", default_models_dir),
        ("JETSHARD_MODELS_DIRS", models_dirs),
        ("JETSHARD_MODELS_READ_ONLY_DIRS", models_read_only_dirs),
    ):
        if value is not None:
            env[name] = value
    extra = {"api": ["--host", host, "--port", str(port)]}
    children = {
        name: spawn([sys.executable, "-m", "jetshard", name, *extra.get(name, [])], logs / f"{name}.log", env)
        for name in SERVICES
    }
    api_url = f"http://{host}:{port}"
    try:
        _wait_healthy(api_url, children, logs)
        console.print(
            f"[bold green]jetshard is up[/]\n  API   {api_url}  (OpenAI base URL: {api_url}/v1)\n"
            f"  NATS  {nats_url}  (try: nats --server {nats_url} stream view JETSHARD_EVENTS)\n"
            f"  logs  {logs}"
        )
        if not no_model:
            place_and_wait(console, api_url, model, children)
        console.print("Press Ctrl-C to stop.")
        while True:
            for name, child in children.items():
                if child.poll() is not None:
                    raise click.ClickException(f"{name} exited with {child.returncode}; see {logs / name}.log")
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        for child in children.values():
            stop_group(child)
        if server is not None:
            server.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_healthy(api_url: str, children: dict, logs: Path, timeout_s: float = 120.0) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, child in children.items():
            if child.poll() is not None:
                raise click.ClickException(f"{name} exited with {child.returncode}; see {logs / name}.log")
        try:
            if httpx.get(f"{api_url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise click.ClickException(f"the API did not become healthy within {timeout_s:.0f} s; see {logs}")
