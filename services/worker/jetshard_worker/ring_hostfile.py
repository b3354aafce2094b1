"""The ring backend's hostfile: each rank of an instance writes its own (`rank_tunnels`); a ring without tunnels
(the engine's own tests and benchmarks) shares one written here."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


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


def ring_listen_port(rank: int) -> int | None:
    """This rank's port in the ring hostfile named by MLX_HOSTFILE, if there is one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path or not Path(path).exists():
        return None
    addresses = json.loads(Path(path).read_text())
    if not 0 <= rank < len(addresses) or not addresses[rank]:
        return None
    return int(addresses[rank][0].rpartition(":")[2])
