"""Running a service: uvloop where available, logging, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from jetshard_bus.tracing import configure_tracing


def configure_logging(service: str) -> None:
    level = os.environ.get("JETSHARD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {service:<10} %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)


def run_service(service: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; SIGINT/SIGTERM set `stop` so it can shut down in order."""
    configure_logging(service)
    configure_tracing(service)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop
    except ImportError:  # uvloop does not exist on Windows; the default loop works, only slower
        asyncio.run(runner())
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(runner())
