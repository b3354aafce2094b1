"""A thinking model's output split where the tokens are: reasoning between its think markers, the answer after.

mlx-lm's tokenizer wrapper names the markers (`<think>`/`</think>` for Qwen3, DeepSeek-R1 and their kind). The runner
tags each chunk's text as reasoning or answer, so no API re-parses it, and only the answer goes on to the tool-call
parser and the structured-output constraint.

Two views of the same output, each where it is exact:
* `ReasoningText` splits the detokenized text on the markers' text: a detokenizer may hand a marker's text out
  with the next token's (a byte-level BPE one flushes at the next word), so tokens cannot say which text is which.
  A marker split over pieces is held back until it is whole, as stop strings are.
* `ReasoningTokens` follows the token ids: it counts the reasoning tokens (usage) and, as a logits processor,
  ends the reasoning with the end marker once a thinking budget is spent, and applies an answer's constraint to the
  answer's tokens only.

A prompt may open the reasoning itself (templates that end the generation prompt with `<think>`): the output then
starts inside it (`opens_in_reasoning`), as mlx-lm's server decides, though only from the template's opening of the
assistant's turn (the runner's `_turn_opening`), never from a marker a user wrote in the conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from jetshard_worker.text.textstream import pending_prefix_length

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class ThinkMarkers:
    """A model's think markers, as text and as the token ids it writes them with."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]


def opens_in_reasoning(markers: ThinkMarkers, prompt: Sequence[int]) -> bool:
    """Whether the prompt leaves the model inside its reasoning: a start marker after the last end marker."""
    return _rfind(prompt, markers.start_tokens) > _rfind(prompt, markers.end_tokens)


def _rfind(tokens: Sequence[int], sequence: tuple[int, ...]) -> int:
    for at in range(len(tokens) - len(sequence), -1, -1):
        if tuple(tokens[at : at + len(sequence)]) == sequence:
            return at
    return -1


class ReasoningText:
    """Splits streamed text into reasoning and answer; `add` each piece, then `finish` once.

    The markers are left out, and so is the whitespace templates put around them (the newline after `<think>`,
    before `</think>`, and the blank line after it), as Ollama and vLLM's parsers leave it out."""

    def __init__(self, markers: ThinkMarkers, reasoning: bool) -> None:
        self._markers = markers
        self.reasoning = reasoning
        self._held = ""
        self._started = False
        """Whether the current part has shown any text yet: whitespace before that is dropped."""

    def add(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text now safe to show."""
        reasoning: list[str] = []
        answer: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            marker = self._markers.end if self.reasoning else self._markers.start
            at = text.find(marker)
            if at == -1:
                keep = pending_prefix_length(text, marker)
                if self.reasoning:
                    # Whitespace that may end the reasoning is held: shown only if more reasoning follows.
                    keep = max(keep, len(text) - len(text[: len(text) - keep].rstrip()))
                shown, self._held = text[: len(text) - keep], text[len(text) - keep :]
                (reasoning if self.reasoning else answer).append(self._part(shown))
                break
            before = text[:at].rstrip() if self.reasoning else text[:at]
            (reasoning if self.reasoning else answer).append(self._part(before))
            text = text[at + len(marker) :]
            self.reasoning = not self.reasoning
            self._started = False
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held once the output ended: a marker's start that never completed is text after all."""
        held, self._held = self._held, ""
        shown = self._part(held)
        return (shown, "") if self.reasoning else ("", shown)

    def _part(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text


class ReasoningTokens:
    """Follows one choice's generated token ids through the markers: counts the reasoning tokens, and is the row's
    logits processor when it must steer (a thinking budget, an answer constraint)."""

    def __init__(
        self,
        markers: ThinkMarkers,
        reasoning: bool,
        budget: int | None = None,
        answer_processor: LogitsProcessor | None = None,
    ) -> None:
        """`reasoning`: the prompt opened the reasoning. `budget`: the most reasoning tokens before the end marker is
        forced. `answer_processor` (a constraint) sees the prompt and the answer's tokens only, and while no
        reasoning has begun it lets the model open its reasoning, whose tokens it never sees."""
        self._markers = markers
        self.reasoning = reasoning
        self.count = 0
        """Reasoning tokens so far, markers included."""
        self._budget = budget
        self._answer_processor = answer_processor
        self._recent: list[int] = []
        self._spent = 0
        """Reasoning tokens since the reasoning last opened, its start marker not counted: what the budget bounds."""
        self._prompt: mx.array | None = None
        self._seen = 0
        self._answer: list[int] = []
        self._generated = 0

    def add(self, token: int) -> None:
        """The choice's next token."""
        self._generated += 1
        longest = max(len(self._markers.start_tokens), len(self._markers.end_tokens))
        self._recent = [*self._recent, token][-longest:]
        if self.reasoning:
            self.count += 1
            self._spent += 1
            if self._ends_with(self._markers.end_tokens):
                self.reasoning = False
        elif self._ends_with(self._markers.start_tokens):
            # The marker's earlier tokens (when it has several) were counted as answer: they are reasoning too.
            self.count += len(self._markers.start_tokens)
            self._answer = self._answer[: len(self._answer) - len(self._markers.start_tokens) + 1]
            self.reasoning = True
            self._spent = 0
        else:
            self._answer.append(token)

    @property
    def steers(self) -> bool:
        return self._budget is not None or self._answer_processor is not None

    def process(self, tokens: mx.array, logprobs: mx.array) -> mx.array:
        """mlx-lm logits processor: `tokens` is the prompt and the generated ids so far, `logprobs` (1, vocab)."""
        if self._prompt is None:
            self._prompt = tokens
            self._seen = tokens.size
        else:
            for token in cast(list[int], tokens[self._seen :].tolist()):
                self.add(token)
            self._seen = tokens.size
        if self.reasoning:
            if self._budget is not None and self._spent >= self._budget:
                return self._force(self._markers.end_tokens, logprobs)
            return logprobs
        if self._answer_processor is None:
            return logprobs
        history = mx.concatenate([self._prompt, mx.array(self._answer, dtype=self._prompt.dtype)])
        allowed = self._answer_processor(history, logprobs)
        if self._generated == 0 and len(self._markers.start_tokens) == 1:
            start = self._markers.start_tokens[0]
            opening = mx.arange(logprobs.shape[-1]) == start
            allowed = mx.where(opening, logprobs, allowed)
        return allowed

    def _force(self, marker: tuple[int, ...], logprobs: mx.array) -> mx.array:
        """Only the marker's next token allowed (its tokens written so far are the end of `_recent`)."""
        done = next((n for n in range(len(marker) - 1, 0, -1) if self._ends_with(marker[:n])), 0)
        only = mx.arange(logprobs.shape[-1]) == marker[done]
        return mx.where(only, logprobs, mx.array(-mx.inf, dtype=logprobs.dtype))

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return len(self._recent) >= len(marker) and tuple(self._recent[-len(marker) :]) == marker
