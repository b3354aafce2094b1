"""A task's whole output, as a non-streaming answer gives it: each choice's text, reasoning, tool calls, logprobs,
finish reason or embedding, and the usage. The dialects' wire types are built from it; the request path
(`tasks`) fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jetshard_schema.types import Chunk, TaskOutcome, TokenLogprob, ToolCall, Usage


@dataclass
class Choice:
    """One choice's whole output, as a non-streaming answer gives it."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: TaskOutcome | None = None
    stop_sequence: str | None = None
    """The stop string that ended it, where one did."""
    embedding: tuple[float, ...] = ()

    def add(self, chunk: Chunk) -> None:
        """Take in one chunk of this choice's output."""
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.tool_calls += chunk.tool_calls
        self.logprobs += chunk.logprobs
        self.embedding = chunk.embedding or self.embedding
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stop_sequence = chunk.stop_sequence or self.stop_sequence


@dataclass
class Answer:
    choices: list[Choice]
    usage: Usage
