"""The fast CPU path, measured: float32 matmul GFLOP/s and demo-model decode tok/s at batch 1 and 8, with the
reference BLAS of the mlx[cpu] wheel and with the BLAS a runner loads, for the 4-bit checkpoint and its float32
dequantization.

    .venv/bin/python bench/cpu_blas.py [--steps 32] [--blas LIBRARY ...]

First `jetshard up` serves the demo on MLX (in a temporary directory, offline): the demo as jetshard converts it is
the 4-bit checkpoint, and its runner's library variables (LD_PRELOAD, the BLAS threads; read from /proc) say
which BLAS a runner loads. Each measurement then runs in a fresh process: without a preload for the reference,
with the runner's variables for the runner's BLAS, with LD_PRELOAD=LIBRARY (and the runner's threads) for each
other candidate named with --blas, so the BLAS is chosen before MLX loads, exactly as for a runner; a candidate
that fails here (SIGILL) is reported as such. Decode is mlx-lm's own model forward on a (B, 1) batch with a KV
cache (no jetshard engine), after a 16-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEMO, jetshard_up, mlx_only_env, model_directory, runner_library_env, runner_pids

BATCHES = (1, 8)


def gflops() -> float:
    import mlx.core as mx

    n = 1024
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def decode_tps(model_dir: str, batch: int, steps: int) -> float:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_dir)
    cache = make_prompt_cache(model)
    prompt = mx.broadcast_to(mx.arange(16)[None] + 100, (batch, 16))
    token = mx.argmax(model(prompt, cache=cache)[:, -1:], axis=-1)
    mx.eval(token)
    for _ in range(4):  # warm-up steps
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    return batch * steps / (time.perf_counter() - start)


def prepare(root: Path) -> tuple[Path, Path, dict[str, str]]:
    """The demo as jetshard converts it for MLX, mlx-lm's float32 dequantization of that, and the library
    variables jetshard's runner got."""
    from mlx_lm import convert

    with jetshard_up(root / "jetshard", DEMO, env=mlx_only_env(root)) as (_, up):
        runners = runner_pids(up.pid)
        if not runners:
            raise RuntimeError("no runner of jetshard's found: its environment says which BLAS a runner loads")
        library_env = runner_library_env(runners[0])
    quantized, dequantized = model_directory(root / "jetshard" / "models", DEMO), root / "float32"
    convert(str(quantized), str(dequantized), dequantize=True, dtype="float32")
    return quantized, dequantized, library_env


def measure_in_child(env: dict[str, str], what: list[str]) -> float:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *what], env=env, capture_output=True, text=True, check=True
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--blas", nargs="*", default=[], help="more libraries to measure (their paths)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        value = gflops() if kind == "gflops" else decode_tps(rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(value))
        return

    with tempfile.TemporaryDirectory(prefix="jetshard-cpu-blas-") as tmp:
        root = Path(tmp)
        quantized, dequantized, library_env = prepare(root)
        base = {k: v for k, v in os.environ.items() if k != "JETSHARD_BLAS"}
        threads = {k: v for k, v in library_env.items() if k.endswith("_NUM_THREADS")}
        print(f"machine: {os.cpu_count()} cores; runner's library variables: {library_env or 'none'}")
        envs = {"reference BLAS": base, "runner BLAS": {**base, **library_env}}
        for library in args.blas:
            if not Path(library).is_file():  # the loader would skip it silently, and measure the reference
                print(f"{library}: no such file, not measured")
                continue
            preload = ":".join(p for p in (library, base.get("LD_PRELOAD", "")) if p)
            envs[Path(library).name] = {**base, **threads, "LD_PRELOAD": preload}
        results: dict[str, float] = {}
        for name, env in envs.items():
            try:
                results[f"{name}: float32 matmul 1024 GFLOP/s"] = measure_in_child(env, ["gflops"])
            except subprocess.CalledProcessError as error:  # a library built for another processor: SIGILL
                print(f"{name}: fails here ({error}), not measured")
                continue
            for label, model_dir in (("4-bit", quantized), ("float32", dequantized)):
                for batch in BATCHES:
                    key = f"{name}: {label} decode tok/s at batch {batch}"
                    results[key] = measure_in_child(env, ["decode", str(model_dir), str(batch), str(args.steps)])
        for key, value in results.items():
            print(f"{key}: {value:.1f}")
        for batch in BATCHES:
            fast = results[f"runner BLAS: float32 decode tok/s at batch {batch}"]
            slow = results[f"reference BLAS: 4-bit decode tok/s at batch {batch}"]
            print(f"ratio float32 + runner BLAS vs 4-bit + reference BLAS, batch {batch}: {fast / slow:.2f}")


if __name__ == "__main__":
    main()
