"""Publishing a service's figures (`jetshard_schema.stats`) on core NATS every few seconds."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from jetshard_schema.codec import encode
from jetshard_schema.stats import Stats, stats_subject

log = logging.getLogger(__name__)

STATS_INTERVAL_ENV = "JETSHARD_STATS_INTERVAL_S"
DEFAULT_STATS_INTERVAL_S = 2.0


def interval_s(name: str, default: float, environ: Mapping[str, str] = os.environ) -> float:
    """The interval the environment variable `name` sets, in seconds (`default` where unset)."""
    value = float(environ.get(name) or default)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    return value


def stats_interval_s(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between two publishes of a service's stats: `JETSHARD_STATS_INTERVAL_S`, default 2."""
    return interval_s(STATS_INTERVAL_ENV, DEFAULT_STATS_INTERVAL_S, environ)


async def publish_stats(client: Any, figures: Callable[[float], Stats], interval_s: float | None = None) -> None:
    """Publish `figures(interval_s)` now and then every `interval_s` (default: `stats_interval_s()`) until
    cancelled. Figures are not worth a retry: a publish that fails is logged and the next one comes."""
    interval = stats_interval_s() if interval_s is None else interval_s
    while True:
        try:
            stats = figures(interval)
            await client.publish(stats_subject(stats), encode(stats))
        except Exception as error:  # NATS away for a moment
            log.warning("stats not published: %s", error)
        await asyncio.sleep(interval)
