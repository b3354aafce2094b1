"""Noticing a client that leaves while its request waits (for placement, a queue, a prefill, the whole answer).

Once a request's body is read, the next ASGI `receive()` returns only when the client disconnects (or the
response is complete). Racing that against the work lets a route stop generation at once instead of
finishing an answer nobody reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from litestar.types import Receive

from jetshard_api.errors import ApiError

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client left; never seen by that client, but visible in logs."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (its clean-up cancels the task) and raise
    ApiError(499)."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        await stopped(working)
    if working.cancelled():
        raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the request", "client_closed_request")
    return working.result()


async def stopped(task: asyncio.Future[Any]) -> None:
    """Cancel `task` until it is done. Cancelled again and again: Python 3.11's wait_for (awaiting the next
    chunk) loses a cancellation that lands as the awaited chunk arrives, and chunks keep arriving."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
