"""The Ollama dialect, with the official `ollama` client against a live cluster (the session's
`dialect_cluster`: a tiny llama model on one runner): chat and generate, streaming or not, structured output,
a conversation with tool calls, embeddings, the model list, show, ps, version, pull and delete, and errors
in Ollama's shape.

The tiny model writes gibberish, so these tests assert structure and what constrained decoding guarantees.
Ollama has no `tool_choice`, so nothing makes the tiny model call a tool: the way a call goes out (arguments
as an object) is tested on the answer's shape, without a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import ollama
import pytest
from helpers.dialects import PERSON, DialectCluster
from helpers.harness import wait_for
from helpers.tiny_models import make_tiny_model
from jetshard_api.dialects.ollama.types import (
    AssistantMessage,
    ChatAnswer,
    FunctionCallBody,
    MessageBody,
    Options,
    ToolCallBody,
    messages,
    sampling,
    tool_call_bodies,
)
from jetshard_api.errors import ApiError
from jetshard_schema.cards import ModelSource
from jetshard_schema.models import builtin_cards
from jetshard_schema.types import SamplingParams, ToolCall
from jetshard_worker.library_boundary import load_tokenizer

pytestmark = pytest.mark.timeout(240)

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT = {"num_predict": 5, "temperature": 0}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(dialect_cluster: DialectCluster) -> ollama.Client:
    return ollama.Client(host=dialect_cluster.api, timeout=120)


def error_of(response: httpx.Response) -> str:
    """The body of an error, which must be Ollama's `{"error": message}` and nothing else."""
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    return str(body["error"])


# --- chat and generate -----------------------------------------------------------------------------------


def test_chat_answers_with_ollamas_fields_and_streams_the_same_text(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    # Options about resources are accepted (num_ctx past the model's context too), as are neutral ones.
    options = {**SHORT, "num_ctx": 1_000_000, "top_k": 0, "repeat_penalty": 1.0, "seed": -1}
    reply = client.chat(model=dialect_cluster.model, messages=QUESTION, options=options)
    assert reply.model == dialect_cluster.model and reply.created_at
    assert reply.message.role == "assistant" and isinstance(reply.message.content, str)
    assert reply.done is True and reply.done_reason in ("stop", "length")
    assert reply.eval_count is not None and 1 <= reply.eval_count <= 5
    assert reply.prompt_eval_count is not None and reply.prompt_eval_count > 5
    durations = [reply.load_duration, reply.prompt_eval_duration, reply.eval_duration]
    assert all(isinstance(d, int) and d >= 0 for d in durations)
    assert reply.total_duration is not None and reply.total_duration >= sum(d or 0 for d in durations)

    pieces = list(client.chat(model=f"{dialect_cluster.model}:latest", messages=QUESTION, options=SHORT, stream=True))
    *partial, last = pieces
    assert all(p.done is False and p.done_reason is None and p.eval_count is None for p in partial)
    assert last.done is True and last.done_reason == reply.done_reason and last.eval_count == reply.eval_count
    assert "".join(p.message.content or "" for p in pieces) == reply.message.content


def test_stop_strings_cut_the_answer_and_there_may_be_more_than_openais_four(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    """Editors built for Ollama send several stop strings; Ollama takes any number."""
    options = {**SHORT, "temperature": 0}
    whole = client.generate(model=dialect_cluster.model, prompt="hello", raw=True, options=options).response
    stop = whole[len(whole) // 2 :][:3]
    assert stop, whole
    unseen = [f"<never {i}>" for i in range(7)]
    cut = client.generate(
        model=dialect_cluster.model, prompt="hello", raw=True, options={**options, "stop": [*unseen, stop]}
    )
    assert cut.response == whole[: whole.index(stop)] and cut.done_reason == "stop"


def test_a_last_assistant_message_is_continued_not_answered(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    """As in Ollama, an assistant's message last is text the answer goes on from (a prefill): the answer is what
    the model generates from the prompt that ends with that text, still in the assistant's turn."""
    conversation = [*QUESTION, {"role": "assistant", "content": "It is"}]
    continued = client.chat(model=dialect_cluster.model, messages=conversation, options=SHORT).message.content
    tokenizer = load_tokenizer(dialect_cluster.model_dir)
    prompt = tokenizer.apply_chat_template(conversation, continue_final_message=True, tokenize=False)
    assert prompt.endswith("It is")
    raw = client.generate(model=dialect_cluster.model, prompt=prompt, raw=True, options=SHORT).response
    assert continued == raw
    with pytest.raises(ollama.ResponseError, match="tool calls"):
        called = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
        client.chat(model=dialect_cluster.model, messages=[*QUESTION, called], options=SHORT)


def test_the_http_default_is_a_stream_of_json_lines(dialect_cluster: DialectCluster) -> None:
    body = {"model": dialect_cluster.model, "messages": QUESTION, "options": SHORT}
    response = httpx.post(f"{dialect_cluster.api}/api/chat", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_with_and_without_the_template(client: ollama.Client, dialect_cluster: DialectCluster) -> None:
    reply = client.generate(model=dialect_cluster.model, prompt="hello", system="Be brief.", options=SHORT)
    assert isinstance(reply.response, str) and reply.done and reply.done_reason in ("stop", "length")
    raw = client.generate(model=dialect_cluster.model, prompt="hello", raw=True, options=SHORT)
    # The chat template wraps the prompt in the system and user turns; raw sends the prompt alone.
    assert raw.prompt_eval_count is not None and reply.prompt_eval_count is not None
    assert raw.prompt_eval_count < reply.prompt_eval_count
    streamed = list(client.generate(model=dialect_cluster.model, prompt="hello", raw=True, options=SHORT, stream=True))
    assert "".join(p.response or "" for p in streamed) == raw.response and streamed[-1].done


def test_nothing_to_answer_loads_the_model(client: ollama.Client, dialect_cluster: DialectCluster) -> None:
    assert client.chat(model=dialect_cluster.model, messages=[]).done_reason == "load"
    assert client.generate(model=dialect_cluster.model, prompt="").done_reason == "load"
    # A keep-alive that is no duration is refused, naming it (0 unloads: tests/test_keep_alive.py).
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model=dialect_cluster.model, keep_alive="soon")
    assert caught.value.status_code == 400 and "keep_alive 'soon' is not a duration" in caught.value.error
    for not_go in ("\u0665s", " 5m", "5m ", "-"):  # an Arabic-Indic 5, spaces, a sign alone: Go refuses them too
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model=dialect_cluster.model, keep_alive=not_go)
        assert caught.value.status_code == 400 and "is not a duration" in caught.value.error, not_go


def test_format_schema_and_json_always_parse(client: ollama.Client, dialect_cluster: DialectCluster) -> None:
    for seed in range(4):
        options = {"temperature": 1, "seed": seed, "num_predict": 60}
        reply = client.chat(model=dialect_cluster.model, messages=QUESTION, format=PERSON, options=options)
        jsonschema.validate(json.loads(reply.message.content or ""), PERSON)
    pieces = client.generate(
        model=dialect_cluster.model, prompt="hi", format="json", options={"num_predict": 12}, stream=True
    )
    assert isinstance(json.loads("".join(p.response or "" for p in pieces)), dict)


def test_a_conversation_with_a_tool_call_and_its_result_is_answered(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    call = ollama.Message.ToolCall(
        function=ollama.Message.ToolCall.Function(name="get_weather", arguments={"city": "Paris"})
    )
    conversation: list[Any] = [
        *QUESTION,
        ollama.Message(role="assistant", tool_calls=[call]),
        ollama.Message(role="tool", tool_name="get_weather", content='{"temperature": 21}'),
    ]
    before = client.chat(model=dialect_cluster.model, messages=QUESTION, tools=[WEATHER_TOOL], options=SHORT)
    after = client.chat(model=dialect_cluster.model, messages=conversation, tools=[WEATHER_TOOL], options=SHORT)
    assert after.done and after.prompt_eval_count is not None and before.prompt_eval_count is not None
    assert after.prompt_eval_count > before.prompt_eval_count + 10  # the call and its result are in the prompt

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
          city: The city
        """
        return "sunny"

    assert client.chat(model=dialect_cluster.model, messages=QUESTION, tools=[get_weather], options=SHORT).done


def test_a_tool_message_answers_the_call_of_its_name() -> None:
    """Ollama's calls have no ids; the conversation given to the model pairs each result with its call."""
    calls = [
        ToolCallBody(function=FunctionCallBody(name="a", arguments={"x": 1})),
        ToolCallBody(function=FunctionCallBody(name="b")),
    ]
    converted = messages(
        [
            MessageBody(role="assistant", tool_calls=calls),
            MessageBody(role="tool", tool_name="b", content="B"),
            MessageBody(role="tool", content="A"),
        ]
    )
    assistant, b, a = converted
    assert [c.arguments for c in assistant.tool_calls] == ['{"x": 1}', "{}"]
    assert b.tool_call_id == assistant.tool_calls[1].id and b.name == "b"
    assert a.tool_call_id == assistant.tool_calls[0].id


def test_tool_calls_go_out_with_their_arguments_as_an_object() -> None:
    calls = tool_call_bodies([ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')], 2)
    message = AssistantMessage(role="assistant", content="", tool_calls=calls)
    answer = ChatAnswer(model="m", created_at="2025-01-01T00:00:00Z", done=True, message=message)
    parsed = ollama.ChatResponse.model_validate(msgspec.to_builtins(answer))
    (call,) = parsed.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert msgspec.to_builtins(calls)[0]["function"]["index"] == 2


def test_options_map_onto_sampling() -> None:
    assert sampling(Options(num_predict=-1, seed=-1, num_ctx=8), context_length=2048).max_tokens == 2048
    assert sampling(Options(num_predict=-2), context_length=2048).max_tokens == 2048
    assert sampling(Options(seed=-1), None).seed is None  # Ollama's random seed
    neutral = Options(typical_p=1, tfs_z=1, mirostat=0, penalize_newline=True)
    assert sampling(neutral, None) == sampling(None, None)
    options = Options(top_k=40, min_p=0.05, repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5)
    assert sampling(options, None) == SamplingParams(
        top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5
    )
    assert sampling(Options(top_k=-1, repeat_last_n=-1), None) == SamplingParams(top_k=0)  # Ollama's "no limit"
    assert sampling(Options(repeat_last_n=64), None).repeat_last_n == 64
    with pytest.raises(ApiError) as caught:
        sampling(Options(mirostat=2), None)
    assert caught.value.status == 400 and caught.value.param == "options.mirostat"


def test_integer_options_given_as_floats_are_cut_to_their_whole_part_as_ollama_does(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    options = {"num_predict": 3.9, "top_k": 1.0, "seed": 7.0, "temperature": 0}
    reply = client.generate(model=dialect_cluster.model, prompt="hi", options=options)
    assert reply.eval_count == 3 and reply.done_reason == "length"


def test_logprobs_stream_per_piece_and_add_up(client: ollama.Client, dialect_cluster: DialectCluster) -> None:
    options = {"num_predict": 4, "temperature": 0}
    reply = client.generate(model=dialect_cluster.model, prompt="hi", logprobs=True, top_logprobs=2, options=options)
    assert reply.logprobs is not None and len(reply.logprobs) == reply.eval_count
    assert "".join(lp.token for lp in reply.logprobs) == reply.response
    assert all(len(lp.top_logprobs or []) == 2 for lp in reply.logprobs)
    pieces = client.generate(model=dialect_cluster.model, prompt="hi", logprobs=True, options=options, stream=True)
    assert [lp.token for p in pieces for lp in p.logprobs or []] == [lp.token for lp in reply.logprobs]


# --- embeddings -------------------------------------------------------------------------------------------


def test_embed_returns_normalised_vectors_of_the_hidden_size(
    client: ollama.Client, dialect_cluster: DialectCluster
) -> None:
    result = client.embed(model=dialect_cluster.model, input=["the capital of France", "a"])
    assert len(result.embeddings) == 2 and result.prompt_eval_count and result.prompt_eval_count > 2
    for vector in result.embeddings:
        assert len(vector) == 64 and math.fsum(v * v for v in vector) == pytest.approx(1.0, abs=1e-4)
    short = client.embed(model=dialect_cluster.model, input="a", dimensions=8).embeddings[0]
    assert len(short) == 8 and math.fsum(v * v for v in short) == pytest.approx(1.0, abs=1e-4)
    legacy = client.embeddings(model=dialect_cluster.model, prompt="a").embedding
    assert list(legacy) == pytest.approx(list(result.embeddings[1]), abs=1e-6)
    # No input loads the model, as in Ollama: no vector, no error.
    for nothing in ("", []):
        assert client.embed(model=dialect_cluster.model, input=nothing).embeddings == []


# --- models -----------------------------------------------------------------------------------------------


def test_tags_show_ps_and_version(client: ollama.Client, dialect_cluster: DialectCluster) -> None:
    name = f"{dialect_cluster.model}:latest"
    listed = {m.model: m for m in client.list().models}
    assert name in listed
    model = listed[name]
    assert model.size and model.size > 0 and model.details and model.details.family == "llama"
    assert model.digest is None, "a Hub repository's files have no one hash: none is invented"
    packaged = [card for card in builtin_cards().values() if card.source_sha256]
    assert packaged and all(listed[f"{card.model_id}:latest"].digest == card.source_sha256 for card in packaged)
    # A card made of a GGUF file (packaged, imported, or one file of a Hub repo) is listed as one.
    for card in builtin_cards().values():
        expected = "gguf" if card.source is not ModelSource.HUB else "safetensors"
        assert listed[f"{card.model_id}:latest"].details.format == expected, card.model_id  # type: ignore[union-attr]

    shown = client.show(name)
    assert shown.capabilities is not None and {"completion", "tools", "embedding"} <= set(shown.capabilities)
    assert shown.modelinfo is not None and shown.modelinfo["llama.embedding_length"] == 64
    assert shown.details is not None and shown.details.family == "llama"

    running = client.ps().models
    assert any(m.model == name and m.context_length == 2048 for m in running)

    version = httpx.get(f"{dialect_cluster.api}/api/version").json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 6, 0)


def test_pull_downloads_a_model_and_delete_removes_it(
    client: ollama.Client, dialect_cluster: DialectCluster, tmp_path: Path
) -> None:
    assert client.pull(dialect_cluster.model).status == "success"  # already here

    pulled = "jetshard-test/tiny-pulled"
    dialect_cluster.cluster.hub.add_repo(pulled, make_tiny_model(tmp_path / "pulled", num_layers=2, num_files=2))
    progress = list(client.pull(pulled, stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    layers = [p for p in progress if p.total]
    assert all(p.digest is None for p in progress), "the tiny model has no one file whose sha256 to name"
    assert layers and layers[-1].total and layers[-1].completed == layers[-1].total
    assert f"{pulled}:latest" in [m.model for m in client.list().models]

    assert client.delete(pulled).status == "success"
    assert f"{pulled}:latest" not in [m.model for m in client.list().models]
    assert wait_for(lambda: all(pulled not in d for d in dialect_cluster.cluster.get("/state")["downloads"].values()))

    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("nobody/nothing")  # the Hub has no such model
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete("nobody/nothing")
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete(dialect_cluster.model)  # its instance uses it
    assert caught.value.status_code == 409


# --- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "status"),
    [("nobody/nothing", 404), ("jetshard-test/tiny-dialects:7b", 404), ("llama3", 404), ("../../llama3", 400)],
)
def test_model_errors_in_ollamas_shape(client: ollama.Client, model: str, status: int) -> None:
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as caught:
            result = client.chat(model=model, messages=QUESTION, stream=stream)  # type: ignore[call-overload]
            list(result) if stream else None
        assert caught.value.status_code == status and caught.value.error


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"options": {"temperature": "hot"}}, "temperature"),
        ({"options": {"top_k": -2}}, "top_k"),
        ({"options": {"typical_p": 0.9}}, "typical_p"),
        ({"options": {"num_predict": 0}}, "num_predict"),
        ({"options": {"num_predict": "5"}}, "num_predict"),
        ({"format": "yaml"}, "format"),
        ({"think": True}, "think"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    dialect_cluster: DialectCluster, body: dict[str, Any], field: str
) -> None:
    request = {"model": dialect_cluster.model, "messages": QUESTION, "stream": False, **body}
    response = httpx.post(f"{dialect_cluster.api}/api/chat", json=request, timeout=30)
    assert response.status_code == 400 and field in error_of(response)


def test_a_body_is_read_as_json_whatever_its_content_type_and_one_that_is_not_is_an_error_in_ollamas_shape(
    dialect_cluster: DialectCluster,
) -> None:
    url = f"{dialect_cluster.api}/api/show"
    response = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and error_of(response)
    # Ollama's own examples (`curl http://localhost:11434/api/show -d '{"model": …}'`) send a form's Content-Type.
    body = json.dumps({"model": dialect_cluster.model}).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = httpx.post(url, content=body, headers={"content-type": content_type}, timeout=30)
        assert response.status_code == 200 and response.json()["details"], response.text
    response = httpx.post(url, content=b"model=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and error_of(response)


def test_the_ollama_cli_finds_the_server_up(dialect_cluster: DialectCluster) -> None:
    """The `ollama` CLI asks `HEAD /` before each command (its client's Heartbeat); Ollama answers HEAD on its
    version and tags routes too."""
    for path in ("/", "/api/version", "/api/tags"):
        response = httpx.head(f"{dialect_cluster.api}{path}", timeout=30)
        assert response.status_code == 200, (path, response.status_code)
