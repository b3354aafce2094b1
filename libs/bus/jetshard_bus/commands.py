"""Publishing commands. `Nats-Msg-Id` is the command id, so a retried publish is stored once."""

from __future__ import annotations

from jetshard_schema.codec import encode
from jetshard_schema.commands import Command
from jetshard_schema.ids import CommandId, new_command_id
from jetshard_schema.subjects import MSG_ID_HEADER
from nats.js import JetStreamContext

from jetshard_bus.tracing import inject


async def publish_command(
    js: JetStreamContext, command: Command, command_id: CommandId | None = None, timeout_s: float = 5.0
) -> tuple[CommandId, int]:
    """Store `command` in JETSHARD_COMMANDS; returns its id and stream sequence."""
    command_id = command_id or new_command_id()
    ack = await js.publish(
        command.subject, encode(command), timeout=timeout_s, headers=inject({MSG_ID_HEADER: command_id})
    )
    return command_id, ack.seq
