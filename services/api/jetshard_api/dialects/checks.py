"""Checks every dialect's request goes through on its way to a `TaskRequest`: sampling values, tools, output
schemas, conversation messages. Each dialect names its own fields (`max_tokens`, `num_predict`,
`max_output_tokens`…) and passes the name along, so an error names the field the client sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jetshard_schema.ids import MODEL_ID_MAX_LENGTH, ModelId, parse_model_id
from jetshard_schema.types import (
    CHAT_TEMPLATE_ARGUMENTS,
    MAX_CHOICES,
    MAX_EMBEDDING_INPUTS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    TOKEN_ID_LIMIT,
    ChatMessage,
    SamplingParams,
    Tool,
    ToolChoice,
    Tools,
)

from jetshard_api.errors import ApiError
from jetshard_api.images import data_url_image, is_data_url

MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit, the range MLX's PRNG keys take."""
MAX_TOOLS = 128
"""OpenAI's bound."""
MAX_STOP = 16
"""OpenAI takes 4; vLLM and Ollama take any number, and editors built for Ollama send more than 4."""
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""OpenAI's rule for function names (and dots, which Ollama's and Anthropic's tools use)."""
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_ALTERNATIVES = 1000
"""OpenAI's bound on a schema's enum values, here on every choice a schema offers (enum values, anyOf and oneOf
branches, optional properties): llama.cpp's grammar sampler walks them all for each token, while every other request
on the model waits. On a 2-core x86 CPU 1000 of them cost about 0.25 s a token, 3000 over a second, and a schema of
20000 held a model for minutes."""


def unsupported(param: str, why: str = "") -> ApiError:
    what = f"'{param}' {why}" if why else f"'{param}'"
    return ApiError(400, f"{what} is not supported", "unsupported_parameter", param)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_value", param)


SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
)
"""The parameters of `sampling`, each named in errors as itself unless the dialect names it otherwise."""


def sampling(
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repeat_last_n: int | None = None,
    names: dict[str, str] | None = None,
) -> SamplingParams:
    """A request's sampling values, checked; a value left out stays None, for the model's defaults to fill in
    where the model is (jetshard_schema.sampling). `names` maps these parameters to the dialect's fields.

    `top_k` -1 means no cut, as 0 does (vLLM's and Ollama's way of saying it); `repeat_last_n` -1 means the whole
    sequence (Ollama's and llama.cpp's), as leaving it out does."""
    name = {field: field for field in SAMPLING_FIELDS} | (names or {})
    if max_tokens is not None and max_tokens < 1:
        raise invalid(name["max_tokens"], f"{name['max_tokens']} must be at least 1")
    if temperature is not None and not 0 <= temperature <= 2:
        raise invalid(name["temperature"], f"{name['temperature']} must be between 0 and 2")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid(name["top_p"], f"{name['top_p']} must be in (0, 1]")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise invalid(name["seed"], f"{name['seed']} must be between 0 and {MAX_SEED}")
    if top_k is not None and top_k < -1:
        raise invalid(name["top_k"], f"{name['top_k']} must be 0 or more (0 or -1: no cut)")
    if min_p is not None and not 0 <= min_p <= 1:
        raise invalid(name["min_p"], f"{name['min_p']} must be between 0 and 1")
    if repetition_penalty is not None and not 0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        field = name["repetition_penalty"]
        raise invalid(field, f"{field} must be in (0, {MAX_REPETITION_PENALTY:g}] (1: no penalty)")
    for key, penalty in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if penalty is not None and not -2 <= penalty <= 2:
            raise invalid(name[key], f"{name[key]} must be between -2 and 2")
    if repeat_last_n is not None and repeat_last_n < -1:
        field = name["repeat_last_n"]
        raise invalid(field, f"{field} must be 0 or more (0: no penalties; -1: the whole sequence)")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise invalid(name["stop"], f"{name['stop']} takes up to {MAX_STOP} non-empty strings")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stops,
        top_k=0 if top_k == -1 else top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repeat_last_n=None if repeat_last_n == -1 else repeat_last_n,
    )


def choices(n: int | None) -> int:
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"n must be between 1 and {MAX_CHOICES}")
    return n or 1


def top_logprobs(wanted: bool, top: int | None, param: str = "top_logprobs") -> int | None:
    """How many alternatives to report per token, or None for no logprobs at all."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(param, f"{param} must be between 0 and {MAX_TOP_LOGPROBS}")
    if top and not wanted:
        raise invalid(param, f"{param} needs logprobs")
    return (top or 0) if wanted else None


EmbeddingInput = str | Sequence[str | int | Sequence[int]]
"""OpenAI's (and llama.cpp's) forms of what to embed: a string, a list of strings, one input's token ids, or a list
of such lists."""


def embedding_inputs(value: EmbeddingInput, param: str = "input") -> tuple[str | tuple[int, ...], ...]:
    """The inputs to embed, each a text or token ids; none empty, every id in [0, TOKEN_ID_LIMIT). Whether an id
    is in the model's vocabulary is checked where the model is (an error there is a 400 too)."""
    single = isinstance(value, str) or (bool(value) and all(isinstance(item, int) for item in value))
    items = [value] if single else list(value)
    if not items or len(items) > MAX_EMBEDDING_INPUTS:
        raise invalid(param, f"{param} takes 1 to {MAX_EMBEDDING_INPUTS} inputs")
    if all(isinstance(item, str) for item in items):
        if not all(items):
            raise invalid(param, f"{param} strings must not be empty")
        return tuple(str(item) for item in items)
    inputs = []
    for i, ids in enumerate(items):
        if not isinstance(ids, list):
            forms = "a string, a list of strings, a list of token ids or a list of lists of token ids"
            raise invalid(param, f"{param} must be {forms}, not a mix")
        where = param if single else f"{param}[{i}]"
        if not ids:
            raise invalid(param, f"{where} is an empty list of token ids")
        wrong = next((t for t in ids if not 0 <= t < TOKEN_ID_LIMIT), None)
        if wrong is not None:
            raise invalid(param, f"{where} holds {wrong}: token ids are 0 or more (and below {TOKEN_ID_LIMIT})")
        inputs.append(tuple(ids))
    return tuple(inputs)


def output_schema(schema: object, param: str) -> dict[str, Any]:
    """A JSON Schema a client asks the output to follow: an object, not too deep, offering not too many choices.
    Whether the runner's grammar compiler can follow it is checked where the model is (an error there is a 400 too)."""
    if not isinstance(schema, dict):
        raise invalid(param, f"{param} must be a JSON Schema object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise invalid(param, f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if (offered := _alternatives(schema)) > MAX_SCHEMA_ALTERNATIVES:
        raise invalid(
            param,
            f"{param} offers {offered} choices (enum values, anyOf and oneOf branches, optional properties); at most "
            f"{MAX_SCHEMA_ALTERNATIVES} are allowed",
        )
    return schema


def tools(
    functions: Sequence[tuple[str, str, object]],
    choice: ToolChoice = ToolChoice.AUTO,
    function: str | None = None,
    parallel: bool = True,
    param: str = "tools",
) -> Tools | None:
    """Functions (name, description, parameters schema) and how they may be called; None when there are none
    and none is asked for."""
    if len(functions) > MAX_TOOLS:
        raise invalid(param, f"{param} takes at most {MAX_TOOLS} functions")
    checked = []
    for i, (name, description, parameters) in enumerate(functions):
        if not FUNCTION_NAME.match(name):
            raise invalid(f"{param}[{i}]", f"function names are 1 to 64 of a-z, A-Z, 0-9, '_', '.', '-'; got {name!r}")
        field = f"{param}[{i}].parameters"
        schema = {"type": "object"} if parameters is None else output_schema(parameters, field)
        if schema.get("type", "object") != "object":
            raise invalid(field, f"{field} must be a JSON Schema of type 'object' (a call's arguments are an object)")
        checked.append(Tool(name=name, description=description, parameters=schema))
    if (offered := sum(_alternatives(tool.parameters) for tool in checked)) > MAX_SCHEMA_ALTERNATIVES:
        # A forced call's grammar (llama.cpp's lazy one for any call, too) holds every function's parameters.
        raise invalid(
            param,
            f"the parameters of {param} offer {offered} choices together (enum values, anyOf and oneOf branches, "
            f"optional properties); at most {MAX_SCHEMA_ALTERNATIVES} are allowed",
        )
    names = [tool.name for tool in checked]
    if len(set(names)) != len(names):
        raise invalid(param, f"{param} names a function twice")
    if choice is ToolChoice.FUNCTION and function not in names:
        raise invalid("tool_choice", f"tool_choice names {function!r}, which is not among the tools")
    if choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION) and not checked:
        raise invalid("tool_choice", "tool_choice asks for a call but there are no tools")
    if not checked:
        return None
    return Tools(functions=tuple(checked), choice=choice, function=function, parallel=parallel)


def template_kwargs(
    given: dict[str, Any] | None,
    param: str = "chat_template_kwargs",
    *,
    thinking: bool | None = None,
    effort: str | None = None,
) -> dict[str, Any]:
    """The values a chat's template gets: the client's own (`chat_template_kwargs`), then the dialect's thinking
    switch as `enable_thinking` (Qwen3's name, which mlx-lm renames for templates that call it otherwise) and its
    reasoning effort as `reasoning_effort` (gpt-oss' name), unless the client's own set them. A template that
    does not read a value renders as if it were not there."""
    kwargs = dict(given or {})
    reserved = sorted(set(kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise invalid(param, f"{param} may not set {', '.join(reserved)}: the rendering sets them")
    # A few hundred levels would pass the JSON decoder and end in a RecursionError where the template renders.
    if _depth(kwargs) > MAX_SCHEMA_DEPTH:
        raise invalid(param, f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def continued(messages: Sequence[ChatMessage], param: str = "messages") -> bool:
    """Whether the answer continues the last message: an assistant's text, which Anthropic and Ollama continue
    (a prefill) rather than answer. One that holds tool calls cannot be continued."""
    if not messages or messages[-1].role != "assistant":
        return False
    if messages[-1].tool_calls:
        raise invalid(param, f"{param} ends with an assistant's tool calls: their results come next, not more of it")
    return True


def thinking_budget(budget: int | None, param: str, max_tokens: int | None = None) -> int | None:
    if budget is None:
        return None
    if budget < 1:
        raise invalid(param, f"{param} must be at least 1")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid(param, f"{param} must be less than max_tokens ({max_tokens}): the answer comes after it")
    return budget


def chat_content(content: object, param: str, loaded: Mapping[str, bytes]) -> tuple[str, tuple[bytes, ...]]:
    """A message's text and images: a string, or a list of text parts and image parts (Chat Completions'
    `image_url`, the Responses API's `input_image`) whose URL is a data URL, or a file or web address whose image
    `loaded` holds (see `image_urls`)."""
    if not isinstance(content, list):
        return text_content(content, param), ()
    texts, images = [], []
    for j, part in enumerate(content):
        url = _image_url(part, f"{param}[{j}]")
        if url is None:
            texts.append(part)
        elif is_data_url(url):
            images.append(data_url_image(url, f"{param}[{j}].image_url"))
        elif url in loaded:
            images.append(loaded[url])
        else:
            field = f"{param}[{j}].image_url"
            raise invalid(field, f"{field} must be a data URL of an image, or a file or web address the API may read")
    return text_content(texts, param), tuple(images)


def image_urls(content: object, param: str) -> list[tuple[str, str]]:
    """The file and web addresses of a message's `image_url` parts, each with the field that names it: the API
    reads them (`images.load_image_urls`) before `chat_content`."""
    if not isinstance(content, list):
        return []
    urls = [(_image_url(part, f"{param}[{j}]"), f"{param}[{j}].image_url") for j, part in enumerate(content)]
    return [(url, field) for url, field in urls if url is not None and not is_data_url(url)]


def _image_url(part: object, param: str) -> str | None:
    """An image part's URL (`image_url: {"url": ...}`, or the URL alone as the Responses API and some clients
    send it); None for another part."""
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image"):
        return None
    if part.get("file_id") is not None:
        raise unsupported(f"{param}.file_id", "(there are no stored files: send the image as a data URL)")
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise invalid(f"{param}.image_url", f"{param}.image_url needs a url")
    return url


def text_content(content: object, param: str) -> str:
    """A message's content: a string, or a list of text parts (`{"type": "text", "text": …}`; Anthropic's and
    the Responses API's `input_text` / `output_text` too)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ApiError(400, f"{param}: only text parts are supported", "unsupported_content", param)
        return "".join(parts)
    raise invalid(param, f"{param} must be a string or a list of text parts")


_TEXT_PARTS = ("text", "input_text", "output_text")
_VALUES = frozenset({"enum", "const", "default", "examples"})
"""Schema keywords whose values are JSON values, not schemas."""


def _depth(value: object, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def _alternatives(schema: object) -> int:
    """The choices `schema` offers a document, in all its subschemas: enum values, anyOf and oneOf branches, and
    properties that are not required (an object may hold or leave out each)."""
    if isinstance(schema, list):
        return sum(_alternatives(item) for item in schema)
    if not isinstance(schema, dict):
        return 0
    offered = sum(len(schema[key]) for key in ("enum", "anyOf", "oneOf") if isinstance(schema.get(key), list))
    properties, required = schema.get("properties"), schema.get("required")
    if isinstance(properties, dict):
        named = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
        offered += len(set(properties) - named)
        offered += sum(_alternatives(value) for value in properties.values())
    return offered + sum(_alternatives(v) for k, v in schema.items() if k not in _VALUES and k != "properties")


_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
"""What another server's model names look like (`gpt-4o`, `claude-sonnet-4-5`, `llama3:8b`,
`hf.co/org/repo:Q4_K_M`): a name this cluster cannot have, not an attack."""


def requested_model_id(value: str, param: str = "model") -> ModelId:
    """The model an inference request names (every dialect's `model`). A name that cannot be one of this cluster's
    models, as clients send that were made for another server (`gpt-3.5-turbo`, `llama3`), is a 404
    `model_not_found`, which is what OpenAI, Anthropic and Ollama answer for a model they do not have; only a
    hostile value (a path, control characters, an overlong string) is a 400 `invalid_model_id`."""
    try:
        return parse_model_id(value)
    except ValueError as error:
        hostile = len(value) > MODEL_ID_MAX_LENGTH or not _MODEL_NAME.fullmatch(value) or ".." in value or "//" in value
        if hostile:
            raise ApiError(400, str(error), "invalid_model_id", param) from error
        raise ApiError(
            404, f"model {value!r} not found: this cluster's models are named 'org/name'", "model_not_found", param
        ) from error
