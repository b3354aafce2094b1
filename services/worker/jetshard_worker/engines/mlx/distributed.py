"""Join the ring of ranks with mlx's ring backend over TCP."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx


def init_ring(rank: int, hostfile: Path) -> mx.distributed.Group:
    """Connect this process as `rank` of the ring described by `hostfile`; blocks until every
    neighbour is up. mlx keeps one global group per process, so call this once."""
    size = len(json.loads(Path(hostfile).read_text()))
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the hostfile's {size} ranks")
    # The ring backend reads its configuration from these variables only.
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != size or group.rank() != rank:
        raise RuntimeError(f"ring came up as rank {group.rank()} of {group.size()}, expected {rank} of {size}")
    return group
