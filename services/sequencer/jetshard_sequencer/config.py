"""How a sequencer runs, as `jetshard sequencer` sets it: a flag per field whose `msgspec.Meta` gives its help.
Kept apart from the service so that the command line reads it without loading the sequencer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.ids import new_id


@dataclass(frozen=True)
class SequencerConfig:
    nats: NatsOptions = NatsOptions()
    timings: BusTimings = BusTimings()
    snapshot_every: Annotated[int, msgspec.Meta(description="events between State snapshots")] = 1000
    batch_size: int = 256
    """Commands handled per round; their events are appended pipelined, then the commands acked."""
    sequencer_id: str = field(default_factory=lambda: f"seq-{new_id()[:8]}")
    max_restarts: int = 3
    failed_retention_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description="how long a failed instance stays listed (with why it failed) before it leaves State",
        ),
    ] = 900.0
    """So that people see why it failed; its history stays in the event stream."""
