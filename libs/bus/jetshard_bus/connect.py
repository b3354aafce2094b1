"""Connecting to NATS and declaring what jetshard needs there."""

from __future__ import annotations

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings, declare


async def connect(options: NatsOptions, name: str, timings: BusTimings = BusTimings()) -> tuple[Client, JetStreamContext]:
    """Connect as `name` (shown by `nats server report connections`) and declare streams and buckets."""
    kwargs = options.connect_kwargs()
    kwargs["name"] = name
    client = await nats.connect(**kwargs)
    js = client.jetstream(publish_async_max_pending=20_000)
    await declare(js, timings, replicas=options.replicas)
    return client, js
