"""Constrained decoding of JSON: a JSON Schema, OpenAI `response_format` json_object/json_schema, forced tool calls.

llguidance compiles the schema into a token matcher; `JsonConstraint.process` is an mlx-lm logits processor that masks
every token the grammar does not allow, so each sampled token keeps the output a valid prefix of a valid document.
The budget of generated tokens can still cut a document short: `JsonConstraint.ends` tells the runner when to stop,
and `JsonConstraint.completion` which text completes the document, so the output always parses, even when max_tokens
cuts it. A budget too small for the shortest document the schema allows is refused up front (`BudgetTooSmall`).

The closing text comes from `json_closer.completions`, which builds the shortest completions of the prefix it can;
each is then verified with a copy of the matcher, since llguidance (not that parser) is the authority on what the
schema allows.

The engine thread feeds the matcher each token as it samples the next one, while the runner's event loop reads the
text: the loop may be many tokens behind the engine (other tasks' output keeps it busy), so the matcher says nothing
about the text the loop holds until it is positioned there (`_positioned`).
"""

from __future__ import annotations

import logging
import string
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from jetshard_worker.library_boundary import LLMatcher, LLTokenizer, grammar_tokenizer_of, json_schema_grammar
from jetshard_worker.text.json_closer import agnostic_close, completions

if TYPE_CHECKING:
    from jetshard_worker.library_boundary import JsonCompileOptions

log = logging.getLogger(__name__)

# No flexible whitespace: the shortest documents, and a prefix the closer parses without guessing about spaces.
# oneOf compiles as anyOf (llguidance cannot check that exactly one branch matches): tool schemas use oneOf for
# unions whose branches are disjoint anyway.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "coerce_one_of": True}
_MARGIN = 3  # tokens kept in hand, so the next sampled token cannot push the completion past the budget
_LOOKAHEAD = 64  # `ends` computes completions only within this many tokens (plus the minimal document) of the budget
_GUIDED_STEPS = 64  # bytes the guided close may add before giving up
# The guided close's choice among allowed characters: closing ones first, then short values' characters.
# "1" before "0": a fraction may not end in 0 where a range bounds it, and zeros would never end it.
_CLOSERS = '"}]'
_PREFERRED = (
    _CLOSERS + "1234567890" + string.ascii_letters + "".join(c for c in string.punctuation + " " if c not in _CLOSERS)
)


class SchemaError(ValueError):
    """A JSON schema llguidance cannot compile; the message names the problem in the schema."""


class BudgetTooSmall(ValueError):
    """The task's budget of generated tokens cannot hold the shortest document valid for the schema."""


_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, LLTokenizer]] = weakref.WeakKeyDictionary()


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> LLTokenizer:
    """The llguidance view of `hf_tokenizer` (a fast Hugging Face tokenizer or mlx-lm's TokenizerWrapper around one).

    Cached per tokenizer object, as building one costs about a second for a real vocabulary. `vocab_size` is the model's
    logits width, which may exceed len(tokenizer): the tokens beyond the tokenizer are never allowed. With a
    TokenizerWrapper every one of its EOS ids (the generation config's too) is an EOS for the grammar, so a finished
    document allows each of them.
    """
    per_size = _tokenizers.setdefault(hf_tokenizer, {})
    if vocab_size not in per_size:
        per_size[vocab_size] = grammar_tokenizer_of(hf_tokenizer, vocab_size)
    return per_size[vocab_size]


class JsonConstraint:
    """One task's constraint: the matcher that masks logits and the closer that completes a document cut short."""

    def __init__(
        self,
        ll_tokenizer: LLTokenizer,
        schema: dict[str, Any],
        max_tokens: int,
        encode: Callable[[str], list[int]],
        closes_at_budget: bool = True,
    ) -> None:
        """Compile `schema` into compact JSON (no flexible whitespace); raise SchemaError if llguidance cannot.

        `encode` tokenizes text without special tokens; it counts the tokens of a completion against `max_tokens`,
        the task's budget of generated tokens. `closes_at_budget`: whether a document the budget would cut is ended
        early enough to be closed (a response format), or runs on to the budget (a forced tool call, whose call cut
        there is left out rather than closed with arguments the model did not write).
        """
        try:
            grammar = json_schema_grammar(schema, JSON_OPTIONS)
        except ValueError as e:
            raise SchemaError(f"invalid JSON schema: {e}") from e
        self._matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise SchemaError(f"unsupported JSON schema: {self._matcher.get_error()}")
        self._ll = ll_tokenizer
        self._schema = schema
        self._max_tokens = max_tokens
        self._encode = encode
        self._prompt_len: int | None = None
        self._generated: list[int] = []
        # The engine thread calls `process`, the runner's event loop `ends`: the matcher is used by one at a time.
        self._lock = threading.Lock()
        spelled = {c: ll_tokenizer.greedy_tokenize(c) for c in _PREFERRED}
        single = {c: tokens[0] for c, tokens in spelled.items() if len(tokens) == 1}
        self._byte_tokens = list(single.values())
        self._closers = {single[c] for c in _CLOSERS if c in single}
        self._eos_only = np.zeros(ll_tokenizer.vocab_size, dtype=np.bool_)
        self._eos_only[ll_tokenizer.eos_tokens] = True
        # The closer's shortest documents: when llguidance accepts one, the budget must hold it.
        try:
            shortest = completions("", schema)
        except ValueError:
            shortest = []
        fewest = min((len(encode(c)) for c in shortest if self._verifies(self._matcher, c)), default=0)
        if fewest > max_tokens:
            raise BudgetTooSmall(
                f"max_tokens {max_tokens} cannot hold a JSON document valid for the schema (of the response format or "
                f"the forced tool call): the shortest takes {fewest} tokens (the budget is max_tokens, or the room the "
                "context leaves after the prompt if that is less)"
            )
        # A document with many required fields needs more than _LOOKAHEAD tokens to close: start looking earlier.
        self._window = _LOOKAHEAD + len(encode(shortest[0] if shortest else ""))
        self._closes_at_budget = closes_at_budget

    def process(self, tokens: mx.array, logprobs: mx.array) -> mx.array:
        """mlx-lm logits processor: `tokens` is the row's prompt and generated ids so far, `logprobs` (1, vocab).

        Everything passed on the first call is prompt; later calls feed the generated tokens not seen yet to the
        matcher. Returns `logprobs` with every token the grammar does not allow at -inf. A complete document allows
        only EOS (llguidance's mask does that). If the matcher fails (a token it did not allow was forced in), only
        EOS is allowed from then on and closing falls back to a schema-agnostic close.
        """
        with self._lock:
            return self._process(tokens, logprobs)

    def _process(self, tokens: mx.array, logprobs: mx.array) -> mx.array:
        if self._prompt_len is None:
            self._prompt_len = tokens.size
        else:
            new = cast(list[int], tokens[self._prompt_len + len(self._generated) :].tolist())
            self._generated += new
            if new and not self._matcher.is_error() and not self._matcher.consume_tokens(new):
                log.warning("constrained decoding: the matcher rejected a token: %s", self._matcher.get_error())
        if self._matcher.is_error():
            allowed = self._eos_only
        else:
            mask = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(mask, bitorder="little").view(np.bool_)
        width = logprobs.shape[-1]
        if allowed.size < width:
            allowed = np.pad(allowed, (0, width - allowed.size))
        return mx.where(mx.array(allowed[:width]), logprobs, mx.array(-mx.inf, dtype=logprobs.dtype))

    def ends(self, text: Callable[[], str], generated: int) -> bool:
        """Whether the task ends now: `completion` then gives the text that ends it.

        Called after each generated token with the text generated so far (a function, as it is needed only when the
        matcher has stopped or near the budget's end) and the number of tokens generated. True once `text` is a
        complete document (only EOS allowed), or, where it `closes_at_budget`, once the budget requires closing it:
        the completion's tokens plus a margin of a few tokens reach `max_tokens`. A completion that depends on an
        unusual token (say, a long property name the next token starts) may overshoot by a few tokens. Where even the
        shortest document exceeds the budget (one the constructor could not refuse: a schema the closer does not
        model), that is at once, and the output exceeds `max_tokens` by the completion's tokens, but parses.
        """
        with self._lock:
            # Near the budget, `text` is checked whatever the live matcher says. A document that does not close
            # there is checked at its last token only: the engine ends the row after it without feeding the matcher.
            window = self._window if self._closes_at_budget else 0
            near_budget = self._max_tokens - generated <= window
            # The live matcher may be ahead of `text` (see the module's doc): stopped, it says that the engine's
            # document is complete, not `text`; not stopped, `text` is not complete either (it is at most a token
            # ahead of the matcher, whose next step allows EOS if that token completes it).
            if not near_budget and not self._matcher.is_stopped():
                return False
            completion, verified = self._completion(text())
            if verified and not completion:
                return True
            closes = self._closes_at_budget and near_budget
            return closes and generated + len(self._encode(completion)) + _MARGIN >= self._max_tokens

    def completion(self, text: str) -> str:
        """The shortest verified text that makes `text` a document valid for the schema: "" when it is one. If none
        is found (or the matcher failed), the schema-agnostic close, which still parses."""
        with self._lock:
            completion, verified = self._completion(text)
        if not verified:
            log.warning(
                "constrained decoding: no completion valid for the schema; closing ...%r as plain JSON", text[-80:]
            )
        return completion

    def _completion(self, text: str) -> tuple[str, bool]:
        """`completion`, and whether llguidance verified it."""
        matcher = self._positioned(text)
        if matcher is None:
            return agnostic_close(text), False
        if matcher.is_stopped() and matcher.is_accepting():
            return "", True
        try:
            candidates = completions(text, self._schema)
        except ValueError:
            candidates = []
        verified = next((c for c in candidates if self._verifies(matcher, c)), None)
        if verified is None:
            verified = self._guided_close(matcher)
        return (agnostic_close(text), False) if verified is None else (verified, True)

    def _positioned(self, text: str) -> LLMatcher | None:
        """A matcher that has consumed exactly `text`, or None if the matcher failed.

        Usually the live matcher, which has consumed the generated tokens. Their bytes can differ from `text` at the
        end, where the runner's detokenizer replaces or holds back an incomplete UTF-8 character (the closing text
        follows the text as the client sees it): a copy then rolls back the tokens past the common prefix, on a
        character boundary, and consumes the rest of `text`.
        """
        if self._matcher.is_error():
            return None
        target = text.encode()
        kept = self._ll.decode_bytes(self._generated)
        if kept == target:
            return self._matcher
        common = next(
            (i for i, (a, b) in enumerate(zip(kept, target, strict=False)) if a != b), min(len(kept), len(target))
        )
        rolled = 0
        while len(kept) > common or (len(kept) < len(target) and target[len(kept)] & 0xC0 == 0x80):
            rolled += 1
            kept = self._ll.decode_bytes(self._generated[: len(self._generated) - rolled])
        matcher = self._matcher.deep_copy()
        if not matcher.rollback(rolled) or not matcher.consume_tokens(self._bytes_tokens(target[len(kept) :].decode())):
            return None
        return matcher

    def _verifies(self, matcher: LLMatcher, completion: str) -> bool:
        """Whether `completion` ends a document llguidance accepts, checked on a copy of `matcher`."""
        copy = matcher.deep_copy()
        return copy.consume_tokens(self._bytes_tokens(completion)) and copy.is_accepting()

    def _guided_close(self, matcher: LLMatcher) -> str | None:
        """A completion found by the matcher itself, for what the closer does not model (pattern, format,
        minProperties...): take the forced tokens, else the first allowed single-byte token in `_PREFERRED` order
        (closing characters first, else the first character a closing one may follow), until the document is
        accepted. None if that takes over _GUIDED_STEPS steps."""
        copy = matcher.deep_copy()
        added: list[int] = []
        for _ in range(_GUIDED_STEPS):
            if copy.is_accepting():
                return self._ll.decode_bytes(added).decode(errors="replace")
            step = copy.compute_ff_tokens()
            if not step:
                allowed = [t for t in self._byte_tokens if copy.validate_tokens([t])]
                step = allowed[:1]
                if allowed and allowed[0] not in self._closers:  # prefer a way out of repetitions like [a-c]+x
                    ways_out = (t for t in allowed for c in self._closers if copy.validate_tokens([t, c]) == 2)
                    step = [next(ways_out, allowed[0])]
            if not step or not copy.consume_tokens(step):
                return None
            added += step
        return None

    def _bytes_tokens(self, text: str) -> list[int]:
        """Tokens spelling exactly the bytes of `text`: the matcher checks bytes, and some tokenizers' own encoding
        would add a leading space to a standalone fragment."""
        return self._ll.greedy_tokenize(text)
