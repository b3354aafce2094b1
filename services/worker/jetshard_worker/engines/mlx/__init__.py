"""MLX shard engine: generation over a ring of processes, each holding a layer range (a pipeline) or its slice of
every layer (tensor parallelism)."""

from jetshard_worker.ring_hostfile import write_hostfile

from .distributed import init_ring
from .drafting import Drafter, DraftModel, PromptLookup
from .engine import EngineStats, GenerationRequest, PipelineEngine, TokenScores
from .shard import Shard, eos_token_ids, load_shard

__all__ = [
    "DraftModel",
    "Drafter",
    "EngineStats",
    "GenerationRequest",
    "PipelineEngine",
    "PromptLookup",
    "Shard",
    "TokenScores",
    "eos_token_ids",
    "init_ring",
    "load_shard",
    "write_hostfile",
]
