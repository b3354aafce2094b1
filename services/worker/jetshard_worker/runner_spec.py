"""What the worker hands a runner process on its command line: the worker builds it without loading the
engine or mlx-lm, which only the runner process needs."""

from __future__ import annotations

import msgspec
from jetshard_bus.options import NatsOptions
from jetshard_schema.cards import GenerationDefaults
from jetshard_schema.ids import NodeId
from jetshard_schema.placement import LLAMA_CPP_SLOT_CONTEXT

from jetshard_worker.planning import RunnerPlan


class PeerIdentityFiles(msgspec.Struct, frozen=True):
    certificate_path: str
    key_path: str
    """Readable by its owner only."""


class RunnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsOptions
    plan: RunnerPlan
    """Which rank of which instance generation, its layers and files, and how the instance serves."""
    node_id: NodeId
    worker_session: str
    hostfile: str | None = None
    """Where an MLX rank of several writes its own ring hostfile, in the worker's scratch directory."""
    ring_socket_fd: int | None = None
    """A socket bound to the port of this rank's endpoint, inherited from the worker, which bound it before it reported
    the port: open until the ring's own listener binds the port too, so nothing else can take it meanwhile."""
    identity: PeerIdentityFiles | None = None
    """The worker session's certificate and key, which the rank presents on the tunnels to the instance's other
    ranks (`jetshard_worker.peer_tunnel`)."""
    card_generation: GenerationDefaults = GenerationDefaults()
    """The model card's sampling defaults; the model directory's generation_config.json overrides them."""
    context_per_slot: int = LLAMA_CPP_SLOT_CONTEXT
    """On llama.cpp: the context each of the instance's slots holds (prompt and answer), as placement counted
    its KV cache (`jetshard_schema.placement.llama_cpp_slot_context`)."""
