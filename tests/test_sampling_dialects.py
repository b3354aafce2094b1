"""`top_k`, `min_p` and the repetition, presence and frequency penalties through every dialect, with the official
clients against the session's `dialect_cluster` (a tiny llama model on one runner): each reaches the engine under
the name its ecosystem gives it (vLLM's extras through the openai client's `extra_body`, Ollama's options,
Anthropic's `top_k`), and a value out of range is a 400 in the dialect's shape naming the field.

The tiny model writes gibberish, so these tests compare token streams: the same request through two dialects gives
the same answer; a cut to the most likely token gives the greedy answer at any temperature; a penalty changes it.
How the engine applies each one is tested in tests/test_engine.py.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers.dialects import DialectCluster

pytestmark = pytest.mark.timeout(240)

QUESTION: Any = [{"role": "user", "content": "Tell me a long story about a cat and a dog."}]
LONG = 48
"""Tokens: enough for the tiny model's greedy answer to repeat some."""
HOT = {"temperature": 2.0, "seed": 3}
OPENAIS_OWN = ("temperature", "seed", "presence_penalty", "frequency_penalty")
"""The sampling arguments of the openai client's `chat.completions.create`; vLLM's others go in `extra_body`."""


def openai_chat(client: openai.OpenAI, model: str, max_tokens: int = LONG, **sampling: Any) -> str:
    """The answer, with `sampling`'s values sent as the openai client sends vLLM's extras (`extra_body`) and
    OpenAI's own as arguments."""
    own = {k: sampling.pop(k) for k in OPENAIS_OWN if k in sampling}
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, extra_body=sampling, **own
    )
    return reply.choices[0].message.content or ""


def ollama_chat(client: ollama.Client, model: str, **options: Any) -> str:
    reply = client.chat(model=model, messages=QUESTION, options={"num_predict": LONG, **options})
    return reply.message.content or ""


@pytest.fixture(scope="module")
def greedy(openai_client: openai.OpenAI, dialect_cluster: DialectCluster) -> str:
    return openai_chat(openai_client, dialect_cluster.model, temperature=0)


def test_a_cut_to_the_likeliest_token_answers_greedily_at_any_temperature(
    openai_client: openai.OpenAI,
    anthropic_client: anthropic.Anthropic,
    ollama_client: ollama.Client,
    dialect_cluster: DialectCluster,
    greedy: str,
) -> None:
    model = dialect_cluster.model
    assert openai_chat(openai_client, model, **HOT) != greedy  # so the cuts below are what makes it greedy
    assert openai_chat(openai_client, model, top_k=1, **HOT) == greedy
    assert openai_chat(openai_client, model, min_p=1.0, **HOT) == greedy
    assert ollama_chat(ollama_client, model, top_k=1, **HOT) == greedy
    assert ollama_chat(ollama_client, model, min_p=1.0, **HOT) == greedy
    # Anthropic's temperature goes up to 1 and it has no seed: a cut at k=1 is greedy whatever the draw. (The
    # anthropic client no longer has arguments for either: older clients and other SDKs send them in the body.)
    message = anthropic_client.messages.create(
        model=model, messages=QUESTION, max_tokens=LONG, extra_body={"temperature": 1.0, "top_k": 1}
    )
    assert message.content[0].type == "text" and message.content[0].text == greedy
    completion = openai_client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=LONG, extra_body={"top_k": 1}, **HOT
    )
    plain = openai_client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG, temperature=0)
    assert completion.choices[0].text == plain.choices[0].text
    response = openai_client.responses.create(
        model=model, input=QUESTION, max_output_tokens=LONG, temperature=2.0, extra_body={"top_k": 1}
    )
    assert response.output_text == greedy


@pytest.mark.parametrize(
    ("openai_values", "ollama_options"),
    [
        ({"repetition_penalty": 3.0}, {"repeat_penalty": 3.0}),
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
        ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    ],
)
def test_a_penalty_changes_the_greedy_answer_the_same_way_in_every_dialect(
    openai_client: openai.OpenAI,
    ollama_client: ollama.Client,
    dialect_cluster: DialectCluster,
    greedy: str,
    openai_values: dict[str, float],
    ollama_options: dict[str, float],
) -> None:
    model = dialect_cluster.model
    penalised = openai_chat(openai_client, model, temperature=0, **openai_values)
    assert penalised != greedy
    assert ollama_chat(ollama_client, model, temperature=0, **ollama_options) == penalised
    response = openai_client.responses.create(
        model=model, input=QUESTION, max_output_tokens=LONG, temperature=0, extra_body=openai_values
    )
    assert response.output_text == penalised


def test_ollamas_repeat_last_n_bounds_the_penalties(
    ollama_client: ollama.Client, dialect_cluster: DialectCluster, greedy: str
) -> None:
    model = dialect_cluster.model
    penalised = ollama_chat(ollama_client, model, temperature=0, repeat_penalty=3.0)
    assert ollama_chat(ollama_client, model, temperature=0, repeat_penalty=3.0, repeat_last_n=-1) == penalised
    assert ollama_chat(ollama_client, model, temperature=0, repeat_penalty=3.0, repeat_last_n=0) == greedy


OUT_OF_RANGE = [
    ("top_k", -2),
    ("min_p", 1.5),
    ("repetition_penalty", 0),
    ("repetition_penalty", 11),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_openais_400_naming_it(
    openai_client: openai.OpenAI, dialect_cluster: DialectCluster, field: str, value: float
) -> None:
    model = dialect_cluster.model
    for create in (
        lambda: openai_client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=2, extra_body={field: value}
        ),
        lambda: openai_client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={field: value}),
        lambda: openai_client.responses.create(model=model, input="hi", max_output_tokens=2, extra_body={field: value}),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        body: Any = caught.value.body
        assert body["param"] == field and field in body["message"], body


OLLAMA_OUT_OF_RANGE = [
    ("top_k", -2),
    ("min_p", 1.5),
    ("repeat_penalty", 0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repeat_last_n", -2),
]


@pytest.mark.parametrize(("option", "value"), OLLAMA_OUT_OF_RANGE)
def test_a_value_out_of_range_is_ollamas_400_naming_it(
    ollama_client: ollama.Client, dialect_cluster: DialectCluster, option: str, value: float
) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.chat(model=dialect_cluster.model, messages=QUESTION, options={option: value})
    assert caught.value.status_code == 400 and f"options.{option}" in caught.value.error
    body = {"model": dialect_cluster.model, "prompt": "hi", "stream": False, "options": {option: value}}
    answered = httpx.post(f"{dialect_cluster.api}/api/generate", json=body, timeout=60)
    assert answered.status_code == 400 and list(answered.json()) == ["error"]


def test_a_negative_top_k_is_anthropics_400_naming_it(
    anthropic_client: anthropic.Anthropic, dialect_cluster: DialectCluster
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model=dialect_cluster.model, messages=QUESTION, max_tokens=2, extra_body={"top_k": -1}
        )
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "top_k" in body["error"]["message"]
