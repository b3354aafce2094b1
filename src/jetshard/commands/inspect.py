"""`jetshard events` and `jetshard state`: read the cluster straight from JetStream."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import time
from typing import Any

import click
import msgspec
from jetshard_bus.connect import NatsUnreachableError, connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.inbox import NotASeedError
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import MAX_EVENT_SEQ, StreamsMissingError, subscribe_events
from jetshard_schema.codec import decode_event
from jetshard_schema.state import State
from jetshard_schema.view import cluster_view, event_line
from rich.console import Console
from rich.markup import escape

from jetshard.commands.status import render
from jetshard.options import client_nats_options, option


async def fetch_state(nats: NatsOptions) -> State:
    client, js = await connect(nats, "jetshard state", wait_for_server=False, declare_streams=False)
    try:
        follower = StateFollower(js)
        await follower.start()
        await follower.stop()
        return follower.state
    finally:
        await client.close()


def print_state(state: State, as_json: bool) -> None:
    """The whole State as JSON, or the summary `jetshard status` shows, with the stream positions."""
    if as_json:
        json.dump(msgspec.to_builtins(state), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    Console(highlight=False).print(render(cluster_view(state, int(time.time() * 1000))))
    print(f"State at event {state.last_seq} (command {state.last_command_seq}); `--json` prints all of it")


async def print_events(nats: NatsOptions, since: int | None, as_json: bool) -> None:
    console = Console(highlight=False, soft_wrap=True)
    client, js = await connect(nats, "jetshard events", wait_for_server=False, declare_streams=False)

    async def show(msg: Any) -> None:
        seq = msg.metadata.sequence.stream
        if as_json:
            sys.stdout.write(json.dumps({"seq": seq, **json.loads(msg.data)}) + "\n")
            sys.stdout.flush()
            return
        envelope = decode_event(msg.data)
        if envelope is None:
            console.print(f"[dim]{seq:>7}[/] [red]an event this jetshard cannot read[/]")
            return
        line = event_line(seq, envelope)
        at = datetime.datetime.fromtimestamp(line.at_ms / 1000).strftime("%H:%M:%S.%f")[:-3]
        console.print(f"[dim]{seq:>7} {at}[/] [bold]{line.type}[/] {escape(line.gist)}")

    await subscribe_events(js, show, since)
    try:
        await asyncio.Event().wait()
    finally:
        await client.close()


@click.command()
@client_nats_options
@option(
    "--since",
    type=click.IntRange(0, MAX_EVENT_SEQ),
    default=None,
    help="first event sequence to show (default: only new events)",
)
@option("--json", "as_json", is_flag=True, help="print each event's whole envelope as a JSON line")
def events(nats: NatsOptions, since: int | None, as_json: bool) -> None:
    """Print the event stream live, one readable line per event."""
    run_one_shot(print_events(nats, since, as_json))


@click.command()
@client_nats_options
@option("--json", "as_json", is_flag=True, help="print the whole State as JSON")
def state(nats: NatsOptions, as_json: bool) -> None:
    """Summarise the cluster State, rebuilt here from the latest snapshot and the events after it."""
    state = run_one_shot(fetch_state(nats))
    if state is not None:
        print_state(state, as_json)


def run_one_shot(coroutine: Any) -> Any:
    """Run a one-shot tool's coroutine; Ctrl-C ends it quietly, an unreachable NATS or a file that is no nkey seed
    with one clear line."""
    try:
        return asyncio.run(coroutine)
    except KeyboardInterrupt:
        return None
    except (NatsUnreachableError, StreamsMissingError, NotASeedError) as error:
        raise click.ClickException(str(error)) from None
