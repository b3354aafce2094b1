"""Direct mlx-lm, the anchor with no server at all: run as a subprocess by bench/compare.py, in the environment
jetshard's runners get (an LD_PRELOAD of a BLAS only works from a process's start).

    python bench/_direct_mlx.py JOB.json OUT.json

JOB: {"model_dir", "max_tokens", "cases": [[messages, ...] per round, ...] per stream count}. One stream runs
`stream_generate`; several run together through `BatchGenerator` (what `batch_generate` and mlx_lm.server use),
all inserted at once. OUT: per case, per round, per stream {start, chunks, tokens}, plus the BLAS and the dtype
of the loaded weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, stream_generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import blas_of


def encode(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def one(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        chunks.append(time.perf_counter())
        tokens = response.generation_tokens
    return {"start": start, "chunks": chunks, "tokens": tokens}


def batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], max_tokens=max_tokens)
    start = time.perf_counter()
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    out = {uid: {"start": start, "chunks": [], "tokens": 0} for uid in uids}
    while responses := generator.next_generated():
        now = time.perf_counter()
        for response in responses:
            if response.finish_reason != "stop":  # an end-of-sequence token is not output
                out[response.uid]["chunks"].append(now)
                out[response.uid]["tokens"] += 1
    generator.close()
    return [out[uid] for uid in uids]


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    model, tokenizer = load(job["model_dir"])
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    encoded = [[[encode(tokenizer, m) for m in round_] for round_ in case] for case in job["cases"]]
    one(model, tokenizer, encoded[0][0][0], 4)  # warm-up, not counted
    results = []
    for case in encoded:
        rounds = []
        for prompts in case:
            if len(prompts) == 1:
                rounds.append([one(model, tokenizer, prompts[0], job["max_tokens"])])
            else:
                rounds.append(batch(model, tokenizer, prompts, job["max_tokens"]))
        results.append(rounds)
    mx.clear_cache()
    with open(sys.argv[2], "w") as file:
        json.dump({"results": results, "blas": blas_of(os.getpid()), "dtypes": dtypes}, file)


if __name__ == "__main__":
    main()
