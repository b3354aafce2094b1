"""The API shell: connect, follow State, serve HTTP with uvicorn until stopped."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from jetshard_bus.connect import connect, disconnect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import keep_alive
from jetshard_bus.options import DEFAULT_API_PORT, NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.subjects import requester_key

from jetshard_api.app import create_app
from jetshard_api.cluster import Cluster
from jetshard_api.safety import HttpSafety
from jetshard_api.settings import InferenceSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiConfig:
    nats: NatsOptions = NatsOptions()
    timings: BusTimings = BusTimings()
    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    port_file: Path | None = None
    """Where to write the bound port (useful with `port=0`)."""
    inference: InferenceSettings = InferenceSettings()
    safety: HttpSafety = HttpSafety()


async def run_api(config: ApiConfig, stop: asyncio.Event) -> None:
    client, js = await connect(config.nats, "jetshard-api", config.timings, declare_streams=False)
    follower = StateFollower(js)
    await follower.start()
    cluster = Cluster(client, js, follower, config.inference.command_timeout_s, config.timings.liveness_ttl_s)
    await cluster.stats.subscribe(client)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cluster, config.inference, config.safety),
            host=config.host,
            port=config.port,
            log_level="warning",
            lifespan="on",
            # Open event streams (GET /events) never end by themselves; a stop must not wait for them.
            timeout_graceful_shutdown=1,
        )
    )
    try:
        # The session's liveness key lives as long as the server: if either ends, both do, and the sequencer
        # cancels the tasks of a session whose key is gone.
        async with asyncio.TaskGroup() as group:
            group.create_task(
                keep_alive(js, requester_key(cluster.session_id), cluster.session_id, cluster.liveness, stop)
            )
            serving = group.create_task(_serve(server, config, stop))
            await serving
            stop.set()
    finally:
        await cluster.close()
        await cluster.stats.close()
        await follower.stop()
        await disconnect(client)


async def _serve(server: uvicorn.Server, config: ApiConfig, stop: asyncio.Event) -> None:
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn offers no event for it)
        await asyncio.sleep(0.02)
    if serving.done():
        await serving
        return
    port = server.servers[0].sockets[0].getsockname()[1]
    if config.port_file:
        config.port_file.write_text(f"{port}\n")
    log.info("API listening on http://%s:%d", config.host, port)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    server.should_exit = True
    await serving
