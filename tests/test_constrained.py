"""Constrained JSON decoding: the closer (`minimal_completion`) on every prefix of valid documents, the llguidance
verification of its completions, generation with a real tiny model at temperature 1 under generous and tight
budgets, and any token sequence handed to the runner's output however far it lags behind the engine: every output
parses and validates, within the budget; a budget below the shortest document is refused."""

from __future__ import annotations

import functools
import json
import logging
import random
import re
from collections.abc import Callable
from typing import Any

import llguidance
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.tiny_models import make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetshard_schema.ids import TaskId
from jetshard_schema.types import Chunk, TaskOutcome
from jetshard_worker.text import constrained
from jetshard_worker.text.constrained import BudgetTooSmall, JsonConstraint, SchemaError, grammar_tokenizer
from jetshard_worker.text.json_closer import minimal_completion
from jetshard_worker.text.output import ChoiceOutput, RowEnd, TaskOutput
from jetshard_worker.text.toolcalls import forced_call_schema
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

# --------------------------------------------------------------------------- a validator for the subset used here


def validate(value: Any, schema: Any, root: Any = None) -> None:
    """Raise AssertionError unless `value` is valid for `schema` (the JSON Schema keywords these tests use)."""
    root = schema if root is None else root
    assert errors(value, schema, root) == [], errors(value, schema, root)


def errors(value: Any, schema: Any, root: Any) -> list[str]:
    if schema is True or schema == {}:
        return []
    if schema is False:
        return ["false schema"]
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        if found := errors(value, target, root):
            return found
    for sub in schema.get("allOf", []):
        if found := errors(value, sub, root):
            return found
    for key in ("anyOf", "oneOf"):
        if key in schema:
            matching = [sub for sub in schema[key] if not errors(value, sub, root)]
            if not matching or (key == "oneOf" and len(matching) > 1):
                return [f"{value!r}: {len(matching)} of the {key} branches match"]
    if "const" in schema and value != schema["const"]:
        return [f"{value!r} != const {schema['const']!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{value!r} not in {schema['enum']!r}"]
    if "type" in schema:
        types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(is_type(value, t) for t in types):
            return [f"{value!r} is not of type {types}"]
    out: list[str] = []
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            out.append(f"{value!r} length out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{value!r} does not match {schema['pattern']!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{value!r} out of range")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{value!r} item count out of bounds")
        for item in value:
            out += errors(item, schema.get("items", True), root)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        out += [f"missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            out += errors(item, properties.get(key, schema.get("additionalProperties", True)), root)
    return out


def is_type(value: Any, name: str) -> bool:
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return checks[name](value)


def test_the_validator_rejects_what_it_should() -> None:
    with pytest.raises(AssertionError):
        validate({"name": "x"}, RECORD)
    with pytest.raises(AssertionError):
        validate({"name": "x", "arguments": {}}, TOOL_CALL)
    validate(json.loads(RECORD_DOC), RECORD)


# --------------------------------------------------------------------------- schemas and documents

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "count", "color", "ok", "tags"],
    "additionalProperties": False,
}
RECORD_DOC = r'{"name":"a\"b\\c\u0001é","count":-120,"color":"green","ok":false,"tags":["x","y\n"]}'

TOOL_CALL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"name": {"const": "get_weather"}, "arguments": {"$ref": "#/$defs/weather"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"name": {"const": "get_time"}, "arguments": {"$ref": "#/definitions/time"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ],
    "$defs": {
        "weather": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    },
    "definitions": {
        "time": {
            "type": "object",
            "properties": {"zone": {"type": "string", "minLength": 3}, "utc": {"type": ["boolean", "null"]}},
            "required": ["zone", "utc"],
            "additionalProperties": False,
        }
    },
}

NESTED = {
    "type": "object",
    "properties": {
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number", "minimum": -1}},
                "required": ["x", "y"],
            },
            "minItems": 1,
        },
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2}},
        "level": {"type": "integer", "minimum": 10, "maximum": 99},
        "code": {"type": "string", "minLength": 4},
        "meta": {"type": "object", "properties": {"on": {"const": True}, "none": {"type": "null"}}},
        "kind": {"enum": [1, "one", None, [1, 2]]},
    },
    "required": ["points", "matrix", "level", "code", "meta", "kind"],
}
NESTED_DOC = (
    '{"points":[{"x":1.5e-3,"y":-0.25},{"x":7E+2,"y":0}],"matrix":[[1,2],[30,-4,5]],"level":42,'
    '"code":"abcdef","meta":{"on":true,"none":null,"extra":[{}]},"kind":"one"}'
)

ANY_OBJECT = {"type": "object"}
ANY_OBJECT_DOC = '{"a":[1,{"b":"c\\u001f"},[],true,null],"":{},"n":-0.5e10}'

CASES = [
    (RECORD, RECORD_DOC),
    (TOOL_CALL, '{"name":"get_weather","arguments":{"city":"Paris","days":3}}'),
    (TOOL_CALL, '{"name":"get_time","arguments":{"zone":"UTC","utc":null}}'),
    (NESTED, NESTED_DOC),
    (ANY_OBJECT, ANY_OBJECT_DOC),
    ({"type": "array", "items": {"type": "string"}, "minItems": 2}, '["a",""]'),
    ({"type": ["string", "null"]}, '"abc"'),
    ({"type": "integer", "minimum": -5, "maximum": -2}, "-3"),
]


@pytest.mark.parametrize(("schema", "doc"), CASES)
def test_every_prefix_of_a_valid_document_completes_into_a_valid_one(schema: dict[str, Any], doc: str) -> None:
    validate(json.loads(doc), schema)
    for end in range(len(doc) + 1):
        prefix = doc[:end]
        suffix = minimal_completion(prefix, schema)
        validate(json.loads(prefix + suffix), schema)


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [
        ("", '{"name":"","count":0,"color":"red","ok":true,"tags":[]}'),
        ('{"na', 'me":"","count":0,"color":"red","ok":true,"tags":[]}'),  # inside a key
        ('{"name":', '"","count":0,"color":"red","ok":true,"tags":[]}'),  # after the colon
        ('{"name":"a\\', 'n","count":0,"color":"red","ok":true,"tags":[]}'),  # a partial escape
        ('{"name":"a\\u00', '00","count":0,"color":"red","ok":true,"tags":[]}'),
        ('{"name":"","count":-', '1,"color":"red","ok":true,"tags":[]}'),  # a number that needs a digit
        ('{"name":"","count":12', ',"color":"red","ok":true,"tags":[]}'),
        ('{"name":"","count":1,"color":"gr', 'een","ok":true,"tags":[]}'),  # the enum member it begins
        ('{"name":"","count":1,"color":"blue","ok":fa', 'lse,"tags":[]}'),  # a literal
        ('{"name":"","count":1,"color":"blue","ok":true,"tags":["a",', '""]}'),
        ('{"name":"","count":1,"color":"blue","ok":true,"tags":[]', "}"),
        ('{"name":"","count":1,"color":"blue","ok":true,"tags":[]}', ""),
    ],
)
def test_completions_are_minimal(prefix: str, suffix: str) -> None:
    assert minimal_completion(prefix, RECORD) == suffix


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [
        ('{"name":"get_', 'weather","arguments":{"city":"","days":1}}'),  # the shorter branch
        ('{"name":"get_t', 'ime","arguments":{"zone":"aaa","utc":null}}'),  # the branch the const allows
        ('{"name":"get_time","arguments":{"zone":"U', 'aa","utc":null}}'),  # minLength pads
        ('{"name":"get_weather","arguments":{', '"city":"","days":1}}'),  # $ref, minimum
    ],
)
def test_completions_follow_the_tool_call_branch_generated(prefix: str, suffix: str) -> None:
    assert minimal_completion(prefix, TOOL_CALL) == suffix


def test_numbers_complete_into_their_range() -> None:
    assert minimal_completion('{"points":[{"x":1.', NESTED).startswith('0,"y":0}]')
    assert minimal_completion('{"points":[{"x":1e-', NESTED).startswith('0,"y":0}]')
    assert minimal_completion('{"points":[{"x":0,"y":0}],"matrix":[],"level":1', NESTED).startswith('0,"code":"aaaa"')
    assert (
        minimal_completion('{"points":[{"x":0,"y":-', NESTED)
        == '1}],"matrix":[],"level":10,"code":"aaaa","meta":{},"kind":1}'
    )
    assert minimal_completion("-", {"type": "integer", "minimum": -5, "maximum": -2}) == "2"


def test_a_prefix_the_schema_cannot_continue_is_an_error() -> None:
    with pytest.raises(ValueError):
        minimal_completion('{"name":"get_date"', TOOL_CALL)
    with pytest.raises(ValueError):
        minimal_completion('{"colour"', RECORD)


# --------------------------------------------------------------------------- llguidance


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = make_tiny_model(tmp_path_factory.mktemp("constrained") / "model", arch="llama", num_layers=2, num_files=1)
    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer


def make_constraint(
    tokenizer: Any, schema: dict[str, Any], max_tokens: int, vocab_size: int = 512, closes_at_budget: bool = True
) -> JsonConstraint:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return JsonConstraint(grammar_tokenizer(tokenizer, vocab_size), schema, max_tokens, encode, closes_at_budget)


def accepted(tokenizer: Any, schema: dict[str, Any], text: str) -> bool:
    """Whether llguidance's matcher for `schema` accepts `text` as a complete document."""
    ll = grammar_tokenizer(tokenizer, 512)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=constrained.JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(ll.greedy_tokenize(text)) and matcher.is_accepting()


@pytest.mark.parametrize(("schema", "doc"), CASES)
def test_llguidance_accepts_the_first_completion_of_every_prefix(
    tiny: tuple[Any, Any], schema: dict[str, Any], doc: str
) -> None:
    """The closer's first choice already satisfies llguidance on documents in llguidance's property order."""
    _, tokenizer = tiny
    for end in range(len(doc) + 1):
        assert accepted(tokenizer, schema, doc[:end] + minimal_completion(doc[:end], schema)), doc[:end]


def test_grammar_tokenizer_is_cached_per_tokenizer_and_width(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    assert grammar_tokenizer(tokenizer, 512) is grammar_tokenizer(tokenizer, 512)
    assert grammar_tokenizer(tokenizer, 520).vocab_size == 520
    assert sorted(grammar_tokenizer(tokenizer, 512).eos_tokens) == sorted(tokenizer.eos_token_ids)


def test_a_schema_llguidance_rejects_is_a_schema_error(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    with pytest.raises(SchemaError, match="look-around"):
        make_constraint(tokenizer, {"type": "string", "pattern": "(?<=a)b"}, 10)
    with pytest.raises(SchemaError, match=r"Unimplemented keys.*uniqueItems"):
        make_constraint(tokenizer, {"type": "array", "uniqueItems": True}, 10)
    with pytest.raises(SchemaError, match="minimum"):
        make_constraint(tokenizer, {"type": "integer", "minimum": 5, "maximum": 1}, 10)


def run_process(constraint: JsonConstraint, prompt: list[int], text_tokens: list[int], width: int) -> mx.array:
    """Feed `text_tokens` as generated after `prompt` the way mlx-lm does; the mask for the next token."""
    logits = mx.zeros((1, width))
    constraint.process(mx.array(prompt), logits)
    tokens = list(prompt)
    for token in text_tokens:
        tokens.append(token)
        masked = constraint.process(mx.array(tokens), logits)
    return masked


def test_a_complete_document_allows_only_eos(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    constraint = make_constraint(tokenizer, RECORD, 100, vocab_size=520)
    doc = '{"name":"x","count":1,"color":"red","ok":true,"tags":[]}'
    masked = run_process(constraint, [1, 2, 3], tokenizer.encode(doc, add_special_tokens=False), width=520)
    allowed = [i for i, value in enumerate(masked[0].tolist()) if value > -float("inf")]
    assert sorted(allowed) == sorted(tokenizer.eos_token_ids)
    assert constraint.ends(lambda: doc, 40) and constraint.completion(doc) == ""


def closing_after(tokenizer: Any, schema: dict[str, Any], text: str) -> str | None:
    """What closes `text` once it is generated and the budget is spent (None if the task would go on)."""
    constraint = make_constraint(tokenizer, schema, max_tokens=100)
    run_process(constraint, [1], tokenizer.encode(text, add_special_tokens=False), width=512)
    return constraint.completion(text) if constraint.ends(lambda: text, 100) else None


def test_the_verifier_rejects_a_completion_llguidance_does_not_accept(tiny: tuple[Any, Any]) -> None:
    """An additional property may not precede a declared one in llguidance's grammar: the closer's shortest
    completion (valid JSON Schema) fails verification, and the next candidate is used."""
    _, tokenizer = tiny
    schema = {
        "type": "object",
        "properties": {"ab": {"type": "integer"}, "z": {"type": "integer"}},
        "required": ["z"],
    }
    text = '{"a'
    assert minimal_completion(text, schema) == '":0,"z":0}'
    assert not accepted(tokenizer, schema, text + '":0,"z":0}')
    assert closing_after(tokenizer, schema, text) == 'b":0,"z":0}'


@pytest.mark.parametrize(
    ("pattern", "text", "completion"),
    [
        ("^[0-9]{3}$", '{"code":"1', '11"}'),
        ("^[a-c]+x$", '{"code":"b', 'x"}'),  # not b, b, b...: the character a closing quote may follow
        ("^[a-c]+x$", '{"code":"', 'ax"}'),
    ],
)
def test_the_matcher_guides_what_the_closer_does_not_model(
    tiny: tuple[Any, Any], pattern: str, text: str, completion: str
) -> None:
    _, tokenizer = tiny
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}
    assert not accepted(tokenizer, schema, text + minimal_completion(text, schema))
    assert closing_after(tokenizer, schema, text) == completion
    validate(json.loads(text + completion), schema)


def test_what_nothing_completes_is_closed_as_plain_json(tiny: tuple[Any, Any], caplog: Any) -> None:
    """No single ASCII character continues the string: the schema-agnostic close, still JSON, and a warning."""
    _, tokenizer = tiny
    schema = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[éè]$"}}, "required": ["c"]}
    with caplog.at_level(logging.WARNING, logger="jetshard_worker.text.constrained"):
        assert closing_after(tokenizer, schema, '{"c":"') == '"}'
    assert "no completion valid for the schema;" in caplog.text


# --------------------------------------------------------------------------- generation with a real model


def generate(
    model: Any, tokenizer: Any, schema: dict[str, Any], max_tokens: int, seed: int, bias: mx.array | None = None
) -> tuple[str, str, int]:
    """Sample at temperature 1 under the constraint, checking `closing` after each token as the runner does.

    Returns the text generated, the closing text appended to it ("" when EOS ended the task) and the number of tokens
    generated. `bias` is added to the logits before the constraint masks them.
    """
    constraint = make_constraint(tokenizer, schema, max_tokens)
    processors = [constraint.process] if bias is None else [lambda _, logits: logits + bias, constraint.process]
    prompt = mx.array(tokenizer.encode("Reply in JSON:", add_special_tokens=False))
    mx.random.seed(seed)
    steps = generate_step(
        prompt, model, max_tokens=max_tokens, sampler=make_sampler(temp=1.0), logits_processors=processors
    )
    generated: list[int] = []
    for token, _ in steps:
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(generated), "", len(generated)
        generated.append(token)
        text = tokenizer.decode(generated)
        if constraint.ends(functools.partial(str, text), len(generated)):
            return text, constraint.completion(text), len(generated)
    raise AssertionError(f"reached max_tokens={max_tokens} without closing: {tokenizer.decode(generated)!r}")


@pytest.mark.parametrize("max_tokens", [120, 70, 46])
def test_sampled_documents_always_parse_and_validate(tiny: tuple[Any, Any], max_tokens: int) -> None:
    """120 tokens: the grammar usually completes the document. 70: the closer completes it mid-way, within the
    budget. 46: just the minimal document, which the closer returns after the first token."""
    model, tokenizer = tiny
    for seed in range(20):
        text, closing, generated = generate(model, tokenizer, RECORD, max_tokens, seed)
        validate(json.loads(text + closing), RECORD)
        assert generated + len(tokenizer.encode(closing, add_special_tokens=False)) <= max_tokens


def test_a_budget_below_the_shortest_document_is_refused(tiny: tuple[Any, Any]) -> None:
    """RECORD's shortest document takes 46 tokens; a schema the closer cannot complete alone is not refused."""
    _, tokenizer = tiny
    with pytest.raises(BudgetTooSmall, match=r"^max_tokens 45 cannot hold .* the shortest takes 46 tokens"):
        make_constraint(tokenizer, RECORD, 45)
    make_constraint(tokenizer, RECORD, 46)
    make_constraint(
        tokenizer,
        {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[éè]$"}}, "required": ["c"]},
        1,
    )


@pytest.mark.parametrize("max_tokens", [8, 30])
def test_json_object_under_a_tight_budget(tiny: tuple[Any, Any], max_tokens: int) -> None:
    """json_object: any object. The tiny model closes objects at once unless "}" is discouraged; discouraged, it
    writes a long key that the budget cuts and the closer completes (keys end with the odd partial UTF-8 character)."""
    model, tokenizer = tiny
    (close,) = tokenizer.encode("}", add_special_tokens=False)
    bias = mx.zeros((512,)).at[close].add(-40.0)
    for seed in range(20):
        text, closing, _ = generate(model, tokenizer, ANY_OBJECT, max_tokens, seed, bias)
        assert isinstance(json.loads(text + closing), dict)
        assert closing


# --------------------------------------------------------------------------- the runner's output behind the engine


def run_like_the_runner(
    tokenizer: Any,
    schema: dict[str, Any],
    max_tokens: int,
    choose: Callable[[np.ndarray], int],
    lag: int,
    chunks: list[Chunk] | None = None,
    forced_calls: bool = False,
) -> tuple[str, int, str]:
    """Generate as the engine and the runner do: the engine masks the logits with the constraint and samples (`choose`
    picks one of the allowed token ids), and hands each token (then the row's end) to the runner's `TaskOutput`, which
    handles it `lag` tokens later, as its event loop does when other tasks keep it busy. Once the output says the
    choice ends, the engine ends the row. Returns the text published, the tokens the output counted, and its closing
    text ("" when the document ended by itself). `chunks` collects what it published; `forced_calls`: the schema is
    a forced tool call's, set up as the MLX engine sets one up."""
    constraint = make_constraint(tokenizer, schema, max_tokens, closes_at_budget=not forced_calls)
    chunks = [] if chunks is None else chunks
    choice = ChoiceOutput(detokenizer=tokenizer.detokenizer, constraint=constraint, forced_calls=forced_calls)
    output = TaskOutput(TaskId("task"), [choice], str, chunks.append, lambda _: None)
    prompt = [1, 2, 3]
    tokens = list(prompt)
    handed: list[int | TaskOutcome] = []

    def loop(behind: int) -> None:
        while len(handed) > behind and not choice.finished:
            item = handed.pop(0)
            if isinstance(item, TaskOutcome):
                output.finish(0, RowEnd(item, len(prompt)))
            elif (ending := output.token(0, item, None)) is not None:
                # The engine ends the row: what it handed out since is void.
                output.finish(0, RowEnd(ending, len(prompt)))

    while not choice.finished and not (handed and isinstance(handed[-1], TaskOutcome)):
        masked = constraint.process(mx.array(tokens), mx.zeros((1, 512)))
        token = choose(np.flatnonzero(np.array(masked[0]) > -np.inf))
        if token in tokenizer.eos_token_ids:
            handed.append(TaskOutcome.STOP)
        else:
            tokens.append(token)
            handed += [token] if len(tokens) - len(prompt) < max_tokens else [token, TaskOutcome.LENGTH]
        loop(lag)
    loop(0)
    closing = choice.text[-1] if choice.ending is TaskOutcome.LENGTH else ""
    return "".join(chunk.text for chunk in chunks), choice.tokens, closing


def test_a_document_the_engine_completed_ahead_of_the_runner_is_not_cut(tiny: tuple[Any, Any]) -> None:
    """The engine has written the whole document (its matcher allows only EOS) before the runner handles the first
    token: the runner's text is not complete until its last token, however far the budget."""
    _, tokenizer = tiny
    doc = '{"name":"x","count":1,"color":"red","ok":true,"tags":[]}'
    script = iter([*tokenizer.encode(doc, add_special_tokens=False), min(tokenizer.eos_token_ids)])
    text, _, closing = run_like_the_runner(tokenizer, RECORD, 300, lambda allowed: next(script), lag=100)
    assert (text, closing) == (doc, "")


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(max_tokens=st.sampled_from([46, 47, 50, 60, 90, 300]), lag=st.integers(0, 40), seed=st.integers(0, 2**32))
def test_any_token_sequence_closes_within_the_budget_however_far_the_runner_lags(
    tiny: tuple[Any, Any], max_tokens: int, lag: int, seed: int
) -> None:
    """Whatever allowed tokens the engine samples (uniformly: long strings of odd characters, several tokens each),
    under a budget from the shortest document (46 tokens) up, and however many tokens the runner's output is behind
    the engine: the published text is a valid document, and its closing fits in the budget with the tokens generated.
    Before, the runner took the engine's finished document for its own text and ended that text unclosed."""
    _, tokenizer = tiny
    draw = random.Random(seed)
    text, generated, closing = run_like_the_runner(tokenizer, RECORD, max_tokens, lambda a: int(draw.choice(a)), lag)
    validate(json.loads(text), RECORD)
    assert generated + len(tokenizer.encode(closing, add_special_tokens=False)) <= max_tokens, (text, closing)


def test_a_forced_call_runs_to_the_budget_and_is_not_cut_before_it(tiny: tuple[Any, Any]) -> None:
    """Two parallel calls that take the whole budget both come: a forced call is not closed near the budget (its cut
    call would be left out), so it is not ended early to make room for a closing either."""
    _, tokenizer = tiny
    add = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    schema = forced_call_schema([add], None, parallel=True)
    doc = '[{"name":"add","arguments":{"a":1}},{"name":"add","arguments":{"a":2}}]'
    tokens = tokenizer.encode(doc, add_special_tokens=False)
    script = iter([*tokens, min(tokenizer.eos_token_ids)])
    chunks: list[Chunk] = []
    _, generated, _ = run_like_the_runner(
        tokenizer, schema, len(tokens), lambda allowed: next(script), lag=0, chunks=chunks, forced_calls=True
    )
    calls = [json.loads(call.arguments) for chunk in chunks for call in chunk.tool_calls]
    assert (calls, generated) == ([{"a": 1}, {"a": 2}], len(tokens))
    assert chunks[-1].finish_reason is TaskOutcome.TOOL_CALLS
