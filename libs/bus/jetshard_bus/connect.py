"""Connecting to NATS and declaring what jetshard needs there."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings, declare, wait_for_streams, while_unavailable

log = logging.getLogger(__name__)


class NatsUnreachableError(ConnectionError):
    pass


async def connect(
    options: NatsOptions,
    name: str,
    timings: BusTimings = BusTimings(),
    wait_for_server: bool = True,
    declare_streams: bool = True,
) -> tuple[Client, JetStreamContext]:
    """Connect as `name` (shown by `nats server report connections`); declare streams and buckets, or, for an
    identity that may not (`declare_streams=False`), wait until they exist.

    Services wait for a server (and streams) that are not up yet (`wait_for_server`); one-shot tools fail at
    once with NatsUnreachableError saying which servers were tried (or StreamsMissingError).
    """
    last_error: list[str] = []

    async def on_error(error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        if wait_for_server and (not last_error or last_error[-1] != message):  # a line per new problem
            log.warning("NATS %s: %s", ", ".join(options.servers), message)
        last_error[:] = [message]

    kwargs = options.connect_kwargs()
    kwargs.update(name=name, error_cb=on_error)
    if not wait_for_server:
        kwargs["max_reconnect_attempts"] = 1
    try:
        client = await nats.connect(**kwargs)
    except Exception as error:
        raise NatsUnreachableError(
            f"cannot reach NATS at {', '.join(options.servers)} ({last_error[-1] if last_error else error}); "
            "is `jetshard up` (or nats-server) running?"
        ) from error
    js = client.jetstream(publish_async_max_pending=20_000)

    async def prepare() -> None:
        if declare_streams:
            await declare(js, timings, replicas=options.replicas, placement_tag=options.placement_tag)
        else:
            await wait_for_streams(js, wait=wait_for_server)

    try:
        await (while_unavailable(prepare) if wait_for_server else prepare())
    except BaseException:
        await client.close()
        raise
    return client, js


async def disconnect(client: Client) -> None:
    """Drain the connection (what is in flight is sent, subscriptions finish what they hold), as a stopping service
    does; close it without draining where the server is gone (a killed `jetshard up`): there is nothing to send
    to, and a stopping service must not end in a traceback."""
    try:
        await client.drain()
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError, TimeoutError) as error:
        log.info("NATS connection closed without draining (%s)", type(error).__name__)
        await client.close()
