"""Request and response bodies of the OpenAI-compatible routes, and the checks that turn a request into a
TaskRequest.

Fields at their neutral values are accepted; fields that would change the output and are not supported
yet are refused with 400, never silently ignored.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.sampling import ResolvedSampling
from jetshard_schema.types import ChatMessage, SamplingParams, TaskKind, TaskRequest, Usage

from jetshard_api.errors import ApiError

MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit, the range MLX's PRNG keys take."""


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None


_Body = TypeVar("_Body", bound="_Common")
_ERROR_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def strictly_decoded(body: bytes, body_type: type[_Body]) -> _Body:
    """Decode a request body with JSON's own types. Litestar converts bodies leniently (`"max_tokens": "5"`
    becomes 5); OpenAI refuses a value of the wrong type, and a client that sends one has a bug to see."""
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as error:
        field = _ERROR_PATH.search(str(error))
        raise ApiError(400, str(error), "invalid_type", field.group(1) if field else None) from error
    except msgspec.DecodeError as error:
        raise ApiError(400, f"the body is not valid JSON: {error}", "invalid_json") from error


def _unsupported(param: str, why: str = "") -> ApiError:
    what = f"'{param}' {why}" if why else f"'{param}'"
    return ApiError(400, f"{what} is not supported yet", "unsupported_parameter", param)


def _check_common(request: _Common) -> SamplingParams:
    if request.n not in (None, 1):
        raise _unsupported("n", "greater than 1")
    if request.presence_penalty or request.frequency_penalty:
        raise _unsupported("presence_penalty" if request.presence_penalty else "frequency_penalty", "other than 0")
    if request.logit_bias:
        raise _unsupported("logit_bias")
    if request.logprobs or request.top_logprobs:
        raise _unsupported("logprobs")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", "invalid_value", "max_tokens")
    # A value left out stays None: the model's defaults fill it in where the model is (jetshard_schema.sampling).
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", "invalid_value", "temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise ApiError(400, "top_p must be in (0, 1]", "invalid_value", "top_p")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and {MAX_SEED}", "invalid_value", "seed")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop takes up to 4 non-empty strings", "invalid_value", "stop")
    return SamplingParams(
        max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed, stop=stop
    )


def _text_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content: only text parts are supported",
                    "unsupported_content",
                    f"messages[{index}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(
        400,
        f"messages[{index}].content must be a string or a list of text parts",
        "invalid_value",
        f"messages[{index}].content",
    )


def chat_task(task_id: TaskId, model_id: ModelId, request: ChatCompletionRequest) -> TaskRequest:
    sampling = _check_common(request)
    if request.tools:
        raise _unsupported("tools")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise _unsupported("response_format", "other than text")
    if not request.messages:
        raise ApiError(400, "messages must not be empty", "invalid_value", "messages")
    messages = []
    for i, message in enumerate(request.messages):
        role = message.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise ApiError(
                400, f"messages[{i}].role must be system, user or assistant", "invalid_value", f"messages[{i}].role"
            )
        messages.append(
            ChatMessage(
                role="system" if role == "developer" else role, content=_text_content(message.get("content"), i)
            )
        )
    return TaskRequest(
        task_id=task_id, model_id=model_id, kind=TaskKind.CHAT, messages=tuple(messages), sampling=sampling
    )


def completion_task(task_id: TaskId, model_id: ModelId, request: CompletionRequest) -> TaskRequest:
    sampling = _check_common(request)
    if request.echo or request.suffix:
        raise _unsupported("echo" if request.echo else "suffix")
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise _unsupported("prompt", "as a list of several prompts")
        prompt = prompt[0]
    return TaskRequest(task_id=task_id, model_id=model_id, kind=TaskKind.COMPLETION, prompt=prompt, sampling=sampling)


# --- response bodies ---------------------------------------------------------------------------------------


class UsageBody(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage | None) -> UsageBody:
        usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


class AssistantMessage(msgspec.Struct, frozen=True):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: str | None
    logprobs: None = None
    message: AssistantMessage


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: str | None
    logprobs: None = None
    text: str


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat completion and a text completion both say besides their choices."""

    id: str
    created: int
    model: str
    usage: UsageBody


class ChatCompletion(Answer, frozen=True, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class Completion(Answer, frozen=True, kw_only=True):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class ModelObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str
    ready: bool
    placeable: bool
    generation_defaults: ResolvedSampling
    """What a request that leaves these out gets, unless the model directory's generation_config.json sets
    them (the runner reads it; see jetshard_schema.sampling)."""


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelObject]
    object: str = "list"
