"""The NATS of `jetshard up`: the one it joins (`--nats`), its embedded server, or this machine's servers of a
LAN cluster (`--lan`); with the identities its services connect as and the streams declared for them."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import click
from jetshard_bus.connect import connect
from jetshard_bus.node import config_dir, node_id_for
from jetshard_bus.options import NatsOptions
from rich.console import Console
from rich.progress import Progress

from jetshard.lan.discovery import Discovery
from jetshard.lan.options import LanChoice, lan_layout, pending_migration
from jetshard.lan.servers import LanServers, this_machine
from jetshard.up.auth import ADMIN, SYSTEM, Identity, cluster_identities, server_authorization
from jetshard.up.migrate import MigrationError, migrate_standalone_store
from jetshard.up.natsserver import DATA_TAG, Fsync, start_nats_server
from jetshard.up.supervisor import Supervisor

NATS_STOP_STAGE = 3
"""NATS stops last, once every service that writes to it has stopped (`SERVICE_STOP_STAGES`)."""


@dataclass(frozen=True)
class UpNats:
    """The NATS `up`'s services join."""

    url: str
    identities: dict[str, Identity]
    """Each role's identity on the server `up` runs; none on a NATS it joins (`--nats`)."""
    lan_servers: LanServers | None = None


def start_nats(
    nats_url: str | None,
    nats_port: int,
    fsync: Fsync,
    lan: LanChoice | None,
    api_port: int,
    root: Path,
    store_lock_fd: int,
    supervisor: Supervisor,
    console: Console,
    stops: contextlib.ExitStack,
) -> UpNats:
    """The NATS at `nats_url`, else the servers `up` starts under `supervisor` on `root`'s store (each inherits
    `store_lock_fd`, `jetshard.up.lock`), their streams declared. What must stop before the servers do (the LAN
    announcement) is pushed onto `stops`."""
    if nats_url is not None:
        return UpNats(nats_url, {})
    node_id = node_id_for(config_dir())
    identities = cluster_identities(root / "creds", node_id)
    authorization = server_authorization(list(identities.values()))
    logs = root / "logs"
    if lan is None:
        url = _start_embedded(root, nats_port, authorization, fsync, store_lock_fd, supervisor)
        asyncio.run(_declare_streams(NatsOptions(servers=(url,), nkey_file=str(identities[ADMIN].seed_file))))
        return UpNats(url, identities)
    layout = lan_layout(root, lan, node_id, nats_port, authorization, fsync)
    discovery = Discovery(this_machine(layout, node_id, api_port))
    discovery.start()
    stops.callback(discovery.stop)
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
        store_lock_fd,
    )
    lan_servers.start()
    admin = NatsOptions(
        servers=(lan_servers.nats_url,), nkey_file=str(identities[ADMIN].seed_file), placement_tag=DATA_TAG
    )
    _migrate_pending(console, root, admin)
    asyncio.run(_declare_streams(admin))
    lan_servers.ensure_replicas()
    return UpNats(lan_servers.nats_url, identities, lan_servers)


def _start_embedded(
    root: Path, port: int, authorization: str, fsync: Fsync, store_lock_fd: int, supervisor: Supervisor
) -> str:
    """Start the single-machine nats-server; its URL."""
    log_file = root / "logs" / "nats-server.log"
    server_url: list[str] = []

    def start() -> subprocess.Popen[bytes]:
        # Same port, store and users on every restart: services reconnect to it and find their history.
        server = start_nats_server(
            root / "nats",
            port=port,
            log_file=log_file,
            authorization=authorization,
            fsync=fsync,
            store_lock_fd=store_lock_fd,
        )
        server_url[:] = [server.url]
        return server.process

    supervisor.start("nats-server", start, NATS_STOP_STAGE, log_file)
    return server_url[0]


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
