"""`jetshard events` and `jetshard state`: read the cluster straight from JetStream."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from typing import Any

import msgspec
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import subscribe_events
from jetshard_schema.codec import decode_event
from jetshard_schema.state import State
from jetshard_schema.view import cluster_view, event_line
from rich.console import Console
from rich.markup import escape

from jetshard.status_cli import render


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
    Console(highlight=False).print(render(cluster_view(state)))
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
