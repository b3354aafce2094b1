"""Join the ring of ranks with mlx's ring backend over TCP."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx


def write_hostfile(path: Path, addresses: Sequence[str]) -> Path:
    """Write the ring backend's hostfile: one list of "ip:port" per rank, in rank order."""
    if len(addresses) < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {len(addresses)}")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"rank address must be 'ip:port', got {address!r}")
    path = Path(path)
    path.write_text(json.dumps([[address] for address in addresses]))
    return path


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


def ring_listen_port(rank: int) -> int | None:
    """This rank's port in the ring hostfile named by MLX_HOSTFILE, if there is one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path or not Path(path).exists():
        return None
    addresses = json.loads(Path(path).read_text())
    if not 0 <= rank < len(addresses) or not addresses[rank]:
        return None
    return int(addresses[rank][0].rpartition(":")[2])
