"""Publishing commands. `Nats-Msg-Id` is the command id, so a retried publish is stored once."""

from __future__ import annotations

from jetshard_schema.codec import encode
from jetshard_schema.commands import Command
from jetshard_schema.ids import CommandId, new_command_id
from jetshard_schema.subjects import MSG_ID_HEADER
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind

from jetshard_bus.tracing import inject, span


async def publish_command(
    js: JetStreamContext, command: Command, command_id: CommandId | None = None, timeout_s: float = 5.0
) -> tuple[CommandId, int]:
    """Store `command` in JETSHARD_COMMANDS; returns its id and stream sequence."""
    command_id = command_id or new_command_id()
    with span(f"command {type(command).__name__}", SpanKind.PRODUCER) as publishing:
        if publishing is not None:
            publishing.set_attributes(
                {
                    "messaging.system": "nats",
                    "messaging.destination.name": command.subject,
                    "jetshard.command_id": command_id,
                }
            )
        ack = await js.publish(
            command.subject, encode(command), timeout=timeout_s, headers=inject({MSG_ID_HEADER: command_id})
        )
        if publishing is not None:
            publishing.set_attribute("jetshard.command_seq", ack.seq)
    return command_id, ack.seq
