"""The runner's split of a thinking model's output (`jetshard_worker.text.reasoning`), where a live model cannot be made
to go: markers cut across pieces of text, a marker that never completes, a prompt that opens the reasoning, markers
of several tokens (Gemma's `<|channel>thought`), a budget that forces such a marker token by token, and stop strings,
which the answer alone is matched against. Pure: no model, no cluster (tests/test_reasoning.py runs the whole path
in every dialect)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from jetshard_schema.ids import TaskId
from jetshard_schema.types import Chunk, TaskOutcome
from jetshard_worker.text.output import ChoiceOutput, RowEnd, TaskOutput
from jetshard_worker.text.reasoning import ReasoningText, ReasoningTokens, ThinkMarkers, opens_in_reasoning
from jetshard_worker.text.textstream import StopText
from test_textstream import PieceDetokenizer

QWEN = ThinkMarkers(start="<think>", end="</think>", start_tokens=(10,), end_tokens=(11,))
CHANNEL = ThinkMarkers(start="<|channel>thought", end="<channel|>", start_tokens=(20, 21), end_tokens=(22, 23))
VOCAB = 32


def split(splitter: ReasoningText, pieces: list[str]) -> tuple[str, str]:
    reasoning, answer = "", ""
    for piece in pieces:
        more_reasoning, more_answer = splitter.add(piece)
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    rest_reasoning, rest_answer = splitter.finish()
    return reasoning + rest_reasoning, answer + rest_answer


@pytest.mark.parametrize("cut", range(1, len("<think>\nhm ok\n</think>\n\nyes")))
def test_markers_cut_anywhere_split_the_same(cut: int) -> None:
    text = "<think>\nhm ok\n</think>\n\nyes"
    assert split(ReasoningText(QWEN, reasoning=False), [text[:cut], text[cut:]]) == ("hm ok", "yes")


def test_whitespace_inside_the_reasoning_is_kept_and_around_the_markers_dropped() -> None:
    pieces = ["<think>", "\n", "one", "\n\n", "two", "\n", "</think>", "\n\n", "yes", " and", "\n"]
    assert split(ReasoningText(QWEN, reasoning=False), pieces) == ("one\n\ntwo", "yes and\n")


def test_a_prompt_that_opens_the_reasoning_starts_the_output_inside_it() -> None:
    assert opens_in_reasoning(QWEN, [1, 2, 10])
    assert not opens_in_reasoning(QWEN, [1, 10, 3, 11])  # enable_thinking false: an empty reasoning, closed
    assert not opens_in_reasoning(QWEN, [1, 2, 3])
    assert opens_in_reasoning(CHANNEL, [22, 23, 5, 20, 21])
    assert split(ReasoningText(QWEN, reasoning=True), ["hm", "</think>", "yes"]) == ("hm", "yes")


def test_a_marker_that_never_completes_is_text_and_an_unclosed_reasoning_stays_reasoning() -> None:
    assert split(ReasoningText(QWEN, reasoning=False), ["a <thi"]) == ("", "a <thi")
    assert split(ReasoningText(QWEN, reasoning=False), ["<think>", "still thinking </thi"]) == (
        "still thinking </thi",
        "",
    )


def test_multi_token_markers_are_counted_as_reasoning() -> None:
    tokens = ReasoningTokens(CHANNEL, reasoning=False)
    for token in (5, 20, 21, 6, 7, 22, 23, 8):
        tokens.add(token)
    assert (tokens.count, tokens.reasoning) == (6, False)


def forced(tokens: ReasoningTokens, history: list[int]) -> int | None:
    """The one token `tokens` allows after `history`, or None when it leaves the logits alone."""
    out = tokens.process(mx.array(history), mx.zeros((1, VOCAB)))
    allowed = [i for i, v in enumerate(out[0].tolist()) if v != float("-inf")]
    return allowed[0] if len(allowed) == 1 else None


def test_a_budget_forces_a_multi_token_end_marker_token_by_token() -> None:
    prompt = [1, 2]
    steering = ReasoningTokens(CHANNEL, reasoning=False, budget=2)
    history = list(prompt)
    assert forced(steering, history) is None
    for token in (20, 21, 5):  # the start marker, then one token of reasoning: within the budget
        history.append(token)
        assert forced(steering, history) is None
    history.append(6)  # the second: the budget is spent
    assert forced(steering, history) == 22
    history.append(22)
    assert forced(steering, history) == 23
    history.append(23)
    assert forced(steering, history) is None  # the answer is free again


def test_an_answer_constraint_sees_the_prompt_and_the_answer_only() -> None:
    seen: list[list[int]] = []

    def constraint(history: mx.array, logprobs: mx.array) -> mx.array:
        seen.append(history.tolist())
        only_three = mx.arange(VOCAB) == 3
        return mx.where(only_three, logprobs, mx.array(-mx.inf))

    steering = ReasoningTokens(QWEN, reasoning=False, answer_processor=constraint)
    first = steering.process(mx.array([1, 2]), mx.zeros((1, VOCAB)))[0].tolist()
    # The first token may open the reasoning besides what the constraint allows.
    assert [i for i, v in enumerate(first) if v != float("-inf")] == [3, 10]
    assert forced(steering, [1, 2, 10]) is None  # reasoning: unconstrained
    assert forced(steering, [1, 2, 10, 7, 11]) == 3  # answering: constrained
    assert forced(steering, [1, 2, 10, 7, 11, 3]) == 3
    assert seen == [[1, 2], [1, 2], [1, 2, 3]]


# --- stop strings: the answer's only, as vLLM matches them ------------------------------------------------------

MARKED = ThinkMarkers(start="<think>", end="</think>", start_tokens=(100,), end_tokens=(101,))
"""Marker ids apart from the pieces' (token i is piece i)."""


def generate(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, str, TaskOutcome | None]:
    """The reasoning, the answer and the finish reason the worker publishes for a thinking model writing `pieces`
    (one token each), as its runner builds a choice's output: detokenized, split, stop strings applied."""
    chunks: list[Chunk] = []
    choice = ChoiceOutput(
        detokenizer=PieceDetokenizer(pieces),
        stop=StopText(stop),
        reasoning=(ReasoningText(MARKED, reasoning=False), ReasoningTokens(MARKED, reasoning=False)),
    )
    output = TaskOutput(TaskId("task"), [choice], str, chunks.append, lambda _: None)
    ending = None
    for token in range(len(pieces)):
        if (ending := output.token(0, token, None)) is not None:
            break
    output.finish(0, RowEnd(ending or TaskOutcome.LENGTH, prompt_tokens=3))
    reasoning = "".join(chunk.reasoning for chunk in chunks)
    return reasoning, "".join(chunk.text for chunk in chunks), chunks[-1].finish_reason


THINKING_ABOUT_STOP = ["<think>", "\nThey said ", "ST", "OP", " so I", " stop.\n", "</think>", "\n\n", "Fine", "."]


def test_a_stop_string_in_the_reasoning_ends_nothing() -> None:
    reasoning, answer, reason = generate([*THINKING_ABOUT_STOP, " Bye"], ("STOP",))
    assert (reasoning, answer, reason) == ("They said STOP so I stop.", "Fine. Bye", TaskOutcome.LENGTH)


def test_a_stop_string_in_the_answer_ends_it_and_is_not_shown() -> None:
    reasoning, answer, reason = generate([*THINKING_ABOUT_STOP, " ST", "OP", " more"], ("STOP",))
    assert (reasoning, answer, reason) == ("They said STOP so I stop.", "Fine. ", TaskOutcome.STOP)
