"""The prefix cache: a prompt that starts like an earlier one prefills only what is new, on one rank and
across a ring, and gives exactly the tokens of a cold run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers.tiny_models import make_tiny_model
from jetshard_worker.engines.mlx import GenerationRequest, PipelineEngine, load_shard
from jetshard_worker.engines.mlx.prefixes import PrefixHit, PrefixIndex
from test_engine import MAX_TOKENS, Collector, reference, run_pipeline

SYSTEM = [(7 * i) % 500 + 3 for i in range(40)]  # a shared "system prompt"
TURN_1 = [*SYSTEM, 11, 12, 13]
TURN_2 = [*TURN_1, 40, 41, 42, 43, 44]  # the same conversation, one turn later
OTHER_QUESTION = [*SYSTEM, 90, 91]  # the same system prompt, another question


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("prefix") / "llama", arch="llama", num_layers=4, num_files=2)


def test_the_index_finds_the_longest_saved_prefix_and_says_what_it_evicts() -> None:
    index = PrefixIndex(budget_bytes=250, min_tokens=4)
    first, evicted = index.add([1, 2, 3, 4, 5, 6], size_bytes=100, trimmable=True)
    assert first is not None and evicted == []

    assert index.find([1, 2, 3, 4, 5, 6]) == PrefixHit(first, 6)  # exact
    assert index.find([1, 2, 3, 4, 5, 6, 7, 8]) == PrefixHit(first, 6)  # the entry is a prefix of the prompt
    assert index.find([1, 2, 3, 4, 9]) == PrefixHit(first, 4)  # the prompt shares 4 tokens: cut the entry
    assert index.find([1, 2, 3, 9]) is None  # fewer than min_tokens in common
    assert index.find([1, 2]) is None

    longer, evicted = index.add([1, 2, 3, 4, 5, 6, 7, 8], size_bytes=120, trimmable=True)
    assert evicted == [first]  # a trimmable cache serves every prefix of itself
    assert index.find([1, 2, 3, 4, 5, 6, 0]) == PrefixHit(longer, 6)

    other, evicted = index.add([5, 5, 5, 5, 5], size_bytes=100, trimmable=True)
    assert evicted == [] and index.size_bytes == 220
    third, evicted = index.add([6, 6, 6, 6, 6], size_bytes=100, trimmable=True)
    assert evicted == [longer]  # the least recently used goes first
    assert index.size_bytes == 200 and len(index) == 2
    assert index.add([7, 7, 7, 7, 7], size_bytes=300, trimmable=True) == (None, [])  # over the whole budget
    assert other is not None and third is not None


def test_an_untrimmable_cache_serves_only_prompts_it_covers_whole() -> None:
    index = PrefixIndex(budget_bytes=1000, min_tokens=2)
    entry, _ = index.add([1, 2, 3, 4], size_bytes=10, trimmable=False)
    assert index.find([1, 2, 3, 9]) is None
    assert index.find([1, 2, 3, 4, 9]) == PrefixHit(entry, 4)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_later_turn_starts_from_the_earlier_prompt_and_equals_a_cold_run(model_dir: Path) -> None:
    expected = reference(model_dir, [TURN_1, TURN_2, OTHER_QUESTION])
    collector = Collector()
    engine = PipelineEngine(load_shard(model_dir, 0, 4), on_token=collector.on_token, on_finished=collector.on_finished)
    thread = threading.Thread(target=engine.run_forever)
    thread.start()
    try:
        # One at a time, as a conversation goes: each request is submitted when the one before has finished.
        for task_id, prompt in [("turn-1", TURN_1), ("turn-2", TURN_2), ("other", OTHER_QUESTION)]:
            engine.submit(GenerationRequest(task_id, prompt, MAX_TOKENS))
            collector.wait([task_id])
    finally:
        engine.shutdown()
        thread.join(timeout=30)

    assert [collector.tokens["turn-1"], collector.tokens["turn-2"], collector.tokens["other"]] == expected
    # turn 2 reused all of turn 1's prompt but its last token; the other question the system prompt.
    assert engine.stats.prefix_hits == 2
    assert engine.stats.prefix_hit_tokens == (len(TURN_1) - 1) + len(SYSTEM)


@pytest.mark.timeout(120)
def test_ranks_of_a_ring_start_from_the_same_saved_prefix(model_dir: Path, tmp_path: Path) -> None:
    expected = reference(model_dir, [TURN_1, TURN_2, OTHER_QUESTION])
    requests = [
        {"task_id": "turn-1", "prompt_tokens": TURN_1, "max_tokens": MAX_TOKENS},
        {"task_id": "turn-2", "prompt_tokens": TURN_2, "max_tokens": MAX_TOKENS},
        {"task_id": "other", "prompt_tokens": OTHER_QUESTION, "max_tokens": MAX_TOKENS},
    ]

    leader = run_pipeline(model_dir, [0, 2, 4], requests, tmp_path)[-1]

    assert [leader["results"][t]["tokens"] for t in ("turn-1", "turn-2", "other")] == expected
    assert leader["prefix_hits"] == 2
