"""llguidance's verdict on a JSON schema, for the llama.cpp engine.

Importing `library_boundary` loads mlx and mlx-lm, which a llama.cpp runner never does, so this one use of llguidance
is here, imported on the first request that carries a schema (llguidance alone: about 0.2 s and 10 MB).
tests/test_library_boundary.py pins it with the others.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

SCHEMAS_REMEMBERED = 256
"""Verdicts kept, by the schema's JSON: an agent sends the same tools on every turn."""


def json_schema_errors(schema: dict[str, Any]) -> list[str]:
    """What llguidance finds wrong with `schema` itself (an unknown type, bounds no value meets), keywords it does
    not implement passed over (`lenient`); [] when it finds nothing. No tokenizer is needed to check a schema."""
    return list(_errors(msgspec.json.encode(schema, order="sorted")))


@functools.lru_cache(maxsize=SCHEMAS_REMEMBERED)
def _errors(schema_json: bytes) -> tuple[str, ...]:
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema_json.decode(), overrides={"lenient": True})
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    return tuple(messages) if is_error else ()
