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
from jetshard_schema.ids import new_id
from rich.console import Console

from jetshard.clusterfile import data_dir, remove_cluster_file, write_cluster_file
from jetshard.natsserver import start_nats_server
from jetshard.placing import place_and_wait
from jetshard.supervisor import STOP_SIGNALS, Supervisor, stop_signals_deferred

SERVICE_STOP_STAGES = {"sequencer": 2, "api": 0, "worker": 0, "downloader": 1}
"""Started in this order; stopped by stage: what serves users and runs models first, the sequencer after the
services whose last reports it must still sequence, NATS last."""
NATS_STOP_STAGE = 3
STOP_GRACE_S = (2.0, 1.0, 0.8, 0.8)
"""Per stop stage, between SIGTERM and SIGKILL: a whole stop takes under 5 s even when a service hangs."""


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
@click.option("--api-key", envvar="JETSHARD_API_KEY", default=None, help="require this key of API clients")
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="also answer API requests naming this Host (besides loopback names and --host's addresses)",
)
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
    api_key: str | None,
    allowed_hosts: tuple[str, ...],
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
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_on_signal)
    root = state_dir or data_dir()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(STOP_GRACE_S)
    api_url = f"http://{host}:{port}"
    worker_session = new_id()[:12]
    try:
        if nats_url is None:
            with stop_signals_deferred():
                server = start_nats_server(root / "nats", port=nats_port, log_file=logs / "nats-server.log")
                supervisor.adopt("nats-server", server.process, NATS_STOP_STAGE, logs / "nats-server.log")
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
        extra_args = {"api": ["--host", host, "--port", str(port), *(f"--allowed-host={h}" for h in allowed_hosts)]}
        # The key travels in the environment: a command line is visible to every user of the machine.
        extra_env = {"worker": {"JETSHARD_WORKER_SESSION": worker_session}, "api": {"JETSHARD_API_KEY": api_key or ""}}
        for name, stage in SERVICE_STOP_STAGES.items():
            supervisor.start(
                name,
                [sys.executable, "-m", "jetshard", name, *extra_args.get(name, [])],
                stage,
                logs / f"{name}.log",
                {**env, **extra_env.get(name, {})},
            )
        _wait_healthy(api_url, supervisor, logs)
        write_cluster_file(root, api_url, nats_url, api_key)
        console.print(
            f"[bold green]jetshard is up[/]\n  API   {api_url}  (OpenAI base URL: {api_url}/v1)\n"
            f"  NATS  {nats_url}  (try: nats --server {nats_url} stream view JETSHARD_EVENTS)\n"
            f"  logs  {logs}",
            soft_wrap=True,
        )
        if not no_model:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            place_and_wait(console, api_url, model, worker_session, lambda: supervisor.exited() is None, headers)
        console.print("Press Ctrl-C to stop.")
        while (exited := supervisor.exited()) is None:
            time.sleep(0.5)
        raise click.ClickException(f"{exited.name} exited with {exited.process.returncode}; see {exited.log_file}")
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        supervisor.stop()
        remove_cluster_file(root)
        console.print("stopped")


def _stop_on_signal(signum: int, frame: object) -> None:
    # The first signal starts the ordered stop; more (a terminal sends one to the whole foreground group,
    # `uv run` may forward another) must not interrupt it half-way.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _wait_healthy(api_url: str, supervisor: Supervisor, logs: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (exited := supervisor.exited()) is not None:
            raise click.ClickException(f"{exited.name} exited with {exited.process.returncode}; see {exited.log_file}")
        try:
            if httpx.get(f"{api_url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise click.ClickException(f"the API did not become healthy within {timeout_s:.0f} s; see {logs}")
