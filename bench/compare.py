"""jetshard against mlx_lm.server and direct mlx-lm: same model, same weights, same fresh prompts, one run.

Three sides, one after the other (never two at once: this is meant for small machines too):
  1. jetshard, started by this bench with `jetshard up` in a temporary directory (offline, free ports);
  2. `mlx_lm.server` on a free port with its defaults (continuous batching on), pointed at the MLX directory
     jetshard converted/downloaded, with the library variables jetshard's runner got (read from its /proc
     environ: the same BLAS preload and threads, or the NVIDIA library directories);
  3. direct mlx-lm in a subprocess with that environment: `stream_generate` for one stream, `BatchGenerator`
     (what `batch_generate` and mlx_lm.server use) for several.
The two servers get every request through the official `openai` client, streaming, with explicit
`max_tokens` and `temperature`; tokens are counted from the usage each server sends last.

At 1 stream (`--rounds` prompts one after another) and at 8 concurrent streams: aggregate decode tok/s
(tokens after each stream's first ÷ time from the first first-token to the last token), TTFT p50/p95 and
inter-token (chunk) p95. Then, for each server, the README's request (16 tokens, greedy) answered whole, its
median latency idle and beside two `nice -n 19` CPU-bound loops (a user's machine is rarely idle; goal: busy
within 1.5x of idle). The last lines are jetshard's aggregate decode tok/s ÷ mlx_lm.server's, and each
server's busy ÷ idle latency.
Goals (issue 12): >= 2x at 1 stream and >= 10x at 8 on a Linux CPU; >= 0.97x and >= 1.05x on Apple silicon
or a GPU. This folds in the former bench/inference.py (jetshard vs in-process mlx-lm on one node); the
two-node pipeline figures moved to bench/concurrency.py.

    uv run --group dev python bench/compare.py                             # defaults: --max-tokens 64 --rounds 2
    uv run --group dev python bench/compare.py --max-tokens 8 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    DEMO,
    Figures,
    Messages,
    Stream,
    blas_of,
    concurrent_streams,
    describe_weights,
    figures,
    fresh_prompts,
    idle_and_busy_latency,
    instance_of,
    jetshard_up,
    machine_line,
    mlx_lm_server,
    mlx_only_env,
    model_directory,
    ms,
    rss_mib,
    runner_library_env,
    runner_pids,
    serving_of,
    table,
)

HERE = Path(__file__).resolve().parent
WIDE = 8
DEQ = ("--dequantize", "--dtype", "float32")


def run_server(url: str, model: str, cases: list[list[list[Messages]]], max_tokens: int, temperature: float):
    """Every case (a list of rounds, each a list of prompts sent at once) against one server."""
    warm = [{"role": "user", "content": "Say hello."}]
    asyncio.run(concurrent_streams(f"{url}/v1", model, [warm], 4, temperature))
    out = []
    for case in cases:
        out.append([asyncio.run(concurrent_streams(f"{url}/v1", model, r, max_tokens, temperature)) for r in case])
    return out


def run_direct(model_dir: Path, cases: list[list[list[Messages]]], max_tokens: int, root: Path, env: dict[str, str]):
    job, result = root / "direct-job.json", root / "direct-out.json"
    job.write_text(json.dumps({"model_dir": str(model_dir), "max_tokens": max_tokens, "cases": cases}))
    with open(root / "direct.log", "wb") as log:
        done = subprocess.run(
            [sys.executable, str(HERE / "_direct_mlx.py"), str(job), str(result)], env=env, stdout=log, stderr=log
        )
    if done.returncode != 0:
        raise RuntimeError(f"direct mlx-lm failed:\n{(root / 'direct.log').read_text()[-3000:]}")
    data = json.loads(result.read_text())
    runs = [[[Stream(**s) for s in round_] for round_ in case] for case in data["results"]]
    return runs, data["blas"], data["dtypes"]


def dequantized(model_dir: Path, root: Path, env: dict[str, str]) -> Path:
    """A float32 copy of `model_dir` for the mlx-lm sides (`mlx_lm convert --dequantize --dtype float32`)."""
    out = root / "mlx-float32"
    if not out.exists():
        subprocess.run(
            [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(model_dir), "--mlx-path", str(out), *DEQ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEMO, help="model id; offline, so it must be the demo or on disk")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens sent with every request")
    parser.add_argument("--temperature", type=float, default=0.0, help="temperature sent with every request")
    parser.add_argument("--rounds", type=int, default=2, help="prompts one after another at 1 stream")
    parser.add_argument("--wide-rounds", type=int, default=1, help="rounds of 8 concurrent streams")
    parser.add_argument(
        "--mlx-weights",
        choices=("native", "float32"),
        default="native",
        help="weights the mlx-lm sides load: the checkpoint as jetshard holds it on disk, or a float32 copy",
    )
    parser.add_argument("--no-direct", action="store_true", help="skip direct mlx-lm")
    parser.add_argument("--work-dir", type=Path, help="keep everything here (default: a temporary directory)")
    args = parser.parse_args()

    root = args.work_dir or Path(tempfile.mkdtemp(prefix="jetshard-compare-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(time.time_ns())
    cases = [
        [fresh_prompts(1, rng) for _ in range(args.rounds)],
        [fresh_prompts(WIDE, rng) for _ in range(args.wide_rounds)],
    ]
    print(machine_line())
    print(f"model: {args.model}; max_tokens {args.max_tokens}, temperature {args.temperature}; work dir {root}")
    started = time.monotonic()
    results: dict[str, list[list[list[Stream]]]] = {}
    notes: dict[str, str] = {}
    latency: dict[str, tuple[float, float]] = {}
    """Per server, the README request's median latency idle and busy, in seconds."""

    print("jetshard: starting `jetshard up`…", flush=True)
    # MLX against MLX: the demo is served from its MLX conversion, as mlx_lm.server serves it.
    with jetshard_up(root / "jetshard", args.model, env=mlx_only_env(root)) as (api, up):
        model_dir = model_directory(root / "jetshard" / "models", args.model)
        serving = serving_of(api, instance_of(api, args.model)["instance_id"])
        print(f"jetshard: ready, model directory {model_dir}", flush=True)
        results["jetshard"] = run_server(api, args.model, cases, args.max_tokens, args.temperature)
        latency["jetshard"] = idle_and_busy_latency(f"{api}/v1", args.model)
        runners = runner_pids(up.pid)
        if not runners:
            raise RuntimeError("no runner of jetshard's found: its environment is what the mlx-lm sides get")
        env = {**os.environ, **runner_library_env(runners[0])}
        notes["jetshard"] = (
            f"BLAS {', '.join(blas_of(p) for p in runners)}; weights setting "
            f"{serving.get('weights', 'not in State')!r} (max_batch {serving.get('max_batch', '?')}), runner RSS "
            f"{', '.join(f'{rss_mib(p):.0f} MiB' for p in runners)}; on disk: {describe_weights(model_dir)}"
        )

    mlx_dir = dequantized(model_dir, root, env) if args.mlx_weights == "float32" else model_dir
    preload = env.get("LD_PRELOAD", "")
    print(f"mlx_lm.server: starting on {mlx_dir} (LD_PRELOAD={preload or 'none'})…", flush=True)
    with mlx_lm_server(mlx_dir, env, root / "mlx_lm_server.log") as (url, server):
        results["mlx_lm.server"] = run_server(url, "default_model", cases, args.max_tokens, args.temperature)
        latency["mlx_lm.server"] = idle_and_busy_latency(f"{url}/v1", "default_model")
        notes["mlx_lm.server"] = f"BLAS {blas_of(server.pid)}; weights {describe_weights(mlx_dir)}"

    if not args.no_direct:
        print("direct mlx-lm: running…", flush=True)
        runs, blas, dtypes = run_direct(mlx_dir, cases, args.max_tokens, root, env)
        results["direct mlx-lm"] = runs
        notes["direct mlx-lm"] = f"BLAS {blas}; loaded parameter dtypes {', '.join(dtypes)}"

    measured: dict[tuple[str, int], Figures] = {}
    rows = []
    for side, runs_ in results.items():
        for case in runs_:
            f = figures(case)
            measured[side, f.streams] = f
            rows.append(
                [
                    side,
                    str(f.streams),
                    f"{f.decode_tok_s:.1f}",
                    ms(f.ttft_p50),
                    ms(f.ttft_p95),
                    ms(f.itl_p95),
                    str(f.tokens),
                ]
            )
    print()
    print(table(["side", "streams", "decode tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p95 ms", "tokens"], rows))
    print()
    for side, note in notes.items():
        print(f"{side}: {note}")
    if not args.work_dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"elapsed {time.monotonic() - started:.0f} s")
    for streams, label in ((1, "1 stream"), (WIDE, f"{WIDE} streams")):
        ours, theirs = measured["jetshard", streams], measured["mlx_lm.server", streams]
        ratio = ours.decode_tok_s / theirs.decode_tok_s if theirs.decode_tok_s else float("nan")
        print(f"ratio vs mlx_lm.server, {label}: {ratio:.2f}")
    for side, (idle, busy) in latency.items():
        print(f"busy/idle latency, README request, {side}: {busy / idle:.2f} ({idle:.2f} s idle, {busy:.2f} s busy)")


if __name__ == "__main__":
    main()
