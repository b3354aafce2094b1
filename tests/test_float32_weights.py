"""Float32 weights at load: a quantized checkpoint dequantized (and its 16-bit weights widened) by load_shard
serves exactly the tokens mlx-lm gives on the same weights dequantized by mlx-lm itself, both multiplying with
the BLAS a runner loads."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.engine_rank import rank_command
from helpers.tiny_models import make_tiny_model
from jetshard_worker.blas import runner_environment
from jetshard_worker.engines.mlx import load_shard
from mlx.utils import tree_flatten
from mlx_lm import convert, load

HELPERS = Path(__file__).parent / "helpers"
MAX_TOKENS = 20
NEAR_TIE = 1e-3
PROMPTS = ("hello world", "the quick brown fox jumps over the lazy dog", "a", "what is two plus two?")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-bit checkpoint with bfloat16 scales and norms, and mlx-lm's float32 dequantization of it (mlx-lm
    casts the scales to float32 first, so its dequantized weights are exact)."""
    root = tmp_path_factory.mktemp("float32-models")
    source = make_tiny_model(root / "source", arch="llama", num_layers=4, num_files=1)
    quantized, dequantized = root / "q4", root / "dequantized"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(source), str(quantized), quantize=True, q_group_size=32, q_bits=4, dtype="bfloat16")
        convert(str(quantized), str(dequantized), dequantize=True, dtype="float32")
    return quantized, dequantized


def test_load_shard_holds_mlx_lms_dequantized_weights(checkpoints: tuple[Path, Path]) -> None:
    quantized, dequantized = checkpoints
    native = load_shard(quantized, 0, 4)
    assert native.weights_dtype == "4-bit affine"

    shard = load_shard(quantized, 0, 4, dtype=mx.float32)
    assert shard.weights_dtype == "float32"
    modules = [m for _, m in shard.model.named_modules()]
    assert not any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for m in modules)
    ours = dict(tree_flatten(shard.model.parameters()))
    reference, _ = load(str(dequantized))
    theirs = dict(tree_flatten(reference.parameters()))
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert value.dtype == mx.float32, name
        assert ours[name].dtype == mx.float32, name
        assert mx.array_equal(ours[name], value).item(), name


def test_a_shard_of_the_middle_layers_dequantizes_only_what_it_holds(checkpoints: tuple[Path, Path]) -> None:
    quantized, _ = checkpoints
    shard = load_shard(quantized, 1, 3, dtype=mx.float32)
    assert shard.weights_dtype == "float32"
    assert "embed_tokens" not in shard.model.model and len(shard.layers) == 2


@pytest.mark.timeout(300)
def test_engine_on_float32_weights_equals_mlx_lm_with_the_runners_blas(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    quantized, dequantized = checkpoints
    # The suite switches the preload off for its other equality tests; this one wants the runner's default.
    env = runner_environment(2, {k: v for k, v in os.environ.items() if k != "JETSHARD_BLAS"})
    _, tokenizer = load(str(dequantized))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))

    greedy = [sys.executable, str(HELPERS / "mlx_lm_greedy.py"), str(dequantized), str(tmp_path / "prompts.json")]
    reference = subprocess.run(
        [*greedy, str(MAX_TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    expected = json.loads(reference.stdout)
    # OpenBLAS where the runner's environment preloads one that runs on this processor (tests/test_blas.py).
    assert expected["blas"] == ("openblas" if "LD_PRELOAD" in env else "reference")

    requests = [{"task_id": f"t{i}", "prompt_tokens": p, "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts)]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    out = tmp_path / "rank0.json"
    cmd = rank_command(quantized, 0, 4, 0, out, None, tmp_path / "requests.json", "--dtype", "float32")
    subprocess.run(cmd, env=env, capture_output=True, check=True, timeout=120)
    served = json.loads(out.read_text())
    assert served["weights_dtype"] == "float32"

    assert sum(len(o["tokens"]) for o in expected["outputs"]) >= MAX_TOKENS  # not a trivial comparison
    for i, want in enumerate(expected["outputs"]):
        got = served["results"][f"t{i}"]["tokens"]
        if got == want["tokens"]:
            continue
        pairs = zip(got, want["tokens"], strict=False)
        step = next((s for s, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want["tokens"])))
        margin = want["margins"][step]
        assert margin < NEAR_TIE, f"prompt {i} differs at step {step} with a top-2 logit margin of {margin}"
        print(f"prompt {i}: a near-tie at step {step} (top-2 margin {margin:.2e}) decided differently")
