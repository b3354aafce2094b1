"""Decode tokens/s of the shard engine with 1, 2 and 3 ranks against mlx-lm's generate_step.

    python tests/helpers/engine_bench.py [--hidden-size 64] [--num-layers 6] [--tokens 100]

Generates a model with tests/helpers/tiny_models.py, then times greedy decoding (EOS ignored)
between the first and the last token, so process start, loading and prefill are excluded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jetshard_worker.engines.mlx import write_hostfile

from helpers.engine_rank import free_ports, rank_command
from helpers.tiny_models import make_tiny_model


def direct_tps(model_dir: Path, prompt: list[int], tokens: int) -> float:
    model, _ = load(str(model_dir))
    times = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def engine_tps(model_dir: Path, num_layers: int, ranks: int, prompt: list[int], tokens: int, work: Path) -> float:
    work.mkdir(parents=True, exist_ok=True)
    cuts = [round(num_layers * r / ranks) for r in range(ranks + 1)]
    spec = [{"task_id": "bench", "prompt_tokens": prompt, "max_tokens": tokens, "eos_token_ids": []}]
    (work / "requests.json").write_text(json.dumps(spec))
    hostfile: Path | None = None
    if ranks > 1:
        hostfile = write_hostfile(work / "hosts.json", [f"127.0.0.1:{p}" for p in free_ports(ranks)])
    procs = []
    for rank, (start, end) in enumerate(itertools.pairwise(cuts)):
        last = rank == ranks - 1
        requests = work / "requests.json" if last else None
        cmd = rank_command(model_dir, start, end, rank, work / f"rank{rank}.json", hostfile, requests)
        procs.append(subprocess.Popen(cmd))
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"a rank failed with {proc.returncode}")
    result = json.loads((work / f"rank{ranks - 1}.json").read_text())["results"]["bench"]
    return float(result["decode_tps"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model", "llama", args.num_layers, min(3, args.num_layers), hidden_size=args.hidden_size
        )
        prompt = list(range(5, 37))
        rows = [("mlx_lm generate_step", direct_tps(model_dir, prompt, args.tokens))]
        for ranks in (1, 2, 3):
            tps = engine_tps(model_dir, args.num_layers, ranks, prompt, args.tokens, Path(tmp) / f"r{ranks}")
            rows.append((f"engine, {ranks} rank(s)", tps))
    print(f"llama, hidden {args.hidden_size}, {args.num_layers} layers, {args.tokens} tokens")
    for name, tps in rows:
        print(f"  {name:24s} {tps:8.1f} tok/s  ({tps / rows[0][1]:.2f}x mlx_lm)")


if __name__ == "__main__":
    main()
