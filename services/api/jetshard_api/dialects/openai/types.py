"""Request and response bodies of the OpenAI-compatible routes, and the translation of a request into a
TaskRequest.

Fields at their neutral values are accepted; fields that would change the output and are not supported
are refused with 400, never silently ignored.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from jetshard_schema.ids import ModelId, TaskId
from jetshard_schema.sampling import ResolvedSampling
from jetshard_schema.types import (
    ChatMessage,
    SamplingParams,
    TaskKind,
    TaskOutcome,
    TaskRequest,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    Tools,
    Usage,
)

from jetshard_api.answers import Choice
from jetshard_api.dialects import checks
from jetshard_api.images import check_images


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling fields of chat completions, completions and responses alike."""

    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    """vLLM's (the openai client sends it in `extra_body`), as are `min_p` and `repetition_penalty`."""
    min_p: float | None = None
    repetition_penalty: float | None = None

    def checked(
        self,
        max_tokens: int | None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        names: dict[str, str] | None = None,
    ) -> SamplingParams:
        return checks.sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop=stop,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            names=names,
        )


class _Common(Sampling, frozen=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class FunctionCallBody(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCallBody(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class MessageBody(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: str = "output"
    description: str = ""
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[MessageBody]
    max_completion_tokens: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    """Passed to the chat template as `reasoning_effort`; "none" turns a thinking model's reasoning off."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: values for the chat template (`{"enable_thinking": false}`)."""
    continue_final_message: bool = False
    """vLLM's: the answer continues the last message, an assistant's, instead of answering it in a new turn."""
    functions: list[Any] | None = None
    """Chat Completions' deprecated form of `tools`: refused, naming `tools`, never ignored."""
    function_call: Any = None
    """The deprecated form of `tool_choice`, refused likewise."""


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    """The legacy form: this many alternatives per token (0: the chosen token's alone)."""


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[str | int | list[int]]
    """A string, a list of strings, one input's token ids, or a list of such lists (see `checks.EmbeddingInput`)."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _common(request: _Common, max_tokens: int | None) -> SamplingParams:
    if request.logit_bias:
        raise checks.unsupported("logit_bias")
    return request.checked(max_tokens, request.seed, request.stop)


def image_urls(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """The file and web addresses of the request's images, each with the field that names it."""
    return [
        url for i, m in enumerate(request.messages) for url in checks.image_urls(m.content, f"messages[{i}].content")
    ]


def chat_task(
    task_id: TaskId, model_id: ModelId, request: ChatCompletionRequest, loaded: Mapping[str, bytes] | None = None
) -> TaskRequest:
    """`loaded`: the images the request names by file or web address (`image_urls`), as the API read them."""
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    sampling = _common(request, max_tokens)
    for deprecated, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(request, deprecated) is not None:
            raise checks.unsupported(deprecated, f"(deprecated by OpenAI; use '{instead}')")
    if not request.messages:
        raise checks.invalid("messages", "messages must not be empty")
    output_schema = None
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        output_schema = {"type": "object"}
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema is None:
            raise checks.invalid("response_format", "response_format json_schema needs json_schema.schema")
        output_schema = checks.output_schema(response_format.json_schema.schema, "response_format")
    messages = tuple(_message(m, i, loaded or {}) for i, m in enumerate(request.messages))
    check_images(messages)
    if request.continue_final_message and not checks.continued(messages):
        raise checks.invalid("continue_final_message", "continue_final_message needs an assistant's message last")
    return TaskRequest(
        task_id=task_id,
        model_id=model_id,
        kind=TaskKind.CHAT,
        messages=messages,
        continue_final_message=request.continue_final_message,
        sampling=sampling,
        tools=_tools(request),
        output_schema=output_schema,
        top_logprobs=checks.top_logprobs(request.logprobs, request.top_logprobs),
        n=checks.choices(request.n),
        chat_template_kwargs=effort_template_kwargs(request.chat_template_kwargs, request.reasoning_effort),
    )


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's values of `reasoning_effort` (and the Responses API's `reasoning.effort`)."""


def effort_template_kwargs(
    given: dict[str, Any] | None, effort: str | None, param: str = "reasoning_effort"
) -> dict[str, Any]:
    """A chat's template values with OpenAI's reasoning effort: "none" is no reasoning; any other effort goes to
    templates that take one (gpt-oss'), leaving a model that thinks on or off by its own default."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise checks.invalid(param, f"{param} must be one of {', '.join(REASONING_EFFORTS)}")
    thinking = False if effort == "none" else None
    return checks.template_kwargs(given, thinking=thinking, effort=None if effort == "none" else effort)


def _tools(request: ChatCompletionRequest) -> Tools | None:
    choice, function = ToolChoice.AUTO, None
    if isinstance(request.tool_choice, NamedToolChoice):
        choice, function = ToolChoice.FUNCTION, request.tool_choice.function.name
    elif request.tool_choice is not None:
        choice = ToolChoice(request.tool_choice)
    functions = [(t.function.name, t.function.description, t.function.parameters) for t in request.tools or ()]
    return checks.tools(functions, choice, function, request.parallel_tool_calls)


def _message(message: MessageBody, index: int, loaded: Mapping[str, bytes]) -> ChatMessage:
    param = f"messages[{index}]"
    role = "system" if message.role == "developer" else message.role
    if role not in ("system", "user", "assistant", "tool"):
        raise checks.invalid(f"{param}.role", f"{param}.role must be system, user, assistant or tool")
    if role == "tool" and not message.tool_call_id:
        raise checks.invalid(f"{param}.tool_call_id", f"{param}: a tool message needs tool_call_id")
    calls = tuple(
        ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in message.tool_calls or ()
    )
    if calls and role != "assistant":
        raise checks.invalid(f"{param}.tool_calls", f"{param}: only assistant messages carry tool_calls")
    content, images = checks.chat_content(message.content, f"{param}.content", loaded)
    return ChatMessage(
        role=role,
        content=content,
        images=images,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def completion_task(task_id: TaskId, model_id: ModelId, request: CompletionRequest) -> TaskRequest:
    sampling = _common(request, request.max_tokens)
    if request.echo or request.suffix:
        raise checks.unsupported("echo" if request.echo else "suffix")
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) > 1:
            raise checks.unsupported("prompt", "as a list of several prompts")
        prompt = prompt[0] if prompt else ""
    if not prompt:
        raise checks.invalid("prompt", "prompt must not be empty: there is nothing to complete")
    return TaskRequest(
        task_id=task_id,
        model_id=model_id,
        kind=TaskKind.COMPLETION,
        prompt=prompt,
        sampling=sampling,
        top_logprobs=checks.top_logprobs(request.logprobs is not None, request.logprobs, "logprobs"),
        n=checks.choices(request.n),
    )


def embedding_task(task_id: TaskId, model_id: ModelId, request: EmbeddingRequest) -> TaskRequest:
    inputs = checks.embedding_inputs(request.input)
    if request.dimensions is not None:
        raise checks.unsupported("dimensions")
    return TaskRequest(task_id=task_id, model_id=model_id, kind=TaskKind.EMBEDDING, inputs=inputs)


# --- response bodies ---------------------------------------------------------------------------------------


class CompletionTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int


class UsageBody(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails

    @classmethod
    def of(cls, usage: Usage | None) -> UsageBody:
        usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
        details = CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens)
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, details)


class TopLogprobBody(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobBody(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobBody]

    @classmethod
    def of(cls, lp: TokenLogprob) -> TokenLogprobBody:
        top = [TopLogprobBody(t.token, t.logprob, list(t.token.encode())) for t in lp.top]
        return cls(lp.token, lp.logprob, list(lp.token.encode()), top)


class ChoiceLogprobs(msgspec.Struct, frozen=True):
    content: list[TokenLogprobBody]

    @classmethod
    def of(cls, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> ChoiceLogprobs:
        return cls([TokenLogprobBody.of(lp) for lp in logprobs])


class CompletionLogprobs(msgspec.Struct, frozen=True):
    """The legacy completions shape."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...], offset: int = 0) -> CompletionLogprobs:
        offsets = []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        return cls(
            tokens=[lp.token for lp in logprobs],
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{t.token: t.logprob for t in lp.top} for lp in logprobs],
            text_offset=offsets,
        )


class AssistantMessage(msgspec.Struct, frozen=True):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallBody] | None = None
    reasoning_content: str | None = None
    """A thinking model's reasoning, apart from its answer (vLLM's and DeepSeek's name)."""


def finish_reason(reason: TaskOutcome | None) -> str | None:
    return None if reason is None else str(reason)


def tool_call_bodies(calls: list[ToolCall] | tuple[ToolCall, ...]) -> list[ToolCallBody]:
    return [ToolCallBody(id=c.id, function=FunctionCallBody(c.name, c.arguments)) for c in calls]


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    message: AssistantMessage

    @classmethod
    def of(cls, index: int, choice: Choice, logprobs: bool) -> ChatChoice:
        calls = tool_call_bodies(choice.tool_calls) or None
        return cls(
            index=index,
            finish_reason=finish_reason(choice.finish_reason),
            logprobs=ChoiceLogprobs.of(choice.logprobs) if logprobs else None,
            message=AssistantMessage(
                content=choice.text if choice.text or not calls else None,
                tool_calls=calls,
                reasoning_content=choice.reasoning or None,
            ),
        )


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    text: str

    @classmethod
    def of(cls, index: int, choice: Choice, logprobs: bool) -> CompletionChoice:
        return cls(
            index=index,
            finish_reason=finish_reason(choice.finish_reason),
            logprobs=CompletionLogprobs.of(choice.logprobs) if logprobs else None,
            text=choice.text,
        )


class AnswerHead(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat completion and a text completion both say besides their choices."""

    id: str
    created: int
    model: str
    usage: UsageBody


class ChatCompletion(AnswerHead, frozen=True, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class Completion(AnswerHead, frozen=True, kw_only=True):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class EmbeddingBody(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"

    @classmethod
    def of(cls, index: int, vector: tuple[float, ...], encoding: str) -> EmbeddingBody:
        if encoding == "base64":
            # Little-endian float32, as OpenAI encodes it (the openai client asks for this by default).
            packed = struct.pack(f"<{len(vector)}f", *vector)
            return cls(index=index, embedding=base64.b64encode(packed).decode())
        return cls(index=index, embedding=list(vector))


class EmbeddingUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[EmbeddingBody]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class ModelObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str
    ready: bool
    unloads_at: int | None = None
    """When it unloads if nothing more comes for it (Unix seconds); null while it is kept loaded, or not ready."""
    placeable: bool
    engines: list[str]
    """What serves its ready instances ("mlx", "llama.cpp"); empty while none is ready."""
    capabilities: list[str]
    """What the model does: completion, tools, thinking, vision, embedding (Ollama's names)."""
    generation_defaults: ResolvedSampling
    """What a request that leaves these out gets, unless the model directory's generation_config.json sets
    them (the runner reads it; see jetshard_schema.sampling)."""


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelObject]
    object: str = "list"
