"""Runner supervision (filled in by the inference work): starts, watches and stops shard runners."""

from __future__ import annotations

from nats.js import JetStreamContext

from jetshard_bus.options import NatsOptions
from jetshard_schema.ids import NodeId
from jetshard_schema.state import State


class RunnerSupervisor:
    def __init__(self, js: JetStreamContext, node_id: NodeId, session_id: str, nats: NatsOptions,
                 start_timeout_s: float) -> None:
        self._js = js
        self.node_id = node_id
        self.session_id = session_id
        self._nats = nats
        self._start_timeout_s = start_timeout_s

    async def start(self, state: State) -> None:
        self.on_state(state)

    def on_state(self, state: State) -> None:
        pass

    async def shutdown(self) -> None:
        pass
