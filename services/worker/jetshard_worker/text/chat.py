"""A conversation, with its tools, as the model's own chat template renders it.

Templates that know tools (Qwen, Llama 3.1+, Mistral…) get them as `tools=` and the conversation's earlier
calls as `tool_calls`, the shape Hugging Face templates read. A template with no place for tools renders the
same text with and without them; the tools are then described in a system message that asks for the JSON
form `jetshard_worker.text.toolcalls` parses, and earlier calls are written in that form, so a model without a
tool format can still take part.

A vision model's template takes each message's content as a list of parts, as Hugging Face processors do: its
images (`{"type": "image"}`, which the template writes as the placeholder the processor expands), then its text.
"""

from __future__ import annotations

import json
from typing import Any

from jetshard_schema.types import CHAT_TEMPLATE_ARGUMENTS, ChatMessage, Tool, ToolChoice, Tools

TOOLS_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    "To call one, answer with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <the arguments object>}}.'
)


def tool_spec(tool: Tool) -> dict[str, Any]:
    """A function as the tool-call parsers and constrained decoding take it."""
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


def render_chat(
    tokenizer: Any,
    messages: tuple[ChatMessage, ...],
    tools: Tools | None,
    template_kwargs: dict[str, Any] | None = None,
    content_parts: bool = False,
    add_generation_prompt: bool = True,
    continue_final: bool = False,
) -> str:
    """The prompt text; the tools are left out when the request's choice is `none`. `template_kwargs` are the
    request's own values for the template (`enable_thinking`...); the ones the rendering itself sets are refused.
    `content_parts`: the template is a vision model's (see the module's doc). Without `add_generation_prompt`, the
    conversation alone, without the opening of the assistant's turn. `continue_final`: the last message, an
    assistant's, left open for the answer to continue (transformers' `continue_final_message`)."""
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    template_kwargs = {**template_kwargs, "add_generation_prompt": add_generation_prompt and not continue_final}
    if continue_final:
        template_kwargs["continue_final_message"] = True
    parts = {i: len(m.images) for i, m in enumerate(messages)} if content_parts else None
    plain = _render(tokenizer, [message_dict(m) for m in messages], None, parts, template_kwargs)
    if tools is None or tools.choice is ToolChoice.NONE or not tools.functions:
        return plain
    specs: list[dict[str, Any]] = [{"type": "function", "function": tool_spec(tool)} for tool in tools.functions]
    with_tools = _render(tokenizer, [message_dict(m) for m in messages], specs, parts, template_kwargs)
    if with_tools != plain:
        return with_tools
    inline = [message_dict(m, calls_as_text=True) for m in messages]
    described = with_tools_described(inline, [spec["function"] for spec in specs])
    if parts is not None and len(described) > len(inline):  # the images stay with their messages
        parts = {i + 1: count for i, count in parts.items()}
    return _render(tokenizer, described, None, parts, template_kwargs)


def with_tools_described(messages: list[dict[str, Any]], specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (earlier calls written as text) with the tools described in the system message, for a template
    with no place for tools: the model answers a call in the JSON form `toolcalls` parses."""
    described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(spec) for spec in specs))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parts: dict[int, int] | None,
    template_kwargs: dict[str, Any],
) -> str:
    """`parts`: each message's image count, by index, for a template that takes content as parts. `template_kwargs`
    include `add_generation_prompt`."""
    if parts is not None:
        messages = [{**m, "content": _content_parts(parts.get(i, 0), m["content"])} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **template_kwargs)
    return str(rendered)


def _content_parts(images: int, text: str) -> list[dict[str, str]]:
    """A message's images, then its text (also when empty: a template may read the first part)."""
    return [
        *({"type": "image"} for _ in range(images)),
        *([{"type": "text", "text": text}] if text or not images else []),
    ]


def message_dict(message: ChatMessage, calls_as_text: bool = False) -> dict[str, Any]:
    """A message as chat templates (and OpenAI-style servers) read it; `calls_as_text`: an assistant's earlier
    calls written into its content in the JSON form, for a template with no place for calls."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if calls_as_text:
            calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in message.tool_calls]
            text = json.dumps(calls[0] if len(calls) == 1 else calls)
            rendered["content"] = f"{message.content}\n{text}" if message.content else text
        else:
            rendered["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in message.tool_calls
            ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _arguments(text: str) -> Any:
    """Templates iterate over the arguments as a mapping; a model's unparsable JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
