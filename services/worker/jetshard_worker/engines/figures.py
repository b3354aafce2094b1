"""What the runner reports of an engine's work (`ServingCounters`, `RunnerStats`): one set of figures, which each
engine keeps up to date (MLX's `EngineStats` adds its own beside them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineFigures:
    tokens: int = 0  # tokens sampled (leader only)
    max_rows: int = 0  # the most tasks decoding at once
    prefix_hits: int = 0  # tasks whose prompt started from a saved prefix
    prefix_hit_tokens: int = 0  # prompt tokens those tasks did not prefill
    prefix_cache_entries: int = 0  # saved prefix caches
    prefix_cache_bytes: int = 0  # their size, for the whole model
    drafted_tokens: int = 0  # tokens drafted for the model to check
    accepted_tokens: int = 0  # of those, the ones it kept
    # How things stand now (leader only): rows in the current decode step, decoding or prefilling, waiting.
    batch_size: int = 0
    running_rows: int = 0
    queued_rows: int = 0
