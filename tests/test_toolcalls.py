"""Generated text is split into content and tool calls for every tool-call format mlx-lm infers for common open
models, whatever the pieces it streams in, and for models without a format when they answer with bare JSON."""

from __future__ import annotations

import importlib
import json
import logging
import random
from dataclasses import dataclass

import pytest
from jetshard_worker.text.toolcalls import ToolCallParsed, ToolCallSplitter, forced_call_schema, parse_forced
from mlx_lm.tokenizer_utils import _infer_tool_parser

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}},
]

WEATHER = ToolCallParsed("get_weather", '{"city":"Paris","days":3}')
TIME = ToolCallParsed("get_time", "{}")


@dataclass(frozen=True)
class Recorded:
    """What a model of one format writes: text before a call, one call, two calls, a call of an unknown tool."""

    parser: str
    template: str  # what in the model's chat template makes mlx-lm pick this parser
    one: str
    two: str
    unknown: str


RECORDED = [
    Recorded(  # Qwen2.5, Qwen3, Hermes
        "json_tools",
        '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}',
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "book_flight", "arguments": {"to": "Paris"}}\n</tool_call>',
    ),
    Recorded(  # Qwen3-Coder
        "qwen3_coder",
        "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",
        "Let me check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "<tool_call>\n<function=book_flight>\n<parameter=to>\nParis\n</parameter>\n</function>\n</tool_call>",
    ),
    Recorded(  # Mistral Small 3.2, Devstral, Magistral: no end marker, several calls after one another
        "mistral",
        "{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}",
        'Let me check the weather.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
        '[TOOL_CALLS]book_flight[ARGS]{"to": "Paris"}',
    ),
    Recorded(  # LFM2
        "pythonic",
        "{{- '<|tool_call_start|>[' }}",
        'Let me check the weather.<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
        '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time()]<|tool_call_end|>',
        '<|tool_call_start|>[book_flight(to="Paris")]<|tool_call_end|>',
    ),
    Recorded(  # GLM-4.5 to 4.7
        "glm47",
        "{{- '<arg_key>' + k + '</arg_key>' }}",
        "Let me check the weather.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
        "<arg_value>3</arg_value></tool_call><tool_call>get_time</tool_call>",
        "<tool_call>book_flight<arg_key>to</arg_key><arg_value>Paris</arg_value></tool_call>",
    ),
    Recorded(  # Kimi K2
        "kimi_k2",
        "{{- '<|tool_calls_section_begin|>' }}",
        "Let me check the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.book_flight:0<|tool_call_argument_begin|>"
        '{"to": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    Recorded(  # MiniMax-M2
        "minimax_m2",
        "{{- '<minimax:tool_call>' }}",
        'Let me check the weather.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="book_flight">\n<parameter name="to">Paris</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
    ),
]


def marker(parser: str) -> str:
    start: str = importlib.import_module(f"mlx_lm.tool_parsers.{parser}").tool_call_start
    return start


def splitter(parser: str | None, parallel: bool = True) -> ToolCallSplitter:
    if parser is None:
        return ToolCallSplitter(None, None, None, TOOLS, parallel)
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolCallSplitter(module.tool_call_start, module.tool_call_end, module.parse_tool_call, TOOLS, parallel)


def run(parser: str | None, pieces: list[str], parallel: bool = True) -> tuple[str, list[ToolCallParsed]]:
    stream = splitter(parser, parallel)
    content, calls = "", []
    for piece in pieces:
        shown, made = stream.add(piece)
        content, calls = content + shown, calls + made
    shown, made = stream.finish()
    return content + shown, calls + made


def small_pieces(text: str, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 4)
        pieces.append(text[at : at + size])
        at += size
    return pieces


class TemplateOnly:
    """The part of a Hugging Face tokenizer `_infer_tool_parser` reads."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template

    def get_vocab(self) -> dict[str, int]:
        return {}


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_mlx_lm_picks_this_format_for_such_models(rec: Recorded) -> None:
    """mlx-lm's private `_infer_tool_parser`, on purpose: it is how mlx-lm picks a model's tool-call format from its
    chat template (no public name does that without loading a tokenizer), and this pins that choice."""
    assert _infer_tool_parser(TemplateOnly(rec.template)) == rec.parser


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_content_before_a_call_is_released_and_the_call_parsed(rec: Recorded) -> None:
    before = rec.one[: rec.one.index(marker(rec.parser))]
    stream = splitter(rec.parser)
    assert stream.add(before) == (before, [])
    shown, calls = stream.add(rec.one[len(before) :])
    rest, more = stream.finish()
    assert (shown + rest, calls + more) == ("", [WEATHER])


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_small_random_pieces_give_what_one_piece_gives(rec: Recorded) -> None:
    for text in (rec.one, rec.two, rec.unknown, "Intro. " + rec.two + "\nDone."):
        whole = run(rec.parser, [text])
        for seed in range(5):
            assert run(rec.parser, small_pieces(text, seed)) == whole


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_two_calls_give_two_and_one_without_parallel_calls(rec: Recorded) -> None:
    assert run(rec.parser, small_pieces(rec.two)) == ("", [WEATHER, TIME])
    assert run(rec.parser, small_pieces(rec.two), parallel=False) == ("", [WEATHER])


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_a_call_of_an_unknown_tool_stays_content(rec: Recorded) -> None:
    assert run(rec.parser, small_pieces(rec.unknown)) == (rec.unknown, [])


@pytest.mark.parametrize("rec", RECORDED, ids=lambda r: r.parser)
def test_a_start_marker_look_alike_is_held_then_released(rec: Recorded) -> None:
    start = marker(rec.parser)
    for look_alike in (start[:5], start[:-1]):
        stream = splitter(rec.parser)
        assert stream.add("Note: " + look_alike) == ("Note: ", [])
        assert stream.add("s are fun") == (look_alike + "s are fun", [])
        assert stream.finish() == ("", [])


def test_text_after_a_call_is_content_and_whitespace_between_calls_is_not() -> None:
    rec = RECORDED[0]
    assert run(rec.parser, small_pieces("Sure.\n" + rec.two + "\n\nDone.")) == ("Sure.\n\n\nDone.", [WEATHER, TIME])
    assert run(rec.parser, [rec.two + "\n\n"]) == ("", [WEATHER, TIME])


def test_an_unterminated_call_is_parsed_if_it_parses_else_returned_as_content() -> None:
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    assert run("json_tools", small_pieces(cut)) == ("", [WEATHER])
    assert run("json_tools", small_pieces(cut[:-8])) == (cut[:-8], [])


def test_mistral_v3_writes_its_calls_as_a_json_list() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    assert run("mistral", small_pieces(text)) == ("", [WEATHER, TIME])


def test_string_arguments_are_normalised_to_compact_json() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}\n</tool_call>'
    assert run("json_tools", [text]) == ("", [WEATHER])


def test_arguments_off_the_schema_are_returned_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"days": "3", "unit": "kelvin"}}\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="jetshard_worker.text.toolcalls"):
        assert run("json_tools", [text]) == ("", [ToolCallParsed("get_weather", '{"days":"3","unit":"kelvin"}')])
    assert "city is required" in caplog.text
    assert "days is not of type integer" in caplog.text
    assert "unit is not one of" in caplog.text


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        '\n```json\n{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}\n```\n',
    ],
)
def test_a_model_without_a_format_calls_with_bare_json(text: str) -> None:
    assert run(None, small_pieces(text)) == ("", [WEATHER])


def test_a_list_of_json_calls_gives_them_all_or_the_first() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {}}]'
    assert run(None, small_pieces(text)) == ("", [WEATHER, TIME])
    assert run(None, small_pieces(text), parallel=False) == ("", [WEATHER])


@pytest.mark.parametrize(
    "text",
    [
        "{curly braces} mark sets in mathematics.",
        '{"name": "book_flight", "arguments": {"to": "Paris"}}',
        '{"name": "get_weather"}',
        '```json\n{"city": "Paris"}\n```',
    ],
)
def test_json_like_output_that_is_no_call_is_content(text: str) -> None:
    assert run(None, small_pieces(text)) == (text, [])


def test_without_a_format_prose_is_released_as_soon_as_it_cannot_be_json() -> None:
    stream = splitter(None)
    assert stream.add(" ") == ("", [])
    assert stream.add("Paris") == (" Paris", [])
    assert stream.add(" is sunny.") == (" is sunny.", [])
    fenced = splitter(None)
    assert fenced.add("```") == ("", [])
    assert fenced.add("python\n") == ("```python\n", [])


def test_forced_call_schema_and_parse_forced_round_trip() -> None:
    named = forced_call_schema(TOOLS, "get_weather", parallel=True)
    assert named == {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": TOOLS[0]["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    one = forced_call_schema(TOOLS, None, parallel=False)
    assert [branch["properties"]["name"]["const"] for branch in one["anyOf"]] == ["get_weather", "get_time"]
    many = forced_call_schema(TOOLS, None, parallel=True)
    assert (many["type"], many["items"], many["minItems"], many["maxItems"]) == ("array", one, 1, 4)
    assert forced_call_schema([{"name": "ping"}], "ping", False)["properties"]["arguments"] == {"type": "object"}

    assert parse_forced(json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "days": 3}})) == [WEATHER]
    written = json.dumps(
        [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {}}]
    )
    assert parse_forced(written) == [WEATHER, TIME]
    with pytest.raises(ValueError):
        parse_forced('{"name": "get_weather", "arguments": {"city": "Par')
    with pytest.raises(ValueError):
        forced_call_schema(TOOLS, "book_flight", parallel=False)
