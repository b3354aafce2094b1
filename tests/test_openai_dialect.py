"""The OpenAI dialect beyond plain text, with the official `openai` client against a live cluster (the session's
`dialect_cluster`: a tiny llama model on one runner): tool calls, structured output, logprobs, `n` choices,
embeddings.

The tiny model writes gibberish, so these tests assert what constrained decoding guarantees (a valid call, a
document that validates) and what mlx-lm computes (logprobs, hidden states), not words.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import mlx.core as mx
import openai
import pytest
from helpers.dialects import PERSON, WEATHER_PARAMETERS, DialectCluster
from helpers.harness import wait_for

pytestmark = pytest.mark.timeout(240)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TAGGED_PERSON = {
    **PERSON,
    "properties": {
        **PERSON["properties"],
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": [*PERSON["required"], "active", "tags"],
}
"""A person with a boolean and a bounded array too."""


@pytest.fixture(scope="module")
def client(dialect_cluster: DialectCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dialect_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def leader_counters(dialect_cluster: DialectCluster) -> dict[str, Any]:
    (instance,) = dialect_cluster.cluster.instances_of(dialect_cluster.model)  # not the other tests' models
    runners = dialect_cluster.cluster.get("/state")["instances"][instance["instance_id"]]["runners"]
    return runners["0"].get("counters") or {}


@pytest.fixture(scope="module")
def reference(dialect_cluster: DialectCluster) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(dialect_cluster.model_dir))


def test_a_named_tool_choice_forces_a_valid_call_and_the_result_goes_back(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=dialect_cluster.model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=tool_choice, max_tokens=200
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert calls[0].id.startswith("call_")

    conversation: list[Any] = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=dialect_cluster.model, messages=conversation, tools=[WEATHER_TOOL], max_tokens=5, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_forced_call_streams_as_tool_call_deltas(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    stream = client.chat.completions.create(
        model=dialect_cluster.model,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        stream=True,
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.function and call.function.name:
                    names.append(call.function.name)
                arguments += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_tool_choice_none_answers_in_text(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    reply = client.chat.completions.create(
        model=dialect_cluster.model, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=5
    )
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason in ("stop", "length")


def test_json_schema_output_always_validates_at_temperature_1(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    """20 seeds, and a budget too small for some of them (the tiny model's tokens are mostly single bytes): the
    constraint closes open values in time."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": TAGGED_PERSON}}
    for seed in range(20):
        reply = client.chat.completions.create(
            model=dialect_cluster.model,
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=response_format,
            temperature=1,
            seed=seed,
            max_tokens=300 if seed % 2 else 90,
        )
        text = reply.choices[0].message.content or ""
        assert text.startswith("{"), (seed, text)
        jsonschema.validate(json.loads(text), TAGGED_PERSON)
        assert reply.usage is not None and reply.usage.completion_tokens <= (300 if seed % 2 else 90)


def test_json_object_parses_even_when_max_tokens_cuts_it(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    for stream in (False, True):
        kwargs: Any = {"response_format": {"type": "json_object"}, "temperature": 1, "seed": 3, "max_tokens": 12}
        if stream:
            pieces = client.chat.completions.create(
                model=dialect_cluster.model, messages=QUESTION, stream=True, **kwargs
            )
            text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        else:
            reply = client.chat.completions.create(model=dialect_cluster.model, messages=QUESTION, **kwargs)
            text = reply.choices[0].message.content or ""
        assert isinstance(json.loads(text), dict), text


def test_a_schema_the_grammar_cannot_follow_is_a_400(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=dialect_cluster.model, messages=QUESTION, response_format=response_format, max_tokens=5
        )
    assert caught.value.code == "invalid_schema"


def test_a_budget_too_small_for_any_valid_document_is_a_400(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    """TAGGED_PERSON's shortest document takes more than 10 tokens: no output could be valid, so none is made."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": TAGGED_PERSON}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=dialect_cluster.model, messages=QUESTION, response_format=response_format, max_tokens=10
        )
    assert caught.value.code == "invalid_request"
    assert "max_tokens 10 cannot hold a JSON document" in caught.value.message


def test_logprobs_of_the_greedy_tokens_are_mlx_lms_log_softmax(
    client: openai.OpenAI, dialect_cluster: DialectCluster, reference: tuple[Any, Any]
) -> None:
    model, tokenizer = reference
    messages = [{"role": "user", "content": "hello world"}]
    reply = client.chat.completions.create(
        model=dialect_cluster.model, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    generated: list[int] = []
    for entry in content:
        logits = model(mx.array([prompt + generated]))[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        token = int(mx.argmax(logprobs).item())
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            sorted(logprobs.tolist(), reverse=True)[:2], abs=1e-4
        )
        generated.append(token)

    streamed = client.chat.completions.create(
        model=dialect_cluster.model, messages=messages, temperature=0, max_tokens=6, logprobs=True, stream=True
    )
    tokens = []
    for chunk in streamed:
        for choice in chunk.choices:
            tokens += [lp.token for lp in (choice.logprobs.content or [])] if choice.logprobs else []
    assert tokens == [entry.token for entry in content]


def test_completions_report_logprobs_in_the_legacy_shape(
    client: openai.OpenAI, dialect_cluster: DialectCluster
) -> None:
    reply = client.completions.create(
        model=dialect_cluster.model, prompt="hello", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    # Keyed by token text: two tokens that decode alike (partial UTF-8 bytes) share a key.
    assert logprobs.top_logprobs and all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    # Each token's place in the text, streamed or not.
    starts = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == starts
    stream = client.completions.create(
        model=dialect_cluster.model, prompt="hello", max_tokens=4, temperature=0, logprobs=2, stream=True
    )
    for empty in ("", [], [""]):
        with pytest.raises(openai.BadRequestError, match="prompt must not be empty"):
            client.completions.create(model=dialect_cluster.model, prompt=empty, max_tokens=4)  # type: ignore[arg-type]
    streamed = [
        offset
        for chunk in stream
        if chunk.choices[0].logprobs
        for offset in chunk.choices[0].logprobs.text_offset or ()
    ]
    assert streamed == starts


def test_n_choices_share_one_prefill_and_differ(client: openai.OpenAI, dialect_cluster: DialectCluster) -> None:
    long_prompt = [{"role": "user", "content": "Tell me a long story about the sea and the ships on it. " * 3}]
    hits_before = leader_counters(dialect_cluster).get("prefix_hits", 0)
    reply = client.chat.completions.create(
        model=dialect_cluster.model, messages=long_prompt, n=3, temperature=1, seed=11, max_tokens=8
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage is not None and 3 <= reply.usage.completion_tokens <= 24
    # The first choice's prefill is saved; the other two start from it.
    assert wait_for(lambda: leader_counters(dialect_cluster).get("prefix_hits", 0) >= hits_before + 2, 30)

    stream = client.chat.completions.create(
        model=dialect_cluster.model, messages=long_prompt, n=3, temperature=1, seed=11, max_tokens=8, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]  # same seed, same choices


def test_embeddings_are_the_normalised_mean_of_the_models_hidden_states(
    client: openai.OpenAI, dialect_cluster: DialectCluster, reference: tuple[Any, Any]
) -> None:
    model, tokenizer = reference
    texts = ["the capital of France", "a"]
    result = client.embeddings.create(model=dialect_cluster.model, input=texts)  # the client asks for base64
    assert [d.index for d in result.data] == [0, 1]
    for text, data in zip(texts, result.data, strict=True):
        hidden = model.model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32).mean(axis=0)
        assert data.embedding == pytest.approx((hidden / mx.linalg.norm(hidden)).tolist(), abs=1e-4)
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)

    plain = client.embeddings.create(model=dialect_cluster.model, input="a", encoding_format="float")
    assert plain.data[0].embedding == pytest.approx(result.data[1].embedding, abs=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=dialect_cluster.model, input=[""])


def test_token_id_inputs_are_embedded_as_they_are(
    client: openai.OpenAI, dialect_cluster: DialectCluster, reference: tuple[Any, Any]
) -> None:
    """OpenAI's and llama.cpp's other forms of `input`: one input's token ids, or a list of such lists. The ids of a
    text embed to the text's vector; ids outside the model's vocabulary, negative ones, an empty list and a mix of
    forms are 400s, and the runner goes on serving."""
    _, tokenizer = reference
    texts = ["the capital of France", "a"]
    ids = [tokenizer.encode(text) for text in texts]
    by_text = client.embeddings.create(model=dialect_cluster.model, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=dialect_cluster.model, input=ids, encoding_format="float")
    for text_data, ids_data in zip(by_text.data, by_ids.data, strict=True):
        assert ids_data.embedding == pytest.approx(text_data.embedding, abs=1e-5)
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model=dialect_cluster.model, input=ids[1], encoding_format="float")
    assert [d.index for d in one.data] == [0]
    assert one.data[0].embedding == pytest.approx(by_text.data[1].embedding, abs=1e-5)

    vocab_size = json.loads((dialect_cluster.model_dir / "config.json").read_text())["vocab_size"]
    for wrong, why in [
        ([ids[0], [*ids[1], vocab_size]], f"input 1 holds token id {vocab_size}"),
        ([1, -2, 3], "input holds -2"),
        ([[1], []], "input[1] is an empty list of token ids"),
        (["a", [1]], "not a mix"),
        ([1, [2]], "not a mix"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=dialect_cluster.model, input=wrong)  # type: ignore[arg-type]
        assert why in refused.value.message
    again = client.embeddings.create(model=dialect_cluster.model, input=ids[1], encoding_format="float")
    assert again.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
