"""One rank of a real MLX ring joined through its rank tunnels (`jetshard_worker.rank_tunnels`), as a runner joins it:
`python ring_rank.py SPEC_JSON HOSTFILE`. Prints "listening" once its tunnels serve, then joins the ring, sums its
rank + 1 with the other ranks' and prints "sum N"."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import mlx.core as mx
import msgspec
from jetshard_worker.engines.mlx import init_ring
from jetshard_worker.rank_tunnels import open_ring_tunnels
from jetshard_worker.runner_spec import RunnerSpec


async def main() -> None:
    spec = msgspec.json.decode(sys.argv[1], type=RunnerSpec)
    tunnels = await open_ring_tunnels(spec, Path(sys.argv[2]))
    print("listening", flush=True)
    try:
        group = await asyncio.to_thread(init_ring, spec.plan.rank, Path(sys.argv[2]))
        tunnels.release_ring_port()
        total = mx.distributed.all_sum(mx.array([float(spec.plan.rank + 1)]), group=group)
        mx.eval(total)
        print(f"sum {int(total.item())}", flush=True)
    finally:
        await tunnels.close()


if __name__ == "__main__":
    asyncio.run(main())
