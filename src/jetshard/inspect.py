"""`jetshard events` and `jetshard state`: read the cluster straight from JetStream."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import msgspec
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import subscribe_events
from jetshard_schema.codec import decode_event
from rich.console import Console


async def fetch_state(nats: NatsOptions) -> dict[str, Any]:
    client, js = await connect(nats, "jetshard state", wait_for_server=False, declare_streams=False)
    try:
        follower = StateFollower(js)
        await follower.start()
        await follower.stop()
        result: dict[str, Any] = msgspec.to_builtins(follower.state)
        return result
    finally:
        await client.close()


async def print_events(nats: NatsOptions, since: int | None) -> None:
    console = Console(highlight=False)
    client, js = await connect(nats, "jetshard events", wait_for_server=False, declare_streams=False)
    done = asyncio.Event()

    async def show(msg: Any) -> None:
        envelope = decode_event(msg.data)
        if envelope is None:
            return
        at = datetime.datetime.fromtimestamp(envelope.at_ms / 1000).strftime("%H:%M:%S.%f")[:-3]
        body = msgspec.to_builtins(envelope.event)
        kind = body.pop("type")
        details = " ".join(f"{k}={v}" for k, v in body.items() if v not in ("", None, [], {}))
        console.print(f"[dim]{msg.metadata.sequence.stream:>7} {at}[/] [bold]{kind}[/] {details}")

    await subscribe_events(js, show, since)
    try:
        await done.wait()
    finally:
        await client.close()
