"""A State replica: the latest snapshot plus the events after it, then every new event as it is stored.

Every service holds one. Besides `state`, it lets callers wait for the outcome of a command they
published (read-your-writes) and subscribe to events as they are applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from jetshard_schema import subjects
from jetshard_schema.codec import decode_event
from jetshard_schema.events import EventEnvelope
from jetshard_schema.ids import CommandId
from jetshard_schema.state import State, apply, skip
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from jetshard_bus.snapshots import load_snapshot
from jetshard_bus.streams import subscribe_events, while_unavailable
from jetshard_bus.tracing import continued

log = logging.getLogger(__name__)

Listener = Callable[[EventEnvelope, State, bool], Awaitable[None] | None]
"""Called with each applied event, the State after it, and whether the event is live (not a replay); the trace
context of the command that caused the event is current."""


class StateFollower:
    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.state = State()
        self._listeners: list[Listener] = []
        self._outcomes: dict[CommandId, tuple[asyncio.Future[list[EventEnvelope]], list[EventEnvelope]]] = {}
        self._conditions: list[tuple[Callable[[State], bool], asyncio.Future[State]]] = []
        self._subscription: Any = None
        self._live_from_seq = 0
        self.received_seq = 0
        """The last stream sequence seen, applied or still in `partial`."""
        self.partial: list[tuple[int, EventEnvelope]] = []
        """Stored events of a command whose remaining events are not stored yet (its writer died midway).
        They are applied only once the command is complete, so every replica sees a command whole."""

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    async def start(self, catch_up_timeout_s: float = 60.0) -> None:
        """Load the snapshot, replay what followed it, and return once caught up with the stream."""
        self.state = await while_unavailable(lambda: load_snapshot(self._js))
        self.received_seq = self.state.last_seq
        info = await while_unavailable(lambda: self._js.stream_info(subjects.EVENTS_STREAM))
        self._live_from_seq = info.state.last_seq + 1
        self._subscription = await while_unavailable(
            lambda: subscribe_events(self._js, self._on_message, self.state.last_seq + 1)
        )
        await self.wait_until(lambda _: self.received_seq >= info.state.last_seq, catch_up_timeout_s)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None
        for outcome, _ in self._outcomes.values():
            outcome.cancel()
        for _, condition in self._conditions:
            condition.cancel()

    async def _on_message(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.received_seq:
            return  # redelivered after an ordered-consumer reset
        self.received_seq = seq
        envelope = decode_event(msg.data)
        if envelope is None:
            await self._commit()
            self.state = skip(self.state, seq)
            self._check_conditions()
            return
        if self.partial and self.partial[0][1].command_id != envelope.command_id:
            log.warning("command %s ended after %d of its events", self.partial[0][1].command_id, len(self.partial))
            await self._commit()
        self.partial.append((seq, envelope))
        if envelope.index >= envelope.count - 1:
            # A command's events share the trace context of its handling: what listeners do continues it.
            with continued(msg.headers):
                await self._commit()
        self._check_conditions()

    async def _commit(self) -> None:
        batch, self.partial = self.partial, []
        for seq, envelope in batch:
            self.state = apply(self.state, envelope.event, seq, envelope.command_seq)
            live = seq >= self._live_from_seq
            for listener in self._listeners:
                try:
                    result = listener(envelope, self.state, live)
                    if result is not None:
                        await result
                except Exception:
                    log.exception("event listener failed on %s", type(envelope.event).__name__)
            self._resolve(envelope)

    def _resolve(self, envelope: EventEnvelope) -> None:
        pending = self._outcomes.get(envelope.command_id)
        if pending is not None:
            future, collected = pending
            collected.append(envelope)
            if envelope.index == envelope.count - 1:
                del self._outcomes[envelope.command_id]
                if not future.done():
                    future.set_result(collected)

    def _check_conditions(self) -> None:
        if self._conditions:
            still_waiting = []
            for predicate, future in self._conditions:
                if future.done():
                    continue
                if predicate(self.state):
                    future.set_result(self.state)
                else:
                    still_waiting.append((predicate, future))
            self._conditions = still_waiting

    def expect(self, command_id: CommandId) -> asyncio.Future[list[EventEnvelope]]:
        """A future of the events of `command_id`, resolved once all are applied. Call before publishing."""
        future: asyncio.Future[list[EventEnvelope]] = asyncio.get_running_loop().create_future()
        self._outcomes[command_id] = (future, [])
        return future

    def forget(self, command_id: CommandId) -> None:
        self._outcomes.pop(command_id, None)

    async def wait_until(self, predicate: Callable[[State], bool], timeout_s: float) -> State:
        """Wait until `predicate(state)` holds; raises TimeoutError."""
        if predicate(self.state):
            return self.state
        future: asyncio.Future[State] = asyncio.get_running_loop().create_future()
        self._conditions.append((predicate, future))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            future.cancel()
