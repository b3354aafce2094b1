"""The MLX shard engine: layer-range loading and pipeline generation equal to mlx-lm.

Pipelines run as real processes joined by mlx's ring backend on 127.0.0.1, one per rank,
through tests/helpers/engine_rank.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from helpers.engine_rank import drafter, free_ports, rank_command
from helpers.tiny_models import layer_of, make_tiny_model
from helpers.tiny_vlm import make_tiny_vlm, mlx_vlm_greedy, png, quantized_vlm
from jetshard_downloader.convert import convert_packaged
from jetshard_downloader.dirs import ModelDirs
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.sampling import TokenSampling
from jetshard_schema.types import ChatMessage, TaskOutcome
from jetshard_worker.engines.mlx import (
    GenerationRequest,
    PipelineEngine,
    Shard,
    TokenScores,
    load_shard,
    write_hostfile,
)
from jetshard_worker.engines.mlx.shard import tensor_split_problem
from jetshard_worker.library_boundary import prompt_inputs, vision_processor
from jetshard_worker.text.chat import render_chat
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import QuantizedKVCache

MAX_TOKENS = 20
ARCHS = ("llama", "qwen3")
PROMPTS = (
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "<|im_start|>user\nwhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-models")
    return {arch: make_tiny_model(root / arch, arch=arch, num_layers=4, num_files=3) for arch in ARCHS}


def prompt_ids(model_dir: Path) -> list[list[int]]:
    _, tokenizer = mlx_load(str(model_dir))
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads 64 values wide, as most models' (the others' are 16): a quantized KV cache groups 32 or 64 of them."""
    return make_tiny_model(tmp_path_factory.mktemp("wide-heads"), hidden_size=256, num_files=1)


def reference(
    model_dir: Path, prompts: list[list[int]], prefill_step_size: int = 2048, kv_bits: int | None = None
) -> list[list[int]]:
    """mlx-lm's own greedy output: the tokens stream_generate yields, without a final EOS; with `kv_bits`, from its
    own `QuantizedKVCache` of that many bits, quantized from the first token on."""
    model, tokenizer = mlx_load(str(model_dir))
    outputs = []
    for prompt in prompts:
        cache = None if kv_bits is None else [QuantizedKVCache(group_size=64, bits=kv_bits) for _ in model.layers]
        tokens = []
        for response in stream_generate(
            model, tokenizer, prompt, max_tokens=MAX_TOKENS, prefill_step_size=prefill_step_size, prompt_cache=cache
        ):
            if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
                break
            tokens.append(response.token)
        outputs.append(tokens)
    return outputs


class Collector:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[TaskOutcome, int, int]] = {}
        self.scores: dict[str, list[TokenScores]] = {}
        self.embeddings: dict[str, list[float]] = {}
        self.done = threading.Condition()

    def on_token(
        self, task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None = None
    ) -> None:
        got = self.tokens.setdefault(task_id, [])
        assert index == len(got)
        got.append(token)
        if scores is not None:
            self.scores.setdefault(task_id, []).append(scores)

    def engine(self, shard: Shard, **settings: Any) -> PipelineEngine:
        """A one-rank engine on `shard` that reports its tokens and endings here."""
        return PipelineEngine(shard, on_token=self.on_token, on_finished=self.on_finished, **settings)

    def on_embedding(self, task_id: str, vector: list[float]) -> None:
        self.embeddings[task_id] = vector

    def on_finished(self, task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        with self.done:
            self.finished[task_id] = (reason, prompt_tokens, completion_tokens)
            self.done.notify_all()

    def wait(self, task_ids: list[str], timeout: float = 60) -> None:
        with self.done:
            assert self.done.wait_for(lambda: all(t in self.finished for t in task_ids), timeout)


def run_single(
    engine: PipelineEngine,
    requests: list[GenerationRequest],
    collector: Collector,
    submitted_later: tuple[str, ...] = (),
) -> None:
    """Serve `requests` (and the tasks `submitted_later` by callbacks) until all have finished."""
    thread = threading.Thread(target=engine.run_forever)
    thread.start()
    try:
        for request in requests:
            engine.submit(request)
        collector.wait([r.task_id for r in requests] + list(submitted_later))
    finally:
        engine.shutdown()
        thread.join(timeout=30)
    assert not thread.is_alive()


def launch_ranks(
    model_dir: Path,
    ranges: list[tuple[int, int]],
    requests: list[dict[str, Any]],
    work: Path,
    prefill_step_size: int = 2048,
    timeout: float = 100,
    rank_args: list[tuple[str, ...]] | None = None,
    tensor: bool = False,
) -> list[int]:
    """Run one process per rank (rank r holds layers [ranges[r][0], ranges[r][1]), or with `tensor` its slice of
    each of them), with `rank_args[r]` added to its command line; their exit codes."""
    ranks = len(ranges)
    work.mkdir(parents=True, exist_ok=True)
    hostfile = write_hostfile(work / "hosts.json", [f"127.0.0.1:{p}" for p in free_ports(ranks)])
    (work / "requests.json").write_text(json.dumps(requests))
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(ranks):
            log = open(work / f"rank{rank}.log", "wb")
            logs.append(log)
            start, end = ranges[rank]
            out = work / f"rank{rank}.json"
            requests_file = work / "requests.json" if rank == ranks - 1 else None
            extra = ("--prefill-step-size", str(prefill_step_size), *(["--tensor"] if tensor else []))
            extra += rank_args[rank] if rank_args else ()
            cmd = rank_command(model_dir, start, end, rank, out, hostfile, requests_file, *extra)
            # Own process group each, so teardown can kill a rank and anything it started.
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        codes = []
        for rank, proc in enumerate(procs):
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} did not finish in {timeout}s:\n{_logs(work, ranks)}")
        return codes
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()


def run_pipeline(
    model_dir: Path,
    bounds: list[int],
    requests: list[dict[str, Any]],
    work: Path,
    prefill_step_size: int = 2048,
    rank_args: list[tuple[str, ...]] | None = None,
) -> list[dict[str, Any]]:
    """Each rank's output (see engine_rank.py), after all ranks exited cleanly; rank r holds
    layers [bounds[r], bounds[r+1])."""
    ranges = list(itertools.pairwise(bounds))
    return _outputs(work, launch_ranks(model_dir, ranges, requests, work, prefill_step_size, rank_args=rank_args))


def run_tensor_parallel(
    model_dir: Path,
    ranks: int,
    requests: list[dict[str, Any]],
    work: Path,
    prefill_step_size: int = 2048,
    rank_args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Each rank's output (see engine_rank.py), after all ranks exited cleanly; every rank holds its slice of
    every layer of the model, and has `rank_args` added to its command line."""
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    ranges = [(0, num_layers)] * ranks
    codes = launch_ranks(
        model_dir, ranges, requests, work, prefill_step_size, rank_args=[rank_args] * ranks, tensor=True
    )
    return _outputs(work, codes)


def _outputs(work: Path, codes: list[int]) -> list[dict[str, Any]]:
    ranks = len(codes)
    assert codes == [0] * ranks, f"exit codes {codes}:\n{_logs(work, ranks)}"
    return [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _logs(work: Path, ranks: int) -> str:
    logs = [(work / f"rank{r}.log").read_text(errors="replace") for r in range(ranks)]
    return "\n".join(f"--- rank {r}\n{text}" for r, text in enumerate(logs))


def assert_within_range(loaded: list[str] | frozenset[str], start: int, end: int, num_layers: int) -> None:
    layers = {layer_of(name) for name in loaded} - {None}
    assert layers == set(range(start, end))
    others = {name for name in loaded if layer_of(name) is None}
    expected = set()
    if start == 0:
        expected.add("model.embed_tokens.weight")
    if end == num_layers:
        expected |= {"model.norm.weight", "lm_head.weight"}
    assert others == expected


# --------------------------------------------------------------------------- pipelines


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("arch", "bounds", "prefill_step_size", "kv_bits"),
    [
        ("llama", [0, 2, 4], 2048, None),
        ("qwen3", [0, 3, 4], 2048, None),
        # Small prefill chunks: the prompt crosses the ring in several PREFILL steps.
        ("llama", [0, 1, 3, 4], 3, None),
        ("qwen3", [0, 1, 2, 4], 3, None),
        # Each rank stores its layers' KV cache in 8 bits (`serving.kv_cache_type` q8_0).
        ("llama", [0, 2, 4], 2048, 8),
    ],
    ids=["llama-2ranks", "qwen3-2ranks", "llama-3ranks-chunked", "qwen3-3ranks-chunked", "llama-2ranks-kv8"],
)
def test_pipeline_greedy_equals_mlx_lm(
    models: dict[str, Path],
    wide_heads: Path,
    tmp_path: Path,
    arch: str,
    bounds: list[int],
    prefill_step_size: int,
    kv_bits: int | None,
) -> None:
    model_dir = models[arch] if kv_bits is None else wide_heads
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts, prefill_step_size, kv_bits)
    requests = [{"task_id": f"t{i}", "prompt_tokens": p, "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts)]
    kv_args = () if kv_bits is None else ("--kv-bits", str(kv_bits))

    outputs = run_pipeline(model_dir, bounds, requests, tmp_path, prefill_step_size, [kv_args] * (len(bounds) - 1))

    results = outputs[-1]["results"]
    assert outputs[-1]["max_rows"] > 1  # the requests decoded as one batch
    # ... split in one micro-batch per rank, all under way at once: no rank waits for another.
    assert outputs[-1]["max_micro_batches"] == len(bounds) - 1
    for i, tokens in enumerate(expected):
        got = results[f"t{i}"]
        assert got["tokens"] == tokens, f"prompt {i}"
        assert got["prompt_tokens"] == len(prompts[i])
        assert got["finish"] == ("length" if len(tokens) == MAX_TOKENS else "stop")
    for rank, output in enumerate(outputs):
        start, end = bounds[rank], bounds[rank + 1]
        assert_within_range(output["loaded_tensors"], start, end, num_layers=4)
        assert output["progress"][-1] == [end - start, end - start]


MIXED_DTYPE_TOLERANCE = 0.05
"""How far apart (in logits) the float32 model's top two tokens may be where a pipeline holding one rank in
bfloat16 picks the other: bfloat16 keeps 8 bits of mantissa, so its rank's hidden states and weights are
rounded to about 0.4 %."""


def top2_margins(model_dir: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each of `tokens`, how far the float32 model's best logit was above its second best when it chose it."""
    model, _ = mlx_load(str(model_dir))
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 :].astype(mx.float32)
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    return cast("list[float]", (top2[:, 1] - top2[:, 0]).tolist())[: len(tokens)]


@pytest.mark.timeout(180)
def test_ranks_holding_different_dtypes_each_compute_in_their_own(models: dict[str, Path], tmp_path: Path) -> None:
    """float32, bfloat16, float32 (a CPU with a fast BLAS, a GPU, a CPU): each rank sends its hidden states as it
    computed them and the next casts them to its own dtype, so the bfloat16 rank computes and caches in bfloat16
    and its bytes cross the wire as bfloat16. The output is the float32 model's, up to bfloat16 rounding: tokens
    agree up to the first whose float32 top-two margin is within MIXED_DTYPE_TOLERANCE."""
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts)
    requests = [{"task_id": f"t{i}", "prompt_tokens": p, "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts)]
    dtypes = [("--dtype", "float32"), ("--dtype", "bfloat16"), ("--dtype", "float32")]

    outputs = run_pipeline(model_dir, [0, 1, 3, 4], requests, tmp_path, rank_args=dtypes)

    assert [o["weights_dtype"] for o in outputs] == ["float32", "bfloat16", "float32"]
    assert [o["arrived_dtypes"] for o in outputs] == [[], ["float32"], ["bfloat16"]]
    agreed = 0
    for i, tokens in enumerate(expected):
        got = outputs[-1]["results"][f"t{i}"]["tokens"]
        same = next((n for n, (a, b) in enumerate(zip(got, tokens, strict=False)) if a != b), None)
        if same is None:
            assert len(got) == len(tokens), f"prompt {i}"
            agreed += len(tokens)
            continue
        margin = top2_margins(model_dir, prompts[i], tokens)[same]
        assert margin < MIXED_DTYPE_TOLERANCE, f"prompt {i} differs at token {same}, where float32's margin is {margin}"
        agreed += same
    assert agreed >= sum(map(len, expected)) // 2  # the rounding changed a near-tie, not the model


@pytest.mark.timeout(120)
def test_cancel_mid_generation_then_next_request_is_served(models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts[1:2])[0]
    requests = [
        {"task_id": "cancelled", "prompt_tokens": prompts[0], "max_tokens": MAX_TOKENS, "cancel_after": 3},
        {"task_id": "next", "prompt_tokens": prompts[1], "max_tokens": MAX_TOKENS},
    ]

    results = run_pipeline(model_dir, [0, 2, 4], requests, tmp_path)[-1]["results"]

    # The cancel, sent from the third token's callback, takes effect at the next decode step.
    assert len(results["cancelled"]["tokens"]) == 3
    assert results["cancelled"]["finish"] == "cancelled"
    assert results["cancelled"]["completion_tokens"] == 3
    assert results["next"]["tokens"] == expected
    assert results["next"]["finish"] in ("length", "stop")


@pytest.mark.timeout(120)
def test_ranges_that_do_not_tile_the_model_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    # Layer 1 is held by nobody: generating would not fail, it would produce garbage.
    requests = [{"task_id": "t", "prompt_tokens": [1, 2, 3], "max_tokens": 5}]
    codes = launch_ranks(models["llama"], [(0, 1), (2, 3), (3, 4)], requests, tmp_path, timeout=60)

    assert codes[:2] == [0, 0]  # the followers were stopped cleanly
    assert codes[2] != 0
    assert "rank 1 holds layers [2, 3), which does not continue" in (tmp_path / "rank2.log").read_text()


# --------------------------------------------------------------------------- tensor parallelism

NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def models_for_three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models with 6 attention heads and 3 key/value heads: they split over 3 ranks."""
    root = tmp_path_factory.mktemp("engine-models-3")
    return {
        arch: make_tiny_model(root / arch, arch=arch, num_layers=4, num_files=3, hidden_size=96, heads=(6, 3))
        for arch in ARCHS
    }


def solo_scored(model_dir: Path, prompts: list[list[int]], prefill_step_size: int = 2048) -> Collector:
    """Greedy output of the whole model on one rank, with each token's top two logprobs."""
    collector = Collector()
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    engine = collector.engine(load_shard(model_dir, 0, num_layers), prefill_step_size=prefill_step_size)
    run_single(
        engine, [GenerationRequest(f"t{i}", p, MAX_TOKENS, top_logprobs=2) for i, p in enumerate(prompts)], collector
    )
    return collector


def assert_as_solo(
    solo: Collector, results: dict[str, Any], prompts: list[list[int]], logprob_tolerance: float = 1e-4
) -> None:
    """Each prompt got the solo tokens, or the same up to a token where the solo top two were a near-tie (the
    text goes its own way after it); the agreed tokens' logprobs are the solo ones."""
    for i in range(len(prompts)):
        expected, got = solo.tokens.get(f"t{i}", []), results[f"t{i}"]
        differs = next((k for k, (a, b) in enumerate(zip(expected, got["tokens"], strict=False)) if a != b), None)
        if differs is None:
            assert got["tokens"] == expected, f"prompt {i}"
        else:
            (_, first), (_, second) = solo.scores[f"t{i}"][differs].top
            assert first - second < NEAR_TIE, f"prompt {i} differs at token {differs}, no near-tie"
        agreed = len(expected) if differs is None else differs
        scores = solo.scores.get(f"t{i}", [])[:agreed]
        for score, (logprob, _) in zip(scores, got.get("logprobs", []), strict=False):
            assert logprob == pytest.approx(score.logprob, abs=logprob_tolerance)
        assert got["prompt_tokens"] == len(prompts[i])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("arch", "ranks", "prefill_step_size"),
    [
        ("llama", 2, 2048),
        # Small prefill chunks: each prompt goes in over several PREFILL steps, between decode steps.
        ("qwen3", 3, 3),
    ],
    ids=["llama-2ranks", "qwen3-3ranks-chunked"],
)
def test_tensor_parallel_greedy_equals_one_rank(
    models: dict[str, Path],
    models_for_three: dict[str, Path],
    tmp_path: Path,
    arch: str,
    ranks: int,
    prefill_step_size: int,
) -> None:
    """Every layer split across the ranks gives each prompt the tokens the whole model gives it on one rank, up to a
    near-tie: the ranks sum a layer's partial outputs in another order, which moves a logit by a rounding error."""
    model_dir = (models_for_three if ranks == 3 else models)[arch]
    prompts = prompt_ids(model_dir)
    solo = solo_scored(model_dir, prompts, prefill_step_size)
    requests = [
        {"task_id": f"t{i}", "prompt_tokens": p, "max_tokens": MAX_TOKENS, "top_logprobs": 2}
        for i, p in enumerate(prompts)
    ]

    outputs = run_tensor_parallel(model_dir, ranks, requests, tmp_path, prefill_step_size)

    assert outputs[-1]["max_rows"] > 1  # the requests decoded as one batch
    assert_as_solo(solo, outputs[-1]["results"], prompts)
    # Each rank holds its share of every layer's projections, and the rest (embedding, norms) whole; only the last,
    # which samples, holds the final norm and the head.
    parameters = tree_flatten(load_shard(model_dir, 0, 4).model.parameters())
    whole_bytes = sum(p.nbytes for _, p in parameters)
    projection_bytes = sum(p.nbytes for name, p in parameters if "_proj." in name)
    head_bytes = sum(p.nbytes for name, p in parameters if name.startswith(("lm_head.", "model.norm.")))
    for rank, output in enumerate(outputs):
        sampler = rank == ranks - 1
        assert output["tensor_rank"] == rank
        sliced_bytes = whole_bytes - projection_bytes + projection_bytes // ranks
        assert output["parameter_bytes"] == sliced_bytes - (0 if sampler else head_bytes)
        assert ("lm_head.weight" in output["loaded_tensors"]) == sampler


@pytest.mark.timeout(120)
def test_a_tensor_parallel_cancel_leaves_the_others_and_a_follow_up_starts_from_its_saved_prefix(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A task cancelled mid-generation ends there; a follow-up turn of a conversation prefilled beside it starts
    from the conversation's saved KV cache (each rank keeps its slice of it) and answers as on one rank."""
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    conversation = prompts[3] * 2  # long enough for the prefix index (16 tokens)
    expected = solo_scored(model_dir, [conversation, conversation + prompts[1]]).tokens
    requests = [
        {"task_id": "cancelled", "prompt_tokens": prompts[0], "max_tokens": MAX_TOKENS, "cancel_after": 3},
        {"task_id": "conversation", "prompt_tokens": conversation, "max_tokens": MAX_TOKENS},
        {"task_id": "follow-up", "prompt_tokens": conversation + prompts[1], "max_tokens": MAX_TOKENS},
    ]

    leader = run_tensor_parallel(model_dir, 2, requests, tmp_path)[-1]
    results = leader["results"]

    assert len(results["cancelled"]["tokens"]) == 3
    assert results["cancelled"]["finish"] == "cancelled"
    assert leader["prefix_hits"] == 1
    assert results["conversation"]["tokens"] == expected["t0"]
    assert results["follow-up"]["tokens"] == expected["t1"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M as the downloader converts it for MLX (30 layers; 4-bit layers, an 8-bit embedding)."""
    models = ModelDirs.from_options(tmp_path_factory.mktemp("demo") / "models")
    model_dir, _ = convert_packaged(builtin_cards()[DEMO_MODEL_ID], models)
    return model_dir


@pytest.fixture(scope="module")
def demo_draft(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft made for the tests: the demo's first 26 of 30 layers, its embedding and head (the same tokenizer; a
    layer-skipping draft, which agrees with its model often but not always: with fewer layers, seldom)."""
    draft = tmp_path_factory.mktemp("demo-draft")
    for path in demo.iterdir():
        (draft / path.name).symlink_to(path)
    (draft / "config.json").unlink()
    config = json.loads((demo / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 26}))
    return draft


CODE_EDIT = (
    "Repeat this code exactly, with `total` renamed to `result`:\n\n"
    "def add(a, b):\n    total = a + b\n    return total\n\n\n"
    "def subtract(a, b):\n    total = a - b\n    return total\n"
)
"""A prompt whose answer repeats much of it: prompt lookup's drafts are kept there."""


def chat_prompts(model_dir: Path, questions: list[str]) -> list[list[int]]:
    _, tokenizer = mlx_load(str(model_dir))
    chats = [[{"role": "user", "content": question}] for question in questions]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("drafting", ["ngram", "draft model"])
def test_drafting_answers_token_for_token_as_mlx_lm_without_it(demo: Path, demo_draft: Path, drafting: str) -> None:
    """`serving.draft` on MLX: rows propose tokens (those that followed their last ones earlier in the prompt or
    answer, or a smaller model's), the model checks them in one step, and the cache drops those it did not keep.
    A prompt that arrives while the first one drafts joins the batch between a checking step and the drop that
    follows it (which leaves the joined row as it is). Each greedy row's text is mlx-lm's for its prompt alone,
    without drafting; a seeded sampled row's is the engine's without drafting, token for token."""
    prompts = chat_prompts(demo, [CODE_EDIT, f"{CODE_EDIT}\nThen say done."])
    expected = reference(demo, prompts)
    collector = Collector()

    def on_token(task_id: str, token: int, index: int, *rest: Any) -> None:
        if (task_id, index) == ("t0", 8):  # on the engine's thread, as t0 drafts
            engine.submit(GenerationRequest("t1", prompts[1], MAX_TOKENS))
        collector.on_token(task_id, token, index, *rest)

    shard = load_shard(demo, 0, 30)
    engine = PipelineEngine(
        shard,
        on_token=on_token,
        on_finished=collector.on_finished,
        prefill_step_size=16,
        drafter=drafter("ngram" if drafting == "ngram" else str(demo_draft), shard),
    )
    sampled = GenerationRequest("sampled", prompts[0], 2 * MAX_TOKENS, TokenSampling(temperature=0.1), seed=7)

    run_single(engine, [GenerationRequest("t0", prompts[0], MAX_TOKENS), sampled], collector, submitted_later=("t1",))

    for i, tokens in enumerate(expected):
        assert collector.tokens.get(f"t{i}", []) == tokens, f"prompt {i}"
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    undrafted = Collector()
    plain = PipelineEngine(shard, on_token=undrafted.on_token, on_finished=undrafted.on_finished, prefill_step_size=16)
    run_single(plain, [sampled], undrafted)
    assert collector.tokens["sampled"] == undrafted.tokens["sampled"]
    # Alone, the sampled row drafts: some of its drafts are what it drew, and kept.
    alone = Collector()
    engine = PipelineEngine(shard, on_token=alone.on_token, on_finished=alone.on_finished, drafter=engine.drafter)
    run_single(engine, [sampled], alone)
    assert alone.tokens["sampled"] == undrafted.tokens["sampled"]
    assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens


@pytest.mark.timeout(300)
def test_a_pipeline_that_drafts_in_an_8_bit_cache_answers_as_mlx_lm_without_it(
    demo: Path, demo_draft: Path, tmp_path: Path
) -> None:
    """Two ranks, each dropping the drafted positions its layers' 8-bit caches did not keep (ROLLBACK steps), in
    step with the leader that chose them with the draft model it runs."""
    prompts = chat_prompts(demo, [CODE_EDIT, "What is the capital of France?"])
    expected = reference(demo, prompts, kv_bits=8)
    requests = [{"task_id": f"t{i}", "prompt_tokens": p, "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts)]
    drafting = ("--kv-bits", "8", "--draft", str(demo_draft))

    outputs = run_pipeline(demo, [0, 15, 30], requests, tmp_path, rank_args=[drafting, drafting])

    leader = outputs[-1]
    assert [leader["results"][f"t{i}"]["tokens"] for i in range(len(prompts))] == expected
    assert 0 < leader["accepted_tokens"] < leader["drafted_tokens"]


@pytest.mark.timeout(300)
def test_tensor_ranks_that_draft_answer_as_mlx_lm_without_drafting(demo: Path, tmp_path: Path) -> None:
    """Three tensor ranks check drafts together, and each drops what the leader did not keep (ROLLBACK), as it
    runs every step with the others: the answer is mlx-lm's without drafting."""
    prompts = chat_prompts(demo, [CODE_EDIT])
    requests = [{"task_id": "t0", "prompt_tokens": prompts[0], "max_tokens": MAX_TOKENS}]

    leader = run_tensor_parallel(demo, 3, requests, tmp_path, rank_args=("--draft", "ngram"))[-1]

    assert leader["results"]["t0"]["tokens"] == reference(demo, prompts)[0]
    assert 0 < leader["accepted_tokens"] < leader["drafted_tokens"]


@pytest.mark.timeout(300)
def test_the_quantized_demo_model_over_three_tensor_ranks_answers_as_on_one(demo: Path, tmp_path: Path) -> None:
    """SmolLM2-135M (9 attention heads, 3 key/value heads; 4-bit layers, an 8-bit embedding) split over 3 ranks:
    mlx's quantized sharded linears."""
    model_dir = demo
    _, tokenizer = mlx_load(str(model_dir))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tokenizer.apply_chat_template(question, add_generation_prompt=True)]
    solo = solo_scored(model_dir, prompts)
    requests = [{"task_id": "t0", "prompt_tokens": prompts[0], "max_tokens": MAX_TOKENS, "top_logprobs": 2}]

    outputs = run_tensor_parallel(model_dir, 3, requests, tmp_path / "ranks")

    assert tokenizer.decode(solo.tokens["t0"]).startswith("The capital of France is Paris")
    # Computed in 16 bits: the logprobs agree to a 16-bit rounding error.
    assert_as_solo(solo, outputs[-1]["results"], prompts, logprob_tolerance=2e-2)
    assert [output["weights_dtype"] for output in outputs] == ["4-bit affine, 8-bit affine"] * 3


def test_a_model_splits_across_tensor_ranks_only_when_its_heads_divide(models: dict[str, Path]) -> None:
    config = json.loads((models["llama"] / "config.json").read_text())  # 4 heads, 2 key/value heads
    assert tensor_split_problem(config, 2) is None
    assert tensor_split_problem(config, 3) == (
        "the model's 4 attention heads and 2 key/value heads do not both divide by 3 tensor-parallel ranks"
    )
    gemma = {"model_type": "gemma", "num_attention_heads": 8, "num_key_value_heads": 1}
    assert tensor_split_problem(gemma, 2) == "mlx-lm cannot split 'gemma' models across tensor-parallel ranks"


# --------------------------------------------------------------------------- single process


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("prefill_step_size", [2048, 2])
def test_single_rank_greedy_equals_mlx_lm(models: dict[str, Path], arch: str, prefill_step_size: int) -> None:
    model_dir = models[arch]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts, prefill_step_size)
    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4), prefill_step_size=prefill_step_size)
    requests = [GenerationRequest(f"t{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]

    run_single(engine, requests, collector)

    # The prompts were prefilled together (padded to the longest), and decoded as one batch: each row's text is
    # still the one mlx-lm gives that prompt alone.
    assert engine.stats.max_prefill_rows > 1
    assert engine.stats.max_rows > 1
    for i, tokens in enumerate(expected):
        assert collector.tokens.get(f"t{i}", []) == tokens, f"prompt {i}"
        reason, prompt_tokens, completion_tokens = collector.finished[f"t{i}"]
        assert prompt_tokens == len(prompts[i])
        if reason is TaskOutcome.LENGTH:
            assert completion_tokens == len(tokens) == MAX_TOKENS
        else:
            assert (reason, completion_tokens) == (TaskOutcome.STOP, len(tokens) + 1)  # the EOS counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_a_cohort_of_a_saved_prefix_fresh_prompts_and_other_lengths_decodes_as_each_does_alone(
    wide_heads: Path, kv_bits: int | None
) -> None:
    """One cohort mixes a row restored from a saved prefix, fresh rows and prompts of other lengths (padded on the
    right), prefilled in small chunks; a prompt that starts as one of its rows waits, to start from that cache cut
    shorter. Each row's greedy text is mlx-lm's for its prompt alone. With a quantized KV cache (`kv_bits`,
    `serving.kv_cache_type` q8_0 or q4_0) it is mlx-lm's with its own quantized cache of as many bits: batching,
    padding, saving and cutting lose nothing more."""
    model_dir = wide_heads
    prompts = prompt_ids(model_dir)
    conversation = prompts[3] * 2  # long enough for the prefix index (16 tokens)
    cohort = [conversation + prompts[1], prompts[1], prompts[0], prompts[2], prompts[3]]
    expected = reference(model_dir, [conversation, *cohort], kv_bits=kv_bits)
    collector = Collector()

    def on_finished(task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        if task_id == "first":  # on the engine's thread: all four are queued before it looks again
            for i, prompt in enumerate(cohort):
                engine.submit(GenerationRequest(f"t{i}", prompt, MAX_TOKENS))
        collector.on_finished(task_id, reason, prompt_tokens, completion_tokens)

    engine = PipelineEngine(
        load_shard(model_dir, 0, 4),
        on_token=collector.on_token,
        on_finished=on_finished,
        prefill_step_size=5,
        kv_bits=kv_bits,
    )
    later = tuple(f"t{i}" for i in range(len(cohort)))
    run_single(engine, [GenerationRequest("first", conversation, MAX_TOKENS)], collector, submitted_later=later)

    # Two rows restored: the follow-up whole, and the conversation's first half, cut from the saved cache.
    assert engine.stats.prefix_hits == 2 and engine.stats.max_prefill_rows == len(cohort) - 1
    assert collector.tokens["first"] == expected[0]
    for i in range(len(cohort)):
        assert collector.tokens.get(f"t{i}", []) == expected[i + 1], f"prompt {i}"


@pytest.mark.timeout(60)
def test_tasks_cancelled_while_their_cohort_prefills_leave_the_rest_as_it_was(models: dict[str, Path]) -> None:
    """A cohort's task cancelled as its prefill begins ends at once; its row joins with the others and leaves
    again, and the rest decode as they do alone. A cohort whose every task is cancelled is dropped, and the
    engine serves the next prompt."""
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, [prompts[1], prompts[0]])
    collector = Collector()
    doomed = ("cancelled", "gone-1", "gone-2")

    def on_finished(task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        if task_id == "cancelled":  # queued while the first cohort fills: they prefill together next
            for gone, prompt in zip(doomed[1:], (prompts[3], prompts[0]), strict=True):
                engine.submit(GenerationRequest(gone, prompt, MAX_TOKENS))
        if task_id == "gone-2":
            engine.submit(GenerationRequest("after", prompts[1], MAX_TOKENS))
        collector.on_finished(task_id, reason, prompt_tokens, completion_tokens)

    engine = PipelineEngine(
        load_shard(model_dir, 0, 4),
        on_token=collector.on_token,
        on_finished=on_finished,
        on_started=lambda task_id, prompt_tokens: engine.cancel(task_id) if task_id in doomed else None,
        prefill_step_size=2,  # many PREFILL steps: the cancels land while the cohorts fill
    )
    first = [("kept", prompts[1]), ("cancelled", prompts[3]), ("also-kept", prompts[0])]
    for task_id, prompt in first:  # before the engine runs: one cohort
        engine.submit(GenerationRequest(task_id, prompt, MAX_TOKENS))
    run_single(engine, [], collector, submitted_later=(*(t for t, _ in first), *doomed[1:], "after"))

    assert engine.stats.max_prefill_rows == 3
    for task_id in doomed:
        assert collector.finished[task_id][0] is TaskOutcome.CANCELLED and task_id not in collector.tokens
    assert collector.tokens["kept"] == expected[0] and collector.tokens["after"] == expected[0]
    assert collector.tokens["also-kept"] == expected[1]


@pytest.mark.timeout(60)
def test_finish_with_reason_and_queued_cancel(models: dict[str, Path]) -> None:
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    collector = Collector()
    started: list[tuple[str, set[str]]] = []
    engine = PipelineEngine(
        load_shard(model_dir, 0, 4),
        on_finished=collector.on_finished,
        on_started=lambda task_id, prompt_tokens: started.append((task_id, set(collector.finished))),
        max_batch=1,  # b and c wait in the queue while a decodes
    )

    def on_token(task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None) -> None:
        collector.on_token(task_id, token, index, reason)
        if task_id == "a" and index == 1:
            engine.finish("a", TaskOutcome.STOP)  # as the runner does after matching a stop string
            engine.cancel("b")  # still queued: never starts

    engine.on_token = on_token
    requests = [GenerationRequest(t, prompts[1], MAX_TOKENS) for t in ("a", "b", "c")]
    run_single(engine, requests, collector)

    assert collector.finished["a"] == (TaskOutcome.STOP, len(prompts[1]), 2)
    assert collector.finished["b"] == (TaskOutcome.CANCELLED, len(prompts[1]), 0)
    assert "b" not in collector.tokens
    assert collector.finished["c"][0] in (TaskOutcome.LENGTH, TaskOutcome.STOP)
    # A task is reported started when its prefill begins, not while it waits in the queue.
    assert started == [("a", set()), ("c", {"a", "b"})]


@pytest.mark.timeout(60)
def test_a_stop_in_one_row_leaves_the_batch_unchanged(models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts[1:3])
    collector = Collector()
    engine = PipelineEngine(load_shard(model_dir, 0, 4), on_finished=collector.on_finished)

    def on_token(task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None) -> None:
        collector.on_token(task_id, token, index, reason)
        if task_id == "stopped" and index == 2:
            engine.finish("stopped", TaskOutcome.STOP)  # as the runner does after matching a stop string

    engine.on_token = on_token
    requests = [
        GenerationRequest("stopped", prompts[0], MAX_TOKENS, eos_token_ids=frozenset()),
        GenerationRequest("b", prompts[1], MAX_TOKENS),
        GenerationRequest("c", prompts[2], MAX_TOKENS),
    ]
    run_single(engine, requests, collector)

    assert engine.stats.max_rows == 3
    assert collector.finished["stopped"] == (TaskOutcome.STOP, len(prompts[0]), 3)
    assert [collector.tokens["b"], collector.tokens["c"]] == expected


@pytest.mark.timeout(60)
def test_a_seeded_row_samples_the_same_tokens_whatever_shares_its_batch(models: dict[str, Path]) -> None:
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    seeded = GenerationRequest("seeded", prompts[1], MAX_TOKENS, TokenSampling(temperature=0.8, top_p=0.9), seed=11)

    def run(requests: list[GenerationRequest]) -> tuple[Collector, PipelineEngine]:
        collector = Collector()
        engine = collector.engine(load_shard(model_dir, 0, 4))
        run_single(engine, requests, collector)
        return collector, engine

    alone, _ = run([seeded])
    shared, engine = run(
        [
            GenerationRequest("greedy", prompts[0], MAX_TOKENS),
            GenerationRequest("other-seed", prompts[3], MAX_TOKENS, TokenSampling(temperature=1.0), seed=12),
            seeded,
        ]
    )

    assert engine.stats.max_rows == 3
    assert shared.tokens["seeded"] == alone.tokens["seeded"]
    assert shared.tokens["greedy"] == reference(model_dir, prompts[:1])[0]


@pytest.mark.timeout(60)
def test_a_long_prompt_is_prefilled_between_the_batchs_decode_steps(models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    long_prompt = prompts[3] * 4
    expected = reference(model_dir, [prompts[1], long_prompt])
    collector = Collector()
    events: list[tuple[str, str]] = []
    engine = PipelineEngine(
        load_shard(model_dir, 0, 4),
        on_finished=collector.on_finished,
        on_started=lambda task_id, prompt_tokens: events.append(("started", task_id)),
        interleaved_prefill_tokens=8,
    )

    def on_token(task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None) -> None:
        collector.on_token(task_id, token, index, reason)
        events.append(("token", task_id))
        if task_id == "running" and index == 0:
            engine.submit(GenerationRequest("long", long_prompt, MAX_TOKENS))

    engine.on_token = on_token
    running = GenerationRequest("running", prompts[1], 3 * MAX_TOKENS, eos_token_ids=frozenset())
    run_single(engine, [running], collector, submitted_later=("long",))

    # While the long prompt filled its cache 8 tokens at a time, the running task kept getting a token per chunk.
    window = events[events.index(("started", "long")) : events.index(("token", "long"))]
    assert window.count(("token", "running")) >= (len(long_prompt) - 1) // 8 - 1
    assert collector.tokens["running"][: len(expected[0])] == expected[0]
    assert collector.tokens["long"] == expected[1]


@pytest.mark.timeout(60)
def test_logits_processors_apply_to_their_own_row(models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    expected = reference(model_dir, prompts[:2])
    banned = expected[1][0]

    def ban(tokens: mx.array, logprobs: mx.array) -> mx.array:
        return mx.where(mx.arange(logprobs.shape[-1]) == banned, -mx.inf, logprobs)

    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    requests = [
        GenerationRequest("plain", prompts[0], MAX_TOKENS),
        GenerationRequest("constrained", prompts[1], MAX_TOKENS, logits_processors=(ban,)),
    ]
    run_single(engine, requests, collector)

    assert collector.tokens["plain"] == expected[0]
    assert banned not in collector.tokens["constrained"]
    assert collector.tokens["constrained"] != expected[1]


@pytest.mark.timeout(60)
def test_logprobs_are_mlx_lms_log_softmax(models: dict[str, Path]) -> None:
    """The greedy token's logprob and the top alternatives equal the log-softmax of mlx-lm's own logits for the
    same prefix, for a row that asked, while a row beside it that did not ask gets none."""
    model_dir = models["llama"]
    prompts = prompt_ids(model_dir)
    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    requests = [
        GenerationRequest("scored", prompts[1], 6, top_logprobs=3),
        GenerationRequest("plain", prompts[0], 6),
    ]
    run_single(engine, requests, collector)

    model, _ = mlx_load(str(model_dir))
    tokens, scores = collector.tokens["scored"], collector.scores["scored"]
    assert len(scores) == len(tokens) and "plain" not in collector.scores
    for i, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        logits = model(mx.array([prompts[1] + tokens[:i]]))[0, -1].astype(mx.float32)
        expected = logits - mx.logsumexp(logits)
        assert score.logprob == pytest.approx(expected[token].item(), abs=1e-4)
        best = sorted(range(expected.shape[0]), key=lambda t: -expected[t].item())[:3]
        assert [t for t, _ in score.top] == best
        assert score.top[0] == (token, pytest.approx(score.logprob, abs=1e-6))  # greedy: the top one


@pytest.mark.timeout(60)
def test_embeddings_are_the_normalised_mean_of_the_last_hidden_states(models: dict[str, Path]) -> None:
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    collector = Collector()
    engine = collector.engine(
        load_shard(model_dir, 0, 4),
        on_embedding=collector.on_embedding,
        prefill_step_size=4,  # several chunks pool into one vector
    )
    requests = [GenerationRequest(f"e{i}", p, 1, embed=True) for i, p in enumerate(prompts[:2])]
    run_single(engine, [*requests, GenerationRequest("generated", prompts[0], 3)], collector)

    model, _ = mlx_load(str(model_dir))
    for i, prompt in enumerate(prompts[:2]):
        hidden = model.model(mx.array([prompt]))[0].astype(mx.float32)  # mlx-lm applies the final norm
        mean = hidden.mean(axis=0)
        expected = mean / mx.linalg.norm(mean)
        assert collector.embeddings[f"e{i}"] == pytest.approx(expected.tolist(), abs=1e-4)
        assert collector.finished[f"e{i}"] == (TaskOutcome.STOP, len(prompt), 0)
    assert len(collector.tokens["generated"]) == 3  # generation beside them is unaffected


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible(models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompt = prompt_ids(model_dir)[1]
    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    # No EOS ids: every task runs to max_tokens, so the sequences are comparable.
    requests = [
        GenerationRequest(
            task, prompt, MAX_TOKENS, TokenSampling(temperature=1.0, top_p=0.9), seed=seed, eos_token_ids=frozenset()
        )
        for task, seed in [("s1", 7), ("s2", 7), ("s3", 8)]
    ]
    run_single(engine, requests, collector)

    assert collector.tokens["s1"] == collector.tokens["s2"]
    assert collector.tokens["s1"] != collector.tokens["s3"]
    assert len(collector.tokens["s1"]) == MAX_TOKENS


@pytest.mark.timeout(60)
def test_top_k_1_and_min_p_1_sample_the_greedy_tokens_at_any_temperature(models: dict[str, Path]) -> None:
    """Each row of one batch with its own cut: k=1 and min_p=1 leave the most likely token alone, whatever the
    temperature; a k as large as the vocabulary cuts nothing."""
    model_dir = models["qwen3"]
    prompts = prompt_ids(model_dir)
    greedy = reference(model_dir, prompts[1:2])[0]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    hot = TokenSampling(temperature=2.0)
    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    requests = [
        GenerationRequest("hot", prompts[1], MAX_TOKENS, hot, seed=5),
        GenerationRequest("top_k=1", prompts[1], MAX_TOKENS, msgspec.structs.replace(hot, top_k=1), seed=5),
        GenerationRequest("min_p=1", prompts[1], MAX_TOKENS, msgspec.structs.replace(hot, min_p=1.0), seed=5),
        GenerationRequest("top_k=vocab", prompts[1], MAX_TOKENS, msgspec.structs.replace(hot, top_k=vocab), seed=5),
    ]
    run_single(engine, requests, collector)

    assert engine.stats.max_rows == 4
    assert collector.tokens["hot"] != greedy
    assert collector.tokens["top_k=1"] == greedy
    assert collector.tokens["min_p=1"] == greedy
    assert collector.tokens["top_k=vocab"] == collector.tokens["hot"]


def formula_penalties(
    prompt_length: int, repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0, last_n: int = 10**9
) -> Any:
    """The penalties as their authors define them, in numpy, as an mlx-lm logits processor: the repetition
    penalty (transformers', vLLM's, llama.cpp's) on every token of the prompt and the answer, presence and
    frequency (OpenAI's: logit -= presence * (count > 0) + frequency * count) on the answer's; all within the last
    `last_n` tokens."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        sequence = cast("list[int]", tokens.tolist())
        start = max(0, len(sequence) - last_n)
        out = np.array(logits.astype(mx.float32))
        for token in set(sequence[start:]):
            logit = out[0, token]
            out[0, token] = logit / repetition if logit > 0 else logit * repetition
        answer = sequence[max(start, prompt_length) :]
        for token in set(answer):
            out[0, token] -= presence + frequency * answer.count(token)
        return mx.array(out)

    return process


def greedy_with(model_dir: Path, prompt: list[int], processor: Any, max_tokens: int = MAX_TOKENS) -> list[int]:
    """mlx-lm's greedy output with `processor` on its logits, which it hands the prompt and the tokens so far."""
    model, tokenizer = mlx_load(str(model_dir))
    tokens = []
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=[processor]):
        if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
            break
        tokens.append(response.token)
    return tokens


PENALTIES: dict[str, tuple[TokenSampling, int | None]] = {
    "repetition": (TokenSampling(repetition_penalty=1.5), None),
    "repetition in a window": (TokenSampling(repetition_penalty=3.0), 12),
    "presence": (TokenSampling(presence_penalty=2.0), None),
    "frequency": (TokenSampling(frequency_penalty=1.0), None),
    "all": (TokenSampling(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5), 16),
}
"""Each row's penalties and their window (`repeat_last_n`; None: the whole sequence)."""


@pytest.mark.timeout(120)
def test_each_penalty_follows_its_formula_on_its_own_row(models: dict[str, Path]) -> None:
    """Greedy rows of one batch, each with its penalties, answer as greedy decoding with the published formulas
    does; the unpenalised row beside them as plain greedy decoding."""
    model_dir = models["llama"]
    prompt = prompt_ids(model_dir)[3]  # a chat turn: its template's tokens repeat in the prompt
    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    max_tokens = 2 * MAX_TOKENS  # long enough for plain greedy decoding to repeat a few tokens
    requests = [GenerationRequest("plain", prompt, max_tokens)] + [
        GenerationRequest(name, prompt, max_tokens, penalties, repeat_last_n=window)
        for name, (penalties, window) in PENALTIES.items()
    ]
    run_single(engine, requests, collector)

    greedy = greedy_with(model_dir, prompt, formula_penalties(len(prompt)), max_tokens)
    assert collector.tokens["plain"] == greedy
    for name, (penalties, window) in PENALTIES.items():
        formula = formula_penalties(
            len(prompt),
            penalties.repetition_penalty,
            penalties.presence_penalty,
            penalties.frequency_penalty,
            10**9 if window is None else window,
        )
        assert collector.tokens[name] == greedy_with(model_dir, prompt, formula, max_tokens), name
        assert collector.tokens[name] != greedy, name


@pytest.mark.timeout(120)
def test_a_strong_repetition_penalty_stops_greedy_decoding_repeating_itself(models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompt = prompt_ids(model_dir)[1]
    window = 32

    def repeats(tokens: list[int]) -> int:
        return sum(token in tokens[max(0, i - window + 1) : i] for i, token in enumerate(tokens))

    collector = Collector()
    engine = collector.engine(load_shard(model_dir, 0, 4))
    common: dict[str, Any] = {"max_tokens": 150, "eos_token_ids": frozenset()}
    strong = TokenSampling(repetition_penalty=10.0)
    requests = [
        GenerationRequest("greedy", prompt, **common),
        GenerationRequest("penalised", prompt, sampling=strong, repeat_last_n=window, **common),
        GenerationRequest("off", prompt, sampling=strong, repeat_last_n=0, **common),
    ]
    run_single(engine, requests, collector)

    assert repeats(collector.tokens["greedy"]) > 5
    assert repeats(collector.tokens["penalised"]) == 0
    assert collector.tokens["off"] == collector.tokens["greedy"]  # a window of 0 tokens penalises nothing


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize(("start", "end"), [(0, 1), (1, 3), (2, 4), (0, 4)])
def test_shard_loads_only_its_range(models: dict[str, Path], start: int, end: int) -> None:
    progress: list[tuple[int, int]] = []
    shard = load_shard(models["llama"], start, end, on_progress=lambda d, t: progress.append((d, t)))

    assert_within_range(shard.loaded_tensors, start, end, num_layers=4)
    assert len(shard.layers) == end - start
    assert progress == [(i, end - start) for i in range(end - start + 1)]
    # <|im_end|> from config.json, plus <|endoftext|> that only generation_config.json lists.
    assert shard.eos_token_ids == {509, 511}


def test_a_llama3_rope_shard_loaded_on_one_thread_runs_on_another(tmp_path: Path) -> None:
    """As a runner does: loaded on its main thread, run on the engine's. Llama 3's RoPE keeps its
    frequencies outside the parameters; left lazy, the first request of any Llama 3.x model failed."""
    model_dir = make_tiny_model(tmp_path / "llama3", arch="llama", num_layers=2, num_files=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    shard = load_shard(model_dir, 0, 2)
    outcome: list[object] = []

    def forward() -> None:
        try:
            h = shard.head(shard.run_layers(shard.embed(mx.array([[1, 2, 3]])), shard.make_cache()))
            mx.eval(h)
            outcome.append(h.shape)
        except Exception as error:
            outcome.append(error)

    engine_thread = threading.Thread(target=forward)
    engine_thread.start()
    engine_thread.join(60)
    assert outcome == [(1, 3, config["vocab_size"])]


def test_chained_shards_equal_full_model_with_tied_embeddings(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tied", arch="qwen3", num_layers=4, num_files=4)
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    model, _ = mlx_load(str(model_dir))
    tokens = mx.array([[5, 77, 300, 12, 9]], dtype=mx.int32)

    shards = [load_shard(model_dir, a, b) for a, b in [(0, 1), (1, 3), (3, 4)]]
    # The last rank needs the embedding as its output projection; a middle rank needs neither.
    assert "model.embed_tokens.weight" in shards[2].loaded_tensors
    assert not any("embed_tokens" in n or "lm_head" in n for n in shards[1].loaded_tensors)
    h = shards[0].embed(tokens)
    for shard in shards:
        h = shard.run_layers(h, shard.make_cache())
    logits = shards[-1].head(h)

    assert mx.array_equal(logits, model(tokens)).item()


def test_rejects_bad_ranges_and_unsupported_models(models: dict[str, Path], tmp_path: Path) -> None:
    for start, end in [(2, 2), (-1, 2), (0, 5), (3, 1)]:
        with pytest.raises(ValueError, match="layer range"):
            load_shard(models["llama"], start, end)

    unsupported = tmp_path / "gemma2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(ValueError, match="not supported by the shard engine"):
        load_shard(unsupported, 0, 1)

    with pytest.raises(ValueError, match="last rank"):
        PipelineEngine(load_shard(models["llama"], 0, 2))  # a single process must hold every layer


def test_generation_request_validation() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        GenerationRequest("x", [], 5)
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationRequest("x", [1], 0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationRequest("x", [1], 5, TokenSampling(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        GenerationRequest("x", [1], 5, TokenSampling(top_p=0))
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            GenerationRequest("x", [1], 5, seed=seed)
    with pytest.raises(ValueError, match="top_k"):
        GenerationRequest("x", [1], 5, TokenSampling(top_k=-1))
    with pytest.raises(ValueError, match="min_p"):
        GenerationRequest("x", [1], 5, TokenSampling(min_p=1.5))
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationRequest("x", [1], 5, TokenSampling(repetition_penalty=0))
    with pytest.raises(ValueError, match="repeat_last_n"):
        GenerationRequest("x", [1], 5, repeat_last_n=-1)


def test_the_engine_handles_every_architecture_a_card_may_name() -> None:
    from jetshard_schema.card_from_config import SUPPORTED_ARCHITECTURES
    from jetshard_schema.cards import VISION_ARCHITECTURES
    from jetshard_worker.engines.mlx.shard import model_classes

    for arch in SUPPORTED_ARCHITECTURES:
        model_classes({"model_type": arch})  # refuses an architecture the shard engine cannot run
    for arch in VISION_ARCHITECTURES:  # their language model is one of those
        model_classes({"model_type": arch, "text_config": {"model_type": "llama"}})


# --------------------------------------------------------------------------- vision models

VISION_QUESTION = "What is in this picture?"
VISION_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("engine-vlm") / "vlm", split=True)


def vision_prompt(model_dir: Path, messages: tuple[ChatMessage, ...]) -> tuple[list[int], dict[str, np.ndarray]]:
    """A conversation's prompt tokens and image arrays, as the runner makes them."""
    processor = vision_processor(model_dir)
    rendered = render_chat(processor.tokenizer, messages, None, content_parts=True)
    pictures = [picture for message in messages for picture in message.images]
    inputs = prompt_inputs(processor, rendered, pictures, image_token_index=None)
    return inputs.pop("input_ids")[0].tolist(), inputs


@pytest.fixture(scope="module")
def vision_prompts(vlm: Path) -> list[tuple[list[int], dict[str, np.ndarray], list[int]]]:
    """Two pictures of different sizes asked the same question: each prompt's tokens and image arrays, and
    mlx-vlm's own greedy answer."""
    prompts = []
    for picture in (png(48, 40, seed=1), png(20, 30, seed=2)):
        tokens, arrays = vision_prompt(vlm, (ChatMessage(role="user", content=VISION_QUESTION, images=(picture,)),))
        prompts.append((tokens, arrays, mlx_vlm_greedy(vlm, VISION_QUESTION, picture, VISION_MAX_TOKENS)))
    return prompts


def test_a_follow_up_about_the_same_picture_starts_from_the_first_questions_cache(vlm: Path) -> None:
    """The prefix cache knows image tokens by their picture: the same picture asked again reuses the first turn's
    cache, and the answer is still mlx-vlm's; another picture with the same words does not."""
    picture, other = png(20, 30, seed=2), png(20, 30, seed=3)
    first_tokens, first_arrays = vision_prompt(
        vlm, (ChatMessage(role="user", content=VISION_QUESTION, images=(picture,)),)
    )
    answer = vision_processor(vlm).tokenizer.decode(mlx_vlm_greedy(vlm, VISION_QUESTION, picture, VISION_MAX_TOKENS))
    follow_up = "And what colour is it?"
    conversation = (
        ChatMessage(role="user", content=VISION_QUESTION, images=(picture,)),
        ChatMessage(role="assistant", content=answer),
        ChatMessage(role="user", content=follow_up),
    )
    collector = Collector()
    engine = collector.engine(load_shard(vlm, 0, 4))
    thread = threading.Thread(target=engine.run_forever)
    thread.start()
    try:
        engine.submit(GenerationRequest("first", first_tokens, VISION_MAX_TOKENS, images=first_arrays))
        collector.wait(["first"])
        tokens, arrays = vision_prompt(vlm, conversation)
        engine.submit(GenerationRequest("again", tokens, VISION_MAX_TOKENS, images=arrays))
        collector.wait(["again"])
        assert engine.stats.prefix_hits == 1 and engine.stats.prefix_hit_tokens >= len(first_tokens) - 1
        tokens, arrays = vision_prompt(
            vlm, tuple(msgspec.structs.replace(m, images=(other,) * len(m.images)) for m in conversation)
        )
        engine.submit(GenerationRequest("other", tokens, VISION_MAX_TOKENS, images=arrays))
        collector.wait(["other"])
        assert engine.stats.prefix_hits == 1
    finally:
        engine.shutdown()
        thread.join(timeout=30)

    history = ((VISION_QUESTION, answer),)
    assert collector.tokens.get("again", []) == mlx_vlm_greedy(vlm, follow_up, picture, VISION_MAX_TOKENS, history)
    assert collector.tokens.get("other", []) == mlx_vlm_greedy(vlm, follow_up, other, VISION_MAX_TOKENS, history)


@pytest.mark.parametrize("prefill_step_size", [2048, 7])
def test_a_vision_prompt_is_answered_as_mlx_vlm_answers_it(
    vlm: Path, vision_prompts: list[tuple[list[int], dict[str, np.ndarray], list[int]]], prefill_step_size: int
) -> None:
    """The vision tower and projector run where the embedding is, their features in place of the image tokens,
    also when the prompt is prefilled in chunks; each picture gets its own answer."""
    collector = Collector()
    engine = collector.engine(load_shard(vlm, 0, 4), prefill_step_size=prefill_step_size)
    requests = [
        GenerationRequest(f"v{i}", tokens, VISION_MAX_TOKENS, images=arrays)
        for i, (tokens, arrays, _) in enumerate(vision_prompts)
    ]

    run_single(engine, requests, collector)

    answers = [collector.tokens[f"v{i}"] for i in range(len(vision_prompts))]
    assert answers == [expected for _, _, expected in vision_prompts]
    assert answers[0] != answers[1]
    assert engine.stats.prefix_hits == 0  # the same question with another picture starts afresh


def test_a_4bit_vision_model_is_answered_as_mlx_vlm_answers_it(vlm: Path, tmp_path: Path) -> None:
    """mlx-vlm's own 4-bit conversion: the quantized projector and language model load as the checkpoint says."""
    quantized = quantized_vlm(vlm, tmp_path / "vlm-4bit")
    picture = png(48, 40, seed=1)
    tokens, inputs = vision_prompt(quantized, (ChatMessage(role="user", content=VISION_QUESTION, images=(picture,)),))
    collector = Collector()
    shard = load_shard(quantized, 0, 4)
    assert shard.weights_dtype == "4-bit affine"
    engine = collector.engine(shard)

    run_single(engine, [GenerationRequest("q", tokens, VISION_MAX_TOKENS, images=inputs)], collector)

    assert collector.tokens["q"] == mlx_vlm_greedy(quantized, VISION_QUESTION, picture, VISION_MAX_TOKENS)


@pytest.mark.timeout(180)
def test_a_vision_model_pipeline_answers_as_one_rank(
    vlm: Path, vision_prompts: list[tuple[list[int], dict[str, np.ndarray], list[int]]], tmp_path: Path
) -> None:
    """Rank 0 holds the vision tower and projector; the next rank sees only hidden states."""
    requests = []
    for i, (tokens, arrays, _) in enumerate(vision_prompts):
        np.savez(tmp_path / f"images{i}.npz", **arrays)
        requests.append(
            {
                "task_id": f"v{i}",
                "prompt_tokens": tokens,
                "max_tokens": VISION_MAX_TOKENS,
                "images": str(tmp_path / f"images{i}.npz"),
            }
        )

    outputs = run_pipeline(vlm, [0, 2, 4], requests, tmp_path, prefill_step_size=5)

    results = outputs[-1]["results"]
    assert [results[f"v{i}"]["tokens"] for i in range(len(requests))] == [expected for _, _, expected in vision_prompts]
    first, last = (set(output["loaded_tensors"]) for output in outputs)
    assert any(name.startswith("vision_model.") for name in first) and any(
        name.startswith("connector.") for name in first
    )
    assert not any(name.startswith(("vision_model.", "connector.")) for name in last)
