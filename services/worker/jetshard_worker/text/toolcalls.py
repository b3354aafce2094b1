"""Turning a model's generated text into assistant content plus OpenAI-style tool calls, while it streams.

Models with a tool-call format (mlx-lm's tokenizer wrapper names it: `tool_call_start`, `tool_call_end`,
`tool_parser`) wrap each call in markers; the text between them goes to the parser, never to the client.
Text that could still become the start marker is held back, as stop strings are, so a marker split over
tokens never leaks half-shown. Whitespace between calls and after the last one (templates put newlines
there) is not content either: a client would otherwise get a message of bare newlines next to its calls.
Models without a format (e.g. Llama 3.1) answer a call as a bare JSON object, so for them the whole output
is held while it could still be one.

A call counts only if it names one of the request's tools: anything else the model wrapped in markers is
returned as the text it was, so a client sees what the model wrote rather than an invented call. Arguments
that do not match the tool's `parameters` schema are still returned as a call, with a warning in the log:
the client executes calls and answers errors, and a call it cannot see is one it cannot correct.

`forced_call_schema` and `parse_forced` serve `tool_choice` "required" or a named function, where a
constrained decoder makes the model write the call as JSON of a fixed shape instead of its own format.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from jetshard_worker.text.textstream import pending_prefix_length

log = logging.getLogger(__name__)

# The most calls a forced `required` generation may write when parallel calls are allowed, so it ends.
FORCED_MAX_CALLS = 4

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolCallParsed(NamedTuple):
    name: str
    arguments: str  # a JSON object as compact text, as OpenAI's `function.arguments` carries it


class ToolCallSplitter:
    """Splits streamed generated text into content and tool calls; `add` each piece, then `finish` once."""

    def __init__(
        self,
        start: str | None,
        end: str | None,
        parser: Callable[..., Any] | None,
        tools: list[dict[str, Any]],
        parallel: bool = True,
    ) -> None:
        """`start`/`end`/`parser` come from the tokenizer wrapper (None when the model has no tool-call format:
        then the JSON fallback applies; an empty `end`, as Mistral's, means a call runs to the end of the
        output). `tools` are OpenAI-style function specs: [{"name":..., "description":..., "parameters": {...}}].
        With `parallel` False only the first call is kept."""
        self._start = start if parser is not None else None
        self._end = end or ""
        self._parser = parser
        self._tools = {tool["name"]: tool for tool in tools}
        # mlx-lm's parsers look up parameter types in the request's `tools`, which wrap each spec.
        self._parser_tools = [{"type": "function", "function": tool} for tool in tools]
        self._parallel = parallel
        self._calls_made = 0
        self._buffer = ""  # markers: a held start-marker prefix, or the call so far; no format: all text held
        self._in_call = False
        # Whitespace right after a call is held: dropped if another call or the end follows, else shown.
        self._after_call = False
        self._passthrough = False  # no format: the output can no longer be a JSON call

    def add(self, text: str) -> tuple[str, list[ToolCallParsed]]:
        """Feed the next piece of generated (already detokenized, stop-string-filtered) text; return the content
        that is now safe to show and the tool calls completed by this piece."""
        if self._start is None:
            return self._add_unformatted(text), []
        return self._add_marked(self._start, text)

    def finish(self) -> tuple[str, list[ToolCallParsed]]:
        """At the end of generation: whatever is held back. A call without its end marker (max_tokens cut it,
        or the format has none) is parsed if it parses, else returned as content. Without a format, the whole
        output (stripped, optionally inside a ```json fence) is the calls if it is a JSON object
        {"name": <a known tool>, "arguments"|"parameters": {...}} or a list of them; then the content is ""."""
        rest, self._buffer = self._buffer, ""
        if self._start is None:
            if self._passthrough:
                return rest, []
            calls = _json_calls(rest, self._tools)
            return ("", self._keep(calls)) if calls is not None else (rest, [])
        if self._in_call:
            self._in_call = False
            return self._resolve(self._start, rest, closed=False)
        return ("" if self._after_call and rest.isspace() else rest), []

    def _add_marked(self, start: str, text: str) -> tuple[str, list[ToolCallParsed]]:
        buffer = self._buffer + text
        content: list[str] = []
        calls: list[ToolCallParsed] = []
        while True:
            if self._in_call:
                at = buffer.find(self._end) if self._end else -1
                if at == -1:
                    break
                self._in_call = False
                shown, made = self._resolve(start, buffer[:at], closed=True)
                content.append(shown)
                calls += made
                buffer = buffer[at + len(self._end) :]
            else:
                if self._after_call:
                    stripped = buffer.lstrip()
                    if start.startswith(stripped):
                        break
                    if stripped.startswith(start):
                        buffer = stripped
                    self._after_call = False
                at = buffer.find(start)
                if at == -1:
                    keep = pending_prefix_length(buffer, start)
                    content.append(buffer[: len(buffer) - keep])
                    buffer = buffer[len(buffer) - keep :]
                    break
                content.append(buffer[:at])
                buffer = buffer[at + len(start) :]
                self._in_call = True
        self._buffer = buffer
        return "".join(content), calls

    def _resolve(self, start: str, body: str, closed: bool) -> tuple[str, list[ToolCallParsed]]:
        """The calls in one marked block, or the block's own text as content when it holds none we accept."""
        calls = self._parse(body)
        if calls is None:
            return start + body + (self._end if closed else ""), []
        self._after_call = True
        return "", self._keep(calls)

    def _parse(self, body: str) -> list[ToolCallParsed] | None:
        assert self._parser is not None
        try:
            parsed = self._parser(body, self._parser_tools)
        except Exception as error:  # a parser's failure on odd model output must not end the stream
            log.debug("tool-call text did not parse (%s: %s): %r", type(error).__name__, error, body)
            return None
        return _known_calls(parsed if isinstance(parsed, list) else [parsed], self._tools)

    def _add_unformatted(self, text: str) -> str:
        if self._passthrough:
            return text
        self._buffer += text
        if _could_be_json_call(self._buffer):
            return ""
        self._passthrough = True
        shown, self._buffer = self._buffer, ""
        return shown

    def _keep(self, calls: list[ToolCallParsed]) -> list[ToolCallParsed]:
        if not self._parallel:
            calls = calls[: max(0, 1 - self._calls_made)]
        self._calls_made += len(calls)
        return calls


def forced_call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON Schema a constrained decoder holds the model to for `tool_choice` "required" (`name` None: one
    call of any tool, or with `parallel` an array of 1 to FORCED_MAX_CALLS of them) or a named function (one
    call of it). Its output is read back by `parse_forced`."""
    by_name = {tool["name"]: tool for tool in tools}
    if name is not None:
        if name not in by_name:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return _call_schema(by_name[name])
    if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")
    one_call = {"anyOf": [_call_schema(tool) for tool in tools]}
    if not parallel:
        return one_call
    return {"type": "array", "items": one_call, "minItems": 1, "maxItems": FORCED_MAX_CALLS}


def parse_forced(text: str) -> list[ToolCallParsed]:
    """The calls in the output of a decoding constrained by `forced_call_schema`: one object or an array of them.
    Raises ValueError when the text is not that shape (generation was cut short before the JSON closed)."""
    value = json.loads(text)
    return _forced_calls(value if isinstance(value, list) else [value])


def parse_forced_cut(text: str) -> list[ToolCallParsed]:
    """The calls a forced-call output cut short by max_tokens completed: an array's items before the cut. The call
    being written at the cut is left out: arguments completed for it would be made up, not the model's, and a
    client would run them."""
    with contextlib.suppress(ValueError):
        return parse_forced(text)
    body = text.lstrip()
    if not body.startswith("["):
        return []
    decoder, at = json.JSONDecoder(), 1
    items: list[Any] = []
    while True:
        at = len(body) - len(body[at:].lstrip(" \t\n\r,"))
        try:
            item, at = decoder.raw_decode(body, at)
        except ValueError:
            return _forced_calls(items)
        items.append(item)


def _forced_calls(items: list[Any]) -> list[ToolCallParsed]:
    calls = []
    for item in items:
        if not (
            isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("arguments"), dict)
        ):
            raise ValueError(f"not a forced tool call: {item!r}")
        calls.append(ToolCallParsed(item["name"], _compact(item["arguments"])))
    return calls


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, "arguments": tool.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _known_calls(parsed: list[Any], tools: dict[str, dict[str, Any]]) -> list[ToolCallParsed] | None:
    """The parsed calls as ToolCallParsed, or None unless every one names a known tool with an object of
    arguments: a block or output is taken as calls as a whole, never partly, so no text is lost."""
    calls = []
    for item in parsed:
        if not isinstance(item, dict) or item.get("name") not in tools:
            return None
        key = "arguments" if "arguments" in item else "parameters"
        arguments = item.get(key)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        name = item["name"]
        problems = _schema_problems(tools[name].get("parameters") or {}, arguments)
        if problems:
            log.warning(
                "tool call %s does not match its parameters (%s); returned as written", name, "; ".join(problems)
            )
        calls.append(ToolCallParsed(name, _compact(arguments)))
    return calls or None


def _json_calls(text: str, tools: dict[str, dict[str, Any]]) -> list[ToolCallParsed] | None:
    """The calls a model without a tool-call format wrote as its whole output, or None if it wrote something else."""
    body = text.strip()
    if body.startswith("```"):
        info, _, body = body[3:].partition("\n")
        if info.strip() not in ("", "json") or not body.rstrip().endswith("```"):
            return None
        body = body.rstrip()[:-3]
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _known_calls(value if isinstance(value, list) else [value], tools)


def _could_be_json_call(text: str) -> bool:
    """Whether the output so far could still become what `_json_calls` accepts."""
    rest = text.lstrip()
    if rest.startswith("```"):
        info, newline, body = rest[3:].partition("\n")
        if not newline:
            return "json".startswith(info.strip())
        if info.strip() not in ("", "json"):
            return False
        rest = body.lstrip()
    elif "```".startswith(rest):
        return True
    return rest == "" or rest[0] in "{["


def _schema_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What in `arguments` breaks the top level of the JSON Schema `schema`: missing required properties,
    unexpected ones where additionalProperties is false, a property's type or enum. Deeper levels are the
    client's to check; this only feeds the warning."""
    properties = schema.get("properties") or {}
    problems = [f"{key} is required" for key in schema.get("required", []) if key not in arguments]
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if schema.get("additionalProperties") is False:
                problems.append(f"{key} is not a parameter")
            continue
        types = spec.get("type")
        if types is not None and not any(
            _is_type(value, kind) for kind in ([types] if isinstance(types, str) else types)
        ):
            problems.append(f"{key} is not of type {types}")
        if "enum" in spec and value not in spec["enum"]:
            problems.append(f"{key} is not one of {spec['enum']}")
    return problems


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(kind, object))


def _compact(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
