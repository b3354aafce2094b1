"""What the worker hands a runner process on its command line: the worker builds it without loading the
engine or mlx-lm, which only the runner process needs."""

from __future__ import annotations

import msgspec
from jetshard_bus.options import NatsOptions
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.ids import InstanceId, NodeId
from jetshard_schema.types import ServingSettings


class RunnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsOptions
    instance_id: InstanceId
    generation: int
    node_id: NodeId
    worker_session: str
    rank: int
    world_size: int
    model_dir: str
    start_layer: int
    end_layer: int
    hostfile: str | None = None
    serving: ServingSettings = ServingSettings()
    card_generation: GenerationDefaults = GenerationDefaults()
    """The model card's sampling defaults; the model directory's generation_config.json overrides them."""
