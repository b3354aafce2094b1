"""Completing a prefix of a JSON document into a document valid for a JSON Schema, as briefly as it can.

`completions` is a pure incremental parser of the prefix: it tracks the schema of each value (through $ref, allOf,
anyOf and oneOf) and builds the shortest suffixes that close it, strings, containers and required members included.
Constrained decoding (`constrained`) verifies each with llguidance, the authority on what the schema allows, before
it ends a document with one.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import string
from typing import Any

log = logging.getLogger(__name__)

_LIMIT = 8  # completions kept per value: alternatives for the verifier without combinatorial growth
_MAX_DEPTH = 32  # $ref chains and nested minimal values: deeper is a recursive schema with no finite document
_ALL_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_PLAIN = re.compile(r'[^"\\]+')  # string characters other than the closing quote and escapes
_NUMBER_CHARS = frozenset("-+.eE0123456789")
# Ways to finish a number the prefix ends inside, shortest first: a missing digit, a fraction (-0 becomes -0.1), a
# digit or two to reach a minimum, zeros to reach a larger one.
_NUMBER_TAILS = (
    "",
    *string.digits,
    ".1",
    *(a + b for a in string.digits for b in string.digits),
    *("0" * k for k in range(3, 10)),
)


def minimal_completion(prefix: str, schema: dict[str, Any] | bool) -> str:
    """The shortest (or near-shortest) suffix making `prefix + suffix` valid JSON that validates against `schema`.

    `prefix` must be a valid prefix of such a document in compact JSON, as llguidance guarantees; ValueError otherwise.
    """
    return completions(prefix, schema)[0]


def completions(prefix: str, schema: dict[str, Any] | bool) -> list[str]:
    """Candidate suffixes completing `prefix` into a document valid for `schema`, shortest first (at most _LIMIT).

    Alternatives come from choices the schema leaves open (anyOf branches, property names a partial key may become,
    several minimal values); the first is `minimal_completion`. "" alone when the prefix is a complete document.
    Raises ValueError when `prefix` is not consistent with the schema as far as this parser models it.
    """
    closer = _Closer(prefix, schema)
    outcome = closer.value(0, schema)
    if isinstance(outcome, int):
        if closer.skip_ws(outcome) != len(prefix):
            raise _Mismatch("text after the JSON document")
        return [""]
    if not outcome:
        raise _Mismatch("no finite document completes the prefix")
    return outcome


def agnostic_close(text: str) -> str:
    """The schema-agnostic close of `text` (strings and containers closed, minimal values added), "" if `text` does
    not begin a JSON document."""
    try:
        return minimal_completion(text, True)
    except ValueError:
        log.error("constrained decoding: cannot close %r as JSON", text)
        return ""


class _Mismatch(ValueError):
    """The prefix cannot begin a document valid for this (sub)schema."""


class _Closer:
    """Parses one prefix against one schema. Each `value` call returns either the end of a value that is complete in
    the prefix, or the candidate suffixes for a value the prefix ends inside (those include whatever closes the
    containers around it)."""

    def __init__(self, text: str, root: dict[str, Any] | bool) -> None:
        self.text = text
        self.root = root

    def skip_ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in " \t\n\r":
            pos += 1
        return pos

    # ---------------------------------------------------------------- schemas

    def branches(self, schema: Any, depth: int = 0) -> list[dict[str, Any]]:
        """`schema` as alternatives free of $ref/allOf/anyOf/oneOf: a value is valid if it is valid for one of them.
        allOf and $ref siblings merge shallowly (properties and required combined), enough for generated schemas."""
        if isinstance(schema, bool):
            return [{}] if schema else []
        if depth > _MAX_DEPTH:
            raise _Mismatch("schema nests $ref too deeply")
        combinators = ("$ref", "allOf", "anyOf", "oneOf")
        factors: list[list[dict[str, Any]]] = [[{k: v for k, v in schema.items() if k not in combinators}]]
        if "$ref" in schema:
            factors.append(self.branches(self.resolve(schema["$ref"]), depth + 1))
        factors += [self.branches(sub, depth + 1) for sub in schema.get("allOf", [])]
        for key in ("anyOf", "oneOf"):
            if key in schema:
                factors.append([b for sub in schema[key] for b in self.branches(sub, depth + 1)])
        result: list[dict[str, Any]] = [{}]
        for alternatives in factors:
            result = [_merge(r, a) for r in result for a in alternatives]
        return result

    def resolve(self, ref: str) -> Any:
        """A local JSON pointer: "#", "#/$defs/Name", "#/definitions/Name", ..."""
        if not ref.startswith("#"):
            raise _Mismatch(f"unsupported $ref {ref!r}")
        target: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _Mismatch(f"$ref {ref!r} does not resolve")
            target = target[part]
        return target

    def minimal(self, schema: Any, depth: int = 0) -> list[str]:
        """The shortest documents valid for `schema` (a few alternatives), [] when there is none this closer finds."""
        if depth > _MAX_DEPTH:
            return []
        out: list[str] = []
        for b in self.branches(schema):
            if "const" in b:
                out.append(_dump(b["const"]))
                continue
            if "enum" in b:
                out += [_dump(v) for v in b["enum"]]
                continue
            types = _types(b)
            if "null" in types:
                out.append("null")
            if "boolean" in types:
                out += ["true", "false"]
            if types & {"number", "integer"}:
                out += _numbers(b, integer="number" not in types)
            if "string" in types:
                out.append('"' + "a" * b.get("minLength", 0) + '"')
            if "array" in types:
                out += _join([["["], *self.items_tail(b, 0, b.get("minItems", 0), depth, comma=False), ["]"]])
            if "object" in types:
                out += ["{" + m for m in self.members(b, _missing(b, []), comma=False, depth=depth)]
        return _shortest(out)

    def items_tail(self, b: dict[str, Any], start: int, stop: int, depth: int, comma: bool) -> list[list[str]]:
        """Parts of minimal items `start`..`stop`-1 of array schema `b`, comma-separated (a leading one if `comma`)."""
        parts: list[list[str]] = []
        for i in range(start, stop):
            if comma or i > start:
                parts.append([","])
            parts.append(self.minimal(self.item_schema(b, i), depth + 1))
        return parts

    def members(self, b: dict[str, Any], keys: list[str], comma: bool, depth: int = 0) -> list[str]:
        """Minimal members `keys` of object schema `b` and the closing brace (a leading comma if `comma`)."""
        parts: list[list[str]] = []
        for i, key in enumerate(keys):
            if comma or i:
                parts.append([","])
            parts += [[_dump(key) + ":"], self.minimal(self.property_schema(b, key), depth + 1)]
        return _join([*parts, ["}"]])

    def item_schema(self, b: dict[str, Any], index: int) -> Any:
        prefix_items = b.get("prefixItems", [])
        items = b.get("items", True)
        if isinstance(items, list):  # draft-04 tuples
            prefix_items, items = items, b.get("additionalItems", True)
        return prefix_items[index] if index < len(prefix_items) else items

    def property_schema(self, b: dict[str, Any], key: str) -> Any:
        if key in b.get("properties", {}):
            return b["properties"][key]
        for pattern, sub in b.get("patternProperties", {}).items():
            if re.search(pattern, key):
                return sub
        return b.get("additionalProperties", True)

    # ---------------------------------------------------------------- values

    def value(self, pos: int, schema: Any) -> int | list[str]:
        """Parse the value starting at `pos` (after whitespace) against the branches of `schema` that fit it."""
        pos = self.skip_ws(pos)
        if pos == len(self.text):
            return self.minimal(schema)
        end: int | None = None
        found: list[str] = []
        reasons: list[str] = []
        for b in self.branches(schema):
            try:
                outcome = self.value_branch(pos, b)
            except _Mismatch as e:
                reasons.append(str(e))
                continue
            if isinstance(outcome, int):
                end = outcome  # a value's end is syntax, the same for every branch that accepts it
            else:
                found += outcome
        if end is not None:
            return end
        if not found:
            raise _Mismatch("; ".join(reasons) or f"the schema allows no value at {pos}")
        return _shortest(found)

    def value_branch(self, pos: int, b: dict[str, Any]) -> int | list[str]:
        if "const" in b or "enum" in b:
            return self.enum_value(pos, [b["const"]] if "const" in b else b["enum"])
        types = _types(b)
        c = self.text[pos]
        if c == "{" and "object" in types:
            return self.object_value(pos, b)
        if c == "[" and "array" in types:
            return self.array_value(pos, b)
        if c == '"' and "string" in types:
            end, fix, length = self.scan_string(pos)
            return end if end is not None else [fix + "a" * max(0, b.get("minLength", 0) - length) + '"']
        if (c == "-" or c.isdigit()) and types & {"number", "integer"}:
            return self.number_value(pos, b, integer="number" not in types)
        if c in _LITERALS and ("null" if c == "n" else "boolean") in types:
            word = _LITERALS[c]
            seen = self.text[pos : pos + len(word)]
            if not word.startswith(seen):
                raise _Mismatch(f"not {word} at {pos}")
            return pos + len(word) if seen == word else [word[len(seen) :]]
        raise _Mismatch(f"{c!r} at {pos} does not start a value of type {sorted(types)}")

    def enum_value(self, pos: int, members: list[Any]) -> int | list[str]:
        """A const/enum value: complete, it must equal a member; partial, it must begin a member's compact JSON."""
        outcome = self.value(pos, True)
        if isinstance(outcome, int):
            value = json.loads(self.text[pos:outcome])
            if not any(_same(value, m) for m in members):
                raise _Mismatch(f"{value!r} is not one of {members!r}")
            return outcome
        typed = self.text[pos:]
        found = [d[len(typed) :] for d in map(_dump, members) if d.startswith(typed)]
        if not found:
            raise _Mismatch(f"{typed!r} begins none of {members!r}")
        return _shortest(found)

    def number_value(self, pos: int, b: dict[str, Any], integer: bool) -> int | list[str]:
        end = pos
        while end < len(self.text) and self.text[end] in _NUMBER_CHARS:
            end += 1
        typed = self.text[pos:end]

        def fits(number: str) -> bool:
            syntax = _INTEGER if integer else _NUMBER
            return syntax.fullmatch(number) is not None and _in_range(float(number), b, integer)

        if end < len(self.text):
            if not fits(typed):
                raise _Mismatch(f"{typed!r} is not a valid number here")
            return end
        found = [tail for tail in _NUMBER_TAILS if fits(typed + tail)]
        if not found:
            raise _Mismatch(f"no number in range begins with {typed!r}")
        # -0 is valid JSON, but llguidance's grammars for bounded numbers do not produce it: a last resort.
        nonzero = [tail for tail in found if not (typed.startswith("-") and float(typed + tail) == 0)]
        return (nonzero or found)[:_LIMIT]

    def scan_string(self, pos: int) -> tuple[int | None, str, int]:
        """The string whose opening quote is at `pos`: (its end, "", 0) when complete in the prefix; otherwise (None,
        the text finishing a partial escape, the characters so far counting that escape as one)."""
        text, i, length = self.text, pos + 1, 0
        while i < len(text):
            if plain := _PLAIN.match(text, i):
                length += plain.end() - i
                i = plain.end()
                continue
            if text[i] == '"':
                return i + 1, "", 0
            if i + 1 == len(text):  # an escape: \x, or \u and four hex digits
                return None, "n", length + 1
            if text[i + 1] != "u":
                i += 2
            elif i + 6 > len(text):
                return None, "0" * (i + 6 - len(text)), length + 1
            else:
                i += 6
            length += 1
        return None, "", length

    def array_value(self, pos: int, b: dict[str, Any]) -> int | list[str]:
        min_items = b.get("minItems", 0)
        pos, count, after_comma = pos + 1, 0, False
        while True:
            pos = self.skip_ws(pos)
            if pos == len(self.text):
                if after_comma:  # a value must come next
                    parts = [
                        self.minimal(self.item_schema(b, count)),
                        *self.items_tail(b, count + 1, min_items, 0, True),
                    ]
                else:
                    parts = self.items_tail(b, count, min_items, 0, comma=count > 0)
                return _join([*parts, ["]"]])
            if self.text[pos] == "]" and not after_comma:
                if count < min_items:
                    raise _Mismatch(f"array closed with {count} < minItems {min_items} items")
                return pos + 1
            item_schema = self.item_schema(b, count)
            outcome = self.value(pos, item_schema)
            count += 1
            if isinstance(outcome, list):
                return _join([outcome, *self.items_tail(b, count, min_items, 0, comma=True), ["]"]])
            pos, after_comma = self.after_member(outcome, "]")

    def object_value(self, pos: int, b: dict[str, Any]) -> int | list[str]:
        seen: list[str] = []
        pos, after_comma = pos + 1, False
        while True:
            pos = self.skip_ws(pos)
            if pos == len(self.text):
                return self.close_object(b, seen, after_comma)
            if self.text[pos] == "}" and not after_comma:
                if _missing(b, seen):
                    raise _Mismatch(f"object closed without {_missing(b, seen)}")
                return pos + 1
            if self.text[pos] != '"':
                raise _Mismatch(f"expected a property name at {pos}")
            end, fix, _ = self.scan_string(pos)
            if end is None:
                return self.key_candidates(b, seen, self.text[pos + 1 :], fix)
            key = json.loads(self.text[pos:end])
            value_schema = self.property_schema(b, key)
            if value_schema is False:
                raise _Mismatch(f"property {key!r} is not allowed")
            seen.append(key)
            pos = self.skip_ws(end)
            if pos == len(self.text):
                return _join([[":"], self.minimal(value_schema), self.members(b, _missing(b, seen), comma=True)])
            if self.text[pos] != ":":
                raise _Mismatch(f"expected : at {pos}")
            outcome = self.value(pos + 1, value_schema)
            if isinstance(outcome, list):
                return _join([outcome, self.members(b, _missing(b, seen), comma=True)])
            pos, after_comma = self.after_member(outcome, "}")

    def after_member(self, end: int, closing: str) -> tuple[int, bool]:
        """After a container's member that ends at `end`: where the next one starts, and whether a comma precedes it.
        A comma, the container's `closing` character or the end of the prefix may follow a member."""
        pos = self.skip_ws(end)
        if pos < len(self.text) and self.text[pos] == ",":
            return pos + 1, True
        if pos < len(self.text) and self.text[pos] != closing:
            raise _Mismatch(f"expected , or {closing} at {pos}")
        return pos, False

    def close_object(self, b: dict[str, Any], seen: list[str], after_comma: bool) -> list[str]:
        """Close an object the prefix ends in between members: add the required members still missing; after a comma,
        at least one member (the shortest allowed one when none is missing)."""
        missing = _missing(b, seen)
        if missing or not after_comma:
            return self.members(b, missing, comma=bool(seen) and not after_comma)
        keys = _unused(b, seen)
        if b.get("additionalProperties", True) is not False:
            names = itertools.chain(["", *string.ascii_lowercase], map(str, itertools.count()))
            keys.append(next(k for k in names if k not in seen))
        return _shortest([c for k in keys for c in self.members(b, [k], comma=False)])

    def key_candidates(self, b: dict[str, Any], seen: list[str], typed: str, fix: str) -> list[str]:
        """Complete a property name the prefix ends inside (`typed`, raw JSON) into an allowed, unused one: a declared
        property it begins, or itself closed when additional properties are allowed."""
        found: list[str] = []
        for key in _unused(b, seen):
            raw = _dump(key)[1:]
            if raw.startswith(typed):
                found += _join([[raw[len(typed) :] + ":"], self.members_after(b, seen, key)])
        for extra in ("", *string.ascii_lowercase):  # the name as typed, or made unique when it is taken
            own = json.loads('"' + typed + fix + extra + '"')
            if own not in seen and own not in b.get("properties", {}) and self.property_schema(b, own) is not False:
                found += _join([[fix + extra + '":'], self.members_after(b, seen, own)])
                break
        if not found:
            raise _Mismatch(f"no allowed property name begins with {typed!r}")
        return _shortest(found)

    def members_after(self, b: dict[str, Any], seen: list[str], key: str) -> list[str]:
        """The minimal value of property `key` and the rest of the object once it is added."""
        return _join([self.minimal(self.property_schema(b, key)), self.members(b, _missing(b, [*seen, key]), True)])


def _types(b: dict[str, Any]) -> frozenset[str]:
    declared = b.get("type")
    if declared is None:
        return _ALL_TYPES
    return frozenset([declared] if isinstance(declared, str) else declared)


def _missing(b: dict[str, Any], seen: list[str]) -> list[str]:
    """Required properties not yet present, in the order llguidance expects them: declared order first."""
    required = b.get("required", [])
    declared = b.get("properties", {})
    ordered = [k for k in declared if k in required] + [k for k in required if k not in declared]
    return [k for k in ordered if k not in seen]


def _unused(b: dict[str, Any], seen: list[str]) -> list[str]:
    """Declared properties that may still come: llguidance keeps the declared order, so those after the last present."""
    declared = list(b.get("properties", {}))
    last = max((declared.index(k) for k in seen if k in declared), default=-1)
    return declared[last + 1 :]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if key == "properties" and key in out:
            out[key] = {**out[key], **value}
        elif key == "required" and key in out:
            out[key] = [*out[key], *(r for r in value if r not in out[key])]
        else:
            out[key] = value
    return out


def _in_range(x: float, b: dict[str, Any], integer: bool) -> bool:
    """Whether `x` satisfies the numeric keywords of `b` (draft-04 boolean exclusive bounds included)."""
    if integer and x != int(x):
        return False
    low, high = b.get("minimum"), b.get("maximum")
    low_x, high_x = b.get("exclusiveMinimum"), b.get("exclusiveMaximum")
    if low is not None and (x < low or (low_x is True and x == low)):
        return False
    if high is not None and (x > high or (high_x is True and x == high)):
        return False
    if not isinstance(low_x, bool) and low_x is not None and x <= low_x:
        return False
    if not isinstance(high_x, bool) and high_x is not None and x >= high_x:
        return False
    step = b.get("multipleOf")
    return step is None or abs(x / step - round(x / step)) < 1e-9


def _numbers(b: dict[str, Any], integer: bool) -> list[str]:
    """Short numbers within the bounds of `b`: 0 or ±1 when allowed, else the values next to the bounds."""
    bounds = [b.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
    step = b.get("multipleOf") or 1
    guesses: list[float] = [0, 1, -1]
    for bound in bounds:
        if isinstance(bound, int | float) and not isinstance(bound, bool):
            near = round(bound / step) * step
            guesses += [bound, near - step, near, near + step]
    found = [x for x in guesses if _in_range(x, b, integer)]
    return _shortest([str(int(x)) if x == int(x) else repr(float(x)) for x in found])


def _dump(value: Any) -> str:
    """Compact JSON as llguidance spells constants: no spaces, non-ASCII characters as they are."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return _dump(a) == _dump(b)


def _shortest(candidates: list[str]) -> list[str]:
    return sorted(dict.fromkeys(candidates), key=len)[:_LIMIT]


def _join(parts: list[list[str]]) -> list[str]:
    """Concatenations of one option per part, shortest first (at most _LIMIT); [] if a part has no option.

    Besides the shortest, the shortest concatenation for each choice among the earlier parts is kept, so the verifier
    still has the inner value's alternatives (say, another digit to end a number) after the outer parts are added.
    """
    out = [""]
    for options in parts:
        groups = [[a + b for b in options] for a in out]
        kept = list(dict.fromkeys(min(group, key=len) for group in groups if group))
        others = [c for c in _shortest([c for group in groups for c in group]) if c not in kept]
        out = sorted(kept + others[: _LIMIT - len(kept)], key=len)
    return out
