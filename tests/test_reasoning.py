"""A thinking model's reasoning, apart from its answer, in every dialect: OpenAI chat's `reasoning_content`, the
Responses API's `reasoning` items, Anthropic's `thinking` blocks, Ollama's `message.thinking`; streamed and not,
with the official clients, against the session's dialect cluster serving a scripted thinking model beside its own
(`helpers.tiny_models.thinking_model`), whose output crosses `<think>`/`</think>` the same way every time. Then the
controls: the template's `enable_thinking` from each dialect's switch, a thinking budget, the reasoning tokens in
the usage, and a thinking request for a model that does not think.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import ollama
import openai
import pytest
from helpers.dialects import DialectCluster
from helpers.tiny_models import ANSWER, ANSWER_TOKENS, THOUGHT, THOUGHT_TOKENS
from helpers.tiny_models import thinking_model as tiny_thinking_model

pytestmark = pytest.mark.timeout(240)

THINKING_MODEL = "jetshard-test/tiny-thinking"
QUESTION = [{"role": "user", "content": "Is it?"}]
MARKERS = 2
"""`<think>` and `</think>`: reasoning tokens too."""
REASONING_TOKENS = len(THOUGHT_TOKENS) + MARKERS
ANSWER_TOKEN_COUNT = len(ANSWER_TOKENS)
"""The answer's tokens (the end of the turn is not counted, as mlx-lm does not)."""


@pytest.fixture(scope="module")
def thinking_model(dialect_cluster: DialectCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scripted thinking model (`tiny_models.thinking_model`) served beside the dialect cluster's own, on the same
    node, and removed after: it reasons THOUGHT and answers ANSWER, so each dialect's split is asserted word for
    word."""
    with dialect_cluster.serving(THINKING_MODEL, tiny_thinking_model(tmp_path_factory.mktemp("thinking") / "tiny")):
        yield THINKING_MODEL


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
    chunks = list(stream)
    deltas = [(reasoning_of(c.choices[0].delta), c.choices[0].delta.content) for c in chunks if c.choices]
    assert "".join(r or "" for r, _ in deltas) == THOUGHT
    assert "".join(t or "" for _, t in deltas) == ANSWER
    first_answer = next(i for i, (_, text) in enumerate(deltas) if text)
    assert all(not r for r, _ in deltas[first_answer + 1 :]), "the reasoning comes before the answer"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_stop_string_ends_the_answer_never_the_reasoning(openai_client: openai.OpenAI, thinking_model: str) -> None:
    """As in vLLM: a stop string the model writes while it reasons ends nothing; in the answer it ends it."""
    in_reasoning = THOUGHT.split()[-1]
    answer = openai_client.chat.completions.create(
        model=thinking_model, messages=QUESTION, max_tokens=32, stop=[in_reasoning]
    )
    message = answer.choices[0].message
    assert (reasoning_of(message), message.content) == (THOUGHT, ANSWER)
    cut = openai_client.chat.completions.create(
        model=thinking_model, messages=QUESTION, max_tokens=32, stop=[ANSWER[1:]]
    )
    message = cut.choices[0].message
    assert (reasoning_of(message), message.content, cut.choices[0].finish_reason) == (THOUGHT, ANSWER[:1], "stop")


def test_a_prompt_that_opens_the_reasoning(openai_client: openai.OpenAI, thinking_model: str) -> None:
    """A template that ends the prompt with `<think>` (Qwen3-Thinking-2507's, DeepSeek-R1's): the model writes no
    start marker, and what it writes up to `</think>` is its reasoning all the same."""
    answer = openai_client.chat.completions.create(
        model=thinking_model,
        messages=QUESTION,
        max_tokens=32,
        extra_body={"chat_template_kwargs": {"think_in_prompt": True}},
    )
    message = answer.choices[0].message
    assert (reasoning_of(message), message.content) == (THOUGHT, ANSWER)
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS - 1  # no start marker


def test_a_think_marker_in_the_conversation_opens_no_reasoning(
    openai_client: openai.OpenAI, thinking_model: str
) -> None:
    """Only the template's opening of the answer may leave the model inside its reasoning: a user who writes the
    marker in a message gets the model's reasoning and answer as anyone else does."""
    for content in ("What is <think>?", "<think>"):
        answer = openai_client.chat.completions.create(
            model=thinking_model, messages=[{"role": "user", "content": content}], max_tokens=32
        )
        message = answer.choices[0].message
        assert (reasoning_of(message), message.content) == (THOUGHT, ANSWER), content


def test_openai_thinking_controls_reach_the_template(openai_client: openai.OpenAI, thinking_model: str) -> None:
    """`chat_template_kwargs` and `reasoning_effort: none` turn the reasoning off: the template closes it in the
    prompt, and the model answers at once."""
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        answer = openai_client.chat.completions.create(
            model=thinking_model, messages=QUESTION, max_tokens=32, extra_body=extra
        )
        message = answer.choices[0].message
        assert (reasoning_of(message), message.content) == (None, ANSWER), extra
        assert answer.usage is not None and answer.usage.completion_tokens_details is not None
        assert answer.usage.completion_tokens_details.reasoning_tokens == 0


def test_structured_output_and_forced_calls_constrain_the_answer_only(
    openai_client: openai.OpenAI, thinking_model: str
) -> None:
    """The model reasons freely, and only its answer follows the schema (or is the forced call)."""
    answer = openai_client.chat.completions.create(
        model=thinking_model, messages=QUESTION, max_tokens=40, response_format={"type": "json_object"}
    )
    message = answer.choices[0].message
    assert reasoning_of(message) == THOUGHT
    assert isinstance(json.loads(message.content or ""), dict)

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    answer = openai_client.chat.completions.create(
        model=thinking_model, messages=QUESTION, max_tokens=60, tools=[tool], tool_choice="required"
    )
    message = answer.choices[0].message
    assert reasoning_of(message) == THOUGHT
    assert message.tool_calls and message.tool_calls[0].function.name == "lookup"
    assert isinstance(json.loads(message.tool_calls[0].function.arguments), dict)


def test_a_request_for_a_model_that_cannot_think_leaves_the_template_alone(
    openai_client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    """Values a template does not read change nothing; ones the rendering sets, and an effort OpenAI does not
    name, are refused."""
    answer = openai_client.chat.completions.create(
        model=dialect_cluster.model, messages=QUESTION, max_tokens=3, temperature=0, reasoning_effort="high"
    )
    assert reasoning_of(answer.choices[0].message) is None
    # `self` and `conversations` too: the wrapper's own argument and what transformers renders the messages as.
    for reserved in ("tools", "self", "conversations"):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.chat.completions.create(
                model=dialect_cluster.model, messages=QUESTION, extra_body={"chat_template_kwargs": {reserved: []}}
            )
        assert caught.value.body["param"] == "chat_template_kwargs", reserved  # type: ignore[index]
        assert f"may not set {reserved}:" in caught.value.message
    nested: dict[str, Any] = {}
    for _ in range(500):  # deep enough to overflow the rendering's recursion, not the JSON decoder's
        nested = {"a": nested}
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=dialect_cluster.model, messages=QUESTION, extra_body={"chat_template_kwargs": nested}
        )
    assert caught.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "nested deeper than 32 levels" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=dialect_cluster.model, messages=QUESTION, extra_body={"reasoning_effort": "extreme"}
        )
    assert caught.value.body["param"] == "reasoning_effort"  # type: ignore[index]


# --- the Responses API ------------------------------------------------------------------------------------------


def test_responses_give_a_reasoning_item_before_the_message(openai_client: openai.OpenAI, thinking_model: str) -> None:
    response = openai_client.responses.create(model=thinking_model, input="Is it?", max_output_tokens=32)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [part.text for part in reasoning.content or []] == [THOUGHT]
    assert response.output_text == ANSWER
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS

    events = list(
        openai_client.responses.create(model=thinking_model, input="Is it?", max_output_tokens=32, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [THOUGHT]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [item.type for item in completed.response.output] == ["reasoning", "message"]
    assert completed.response.output_text == ANSWER

    quiet = openai_client.responses.create(
        model=thinking_model, input="Is it?", max_output_tokens=32, reasoning={"effort": "none"}
    )
    assert [item.type for item in quiet.output] == ["message"] and quiet.output_text == ANSWER

    # A summary is not made, but only OpenAI's kinds of it are accepted.
    summarised = openai_client.responses.create(
        model=thinking_model, input="Is it?", max_output_tokens=32, reasoning={"summary": "detailed"}
    )
    assert summarised.output_text == ANSWER
    with pytest.raises(openai.BadRequestError, match=r"reasoning\.summary"):
        openai_client.responses.create(
            model=thinking_model,
            input="Is it?",
            max_output_tokens=32,
            reasoning={"summary": "nonsense"},  # type: ignore[typeddict-item]
        )


# --- Anthropic --------------------------------------------------------------------------------------------------


def blocks(message: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_anthropic_thinking_blocks_streamed_and_not(anthropic_client: anthropic.Anthropic, thinking_model: str) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 16}
    request: Any = {"model": thinking_model, "max_tokens": 32, "messages": QUESTION, "thinking": thinking}
    message = anthropic_client.messages.create(**request)
    assert blocks(message) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert message.usage.output_tokens == REASONING_TOKENS + ANSWER_TOKEN_COUNT

    with anthropic_client.messages.stream(**request) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert blocks(streamed) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert events.count("content_block_start") == 2 and "signature" in events

    # The thinking block goes back with the next turn, as Anthropic's clients send it; it is left out of the prompt.
    conversation: Any = [*QUESTION, {"role": "assistant", "content": message.content}, *QUESTION]
    again = anthropic_client.messages.create(**{**request, "messages": conversation})
    assert blocks(again) == [("thinking", THOUGHT), ("text", ANSWER)]

    # Anthropic's models think only when asked: without `thinking`, the template is told not to.
    plain = anthropic_client.messages.create(model=thinking_model, max_tokens=32, messages=QUESTION)
    assert blocks(plain) == [("text", ANSWER)]


def test_a_thinking_budget_ends_the_reasoning_with_the_end_marker(
    anthropic_client: anthropic.Anthropic, thinking_model: str
) -> None:
    """Two tokens of reasoning, then the model's `</think>` is forced, and it answers as it would have."""
    message = anthropic_client.messages.create(
        model=thinking_model,
        max_tokens=32,
        messages=QUESTION,
        thinking={"type": "enabled", "budget_tokens": 2},
    )
    assert blocks(message) == [("thinking", "hm"), ("text", ANSWER)]
    assert message.usage.output_tokens == 2 + MARKERS + ANSWER_TOKEN_COUNT


def test_anthropic_refuses_thinking_for_a_model_that_cannot(
    anthropic_client: anthropic.Anthropic, dialect_cluster: DialectCluster, thinking_model: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model=dialect_cluster.model,
            max_tokens=32,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": 16},
        )
    assert "does not support thinking" in caught.value.message
    with pytest.raises(anthropic.BadRequestError, match="does not support thinking"):  # counting its tokens too
        anthropic_client.messages.count_tokens(
            model=dialect_cluster.model, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 16}
        )
    with pytest.raises(anthropic.BadRequestError):  # the budget leaves no room for the answer
        anthropic_client.messages.create(
            model=thinking_model, max_tokens=16, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 16}
        )
    # An effort Anthropic does not name is refused, as OpenAI's dialects refuse one OpenAI does not.
    request: Any = {"model": thinking_model, "max_tokens": 16, "messages": QUESTION}
    anthropic_client.messages.create(**request, extra_body={"output_config": {"effort": "max"}})
    for effort in ("extreme", "x" * 10_000):
        with pytest.raises(anthropic.BadRequestError, match=r"output_config\.effort"):
            anthropic_client.messages.create(**request, extra_body={"output_config": {"effort": effort}})


# --- Ollama -----------------------------------------------------------------------------------------------------


def test_ollama_think_gives_message_thinking(ollama_client: ollama.Client, thinking_model: str) -> None:
    options = {"num_predict": 32}
    answer = ollama_client.chat(model=thinking_model, messages=QUESTION, think=True, options=options)
    assert (answer.message.thinking, answer.message.content) == (THOUGHT, ANSWER)
    assert answer.eval_count == REASONING_TOKENS + ANSWER_TOKEN_COUNT

    pieces = list(ollama_client.chat(model=thinking_model, messages=QUESTION, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in pieces) == THOUGHT
    assert "".join(p.message.content or "" for p in pieces) == ANSWER

    generated = ollama_client.generate(model=thinking_model, prompt="Is it?", think=True, options=options)
    assert (generated.thinking, generated.response) == (THOUGHT, ANSWER)

    quiet = ollama_client.chat(model=thinking_model, messages=QUESTION, think=False, options=options)
    assert (quiet.message.thinking, quiet.message.content) == (None, ANSWER)


def test_ollama_refuses_think_for_a_model_that_cannot(
    ollama_client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as caught:
            result = ollama_client.chat(model=dialect_cluster.model, messages=QUESTION, think=True, stream=stream)  # type: ignore[call-overload]
            list(result) if stream else None
        assert caught.value.status_code == 400 and "does not support thinking" in caught.value.error


# --- capabilities -----------------------------------------------------------------------------------------------


def test_models_say_what_they_do(
    openai_client: openai.OpenAI, ollama_client: ollama.Client, dialect_cluster: DialectCluster, thinking_model: str
) -> None:
    """The thinking model's card, derived from its Hub files when it was added, says it thinks; the plain one's does
    not; both in GET /v1/models (and one model's own) and in Ollama's /api/show."""
    listed = {m.id: (m.model_extra or {})["capabilities"] for m in openai_client.models.list()}
    assert listed[thinking_model] == ["completion", "tools", "embedding", "thinking"]
    assert listed[dialect_cluster.model] == ["completion", "tools", "embedding"]
    assert "thinking" in listed["mlx-community/Qwen3-0.6B-4bit"]  # a built-in card
    retrieved = openai_client.models.retrieve(thinking_model)
    assert (retrieved.model_extra or {})["capabilities"] == listed[thinking_model]
    assert ollama_client.show(thinking_model).capabilities == listed[thinking_model]
    assert ollama_client.show(dialect_cluster.model).capabilities == listed[dialect_cluster.model]
