"""A thinking model's reasoning, apart from its answer, in every dialect: OpenAI chat's `reasoning_content`, the
Responses API's `reasoning` items, Anthropic's `thinking` blocks, Ollama's `message.thinking`; streamed and not,
with the official clients, against the session's dialect cluster serving a scripted thinking model beside its own
(`helpers.dialects.thinking_model`), whose output crosses `<think>`/`</think>` the same way every time. Then the
controls: the template's `enable_thinking` from each dialect's switch, a thinking budget, the reasoning tokens in
the usage, and a thinking request for a model that does not think.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from helpers.dialects import DialectCluster
from helpers.tiny_models import ANSWER, ANSWER_TOKENS, THOUGHT, THOUGHT_TOKENS

pytestmark = pytest.mark.timeout(240)

QUESTION = [{"role": "user", "content": "Is it?"}]
MARKERS = 2
"""`<think>` and `</think>`: reasoning tokens too."""
REASONING_TOKENS = len(THOUGHT_TOKENS) + MARKERS
ANSWER_TOKEN_COUNT = len(ANSWER_TOKENS)
"""The answer's tokens (the end of the turn is not counted, as mlx-lm does not)."""


@pytest.fixture(scope="module")
def openai_client(dialect_cluster: DialectCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dialect_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def reasoning_of(message: Any) -> Any:
    return (message.model_extra or {}).get("reasoning_content")


# --- OpenAI chat ----------------------------------------------------------------------------------------------


def test_openai_chat_gives_the_reasoning_apart_from_the_answer(
    openai_client: openai.OpenAI, thinking_model: str
) -> None:
    answer = openai_client.chat.completions.create(model=thinking_model, messages=QUESTION, max_tokens=32)
    message = answer.choices[0].message
    assert (reasoning_of(message), message.content) == (THOUGHT, ANSWER)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert answer.usage.completion_tokens == REASONING_TOKENS + ANSWER_TOKEN_COUNT

    stream = openai_client.chat.completions.create(
        model=thinking_model, messages=QUESTION, max_tokens=32, stream=True, stream_options={"include_usage": True}
    )
    deltas = [(reasoning_of(c.choices[0].delta), c.choices[0].delta.content) for c in stream if c.choices]
    assert "".join(r or "" for r, _ in deltas) == THOUGHT
    assert "".join(t or "" for _, t in deltas) == ANSWER
    first_answer = next(i for i, (_, text) in enumerate(deltas) if text)
    assert all(not r for r, _ in deltas[first_answer + 1 :]), "the reasoning comes before the answer"
