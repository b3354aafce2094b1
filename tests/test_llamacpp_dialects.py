"""The demo GGUF served by llama.cpp, through the official clients of every dialect: the same answers, streams,
usage, stop strings, seeds, logprobs, `n`, structured output and tool calls as on MLX, cancel within a token,
embeddings from a second llama-server, and an instance that heals when its llama-server is killed."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time

import anthropic
import httpx
import jsonschema
import ollama
import openai
import psutil
import pytest
from helpers.harness import wait_for
from helpers.llamacpp_cluster import LlamaCppCluster
from jetshard_schema.catalogue import builtin_cards
from jetshard_schema.placement import LLAMA_CPP_SLOT_CONTEXT

pytestmark = pytest.mark.timeout(300)

QUESTION = "What is the capital of France? Answer in one sentence."
ASK = [{"role": "user", "content": QUESTION}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def client(llamacpp_cluster: LlamaCppCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0)


def test_the_demo_answers_on_llama_cpp_and_says_so(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    reply = client.chat.completions.create(model=llamacpp_cluster.model, messages=ASK, max_tokens=24, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 24
    instance = llamacpp_cluster.cluster.get(f"/instances/{llamacpp_cluster.instance_id}")
    assert instance["engine"] == "llama.cpp", instance
    listed = {m.id: m for m in client.models.list().data}
    assert listed[llamacpp_cluster.model].model_extra["engines"] == ["llama.cpp"]  # type: ignore[index]


def test_a_stream_carries_the_same_text_and_its_usage(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    whole = client.chat.completions.create(model=llamacpp_cluster.model, messages=ASK, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=llamacpp_cluster.model,
        messages=ASK,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_a_stop_string_cuts_the_answer(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    reply = client.chat.completions.create(
        model=llamacpp_cluster.model, messages=ASK, max_tokens=24, temperature=0, stop=["Paris"]
    )
    content = reply.choices[0].message.content or ""
    assert "Paris" not in content and content.startswith("The capital")
    assert reply.choices[0].finish_reason == "stop"
    # The row is ended before llama-server's last event, which carries the usage: the prompt is counted all the same.
    whole = client.chat.completions.create(model=llamacpp_cluster.model, messages=ASK, max_tokens=24, temperature=0)
    assert reply.usage is not None and whole.usage is not None
    assert reply.usage.prompt_tokens == whole.usage.prompt_tokens > 0
    message = anthropic.Anthropic(base_url=llamacpp_cluster.api, api_key="unused", max_retries=0).messages.create(
        model=llamacpp_cluster.model,
        max_tokens=24,
        messages=ASK,  # type: ignore[arg-type]
        stop_sequences=["Paris"],
        extra_body={"temperature": 0},
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
    # A plain completion cut by a stop string counts its prompt too.
    completions = openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", max_retries=0).completions
    prompt = "The capital of France is"
    whole_completion = completions.create(model=llamacpp_cluster.model, prompt=prompt, max_tokens=8, temperature=0)
    assert whole_completion.usage is not None and whole_completion.usage.prompt_tokens > 0
    stop = whole_completion.choices[0].text.strip()[:3]
    cut = completions.create(model=llamacpp_cluster.model, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert cut.usage is not None and cut.usage.prompt_tokens == whole_completion.usage.prompt_tokens


def test_seeds_reproduce_and_n_choices_draw_apart(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    def draw(seed: int) -> list[str]:
        reply = client.chat.completions.create(
            model=llamacpp_cluster.model, messages=STORY, max_tokens=12, temperature=1.5, seed=seed, n=2
        )
        return [choice.message.content or "" for choice in sorted(reply.choices, key=lambda c: c.index)]

    first = draw(7)
    assert len(first) == 2 and draw(7) == first
    assert first[0] != first[1]  # each choice its own draw


def test_requests_queued_behind_full_slots_are_all_answered(llamacpp_cluster: LlamaCppCluster) -> None:
    """More requests than llama.cpp has slots: each queued one goes to llama-server the moment a stream ends, the
    instant its connection closes (llama-server closes it after every stream). Every one is answered."""

    async def crowd() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", timeout=120, max_retries=0
        ) as client:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=llamacpp_cluster.model, messages=[{"role": "user", "content": f"Say {n}."}], max_tokens=1
                    )
                    for n in range(60)
                )
            )
        return [reply.choices[0].finish_reason for reply in replies]

    for _ in range(4):  # the window is narrow: each round opens it about 60 times
        assert asyncio.run(crowd()) == ["length"] * 60


def test_a_top_k_past_32_bits_cuts_nothing(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    """llama-server reads top_k as a 32-bit int: 2**32 + 1 would wrap to 1, greedy, where the request asked for a cut
    larger than any vocabulary, which is none. The answers are those of top_k 0, draw for draw."""

    def draws(top_k: int) -> list[str]:
        extra = {"top_k": top_k}
        replies = [
            client.chat.completions.create(
                model=llamacpp_cluster.model, messages=STORY, max_tokens=8, temperature=1.5, seed=seed, extra_body=extra
            )
            for seed in range(3)
        ]
        return [reply.choices[0].message.content or "" for reply in replies]

    uncut = draws(0)
    assert len(set(uncut)) > 1  # drawn, not greedy
    assert draws(2**32 + 1) == uncut


def test_logprobs_come_with_their_alternatives(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    reply = client.chat.completions.create(
        model=llamacpp_cluster.model, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen token is the likeliest


def test_structured_output_follows_the_schema(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=llamacpp_cluster.model,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_a_required_tool_call_comes_as_a_call(client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
    reply = client.chat.completions.create(
        model=llamacpp_cluster.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # type: ignore[union-attr]


def test_a_schema_no_value_meets_is_a_400_and_llama_server_keeps_serving(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    """llama-server aborts on a grammar no value meets (here a minimum above the maximum), and every request in flight
    on it fails with it: such a schema, as the output's or as a function's parameters, never gets there."""
    (runner,) = llamacpp_cluster.cluster.runners_of(llamacpp_cluster.instance_id)
    servers_before = {p.pid for p in runner.children(recursive=True) if "llama-server" in " ".join(p.cmdline())}
    impossible = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["n"],
    }
    with pytest.raises(openai.BadRequestError, match="response format is invalid: Unsatisfiable"):
        client.chat.completions.create(
            model=llamacpp_cluster.model,
            messages=ASK,
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": impossible}},
        )
    count = {"type": "function", "function": {"name": "count", "parameters": impossible}}
    with pytest.raises(openai.BadRequestError, match="function 'count'"):
        client.chat.completions.create(
            model=llamacpp_cluster.model,
            messages=ASK,
            max_tokens=30,
            tools=[count],  # type: ignore[list-item]
            tool_choice="required",
        )
    reply = client.chat.completions.create(model=llamacpp_cluster.model, messages=ASK, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    servers_after = {p.pid for p in runner.children(recursive=True) if "llama-server" in " ".join(p.cmdline())}
    assert servers_before <= servers_after  # none of them restarted


def test_completions_anthropic_ollama_and_responses_answer_too(llamacpp_cluster: LlamaCppCluster) -> None:
    api, model = llamacpp_cluster.api, llamacpp_cluster.model
    completion = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0).completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text and completion.usage.completion_tokens == 4  # type: ignore[union-attr]
    message = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0).messages.create(
        model=model,
        max_tokens=24,
        messages=ASK,  # type: ignore[arg-type]
    )
    assert "Paris" in message.content[0].text  # type: ignore[union-attr]
    chat = ollama.Client(host=api).chat(model=model, messages=ASK, options={"temperature": 0, "num_predict": 24})
    assert "Paris" in chat.message.content
    # `ollama ps` shows the context a request gets: a llama.cpp slot's, less than the demo's own 8192.
    (running,) = [m for m in ollama.Client(host=api).ps().models if m.model == f"{model}:latest"]
    assert running.context_length == LLAMA_CPP_SLOT_CONTEXT < builtin_cards()[model].context_length
    response = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0).responses.create(
        model=model, input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert "Paris" in response.output_text


def test_anthropics_prefill_and_ollamas_last_assistant_message_are_continued(llamacpp_cluster: LlamaCppCluster) -> None:
    api, model = llamacpp_cluster.api, llamacpp_cluster.model
    prefilled = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    message = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0).messages.create(
        model=model,
        max_tokens=8,
        messages=prefilled,  # type: ignore[arg-type]
        extra_body={"top_k": 1},  # greedy: the SDK takes no temperature
    )
    text = message.content[0].text  # type: ignore[union-attr]
    assert "Paris" in text and "capital" not in text, text  # the sentence goes on; no new answer starts
    options = {"temperature": 0, "num_predict": 8}
    chat = ollama.Client(host=api).chat(model=model, messages=prefilled, options=options)
    assert "Paris" in chat.message.content and "capital" not in chat.message.content, chat.message.content


def test_embeddings_on_llama_cpp_are_normalised_vectors_of_the_hidden_size(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    """A second llama-server, started on the first embedding task, pools the mean of the final norm's outputs:
    one L2-normalised vector per input, of the demo's hidden size, through OpenAI's and Ollama's clients."""
    model = llamacpp_cluster.model
    texts = ["the capital of France", "a", "the capital of France"]
    result = client.embeddings.create(model=model, input=texts)  # the client asks for base64
    assert [d.index for d in result.data] == [0, 1, 2]
    for data in result.data:
        assert len(data.embedding) == 576
        assert math.fsum(v * v for v in data.embedding) == pytest.approx(1.0, abs=1e-4)
    assert result.data[2].embedding == pytest.approx(result.data[0].embedding, abs=1e-5)
    assert result.data[1].embedding != pytest.approx(result.data[0].embedding, abs=1e-2)

    by_ids = client.embeddings.create(model=model, input=[[1, 2, 3, 4], [5, 6]], encoding_format="float")
    assert [len(d.embedding) for d in by_ids.data] == [576, 576]
    assert by_ids.usage.prompt_tokens == 6  # token ids are embedded as they are: no BOS added
    alone = client.embeddings.create(model=model, input=[1, 2, 3, 4], encoding_format="float")
    assert alone.data[0].embedding == pytest.approx(by_ids.data[0].embedding, abs=1e-5)
    assert result.usage.prompt_tokens > 3

    ollama_client = ollama.Client(host=llamacpp_cluster.api)
    embedded = ollama_client.embed(model=model, input=["the capital of France", "a"])
    assert embedded.embeddings[0] == pytest.approx(result.data[0].embedding, abs=1e-5)
    assert embedded.embeddings[1] == pytest.approx(result.data[1].embedding, abs=1e-5)
    assert embedded.prompt_eval_count and embedded.prompt_eval_count > 2


def test_embedding_inputs_the_server_cannot_take_are_refused_before_it_runs(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    model = llamacpp_cluster.model
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=model, input="hello " * 9000)
    assert too_long.value.code == "context_length_exceeded", too_long.value.body
    assert "embeddings on llama.cpp take at most" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.embeddings.create(model=model, input=[[1, 2], [1, 10**6]])
    assert "input 1 holds token id 1000000" in unknown.value.message
    again = client.embeddings.create(model=model, input="a", encoding_format="float")
    assert len(again.data[0].embedding) == 576


def test_a_killed_embedding_server_is_started_again_by_the_next_embedding(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    model = llamacpp_cluster.model
    first = client.embeddings.create(model=model, input="a", encoding_format="float").data[0].embedding
    (runner,) = llamacpp_cluster.cluster.runners_of(llamacpp_cluster.instance_id)
    servers = [p for p in runner.children(recursive=True) if "llama-server" in " ".join(p.cmdline())]
    (embedding,) = [p for p in servers if "--embeddings" in p.cmdline()]
    (serving,) = [p for p in servers if p is not embedding]
    embedding.send_signal(signal.SIGKILL)
    embedding.wait(10)
    again = client.embeddings.create(model=model, input="a", encoding_format="float").data[0].embedding
    assert again == pytest.approx(first, abs=1e-5)
    assert serving.is_running() and runner.is_running()  # the instance's chats went on: nothing restarted
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content


def test_a_disconnected_stream_stops_within_a_token(llamacpp_cluster: LlamaCppCluster) -> None:
    body = {"model": llamacpp_cluster.model, "messages": STORY, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{llamacpp_cluster.api}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one token came: hang up
    before = _tokens_served(llamacpp_cluster)

    def stopped() -> bool:
        state = llamacpp_cluster.cluster.get("/state")
        return not state["tasks"]

    assert wait_for(stopped, timeout=10), llamacpp_cluster.cluster.get("/state")["tasks"]
    time.sleep(1.5)  # three stats intervals: a slot still generating would count on
    assert _tokens_served(llamacpp_cluster) - before < 20


def _tokens_served(llamacpp_cluster: LlamaCppCluster) -> int:
    metrics = httpx.get(f"{llamacpp_cluster.api}/metrics", timeout=10).text
    lines = [line for line in metrics.splitlines() if line.startswith("jetshard_instance_tokens_total")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines))


def test_a_killed_llama_server_fails_its_stream_clearly_and_the_instance_heals(
    llamacpp_cluster: LlamaCppCluster,
) -> None:
    cluster = llamacpp_cluster.cluster
    (runner,) = cluster.runners_of(llamacpp_cluster.instance_id)
    (server,) = [
        p
        for p in runner.children(recursive=True)
        if "llama-server" in " ".join(p.cmdline()) and "--embeddings" not in p.cmdline()
    ]
    body = {"model": llamacpp_cluster.model, "messages": STORY, "max_tokens": 400, "temperature": 0, "stream": True}
    # Read before the kill: the demo reloads in about a second, so its instance may be ready again by the time the
    # stream's error has been read.
    generation = cluster.get(f"/instances/{llamacpp_cluster.instance_id}")["generation"]
    errors = []
    with httpx.stream("POST", f"{llamacpp_cluster.api}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and server.is_running():
                server.send_signal(signal.SIGKILL)
            if '"error"' in line:
                errors.append(json.loads(line.removeprefix("data: "))["error"])
    assert errors and "llama" in errors[0]["message"], errors
    assert wait_for(lambda: _gone(server), timeout=30)
    cluster.wait_instance(llamacpp_cluster.instance_id, "ready", timeout=180, after_generation=generation)
    reply = openai.OpenAI(base_url=f"{llamacpp_cluster.api}/v1", api_key="unused", max_retries=0, timeout=240)
    answer = reply.chat.completions.create(model=llamacpp_cluster.model, messages=ASK, max_tokens=24, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")


def _gone(process: psutil.Process) -> bool:
    """Killed: reaped, or a zombie until its parent, the runner, reaps it."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_conversations_next_turn_starts_from_llama_cpps_prompt_cache(
    client: openai.OpenAI, llamacpp_cluster: LlamaCppCluster
) -> None:
    def counters() -> dict[str, int]:
        runners = llamacpp_cluster.cluster.get("/state")["instances"][llamacpp_cluster.instance_id]["runners"]
        return dict(runners["0"].get("counters") or {})

    before = counters().get("prefix_hit_tokens", 0)
    first = client.chat.completions.create(model=llamacpp_cluster.model, messages=STORY, max_tokens=8, temperature=0)
    turn = [*STORY, {"role": "assistant", "content": first.choices[0].message.content}, *ASK]
    second = client.chat.completions.create(model=llamacpp_cluster.model, messages=turn, max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens > 20
    # The counters come every half second (JETSHARD_COUNTERS_INTERVAL_S): the second turn's shared start was cached.
    assert wait_for(lambda: counters().get("prefix_hit_tokens", 0) - before >= 10, timeout=10), counters()
