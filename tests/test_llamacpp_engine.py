"""The llama.cpp engine below the runner: our tasks as llama-server requests and its events as our pieces (pure),
then the engine against a real llama-server on the demo GGUF: streaming, cancel within a token, a killed server."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from pathlib import Path

import jsonschema
import msgspec
import pytest
from helpers.gguf_models import write_tiny_gguf
from helpers.harness import until
from jetshard_downloader.convert import packaged_gguf_path
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.ids import TaskId
from jetshard_schema.sampling import ResolvedSampling
from jetshard_schema.types import (
    ChatMessage,
    Chunk,
    SamplingParams,
    TaskKind,
    TaskOutcome,
    TaskRequest,
    Tool,
    ToolChoice,
    Tools,
)
from jetshard_worker.engines.llamacpp import requests as llama
from jetshard_worker.engines.llamacpp.engine import LlamaCppEngine
from jetshard_worker.engines.llamacpp.probe import ready_build
from jetshard_worker.engines.llamacpp.server import LlamaServer, ServerDied, ServerSettings
from jetshard_worker.text.output import ChoiceOutput, RowEnd, TaskOutput

DEMO_GGUF, _ = packaged_gguf_path(builtin_cards()[DEMO_MODEL_ID])


GREEDY = ResolvedSampling(temperature=0.0, top_p=1.0, max_tokens=400)
QUESTION = "What is the capital of France? Answer in one sentence."


def _chat(question: str = QUESTION, **fields: object) -> TaskRequest:
    return TaskRequest(
        task_id="t1",
        model_id="jetshard/SmolLM2-135M-Instruct-Q4",
        kind=TaskKind.CHAT,
        messages=(ChatMessage(role="user", content=question),),
        **fields,  # type: ignore[arg-type]
    )


def test_a_chat_becomes_one_streamed_request_with_the_models_own_template_and_our_sampling() -> None:
    tools = Tools(
        functions=(Tool(name="weather", parameters={"type": "object"}),), choice=ToolChoice.FUNCTION, function="weather"
    )
    request = _chat(tools=tools, top_logprobs=3, thinking_budget=64, chat_template_kwargs={"enable_thinking": True})
    row = llama.chat_request(
        "t1#0", request, GREEDY, max_tokens=16, seed=2**64 - 1, window=512, template_takes_tools=True
    )
    assert row.path == llama.CHAT_PATH
    body = row.body
    assert body["messages"] == [{"role": "user", "content": QUESTION}]
    assert body["stream"] and body["cache_prompt"] and body["max_tokens"] == 16
    assert body["seed"] == (2**64 - 1) % 2**32  # llama.cpp's seeds are 32-bit
    # Every sampler as we resolved it, none of llama.cpp's own defaults (top_k 40, min_p 0.05, a 64-token window).
    # Greedy (temperature 0) as a cut to the top token, which spares llama.cpp's other samplers the vocabulary.
    assert (body["top_k"], body["min_p"], body["repeat_penalty"], body["repeat_last_n"]) == (1, 0.0, 1.0, 512)
    assert (body["temperature"], body["presence_penalty"], body["frequency_penalty"]) == (0.0, 0.0, 0.0)
    assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == ["weather"]
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["thinking_budget_tokens"] == 64 and body["chat_template_kwargs"] == {"enable_thinking": True}


def test_images_go_as_data_url_parts_of_their_own_type_and_webp_is_refused_by_its_index() -> None:
    """llama-server reads OpenAI's image parts (its projector turns each into embeddings) and decodes PNG, JPEG and
    GIF; a WebP, which the API takes for MLX, is named before llama-server fails on it."""
    png, jpeg, webp = b"\x89PNG\r\n", b"\xff\xd8\xff\xe0", b"RIFF\0\0\0\0WEBP"
    messages = (
        ChatMessage(role="user", content="first", images=(png, jpeg)),
        ChatMessage(role="assistant", content="seen"),
        ChatMessage(role="user", content="then", images=(webp,)),
    )
    request = msgspec.structs.replace(_chat(), messages=messages)
    row = llama.chat_request("t1#0", request, GREEDY, max_tokens=8, seed=None, window=512, template_takes_tools=True)
    first = row.body["messages"][0]["content"]
    assert [part["type"] for part in first] == ["image_url", "image_url", "text"]
    assert first[0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png).decode()
    assert first[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert first[2] == {"type": "text", "text": "first"}
    assert llama.unreadable_image(request) == (
        "image 2 is WebP, which llama.cpp does not read: send it as PNG, JPEG or GIF"
    )
    assert llama.unreadable_image(_chat()) is None


def test_values_llama_server_reads_as_32_bit_ints_keep_their_meaning() -> None:
    """A top_k or a thinking budget of 2**32 + 1 would wrap to 1 there (greedy; one token of thinking): a cut larger
    than any vocabulary cuts nothing (top_k 0), and a budget that large is one no answer reaches."""
    drawn = ResolvedSampling(temperature=1.0, top_p=1.0, top_k=2**32 + 1, max_tokens=400)
    row = llama.chat_request(
        "t1#0", _chat(thinking_budget=2**32 + 1), drawn, max_tokens=16, seed=None, window=512, template_takes_tools=True
    )
    assert (row.body["top_k"], row.body["thinking_budget_tokens"]) == (0, 2**31 - 1)


def test_logprobs_without_alternatives_still_come_with_each_token() -> None:
    """llama-server sends a token's logprob only with at least one alternative: it is asked for one, and the
    answer keeps none, as the task asked."""
    row = llama.chat_request(
        "t1#0", _chat(top_logprobs=0), GREEDY, max_tokens=4, seed=None, window=512, template_takes_tools=False
    )
    assert row.body["logprobs"] is True and row.body["top_logprobs"] == 1
    state = llama.StreamState(top_logprobs=row.top_logprobs)
    entry = {"token": "Paris", "logprob": -0.5, "top_logprobs": [{"token": "Paris", "logprob": -0.5}]}
    event = {"choices": [{"delta": {"content": "Paris"}, "logprobs": {"content": [entry]}, "finish_reason": None}]}
    piece, _ = llama.parse_event(llama.CHAT_PATH, json.dumps(event), state)
    assert piece is not None and [(lp.token, lp.logprob, lp.top) for lp in piece.logprobs] == [("Paris", -0.5, ())]


def test_a_long_prompts_progress_counts_what_the_slots_cache_held_as_done() -> None:
    state = llama.StreamState()
    event = {"choices": [], "prompt_progress": {"total": 3000, "cache": 1000, "processed": 1048, "time_ms": 9}}
    piece, ending = llama.parse_event(llama.CHAT_PATH, json.dumps(event), state)
    assert piece is not None and piece.prompt_progress == (2048, 3000) and not piece.has_output
    assert ending is None


def test_streamed_events_become_pieces_tool_calls_and_an_ending() -> None:
    state = llama.StreamState()
    events = [
        {"choices": [{"delta": {"reasoning_content": "Let me think"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "Paris"}, "finish_reason": None}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}, "timings": {"cache_n": 8}},
    ]
    pieces, ending = [], None
    for event in events:
        piece, end = llama.parse_event(llama.CHAT_PATH, json.dumps(event), state)
        pieces += [piece] if piece else []
        ending = end or ending
    assert [(p.reasoning, p.text) for p in pieces[:2]] == [("Let me think", ""), ("", "Paris")]
    assert pieces[0].reasoning_tokens == 1 and pieces[1].reasoning_tokens == 0
    assert [tuple(call) for call in state.parsed_calls()] == [("weather", '{"city": "Paris"}')]
    # The usage comes last, in an event of its own: the reason the choice ended stays the one said before it.
    assert ending == llama.Ending(TaskOutcome.LENGTH, prompt_tokens=12, completion_tokens=5, cached_tokens=8)
    assert llama.parse_event(llama.CHAT_PATH, "[DONE]", state) == (None, None)


def test_tokens_the_reasoning_parser_consumes_count_as_reasoning() -> None:
    """llama-server sends no event for the tokens its parser consumes (`</think>`, the whitespace after it): the
    answer's first event covers them (`timings.predicted_n` jumps), and they are reasoning's, as MLX counts them."""
    state = llama.StreamState()
    events = [
        ({"reasoning_content": "Let"}, 1),
        ({"reasoning_content": " me"}, 2),
        ({"content": "Paris"}, 5),  # `</think>`, a newline, then "Paris"
        ({"content": "."}, 6),
    ]
    pieces = []
    for delta, sampled in events:
        event = {"choices": [{"delta": delta, "finish_reason": None}], "timings": {"predicted_n": sampled}}
        piece, _ = llama.parse_event(llama.CHAT_PATH, json.dumps(event), state)
        assert piece is not None
        pieces.append(piece)
    assert [(p.tokens, p.reasoning_tokens) for p in pieces] == [(1, 1), (1, 1), (3, 2), (1, 0)]


def test_llama_server_errors_keep_their_meaning() -> None:
    too_long = {  # as llama-server answers it
        "error": {
            "code": 400,
            "message": "request (631 tokens) exceeds the available context size (256 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 631,
            "n_ctx": 256,
        }
    }
    with pytest.raises(llama.ServerError) as raised:
        llama.parse_event(llama.CHAT_PATH, json.dumps(too_long), llama.StreamState())
    assert raised.value.code == "context_length_exceeded"
    # The numbers, and no advice the client cannot follow.
    assert "631 tokens" in str(raised.value) and "256 of context" in str(raised.value)
    assert "increasing" not in str(raised.value)


def test_a_completion_ends_at_its_limit_with_its_token_counts() -> None:
    request = TaskRequest(
        task_id="t2", model_id="a/b", kind=TaskKind.COMPLETION, prompt="Once", sampling=SamplingParams()
    )
    sampling = ResolvedSampling(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.3, max_tokens=4)
    row = llama.completion_request("t2#0", request, sampling, max_tokens=4, seed=None, window=512)
    assert (row.body["top_k"], row.body["repeat_penalty"], row.body["temperature"]) == (5, 1.3, 0.7)
    assert row.path == llama.COMPLETION_PATH and row.body["prompt"] == "Once" and row.body["n_predict"] == 4
    assert "seed" not in row.body
    last = {"content": "", "stop": True, "stop_type": "limit", "tokens_evaluated": 2, "tokens_predicted": 4}
    assert llama.parse_event(llama.COMPLETION_PATH, json.dumps(last), llama.StreamState())[1] == llama.Ending(
        TaskOutcome.LENGTH, 2, 4
    )


def _server_of(model: Path, slots: int = 1, context_per_slot: int = 256, **settings: int) -> LlamaServer:
    build = ready_build()
    assert build is not None, "no llama.cpp build: `bash tests/run` builds it before the suite"
    root = build.build.root
    return LlamaServer(ServerSettings(build.llama_server, root, model, slots, context_per_slot, **settings))


@pytest.fixture
async def demo_server() -> LlamaServer:
    server = _server_of(DEMO_GGUF, slots=2, context_per_slot=512)
    await asyncio.wait_for(server.start(timeout_s=120), 150)
    yield server
    await server.stop()


async def test_a_model_llama_cpp_cannot_load_fails_the_start_with_llama_cpps_reason(tmp_path: Path) -> None:
    """What llama-server says when it gives up (here on a chat template it cannot parse) is what the runner reports,
    and so what the client's 503 says: not only its exit status."""
    model = write_tiny_gguf(tmp_path / "broken.gguf", "llama", chat_template="{{ messages }")
    with pytest.raises(ServerDied, match=r"exited with status 1 while loading the model: .*Parser Error: Expected }}"):
        await asyncio.wait_for(_server_of(model).start(timeout_s=120), 150)


async def test_a_chat_template_that_runs_away_fails_the_start_within_its_memory_limit(tmp_path: Path) -> None:
    """A downloaded model's template may build gigabytes when llama-server tries it as it loads (this one 1 GB of
    'x', which a probe's host paid for in full, out of memory): under the limit the runner sets, the allocation
    fails, and so does the start, saying so."""
    model = write_tiny_gguf(tmp_path / "runaway.gguf", "llama", chat_template="{{ 'x' * 1000000000 }}")
    server = _server_of(model, memory_limit_bytes=768 * 2**20)
    with pytest.raises(ServerDied, match="std::bad_alloc"):
        await asyncio.wait_for(server.start(timeout_s=120), 150)


class _Rows:
    """What the engine hands the runner, per row."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.endings: dict[str, llama.Ending] = {}
        self.failures: dict[str, tuple[str, str]] = {}
        self.first_piece = asyncio.Event()
        self.finished = asyncio.Event()

    def engine(self, server: LlamaServer, **options: float) -> LlamaCppEngine:
        return LlamaCppEngine(
            server,
            2,
            **options,
            on_started=lambda row: None,
            on_piece=self._piece,
            on_finished=self._finished,
            on_failed=lambda row, message, code: (self.failures.__setitem__(row, (message, code)), self.finished.set()),
        )

    def _piece(self, row: str, piece: llama.Piece) -> None:
        self.text[row] = self.text.get(row, "") + piece.text
        self.first_piece.set()

    def _finished(self, row: str, ending: llama.Ending, calls: object) -> None:
        self.endings[row] = ending
        self.finished.set()


async def test_the_engine_streams_a_greedy_answer_and_counts_it(demo_server: LlamaServer) -> None:
    rows = _Rows()
    engine = rows.engine(demo_server)
    engine.submit(
        llama.chat_request("t1#0", _chat(), GREEDY, max_tokens=16, seed=None, window=512, template_takes_tools=False)
    )
    await asyncio.wait_for(rows.finished.wait(), 60)
    assert "Paris" in rows.text["t1#0"], rows.text
    ending = rows.endings["t1#0"]
    assert ending.prompt_tokens > 0 and 0 < ending.completion_tokens <= 16
    assert engine.stats.tokens >= ending.completion_tokens - 1 and engine.stats.running_rows == 0
    await engine.close()


def _a_long_row(server: LlamaServer, **options: float) -> tuple[_Rows, LlamaCppEngine]:
    """An engine on `server` answering row t1#0 at length: it is still answering when the test cuts it."""
    rows = _Rows()
    engine = rows.engine(server, **options)
    long = _chat("Write a very long story about a dragon.")
    engine.submit(
        llama.chat_request("t1#0", long, GREEDY, max_tokens=400, seed=None, window=512, template_takes_tools=False)
    )
    return rows, engine


async def test_a_cancelled_row_ends_at_once_and_frees_its_slot(demo_server: LlamaServer) -> None:
    rows, engine = _a_long_row(demo_server)
    await asyncio.wait_for(rows.first_piece.wait(), 60)
    engine.cancel("t1#0")
    await asyncio.wait_for(rows.finished.wait(), 5)
    assert rows.endings["t1#0"].reason is TaskOutcome.CANCELLED
    slots = await engine._client.get("/slots")  # llama-server's own view: the slot stopped
    for _ in range(50):
        if not any(slot["is_processing"] for slot in slots.json()):
            break
        await asyncio.sleep(0.1)
        slots = await engine._client.get("/slots")
    assert not any(slot["is_processing"] for slot in slots.json())
    await engine.close()


async def test_a_killed_llama_server_fails_the_rows_and_ends_the_engine(demo_server: LlamaServer) -> None:
    rows, engine = _a_long_row(demo_server)
    serving = asyncio.create_task(engine.serve())
    await asyncio.wait_for(rows.first_piece.wait(), 60)
    assert demo_server._process is not None
    os.kill(demo_server._process.pid, signal.SIGKILL)
    with pytest.raises(ServerDied, match="llama-server was killed by SIGKILL"):
        await asyncio.wait_for(serving, 10)
    await asyncio.wait_for(rows.finished.wait(), 10)
    message, code = rows.failures["t1#0"]
    assert code == "engine_error" and "llama.cpp stopped answering" in message
    await engine.close()


async def test_a_stopped_llama_server_is_killed_and_ends_the_engine(demo_server: LlamaServer) -> None:
    """A hung server (here stopped with SIGSTOP mid-answer) answers nothing: past the engine's patience it is
    killed, its rows fail and the engine ends, so the instance restarts instead of its tasks waiting forever."""
    rows, engine = _a_long_row(demo_server, unresponsive_s=5.0)
    serving = asyncio.create_task(engine.serve())
    await asyncio.wait_for(rows.first_piece.wait(), 60)
    await asyncio.sleep(6)  # a server at work answers its health checks: it is left alone
    assert not serving.done()
    rows.first_piece.clear()
    count = _chat("Count to a hundred.")
    engine.submit(
        llama.chat_request("t2#0", count, GREEDY, max_tokens=400, seed=None, window=512, template_takes_tools=False)
    )
    await asyncio.wait_for(rows.first_piece.wait(), 60)
    assert demo_server._process is not None
    os.kill(demo_server._process.pid, signal.SIGSTOP)
    with pytest.raises(ServerDied, match="llama-server answered no health check for 5 s"):
        await asyncio.wait_for(serving, 30)
    assert demo_server.exited
    await until(lambda: "t2#0" in rows.failures, 10, "the answer cut by the kill to fail")
    assert rows.failures["t2#0"][1] == "engine_error"
    await engine.close()


def test_tools_a_template_cannot_render_are_described_and_a_forced_call_is_held_to_its_schema() -> None:
    weather = Tool(name="weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})
    request = _chat(tools=Tools(functions=(weather,), choice=ToolChoice.FUNCTION, function="weather"))
    body = llama.chat_request(
        "t1#0", request, GREEDY, max_tokens=16, seed=None, window=512, template_takes_tools=False
    ).body
    assert "tools" not in body  # llama.cpp would render none and parse none
    system = body["messages"][0]
    assert system["role"] == "system" and '"name": "weather"' in system["content"]
    assert body["json_schema"]["properties"]["name"] == {"const": "weather"}
    assert llama.forced_call(request, template_takes_tools=False) == body["json_schema"]
    assert llama.call_splitter(request, template_takes_tools=False) is None  # a forced call is parsed whole
    assert llama.forced_call(request, template_takes_tools=True) is None
    assert llama.call_splitter(request, template_takes_tools=True) is None


def test_a_grammar_document_cut_at_max_tokens_is_closed_into_a_valid_one() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    published: list[Chunk] = []
    output = TaskOutput(
        TaskId("t1"),
        [ChoiceOutput(detokenizer=None, grammar_schema=schema)],
        str,
        published.append,
        lambda output: None,  # the runner flushes held text later; the last chunk flushes it here
    )
    output.text(0, "", '{"city": "Par', (), 4, 0)
    usage = output.finish(0, RowEnd(TaskOutcome.LENGTH, prompt_tokens=9, completion_tokens=4))
    text = "".join(chunk.text for chunk in published)
    jsonschema.validate(json.loads(text), schema)
    assert text.startswith('{"city": "Par') and published[-1].finish_reason is TaskOutcome.LENGTH
    assert usage is not None and usage.completion_tokens == 4


def test_a_cut_document_no_valid_one_completes_still_parses() -> None:
    """A schema whose every document nests without end (a required member of its own type): the cut output is
    closed as plain JSON, not failed."""
    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}}
    published: list[Chunk] = []
    schema = {**endless, "$ref": "#/$defs/n"}
    output = TaskOutput(
        TaskId("t1"), [ChoiceOutput(detokenizer=None, grammar_schema=schema)], str, published.append, lambda o: None
    )
    output.text(0, "", '{"c": {"c": {"c', (), 8, 0)
    output.finish(0, RowEnd(TaskOutcome.LENGTH, prompt_tokens=9, completion_tokens=8))
    text = "".join(chunk.text for chunk in published)
    assert text.startswith('{"c": {"c": {"c') and isinstance(json.loads(text), dict)
    assert published[-1].finish_reason is TaskOutcome.LENGTH and published[-1].error is None


@pytest.mark.parametrize("reason", [TaskOutcome.LENGTH, TaskOutcome.CANCELLED])
@pytest.mark.parametrize(
    ("cut", "kept"),
    [
        ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3', [{"a": 1, "b": 2}]),
        ('{"name": "add", "arguments": {"a": 1', []),
        ("", []),
    ],
)
def test_a_forced_call_cut_is_left_out_never_given_made_up_arguments(cut: str, kept: list, reason: TaskOutcome) -> None:
    """A client runs the calls it gets: the calls completed before the cut (at max_tokens, or by a cancel) come, the
    one being written does not."""
    published: list[Chunk] = []
    output = TaskOutput(
        TaskId("t1"),
        [ChoiceOutput(detokenizer=None, forced_calls=True, grammar_schema={"type": "array"})],
        str,
        published.append,
        lambda output: None,
    )
    output.text(0, "", cut, (), 20, 0)
    output.finish(0, RowEnd(reason, prompt_tokens=9, completion_tokens=20))
    calls = [call for chunk in published for call in chunk.tool_calls]
    assert [json.loads(call.arguments) for call in calls] == kept
    assert published[-1].finish_reason is reason
    assert not "".join(chunk.text for chunk in published)  # the cut JSON is not shown as the answer either


async def test_a_stream_that_ends_before_llama_servers_last_event_fails_its_row() -> None:
    """llama-server killed between two events leaves whole chunks and no last event: the row fails, it never passes
    for a finished answer. A socket server stands in for it, answering two pieces and closing (the timing a real
    kill gives only now and then)."""
    events = [{"choices": [{"delta": {"content": word}, "finish_reason": None}]} for word in ("The", " capital")]
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    stand_in = await asyncio.start_server(answer, "127.0.0.1", 0)
    server = LlamaServer(
        ServerSettings(
            binary=Path("llama-server"), working_dir=Path("."), model=DEMO_GGUF, slots=1, context_per_slot=64
        )
    )
    server.port = stand_in.sockets[0].getsockname()[1]
    rows = _Rows()
    engine = rows.engine(server)
    engine.submit(
        llama.chat_request("t1#0", _chat(), GREEDY, max_tokens=16, seed=None, window=64, template_takes_tools=False)
    )
    await asyncio.wait_for(rows.finished.wait(), 10)
    assert rows.text["t1#0"] == "The capital" and "t1#0" not in rows.endings
    message, code = rows.failures["t1#0"]
    assert code == "engine_error" and "ended before the answer did" in message
    await engine._client.aclose()
    stand_in.close()
