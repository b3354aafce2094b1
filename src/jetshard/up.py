"""`jetshard up`: the whole cluster on this machine — embedded NATS plus the four services."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import click
import httpx
from jetshard_bus.auth import ADMIN, SYSTEM, VIEWER, Identity, cluster_identities, server_authorization
from jetshard_bus.connect import connect
from jetshard_bus.migrate import MigrationError, migrate_standalone_store
from jetshard_bus.natsserver import DATA_TAG, Fsync, NatsServerError, start_nats_server
from jetshard_bus.node import config_dir, node_id_for
from jetshard_bus.options import DEFAULT_API_PORT, NatsOptions
from jetshard_bus.procs import spawn
from jetshard_schema.catalogue import DEMO_MODEL_ID
from jetshard_schema.ids import new_id
from jetshard_schema.types import ServingSettings
from rich.console import Console
from rich.progress import Progress

from jetshard.clusterfile import data_dir, remove_cluster_file, write_cluster_file
from jetshard.discovery import Discovery
from jetshard.lan_options import LanChoice, lan_layout, lan_options, pending_migration
from jetshard.lan_up import LanServers, this_machine
from jetshard.options import model_dir_options, option, serving_args, serving_options
from jetshard.placing import place_and_wait
from jetshard.supervisor import STOP_SIGNALS, Supervisor

SERVICE_STOP_STAGES = {"sequencer": 2, "api": 0, "worker": 0, "downloader": 1}
"""Started in this order; stopped by stage: what serves users and runs models first, the sequencer after the
services whose last reports it must still sequence, NATS last."""
NATS_STOP_STAGE = 3
STOP_GRACE_S = (2.0, 1.0, 0.8, 0.8)
"""Per stop stage, between SIGTERM and SIGKILL: a whole stop takes under 5 s even when a service hangs."""


@click.command()
@option(
    "--nats",
    "nats_url",
    default=None,
    help="join this NATS server instead of starting the embedded one",
)
@option(
    "--nats-port",
    type=int,
    default=4222,
    show_default=True,
    help="port of the embedded NATS server (loopback only)",
)
@option(
    "--fsync",
    type=click.Choice(Fsync, case_sensitive=False),
    default=Fsync.ALWAYS.value,
    show_default=True,
    help="when the NATS servers `up` starts put JetStream's writes on disk: `always` before acknowledging them "
    "(an acknowledged write survives a power loss), `interval` every two minutes (faster; an OS crash or a power "
    "loss loses what was acknowledged since)",
)
@option("--host", default=None, help="API address [default: 127.0.0.1; with --lan every interface]")
@option("--port", type=int, default=DEFAULT_API_PORT, show_default=True, help="API port")
@option("--api-key", default=None, help="require this key of API clients")
@option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="also answer API requests naming this Host (besides loopback names and --host's addresses)",
)
@option(
    "--data-dir",
    "state_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="where NATS keeps the cluster's history and services their logs",
)
@option("--offline", is_flag=True, help="make no network call at all")
@option(
    "--model",
    default=DEMO_MODEL_ID,
    show_default=True,
    help="model to place once the cluster is up",
)
@option("--no-model", is_flag=True, help="place no model")
@lan_options
@serving_options
@model_dir_options
def up(
    nats_url: str | None,
    nats_port: int,
    fsync: Fsync,
    host: str | None,
    port: int,
    api_key: str | None,
    allowed_hosts: tuple[str, ...],
    state_dir: Path | None,
    offline: bool,
    model: str,
    no_model: bool,
    lan: LanChoice | None,
    serving: ServingSettings,
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
    supervisor = Supervisor(STOP_GRACE_S, report=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
    host = host or ("0.0.0.0" if lan else "127.0.0.1")
    api_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    lan_servers: LanServers | None = None
    discovery: Discovery | None = None
    # Each start of the worker is a session of its own: a restarted worker must not pass for its predecessor,
    # whose runners died with it.
    worker_sessions: list[str] = []
    try:
        identities: dict[str, Identity] = {}
        if nats_url is None and lan is not None:
            node_id = node_id_for(config_dir())
            identities = cluster_identities(root / "creds", node_id)
            authorization = server_authorization(list(identities.values()))
            layout = lan_layout(root, lan, node_id, nats_port, authorization, fsync)
            discovery = Discovery(this_machine(layout, node_id, port))
            discovery.start()
            lan_servers = LanServers(
                layout,
                discovery,
                lan.join,
                supervisor,
                logs,
                identities[ADMIN].seed_file,
                identities[SYSTEM].seed_file,
                lambda line: console.print(line, soft_wrap=True),
                NATS_STOP_STAGE,
            )
            lan_servers.start()
            nats_url = lan_servers.nats_url
            admin = NatsOptions(servers=(nats_url,), nkey_file=str(identities[ADMIN].seed_file), placement_tag=DATA_TAG)
            _migrate_pending(console, root, admin)
            asyncio.run(_declare_streams(admin))
            lan_servers.ensure_replicas()
        elif nats_url is None:
            identities = cluster_identities(root / "creds", node_id_for(config_dir()))
            authorization = server_authorization(list(identities.values()))
            server_url: list[str] = []

            def start_nats() -> subprocess.Popen[bytes]:
                # Same port, store and users on every restart: services reconnect to it and find their history.
                server = start_nats_server(
                    root / "nats",
                    port=nats_port,
                    log_file=logs / "nats-server.log",
                    authorization=authorization,
                    fsync=fsync,
                )
                server_url[:] = [server.url]
                return server.process

            supervisor.start("nats-server", start_nats, NATS_STOP_STAGE, logs / "nats-server.log")
            nats_url = server_url[0]
            asyncio.run(_declare_streams(NatsOptions(servers=(nats_url,), nkey_file=str(identities[ADMIN].seed_file))))
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
        extra_args = {
            "api": [
                *("--host", host, "--port", str(port)),
                *(f"--allowed-host={h}" for h in allowed_hosts),
                *serving_args(serving),
            ],
            # Runners of one model on several machines reach each other on the address the LAN sees.
            "worker": ["--advertise-host", lan_servers.layout.address] if lan_servers else [],
        }

        def starter(name: str) -> Callable[[], subprocess.Popen[bytes]]:
            args = [sys.executable, "-m", "jetshard", name, *extra_args.get(name, [])]
            log_file = logs / f"{name}.log"
            service_env = {**env, "JETSHARD_NATS_NKEY": str(identities[name].seed_file)} if identities else env
            if name == "api":
                # The key travels in the environment: a command line is visible to every user of the machine.
                service_env = {**service_env, "JETSHARD_API_KEY": api_key or ""}

            def start() -> subprocess.Popen[bytes]:
                if name != "worker":
                    return spawn(args, log_file, service_env)
                worker_sessions.append(new_id()[:12])
                return spawn(args, log_file, {**service_env, "JETSHARD_WORKER_SESSION": worker_sessions[-1]})

            return start

        for name, stage in SERVICE_STOP_STAGES.items():
            supervisor.start(name, starter(name), stage, logs / f"{name}.log")
        _wait_healthy(api_url, supervisor, logs)
        write_cluster_file(root, api_url, nats_url, identities[VIEWER].seed_file if identities else None, api_key)
        shown_url = _without_userinfo(nats_url)
        nats_cli = f"nats --server {shown_url}"
        if identities:
            nats_cli += f" --nkey {identities[ADMIN].seed_file}"
        console.print(
            f"[bold green]jetshard is up[/]\n  API   {api_url}  (OpenAI base URL: {api_url}/v1)\n"
            f"  NATS  {shown_url}  (as admin: {nats_cli} stream view JETSHARD_EVENTS)\n"
            f"  logs  {logs}",
            soft_wrap=True,
        )

        if lan_servers is not None:
            _print_lan(console, lan_servers, host, port, api_key)

        def tend() -> bool:
            supervisor.tend()
            if lan_servers is not None:
                lan_servers.tend()
            return True

        if not no_model:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            place_and_wait(console, api_url, model, lambda: worker_sessions[-1], tend, headers)
        console.print("Press Ctrl-C to stop.")
        while tend():
            time.sleep(0.2)
    except NatsServerError as error:
        raise click.ClickException(f"{error} (see {logs / 'nats-server.log'})") from None
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if discovery is not None:
            discovery.stop()
        supervisor.stop()
        remove_cluster_file(root)
        console.print("stopped")


async def _declare_streams(options: NatsOptions) -> None:
    """Declare as admin before any service starts: only the admin and the sequencer may. Its own server is up;
    a JetStream cluster may still be electing its stream leaders, which the declare waits out."""
    client, _ = await connect(options, "jetshard up")
    await client.close()


def _migrate_pending(console: Console, root: Path, admin: NatsOptions) -> None:
    """Copy a single-machine cluster's history (`up --lan --migrate`) before any service writes."""
    store = pending_migration(root)
    if not store.exists():
        return
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("moving the single-machine cluster's history into the LAN cluster", total=None)
            report = migrate_standalone_store(
                store,
                admin,
                progress=lambda copied, total: progress.update(task, completed=copied, total=total),
                log_file=root / "logs" / "nats-migration.log",
            )
    except MigrationError as error:
        raise click.ClickException(f"could not move the history ({error}); it is still in {store}") from None
    if report is not None:
        console.print(f"moved {report.events} events; the old store is kept in {report.backup_dir}")


def _print_lan(console: Console, lan_servers: LanServers, host: str, port: int, api_key: str | None) -> None:
    membership = lan_servers.membership
    layout = lan_servers.layout
    console.print(
        f"  LAN   cluster {membership.cluster!r}, this machine {membership.server_name} at {layout.address} "
        f"(routes on port {layout.ports.route})\n"
        f"  Add a machine: [bold]jetshard up --lan --join-token {membership.token}[/]",
        soft_wrap=True,
    )
    if host in ("0.0.0.0", "::") and not api_key:
        console.print(
            f"[yellow]The API on http://{layout.address}:{port} answers anyone on this network: set --api-key "
            "(or JETSHARD_API_KEY) to require a key.[/]",
            soft_wrap=True,
        )


def _without_userinfo(url: str) -> str:
    """The URL to show: a user name or password in it stays off the screen."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


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
