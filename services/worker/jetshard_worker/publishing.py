"""Publishing a report until JetStream stores it: a report lost to a moment without NATS (a server restarting, a
stream electing its leader) would leave State wrong for good, a task running for ever or a dead runner READY."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from jetshard_bus.commands import publish_command
from jetshard_schema.commands import Command
from jetshard_schema.ids import new_command_id
from nats.js import JetStreamContext

log = logging.getLogger(__name__)

NATS_ERRORS = (nats.errors.Error, TimeoutError)
"""What a publish raises while NATS or JetStream cannot store it; worth another try."""
FIRST_RETRY_S = 0.1
LAST_RETRY_S = 5.0


def retry_delay_s(attempt: int) -> float:
    """Seconds before retry number `attempt` (0 first): doubling from FIRST_RETRY_S, at most LAST_RETRY_S."""
    return min(LAST_RETRY_S, FIRST_RETRY_S * 2**attempt)


async def publish_until_stored(js: JetStreamContext, command: Command) -> None:
    """Publish `command` until it is stored. Every try carries the same command id, so a try whose ack was lost
    after JetStream stored it is stored once."""
    command_id = new_command_id()
    attempt = 0
    while True:
        try:
            await publish_command(js, command, command_id)
            return
        except NATS_ERRORS as error:
            delay = retry_delay_s(attempt)
            log.warning("%s not stored (%s); trying again in %.1f s", type(command).__name__, error, delay)
            await asyncio.sleep(delay)
            attempt += 1
