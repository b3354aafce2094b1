"""The flags of `jetshard up --lan`, and the layout of this machine's servers they make."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from jetshard.lan.discovery import lan_address
from jetshard.lan.membership import JoinToken, LanLayout, LanPorts, load_membership, resolve_membership
from jetshard.options import option, with_options
from jetshard.up.natsserver import Fsync, RouteTls

DEFAULT_ROUTE_PORT = 6222
DEFAULT_MONITOR_PORT = 8222


@dataclass(frozen=True)
class LanChoice:
    """What the user asked of `--lan`; `lan_layout` turns it into this machine's servers."""

    cluster: str | None
    token: JoinToken | None
    join: tuple[str, ...]
    address: str | None
    route_port: int
    monitor_port: int
    tls: RouteTls | None
    migrate: bool


def lan_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--lan` and its companions; passed on as `lan` (None without `--lan`)."""
    decorators = [
        option(
            "--lan",
            is_flag=True,
            help="join the machines of this network into one cluster: find them (mDNS), route NATS between them",
        ),
        option("--cluster", "cluster_name", default=None, help="name of the LAN cluster to create [default: jetshard]"),
        option("--join-token", default=None, help="join the cluster whose first machine printed this token"),
        option(
            "--join-token-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="read the join token from this file",
        ),
        option(
            "--join",
            "join_routes",
            multiple=True,
            help="HOST:PORT of a member's route port, where multicast does not reach it; repeat for several",
        ),
        option(
            "--migrate",
            is_flag=True,
            help="bring the history of this data dir's single-machine cluster into the new LAN cluster",
        ),
        option("--lan-address", default=None, help="this machine's address on the LAN [default: found]"),
        option(
            "--route-port", type=int, default=DEFAULT_ROUTE_PORT, show_default=True, help="NATS route port on the LAN"
        ),
        option(
            "--nats-monitor-port",
            type=int,
            default=DEFAULT_MONITOR_PORT,
            show_default=True,
            help="NATS monitoring port (loopback only; /routez, /jsz)",
        ),
        option("--route-tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None),
        option("--route-tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None),
        option(
            "--route-tls-ca",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="with --route-tls-cert and --route-tls-key: routes use TLS and verify peers against this CA",
        ),
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs["lan"] = _lan_choice(
            kwargs.pop("lan"),
            kwargs.pop("cluster_name"),
            kwargs.pop("join_token"),
            kwargs.pop("join_token_file"),
            kwargs.pop("join_routes"),
            kwargs.pop("lan_address"),
            kwargs.pop("migrate"),
            kwargs.pop("route_port"),
            kwargs.pop("nats_monitor_port"),
            (kwargs.pop("route_tls_cert"), kwargs.pop("route_tls_key"), kwargs.pop("route_tls_ca")),
        )
        return command(**kwargs)

    return with_options(wrapper, decorators)


def _lan_choice(
    lan: bool,
    cluster: str | None,
    token_text: str | None,
    token_file: Path | None,
    join: tuple[str, ...],
    address: str | None,
    migrate: bool,
    route_port: int,
    monitor_port: int,
    tls_files: tuple[Path | None, Path | None, Path | None],
) -> LanChoice | None:
    given = [
        name
        for name, value in (("--join-token", token_text or token_file), ("--join", join), ("--migrate", migrate))
        if value
    ]
    if not lan:
        if given or cluster:
            raise click.UsageError(f"{(given or ['--cluster'])[0]} needs --lan")
        return None
    if token_text and token_file:
        raise click.UsageError("give --join-token or --join-token-file, not both")
    text = token_file.read_text() if token_file else token_text
    try:
        token = JoinToken.parse(text) if text else None
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--join-token") from None
    for route in join:
        host, _, port = route.rpartition(":")
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise click.BadParameter(f"{route!r}: expected HOST:PORT", param_hint="--join")
    if any(tls_files) and not all(tls_files):
        raise click.UsageError("route TLS needs --route-tls-cert, --route-tls-key and --route-tls-ca together")
    cert, key, ca = tls_files
    tls = RouteTls(cert, key, ca) if cert and key and ca else None
    return LanChoice(cluster, token, join, address, route_port, monitor_port, tls, migrate)


def lan_layout(
    root: Path, choice: LanChoice, node_id: str, client_port: int, authorization: str, fsync: Fsync
) -> LanLayout:
    """This machine's membership (new at its first `--lan` start: `LanServers.start` saves it) and servers."""
    try:
        membership = resolve_membership(load_membership(root), choice.token, choice.cluster, node_id)
        address = lan_address(choice.address)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    standalone = root / "nats" / "jetstream"
    if standalone.exists() and load_membership(root) is None:
        if not choice.migrate or choice.token is not None:
            raise click.ClickException(
                f"{root} holds the history of a single-machine cluster (a plain `jetshard up`). To bring it into a new "
                "LAN cluster, start this machine first with `jetshard up --lan --migrate` (the old store is kept as a "
                "backup); to join another cluster, use another --data-dir"
            )
        # The clustered server's store takes this place; `migrate_pending` copies the history into it.
        pending_migration(root).parent.mkdir(parents=True, exist_ok=True)
        standalone.rename(pending_migration(root))
    return LanLayout(
        root=root,
        membership=membership,
        address=address,
        ports=LanPorts(client=client_port, route=choice.route_port, monitor=choice.monitor_port),
        authorization=authorization,
        tls=choice.tls,
        fsync=fsync,
    )


def pending_migration(root: Path) -> Path:
    """Where a single-machine cluster's store waits, moved aside, to be copied into the LAN cluster."""
    return root / "nats-standalone" / "jetstream"
