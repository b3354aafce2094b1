"""Our tasks as llama-server requests, and its streamed answers as our pieces: pure translation, tested without
a server.

Chats go to `/v1/chat/completions`, so the model's own chat template (Jinja, in the GGUF), llama.cpp's tool-call
parsers and its reasoning split serve them; completions go to `/completion` with the prompt as it is. Both stream
(server-sent events), and `cache_prompt` keeps each slot's prompt for the next request that starts alike.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field, replace
from typing import Any

from jetshard_schema.placement import LLAMA_CPP_SLOT_CONTEXT
from jetshard_schema.sampling import ResolvedSampling
from jetshard_schema.types import ChatMessage, TaskOutcome, TaskRequest, TokenLogprob, ToolChoice, TopLogprob

from jetshard_worker.text.chat import message_dict, tool_spec, with_tools_described
from jetshard_worker.text.toolcalls import ToolCallParsed, ToolCallSplitter, forced_call_schema

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/completion"
SEED_LIMIT = 2**32
"""llama.cpp's samplers take a 32-bit seed; ours are 64-bit, folded into its range."""
INT32_MAX = 2**31 - 1
"""llama-server reads top_k and the thinking budget as 32-bit ints, wrapping larger ones (2**32 + 1 would be 1:
greedy; one token of thinking). A larger top_k keeps every token of any vocabulary: it is sent as 0, no cut; a
larger budget is sent as this, which no answer reaches."""

_FINISH = {"stop": TaskOutcome.STOP, "length": TaskOutcome.LENGTH, "tool_calls": TaskOutcome.STOP}
_STOP_TYPES = {"eos": TaskOutcome.STOP, "word": TaskOutcome.STOP, "limit": TaskOutcome.LENGTH}


@dataclass(frozen=True)
class LlamaRequest:
    """One choice of a task, as llama-server takes it."""

    row_id: str
    path: str
    body: dict[str, Any]
    top_logprobs: int = 0
    """Alternatives the task asked for at each token: llama-server gives a token's own logprob only with at least
    one alternative, so it is asked for one more where the task asked for none, and the events are cut back."""
    echo: str = ""
    """What llama-server repeats before the text it generates: a last assistant message, which it continues (a
    prefill) and then gives again as the start of the answer."""


@dataclass(frozen=True)
class Piece:
    """What one streamed event adds to a choice."""

    reasoning: str = ""
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    tokens: int = 0
    """Tokens the event stands for: the ones sampled since the event before, a reasoning token too (the parser
    sends none for the tokens it consumes, such as `</think>`, so they count with the next event)."""
    reasoning_tokens: int = 0
    prompt_progress: tuple[int, int] | None = None
    """The prompt's tokens processed so far and in all, while it is processed (llama-server's `return_progress`)."""

    @property
    def has_output(self) -> bool:
        return bool(self.reasoning or self.text or self.logprobs or self.tokens)


@dataclass(frozen=True)
class Ending:
    """How a choice ended, from llama-server's last event."""

    reason: TaskOutcome
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the slot's cache, not prefilled."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    """Drafted tokens, and those the model kept (speculative decoding)."""


@dataclass
class StreamState:
    """What a choice's stream has said so far that only its end uses: tool calls arrive in fragments."""

    calls: dict[int, list[str]] = field(default_factory=dict)
    """Per call index: its name, then its argument fragments."""
    reason: TaskOutcome = TaskOutcome.STOP
    """Why the choice ended, once an event said so (the usage comes in a later event of its own)."""
    sampled: int = 0
    """Tokens sampled as of the last event (llama-server's `timings.predicted_n`, sent with every event)."""
    reasoning: bool = False
    """The last piece was reasoning: the tokens the parser consumed before the answer's first (the closing marker,
    whitespace) are reasoning's, as the MLX engine counts them."""
    top_logprobs: int = 0
    """The alternatives each token's logprob keeps (`LlamaRequest.top_logprobs`)."""
    echo: str = ""
    """What is still to come of `LlamaRequest.echo`: left out of the answer."""
    timings: dict[str, Any] = field(default_factory=dict)
    """The last event's `timings` (every event has them: `timings_per_token`)."""

    def cut(self, reason: TaskOutcome) -> Ending:
        """How the choice ended where it was ended before llama-server's last event (a stop string, a cancel): the
        prompt and cache counts of the last event's timings (the prompt's tokens, cached ones too), as that last
        event's usage would have given them; the output counts the tokens it got."""
        prompt_tokens = int(self.timings.get("cache_n", 0)) + int(self.timings.get("prompt_n", 0))
        return _ending(reason, prompt_tokens, 0, self.timings)

    def parsed_calls(self) -> list[ToolCallParsed]:
        return [ToolCallParsed(parts[0], "".join(parts[1:]) or "{}") for _, parts in sorted(self.calls.items())]


def chat_request(
    row_id: str,
    request: TaskRequest,
    sampling: ResolvedSampling,
    *,
    max_tokens: int,
    seed: int | None,
    window: int,
    template_takes_tools: bool,
) -> LlamaRequest:
    """`window`: the tokens the penalties look back over when the request does not say (the slot's context).
    `template_takes_tools`: the model's chat template renders tools (llama-server's `chat_template_caps`); llama.cpp
    then parses the calls in the model's own format. A template without tools renders none, so the tools are
    described in the system message, as on MLX (`chat.with_tools_described`), a forced call is held to its schema
    (`forced_call`) by llama.cpp's grammar, and the runner parses the calls (`call_splitter`)."""
    body: dict[str, Any] = {
        "messages": [_message(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "cache_prompt": True,
        # Each event then says how many tokens were sampled so far: the reasoning parser sends no event for the
        # tokens it consumes, which the usage's reasoning tokens would otherwise leave out.
        "timings_per_token": True,
        **_sampling(sampling, request.sampling.repeat_last_n, seed, window),
    }
    if request.output_schema is not None:
        body["json_schema"] = request.output_schema
    tools = request.tools
    if tools is not None and tools.functions and tools.choice is not ToolChoice.NONE and not template_takes_tools:
        specs = [tool_spec(tool) for tool in tools.functions]
        inline = [_message(m, calls_as_text=True) for m in request.messages]
        body["messages"] = with_tools_described(inline, specs)
        if tools.choice is not ToolChoice.AUTO:
            body["json_schema"] = forced_call_schema(specs, tools.function, tools.parallel)
    elif tools is not None and tools.functions and tools.choice is not ToolChoice.NONE:
        functions = tools.functions
        if tools.choice is ToolChoice.FUNCTION:
            functions = tuple(f for f in functions if f.name == tools.function)
        body["tools"] = [
            {"type": "function", "function": {"name": f.name, "description": f.description, "parameters": f.parameters}}
            for f in functions
        ]
        body["tool_choice"] = "auto" if tools.choice is ToolChoice.AUTO else "required"
        body["parallel_tool_calls"] = tools.parallel
    if request.top_logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = max(1, request.top_logprobs)
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    if request.thinking_budget is not None:
        body["thinking_budget_tokens"] = min(request.thinking_budget, INT32_MAX)
    body["return_progress"] = True
    # llama-server continues an assistant's message last, whatever the dialect asked (vLLM and MLX answer it in a
    # new turn unless told to continue), and gives it again as the answer's start.
    last = request.messages[-1] if request.messages else None
    echo = last.content if last is not None and last.role == "assistant" and not last.tool_calls else ""
    return LlamaRequest(row_id, CHAT_PATH, body, request.top_logprobs or 0, echo)


def completion_request(
    row_id: str, request: TaskRequest, sampling: ResolvedSampling, *, max_tokens: int, seed: int | None, window: int
) -> LlamaRequest:
    body: dict[str, Any] = {
        "prompt": request.prompt,
        "stream": True,
        "n_predict": max_tokens,
        "cache_prompt": True,
        # Each event then carries the prompt's counts: a completion cut by a stop string ends before the last event.
        "timings_per_token": True,
        **_sampling(sampling, request.sampling.repeat_last_n, seed, window),
    }
    if request.output_schema is not None:
        body["json_schema"] = request.output_schema
    if request.top_logprobs is not None:
        body["n_probs"] = max(1, request.top_logprobs)
        body["post_sampling_probs"] = False
    body["return_progress"] = True
    return LlamaRequest(row_id, COMPLETION_PATH, body, request.top_logprobs or 0)


def _sampling(sampling: ResolvedSampling, repeat_last_n: int | None, seed: int | None, window: int) -> dict[str, Any]:
    # Every value, always: llama.cpp's own defaults (top_k 40, min_p 0.05, a 64-token penalty window) would
    # otherwise apply on top of what the request and the model asked for. Its presence and frequency penalties
    # count the prompt's tokens too (MLX's count the answer's, as OpenAI's do): a difference upstream has no
    # switch for.
    values: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # Greedy is the top token: a cut to one spares llama.cpp's other samplers the whole vocabulary each token
        # (and with a grammar it is still the top token the grammar allows).
        "top_k": 1 if sampling.temperature == 0 else (sampling.top_k if sampling.top_k <= INT32_MAX else 0),
        "min_p": sampling.min_p,
        "repeat_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        # None is the whole sequence: llama-server refuses -1, and allocates a window of the size it is given.
        "repeat_last_n": window if repeat_last_n is None else min(repeat_last_n, window),
    }
    if seed is not None:
        values["seed"] = seed % SEED_LIMIT
    return values


def _message(message: ChatMessage, calls_as_text: bool = False) -> dict[str, Any]:
    """A message in OpenAI's shape, as llama-server reads it: calls' arguments as JSON text, images as parts."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls and calls_as_text:
        out = message_dict(message, calls_as_text=True)
    elif message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    if message.images:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": _data_url(image)}} for image in message.images
        ]
        out["content"] = [*parts, {"type": "text", "text": out["content"]}]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _parsed_here(request: TaskRequest, template_takes_tools: bool) -> bool:
    """Whether the runner parses the chat's calls itself: it has tools, and a template that renders none (where one
    does, llama.cpp parses them)."""
    tools = request.tools
    return (
        not template_takes_tools and tools is not None and bool(tools.functions) and tools.choice is not ToolChoice.NONE
    )


def forced_call(request: TaskRequest, template_takes_tools: bool) -> dict[str, Any] | None:
    """The schema the runner's forced call is held to (`tool_choice` required or named), which `chat_request` sends
    as the grammar; None where there is none to force or llama.cpp parses the calls."""
    tools = request.tools
    if tools is None or tools.choice is ToolChoice.AUTO or not _parsed_here(request, template_takes_tools):
        return None
    return forced_call_schema([tool_spec(tool) for tool in tools.functions], tools.function, tools.parallel)


def call_splitter(request: TaskRequest, template_takes_tools: bool) -> ToolCallSplitter | None:
    """A choice's own splitter of its text into content and calls, for tools in `auto` the runner parses."""
    tools = request.tools
    if tools is None or tools.choice is not ToolChoice.AUTO or not _parsed_here(request, template_takes_tools):
        return None
    return ToolCallSplitter(None, None, None, [tool_spec(tool) for tool in tools.functions], tools.parallel)


_IMAGE_TYPES = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif", b"RIFF": "image/webp"}


def _image_type(image: bytes) -> str:
    """The image's media type (the API has checked it is one of these)."""
    return next((name for magic, name in _IMAGE_TYPES.items() if image.startswith(magic)), "image/png")


def _data_url(image: bytes) -> str:
    """The image as a data URL with its type."""
    return f"data:{_image_type(image)};base64," + base64.b64encode(image).decode("ascii")


def unreadable_image(request: TaskRequest) -> str | None:
    """Why llama.cpp cannot read one of the request's images, else None. It decodes images with stb_image: PNG,
    JPEG and GIF, not the WebP the API also takes (llama-server would answer only that it failed to load a file)."""
    images = [image for message in request.messages for image in message.images]
    for index, image in enumerate(images):
        if _image_type(image) == "image/webp":
            return f"image {index} is WebP, which llama.cpp does not read: send it as PNG, JPEG or GIF"
    return None


def parse_event(path: str, data: str, state: StreamState) -> tuple[Piece | None, Ending | None]:
    """One server-sent event's data: what it adds to the choice, and how the choice ended if this is its end.
    Raises `ServerError` for an error event."""
    if data == "[DONE]":
        return None, None
    event = json.loads(data)
    if "error" in event:
        raise ServerError.of(event)
    state.timings = event.get("timings") or state.timings
    piece, ending = _chat_event(event, state) if path == CHAT_PATH else _completion_event(event, state)
    if (progress := event.get("prompt_progress")) is not None:
        # Tokens served from the slot's cache count as done: the progress runs from them to the whole prompt.
        total = int(progress.get("total", 0))
        done = min(total, int(progress.get("cache", 0)) + int(progress.get("processed", 0)))
        piece = replace(piece or Piece(), prompt_progress=(done, total))
    return piece, ending


def _without_echo(text: str, state: StreamState) -> str:
    """`text` less what of it repeats the prefill llama-server continued; once the text goes its own way, the echo
    is over."""
    if not state.echo:
        return text
    same = (i for i, (echoed, given) in enumerate(zip(state.echo, text, strict=False)) if echoed != given)
    repeated = next(same, min(len(state.echo), len(text)))
    state.echo = state.echo[repeated:] if repeated == len(text) else ""
    return text[repeated:]


def _chat_event(event: dict[str, Any], state: StreamState) -> tuple[Piece | None, Ending | None]:
    piece = ending = None
    timings = event.get("timings") or {}
    sampled = int(timings.get("predicted_n", state.sampled))
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or ""
        text = _without_echo(delta.get("content") or "", state)
        for call in delta.get("tool_calls") or ():
            parts = state.calls.setdefault(int(call.get("index", 0)), [""])
            function = call.get("function") or {}
            parts[0] += function.get("name") or ""
            if function.get("arguments"):
                parts.append(function["arguments"])
        entries = (choice.get("logprobs") or {}).get("content") or ()
        logprobs = tuple(_token_logprob(entry, state.top_logprobs) for entry in entries)
        if reasoning or text or logprobs or delta.get("tool_calls"):
            counted = max(1, len(logprobs), sampled - state.sampled)
            if reasoning and not text:
                reasoning_tokens = counted
            else:
                reasoning_tokens = counted - 1 if state.reasoning else 0
            state.reasoning = bool(reasoning and not text)
            piece = Piece(reasoning, text, logprobs, counted, reasoning_tokens)
        if choice.get("finish_reason"):
            state.reason = _FINISH.get(choice["finish_reason"], TaskOutcome.STOP)
            ending = Ending(state.reason)
    state.sampled = max(state.sampled, sampled)
    usage = event.get("usage")
    if usage:
        ending = _ending(
            state.reason, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), timings
        )
    return piece, ending


def _completion_event(event: dict[str, Any], state: StreamState) -> tuple[Piece | None, Ending | None]:
    probabilities = event.get("completion_probabilities") or ()
    logprobs = tuple(_token_logprob(entry, state.top_logprobs) for entry in probabilities)
    text = event.get("content") or ""
    piece = Piece("", text, logprobs, max(1, len(logprobs))) if text or logprobs else None
    if not event.get("stop"):
        return piece, None
    ending = _ending(
        _STOP_TYPES.get(event.get("stop_type", "eos"), TaskOutcome.STOP),
        int(event.get("tokens_evaluated", 0)),
        int(event.get("tokens_predicted", 0)),
        event.get("timings") or {},
    )
    return piece, ending


def _ending(reason: TaskOutcome, prompt_tokens: int, completion_tokens: int, timings: dict[str, Any]) -> Ending:
    """How a choice ended, with the slot's cache and drafting counts from its last event's `timings` (which chat
    and completion events carry alike)."""
    return Ending(
        reason,
        prompt_tokens,
        completion_tokens,
        int(timings.get("cache_n", 0)),
        int(timings.get("draft_n", 0)),
        int(timings.get("draft_n_accepted", 0)),
    )


def _token_logprob(entry: dict[str, Any], alternatives: int) -> TokenLogprob:
    top = tuple(
        TopLogprob(token=str(t.get("token", "")), logprob=float(t["logprob"]))
        for t in (entry.get("top_logprobs") or ())[:alternatives]
    )
    return TokenLogprob(token=str(entry.get("token", "")), logprob=float(entry.get("logprob", 0.0)), top=top)


class ServerError(Exception):
    """llama-server refused or failed a request; `code` is ours for the task's error."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, body: dict[str, Any]) -> ServerError:
        error = body.get("error") or {}
        if not isinstance(error, dict):
            return cls(str(error), "engine_error")
        message = str(error.get("message") or error)
        kind = str(error.get("type") or "")
        if "context" in kind or ("context" in message and "exceed" in message):
            prompt, window = error.get("n_prompt_tokens"), error.get("n_ctx")
            if isinstance(prompt, int) and isinstance(window, int):
                # llama.cpp's own advice ("try increasing it") is not the client's to follow.
                message = (
                    f"the request takes {prompt} tokens, more than the {window} of context a llama.cpp slot holds "
                    f"(the model's own context, at most {LLAMA_CPP_SLOT_CONTEXT} a slot): shorten it"
                )
            return cls(f"llama.cpp: {message}", "context_length_exceeded")
        if kind == "invalid_request_error" or error.get("code") == 400:
            return cls(f"llama.cpp: {message}", "invalid_request")
        return cls(f"llama.cpp: {message}", "engine_error")
