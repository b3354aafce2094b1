"""How a worker runs, as `jetshard worker` sets it: a flag per field whose `msgspec.Meta` gives its help. Kept apart
from the service so that the command line reads it without loading the worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from jetshard_bus.node import config_dir
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.ids import new_id

from jetshard_worker.engines.llamacpp.build import CpuVariants

GiB = Annotated[float, msgspec.Meta(gt=0)]


@dataclass(frozen=True)
class WorkerConfig:
    nats: NatsOptions = NatsOptions()
    timings: BusTimings = BusTimings()
    config_dir: Path = field(default_factory=config_dir)
    card_dir: Path | None = None
    """Where custom cards are persisted; default `<config dir>/cards`."""
    profile_interval_s: float = 5.0
    advertise_host: Annotated[
        str | None,
        msgspec.Meta(
            description="address other nodes reach this node's runners on [default: the address used to reach NATS]"
        ),
    ] = None
    runner_start_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="a runner that has not loaded and joined its peers within this time is killed and reported"
        ),
    ] = 300.0
    session_id: str = field(default_factory=lambda: new_id()[:12])
    """This start of the worker; runners and liveness carry it, so State tells them from a previous life's."""
    build_llama_cpp: Annotated[
        bool,
        msgspec.Meta(
            description="without a ready llama.cpp build on this machine, compile one in the background (nice'd; MLX "
            "serves meanwhile), as `jetshard engines build llama.cpp` does"
        ),
    ] = True
    llama_cpp_cpu_variants: Annotated[
        CpuVariants,
        msgspec.Meta(
            description="the CPU variants of the llama.cpp the worker builds (as `jetshard engines build llama.cpp "
            "--cpu-variants`)"
        ),
    ] = CpuVariants.ALL
    memory_limit_gib: Annotated[
        GiB | None,
        msgspec.Meta(
            description="lend models at most this much of the machine's memory (its runners' use counts against it; "
            "the rest of the machine's does not) [default: what the machine has available]; `jetshard up` passes the "
            "environment variable on"
        ),
    ] = None

    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit_gib is None else int(self.memory_limit_gib * 2**30)
