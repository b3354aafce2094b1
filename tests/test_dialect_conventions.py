"""What every dialect does the way its ecosystem's servers do, with the official clients against the session's
`dialect_cluster`: a request carrying other servers' extra fields is answered (vLLM, llama-server and Ollama
ignore what they do not read); a model the cluster cannot have (`gpt-3.5-turbo`, `llama3`) is the ecosystem's
404, and only a hostile model id a 400; `GET /health` answers as vLLM's and llama-server's does.
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

QUESTION: Any = [{"role": "user", "content": "Hi"}]
EXTRAS = {"cache_prompt": True, "repetition_penalty_range": 64, "another_servers_option": {"x": [1, 2]}}
"""Fields no dialect here knows, as clients made for llama-server, vLLM and others send them."""
HOSTILE_IDS = ["../../etc/passwd", "org/na\x00me", "x" * 10_000]


def test_unknown_top_level_fields_are_ignored_in_every_dialect(
    dialect_cluster: DialectCluster, openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic
) -> None:
    model = dialect_cluster.model
    chat = openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, extra_body=EXTRAS)
    assert chat.choices[0].finish_reason == "length"
    response = openai_client.responses.create(model=model, input="Hi", max_output_tokens=2, extra_body=EXTRAS)
    assert response.status == "incomplete"
    message = anthropic_client.messages.create(model=model, messages=QUESTION, max_tokens=2, extra_body=EXTRAS)
    assert message.stop_reason == "max_tokens"
    # The ollama client sends only the fields it knows.
    body = {"model": model, "messages": QUESTION, "stream": False, "options": {"num_predict": 2}, **EXTRAS}
    answered = httpx.post(f"{dialect_cluster.api}/api/chat", json=body, timeout=120)
    assert answered.status_code == 200 and answered.json()["done_reason"] == "length", answered.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_of_another_server_is_openais_404(openai_client: openai.OpenAI, stream: bool) -> None:
    for create in (
        lambda: openai_client.chat.completions.create(model="gpt-3.5-turbo", messages=QUESTION, stream=stream),
        lambda: openai_client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi", stream=stream),
        lambda: openai_client.responses.create(model="gpt-4o", input="Hi", stream=stream),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            create()
        assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.embeddings.create(model="text-embedding-3-small", input="Hi")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.models.retrieve("gpt-3.5-turbo")
    assert missing.value.code == "model_not_found"


def test_a_model_of_another_server_is_anthropics_and_ollamas_404(
    dialect_cluster: DialectCluster, anthropic_client: anthropic.Anthropic
) -> None:
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as missing:
            anthropic_client.messages.create(model="claude-sonnet-4-5", messages=QUESTION, max_tokens=5, stream=stream)
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    client = ollama.Client(host=dialect_cluster.api, timeout=120)
    for ask in (
        lambda: client.chat(model="llama3", messages=QUESTION, stream=False),
        lambda: client.generate(model="llama3.2:1b", prompt="Hi"),
        lambda: client.embed(model="nomic-embed-text", input="Hi"),
        lambda: client.show("llama3"),
    ):
        with pytest.raises(ollama.ResponseError) as not_found:
            ask()
        assert not_found.value.status_code == 404
        assert not_found.value.error.startswith("model '") and "' not found" in not_found.value.error


@pytest.mark.parametrize("model", HOSTILE_IDS, ids=["path", "control-character", "10-KB"])
def test_a_hostile_model_id_is_still_a_400_in_every_dialect(
    dialect_cluster: DialectCluster, openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=model, messages=QUESTION)
    assert refused.value.code == "invalid_model_id"
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model=model, input="Hi")
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=model, messages=QUESTION, max_tokens=5)
    body = {"model": model, "messages": QUESTION, "stream": False}
    refused_here = httpx.post(f"{dialect_cluster.api}/api/chat", json=body, timeout=30)
    assert refused_here.status_code == 400 and list(refused_here.json()) == ["error"]


def test_health_answers_as_llama_servers_does(dialect_cluster: DialectCluster) -> None:
    response = httpx.get(f"{dialect_cluster.api}/health", timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_an_endpoint_that_is_not_here_is_an_error_in_its_dialects_shape(
    dialect_cluster: DialectCluster, openai_client: openai.OpenAI
) -> None:
    """A path or method no route takes is answered in the shape of the dialect whose path it is under, naming it;
    Ollama's endpoints for making models that this cluster does not have say what to use instead."""
    client = ollama.Client(host=dialect_cluster.api, timeout=30)
    for ask, instead in (
        (lambda: client.copy(dialect_cluster.model, "mine"), "a model has one name"),
        (lambda: client.create(model="mine", from_=dialect_cluster.model), "jetshard models import-gguf"),
        (lambda: client.create_blob(__file__), "jetshard models import-gguf"),
        (lambda: client.push(dialect_cluster.model), "no registry"),
    ):
        with pytest.raises(ollama.ResponseError) as missing:
            ask()
        assert missing.value.status_code == 404 and instead in missing.value.error, missing.value.error
    for method, path, status, error in (
        ("POST", "/api/nothing", 404, "POST /api/nothing is not an endpoint of this API"),
        ("GET", "/api/chat", 405, "/api/chat does not take GET"),
    ):
        answered = httpx.request(method, f"{dialect_cluster.api}{path}", timeout=30)
        assert answered.status_code == status and list(answered.json()) == ["error"]
        assert answered.json()["error"].startswith(error), answered.text
    anthropic_shaped = httpx.get(f"{dialect_cluster.api}/v1/messages/nothing", timeout=30)
    assert anthropic_shaped.json()["type"] == "error" and anthropic_shaped.json()["error"]["type"] == "not_found_error"
    # A request with no body says so, in its dialect's shape.
    for method, path, message_of in (
        ("POST", "/v1/chat/completions", lambda body: body["error"]["message"]),
        ("POST", "/v1/messages", lambda body: body["error"]["message"]),
        ("DELETE", "/api/delete", lambda body: body["error"]),
    ):
        headers = {"content-type": "application/json"}
        empty = httpx.request(method, f"{dialect_cluster.api}{path}", headers=headers, timeout=30)
        assert empty.status_code == 400 and "the request has no JSON body" in message_of(empty.json()), empty.text
    # A method a route does not take is the client's mistake, not the server's (`api_error`).
    wrong_method = httpx.get(f"{dialect_cluster.api}/v1/messages", timeout=30)
    assert (wrong_method.status_code, wrong_method.json()["error"]["type"]) == (405, "invalid_request_error")
    wrong_method = httpx.get(f"{dialect_cluster.api}/v1/chat/completions", timeout=30)
    assert (wrong_method.status_code, wrong_method.json()["error"]["type"]) == (405, "invalid_request_error")
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.fine_tuning.jobs.list()
    assert "GET /v1/fine_tuning/jobs is not an endpoint" in missing.value.message
