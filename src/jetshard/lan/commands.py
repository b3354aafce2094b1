"""`jetshard lan ls|forget`: the servers of this machine's LAN cluster (`jetshard up --lan`), and removing one
that left for good from the JetStream meta group, so the group's majority counts only machines that exist."""

from __future__ import annotations

import asyncio
import json

import click
import nats
from jetshard_bus.options import NatsOptions
from rich.table import Table

from jetshard.clusterfile import data_dir, recorded
from jetshard.lan.jetstream import MetaGroup, meta_group, remove_peer
from jetshard.options import COMMAND_CONTEXT, checked_name, json_option
from jetshard.output import console


@click.group("lan", context_settings=COMMAND_CONTEXT)
def lan() -> None:
    """The machines of this LAN cluster, as this machine's `jetshard up --lan` sees them."""


def _system_options() -> NatsOptions:
    seed, url = data_dir() / "creds" / "system.nk", recorded("nats")
    if url is None or not seed.exists():
        raise click.ClickException(
            "no `jetshard up --lan` runs here: run this on a machine of the cluster, as the user who started it"
        )
    return NatsOptions(servers=(url,), nkey_file=str(seed))


def _group() -> MetaGroup:
    try:
        return asyncio.run(meta_group(_system_options()))
    except (OSError, nats.errors.Error) as error:
        raise click.ClickException(f"cannot reach this machine's nats-server ({error})") from None


@lan.command("ls")
@json_option
def ls(as_json: bool) -> None:
    """Every server of the JetStream meta group, its leader, and which are in touch (`--json`: as JSON)."""
    group = _group()
    if not group.known:  # a nats-server of its own knows no meta group
        raise click.ClickException("this machine's nats-server is in no LAN cluster: `jetshard up` runs without --lan")
    rows = [{"server": s, "leader": s == group.leader, "current": s in group.current} for s in sorted(group.known)]
    if as_json:
        click.echo(json.dumps(rows))
        return
    table = Table(title="servers", title_justify="left")
    for column in ("server", "role", "state"):
        table.add_column(column)
    for server in sorted(group.known):
        table.add_row(
            server, "leader" if server == group.leader else "", "current" if server in group.current else "away"
        )
    console().print(table)


@lan.command("forget")
@click.argument("server", callback=checked_name)
def forget(server: str) -> None:
    """Remove SERVER, a machine that left the cluster for good, from the meta group (refused while it is in
    touch). Its streams' replicas move to the servers left."""
    group = _group()
    if server not in group.known:
        raise click.ClickException(f"{server} is not in the meta group (`jetshard lan ls` lists it)")
    if server in group.current:
        raise click.ClickException(f"{server} is in touch with the cluster: stop its `jetshard up` first")
    answer = asyncio.run(remove_peer(_system_options(), server))
    if not answer.get("success"):
        raise click.ClickException(f"JetStream kept {server}: {answer.get('error')}")
    console().print(f"{server} is no longer a member")
