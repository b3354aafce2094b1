"""Running a service: uvloop where available, logging, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable

from jetshard_bus.tracing import configure_tracing, shutdown_tracing

SHUTDOWN_TIMEOUT_S = 3.0
"""A stop that takes longer than this is stuck (a drain or reconnect towards a NATS server that is gone)."""
STUCK_SHUTDOWN_EXIT_STATUS = 3

log = logging.getLogger(__name__)


def configure_logging(service: str) -> None:
    level = os.environ.get("JETSHARD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {service:<10} %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)


def _exit_if_still_running(service: str) -> None:
    log.error("%s did not stop within %.0f s of being asked to; exiting now", service, SHUTDOWN_TIMEOUT_S)
    logging.shutdown()
    os._exit(STUCK_SHUTDOWN_EXIT_STATUS)


def run_service(service: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; SIGINT/SIGTERM set `stop` so it can shut down in order.

    The shutdown is bounded: `SHUTDOWN_TIMEOUT_S` after the first signal the process exits whatever it is
    waiting for. The deadline runs on a thread of its own, so it holds even when the event loop is blocked.
    Spans still buffered are exported once `main` returns.
    """
    configure_logging(service)
    configure_tracing(service)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = threading.Timer(SHUTDOWN_TIMEOUT_S, _exit_if_still_running, (service,))
        deadline.daemon = True

        def on_signal() -> None:
            if not stop.is_set():
                stop.set()
                deadline.start()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await main(stop)
        finally:
            shutdown_tracing()
        log.info("%s stopped", service)

    try:
        import uvloop
    except ImportError:  # uvloop does not exist on Windows; the default loop works, only slower
        asyncio.run(runner())
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(runner())
