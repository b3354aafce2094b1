"""The downloader shell: reports this node's model directories and fetches what its shards need."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import config_dir, node_id_for
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_downloader.dirs import ModelDirs, directory_report
from jetshard_schema.commands import ReportNodeStorage
from jetshard_schema.types import ModelDirInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloaderConfig:
    nats: NatsOptions = NatsOptions()
    timings: BusTimings = BusTimings()
    config_dir: Path = field(default_factory=config_dir)
    model_dirs: ModelDirs = field(default_factory=ModelDirs.from_env)
    storage_interval_s: float = 10.0


async def run_downloader(config: DownloaderConfig, stop: asyncio.Event) -> None:
    node_id = node_id_for(config.config_dir)
    client, js = await connect(config.nats, f"jetshard-downloader {node_id}", config.timings)
    follower = StateFollower(js)
    await follower.start()
    log.info("downloader for node %s started; model dirs %s", node_id, config.model_dirs)
    try:
        while not stop.is_set():
            dirs = tuple(ModelDirInfo(path=str(d.path), read_only=d.read_only, free_bytes=d.free_bytes,
                                      total_bytes=d.total_bytes) for d in directory_report(config.model_dirs))
            try:
                await publish_command(js, ReportNodeStorage(node_id=node_id, model_dirs=dirs))
            except Exception as error:
                log.warning("storage report failed: %s", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), config.storage_interval_s)
    finally:
        await follower.stop()
        await client.drain()
