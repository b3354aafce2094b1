"""Run one rank of a jetshard pipeline for tests and benchmarks.

    python engine_rank.py --model-dir D --start S --end E --out OUT.json \
        [--rank R --hostfile H.json] [--requests REQ.json] [--prefill-step-size N] [--dtype float32] [--tensor]
        [--kv-bits 8] [--draft ngram|MODEL_DIR]

Every rank writes OUT.json with the tensor names it loaded; the last rank also serves the
requests in REQ.json (a list of GenerationRequest fields plus an optional "cancel_after": cancel
the task once it has produced that many tokens; a vision prompt's "images" name a .npz file of its
image arrays), records what came back, then shuts the ring down.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from jetshard_schema.types import TaskOutcome
from jetshard_worker.engines.mlx import (
    Drafter,
    DraftModel,
    GenerationRequest,
    PipelineEngine,
    PromptLookup,
    Shard,
    TokenScores,
    init_ring,
    load_shard,
)
from mlx.utils import tree_flatten

SCRIPT = Path(__file__)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (all held at once, so no two are the same)."""
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def rank_command(
    model_dir: Path,
    start: int,
    end: int,
    rank: int,
    out: Path,
    hostfile: Path | None = None,
    requests: Path | None = None,
    *extra: str,
) -> list[str]:
    """The command line that runs this script as rank `rank`, holding layers [start, end)."""
    cmd = [sys.executable, str(SCRIPT), "--model-dir", str(model_dir), "--start", str(start), "--end", str(end)]
    cmd += ["--rank", str(rank), "--out", str(out), *extra]
    if hostfile:
        cmd += ["--hostfile", str(hostfile)]
    if requests:
        cmd += ["--requests", str(requests)]
    return cmd


def drafter(draft: str, shard: Shard) -> Drafter:
    """`--draft`: prompt lookup, or the whole model in that directory drafting for `shard`'s."""
    if draft == "ngram":
        return PromptLookup()
    return DraftModel(load_shard(Path(draft), 0, None), shard.config.get("vocab_size"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--hostfile", type=Path)
    parser.add_argument("--requests", type=Path)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="hold the weights as this")
    parser.add_argument("--tensor", action="store_true", help="split every layer across the hostfile's ranks")
    parser.add_argument("--kv-bits", type=int, choices=(8, 4), help="store the KV cache quantized to this many bits")
    parser.add_argument("--draft", help="on the leader, draft by prompt lookup (ngram) or with this model directory")
    parser.add_argument("--idle-before", type=float, default=0.0, help="seconds to idle before submitting")
    args = parser.parse_args()

    progress: list[tuple[int, int]] = []
    # A tensor-parallel rank needs the ring to know its slice; a pipeline rank loads first, as a runner does.
    group = init_ring(args.rank, args.hostfile) if args.hostfile and args.tensor else None
    shard = load_shard(
        args.model_dir,
        args.start,
        args.end,
        on_progress=lambda d, t: progress.append((d, t)),
        dtype=getattr(mx, args.dtype) if args.dtype else None,
        tensor_group=group,
    )
    if args.hostfile and not args.tensor:
        group = init_ring(args.rank, args.hostfile)

    results: dict[str, dict[str, Any]] = {}
    done = threading.Event()
    specs: list[dict[str, Any]] = json.loads(args.requests.read_text()) if args.requests else []
    cancel_after = {s["task_id"]: s.pop("cancel_after") for s in specs if "cancel_after" in s}

    def on_token(task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None) -> None:
        entry = results.setdefault(task_id, {"tokens": [], "times": []})
        entry["tokens"].append(token)
        if scores is not None:
            entry.setdefault("logprobs", []).append([scores.logprob, scores.top])
        entry["times"].append(time.perf_counter())
        if cancel_after.get(task_id) == index + 1:
            engine.cancel(task_id)

    def on_finished(task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        entry = results.setdefault(task_id, {"tokens": [], "times": []})
        entry.update(finish=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        if all("finish" in results.get(s["task_id"], {}) for s in specs):
            done.set()

    engine = PipelineEngine(
        shard,
        group,
        on_token=on_token,
        on_finished=on_finished,
        prefill_step_size=args.prefill_step_size,
        kv_bits=args.kv_bits,
        drafter=drafter(args.draft, shard) if args.draft and (group is None or args.rank == group.size() - 1) else None,
    )
    if engine.is_leader:
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                engine.run_forever()
            except BaseException as exc:
                errors.append(exc)
                raise

        thread = threading.Thread(target=serve, name="engine")
        thread.start()
        try:
            time.sleep(args.idle_before)  # deliberate timing: the engine idles before the first request
            for spec in specs:
                if "images" in spec:
                    with np.load(spec["images"]) as arrays:
                        spec["images"] = dict(arrays)
                engine.submit(GenerationRequest(**spec))
            while specs and not done.wait(0.2) and thread.is_alive():
                pass
        finally:  # a bad request must end the process, not leave it waiting on the engine's thread
            engine.shutdown()
            thread.join()
        if errors:
            sys.exit(f"engine failed: {errors[0]}")
    else:
        engine.run_forever()

    for entry in results.values():
        times = entry.pop("times")
        # Decode rate between the first and the last token: excludes prefill and process start.
        entry["decode_tps"] = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    args.out.write_text(
        json.dumps(
            {
                "rank": args.rank,
                "loaded_tensors": sorted(shard.loaded_tensors),
                "weights_dtype": shard.weights_dtype,
                "arrived_dtypes": sorted(engine.stats.arrived_dtypes),
                "tensor_rank": shard.tensor_rank,
                "parameter_bytes": sum(p.nbytes for _, p in tree_flatten(shard.model.parameters())),
                "progress": progress,
                "results": results,
                "max_rows": engine.stats.max_rows,
                "max_micro_batches": engine.stats.max_micro_batches,
                "drafted_tokens": engine.stats.drafted_tokens,
                "accepted_tokens": engine.stats.accepted_tokens,
                "prefix_hits": engine.stats.prefix_hits,
            }
        )
    )


if __name__ == "__main__":
    main()
