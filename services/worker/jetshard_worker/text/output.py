"""What a task's generated tokens become on `jetshard.chunks.<node id>.<task id>`: per choice, its text split into
reasoning and answer for a thinking model, the answer cut at a stop string (the reasoning may hold one: it ends
nothing, as in vLLM), its tool calls (parsed from the answer), its logprobs; then the task's usage on the last
chunk.

A task with `n` choices runs as `n` engine rows; an embedding task as one row per input. Every piece of
output becomes a `Chunk` with the next index of the task, whichever choice it belongs to, so the API sees
one gap-free sequence; the chunk that carries `usage` is the last.

Text is held, not published at once: the tokens a choice makes before the publisher is ready for more (it
waits for each batch's round trip to NATS) leave as one chunk. A chunk of another choice, tool calls or a
choice's end publish what is held first, so the order of the text never changes.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jetshard_schema.ids import TaskId
from jetshard_schema.types import Chunk, PromptProgress, TaskOutcome, TokenLogprob, ToolCall, TopLogprob, Usage

from jetshard_worker.text.json_closer import agnostic_close, minimal_completion
from jetshard_worker.text.textstream import StopText
from jetshard_worker.text.toolcalls import ToolCallParsed, ToolCallSplitter, parse_forced, parse_forced_cut

if TYPE_CHECKING:
    # MLX's parts, named here only as types: importing them takes seconds (mlx, mlx-lm, transformers, llguidance),
    # which a llama.cpp runner does without.
    from jetshard_worker.engines.mlx import TokenScores
    from jetshard_worker.text.constrained import JsonConstraint
    from jetshard_worker.text.reasoning import ReasoningText, ReasoningTokens

ROW_SEPARATOR = "#"
"""Between a task id and its choice in an engine row's id: task ids never hold it."""
PROGRESS_FROM_TOKENS = 1024
"""A prompt this long tells its client how far it is processed; a shorter one is processed in a moment."""
PROGRESS_EVERY_S = 0.5
"""How often a long prompt's progress is said at most: an engine that processes it between decode steps tells of
every step."""


log = logging.getLogger(__name__)


def _closing(text: str, schema: dict[str, Any]) -> str:
    """What closes `text`, a document cut short by max_tokens, into one valid for `schema`; where the closer finds
    none (a schema no finite document meets, or one it does not model), a close that still parses."""
    try:
        return minimal_completion(text, schema)
    except ValueError as error:
        log.warning("no completion valid for the schema (%s); closing ...%r as plain JSON", error, text[-80:])
        return agnostic_close(text)


def row_id(task_id: str, choice: int) -> str:
    return f"{task_id}{ROW_SEPARATOR}{choice}"


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a task's `choice`: each choice its own draw, and a seeded request stays reproducible."""
    return None if seed is None else (seed + choice) % 2**64


def split_row_id(row: str) -> tuple[TaskId, int]:
    task_id, _, choice = row.rpartition(ROW_SEPARATOR)
    return TaskId(task_id), int(choice)


@dataclass(frozen=True)
class RowEnd:
    """How an engine ended one row: why, and what it counted. An engine that parses tool calls itself (llama.cpp)
    hands them in `engine_calls`, and its own count of the choice's tokens in `completion_tokens`."""

    reason: TaskOutcome
    prompt_tokens: int = 0
    """0 where the engine does not know them (a row cancelled before its prefill)."""
    engine_calls: Sequence[ToolCallParsed] = ()
    completion_tokens: int | None = None


@dataclass(eq=False)
class ChoiceOutput:
    """One choice's output so far: each token detokenized, split into reasoning and answer, the answer cut at a
    stop string."""

    detokenizer: Any
    """mlx-lm's streaming detokenizer; None where the engine hands out text (llama.cpp), and for an embedding."""
    stop: StopText = field(default_factory=lambda: StopText(()))
    """The request's stop strings, matched in the answer only."""
    splitter: ToolCallSplitter | None = None
    """Tools in `auto`: calls parsed out of the text."""
    forced_calls: bool = False
    """Tools `required` or named: the whole (constrained) output is the calls."""
    constraint: JsonConstraint | None = None
    grammar_schema: dict[str, Any] | None = None
    """The JSON Schema an engine's own grammar holds the output to (llama.cpp): a document cut short at
    `max_tokens` is closed with the shortest valid completion, as `constraint` closes one on MLX (a forced call cut
    short is left out instead)."""
    reasoning: tuple[ReasoningText, ReasoningTokens] | None = None
    """A thinking model's chat: its text split into reasoning and answer, its reasoning tokens counted."""
    engine_reasoning_tokens: int = 0
    """Reasoning tokens of an engine that splits the reasoning itself (llama.cpp)."""
    text: list[str] = field(default_factory=list)
    """The answer generated, stop strings cut: what the constraint and a forced call read."""
    tokens: int = 0
    called: bool = False
    ending: TaskOutcome | None = None
    """Why its output ended it (a stop string, a document closed): tokens the engine still hands out are void."""
    finished: bool = False

    def joined(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_tokens(self) -> int:
        return self.engine_reasoning_tokens if self.reasoning is None else self.reasoning[1].count

    def add(self, token: int) -> tuple[str, str]:
        """The reasoning and the answer that `token` makes safe to show."""
        self.detokenizer.add_token(token)
        return self.show(self.detokenizer.last_segment, last=False)

    def finish(self) -> tuple[str, str]:
        """The reasoning and the answer still held once the output ends for another reason than a stop string."""
        if self.detokenizer is None:
            return self.show("", last=True)
        self.detokenizer.finalize()
        return self.show(self.detokenizer.last_segment, last=True)

    def show(self, text: str, last: bool) -> tuple[str, str]:
        """`text`'s reasoning and answer (with what the split and the stop strings still held, when `last`); the
        answer, cut at a stop string, is kept."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning[0].add(text)
            if last:
                more_reasoning, more_text = self.reasoning[0].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        # Only now, on the answer alone: a stop string the model reasons about must not end its answer.
        text = self.stop.add(text)
        if last:
            text += self.stop.finish()
        self.text.append(text)
        return reasoning, text


class TaskOutput:
    """Turns one task's engine rows into chunks, handed to `publish` in index order."""

    def __init__(
        self,
        task_id: TaskId,
        choices: list[ChoiceOutput],
        decode_token: Callable[[int], str],
        publish: Callable[[Chunk], None],
        holding: Callable[[TaskOutput], None],
    ) -> None:
        """`publish` takes each chunk as it is made; `holding` is told when this output starts holding text,
        for its publisher to `flush` it when it is ready for more."""
        self.task_id = task_id
        self.choices = choices
        self._decode_token = decode_token
        self._publish = publish
        self._holding = holding
        self._held: tuple[int, list[str], list[str], list[TokenLogprob]] | None = None
        """A choice's reasoning, text and logprobs not published yet."""
        self._next_index = 0
        self._prompt_tokens = 0
        self.outcome = TaskOutcome.STOP
        """The last choice's reason to end: what the task reports."""
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._progress_at = 0.0

    @property
    def last_index(self) -> int:
        return self._next_index - 1

    @property
    def done(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def token(self, choice: int, token: int, scores: TokenScores | None) -> TaskOutcome | None:
        """A choice's next token; returns why the choice must end now when its output says so (a stop string,
        or a constrained document that has to close within the budget), for the caller to tell the engine."""
        output = self.choices[choice]
        if output.ending is not None or output.finished:
            return None
        output.tokens += 1
        if scores is not None:
            self._logprobs.setdefault(choice, []).append(self._token_logprob(token, scores))
        if output.reasoning is not None:
            output.reasoning[1].add(token)
        reasoning, text = output.add(token)
        if output.stop.stopped:
            output.ending = TaskOutcome.STOP
        elif output.constraint is not None and output.constraint.ends(output.joined, output.tokens):
            # Ending: what the detokenizer still holds back comes first, then what completes the document after it.
            more_reasoning, tail = output.finish()
            closing = output.constraint.completion(output.joined())
            output.ending = TaskOutcome.LENGTH if closing else TaskOutcome.STOP
            if output.forced_calls:
                # Its constraint ends it complete, not near the budget; a call cut short is left out
                # (`parse_forced_cut`), never given made-up arguments.
                closing = ""
            reasoning, text = reasoning + more_reasoning, text + tail + closing
            output.text.append(closing)
        self._emit(choice, reasoning, text)
        return output.ending

    def text(
        self,
        choice: int,
        reasoning: str,
        text: str,
        logprobs: tuple[TokenLogprob, ...],
        tokens: int,
        reasoning_tokens: int,
    ) -> TaskOutcome | None:
        """A choice's next text from an engine that detokenizes and splits the reasoning itself (llama.cpp): the
        answer is cut at a stop string here, as for tokens. Returns STOP when the choice must end now."""
        output = self.choices[choice]
        if output.ending is not None or output.finished:
            return None
        output.tokens += tokens
        output.engine_reasoning_tokens += reasoning_tokens
        if logprobs:
            self._logprobs.setdefault(choice, []).extend(logprobs)
        _, text = output.show(text, last=False)
        if output.stop.stopped:
            output.ending = TaskOutcome.STOP
        self._emit(choice, reasoning, text)
        return output.ending

    def finish(self, choice: int, end: RowEnd) -> Usage | None:
        """A choice ended; its last chunk. Returns the task's usage once every choice has ended."""
        output = self.choices[choice]
        if output.finished:
            return None
        output.finished = True
        if end.completion_tokens:
            output.tokens = end.completion_tokens
        self._prompt_tokens = max(self._prompt_tokens, end.prompt_tokens)
        reason = end.reason
        if output.ending is not None:
            # A stop string or a closed document: the reason the output gave, whatever stopped the engine first
            # (the last token may complete a stop string just as max_tokens is reached: that is a stop).
            reason = output.ending if reason is not TaskOutcome.CANCELLED else reason
            reasoning, text = "", ""
        else:
            reasoning, text = output.finish()
            if output.grammar_schema is not None and reason is TaskOutcome.LENGTH and not output.forced_calls:
                closing = _closing(output.joined(), output.grammar_schema)
                text += closing
                output.text.append(closing)
        calls: list[ToolCallParsed] = []
        if output.forced_calls:
            # Cut at max_tokens or by a cancel: only the calls written whole come.
            cut = reason in (TaskOutcome.LENGTH, TaskOutcome.CANCELLED)
            calls = parse_forced_cut(output.joined()) if cut else parse_forced(output.joined())
            text = "" if calls or cut else text
        elif output.splitter is not None:
            shown, calls = output.splitter.add(text)
            rest, more = output.splitter.finish()
            text, calls = shown + rest, calls + more
        elif end.engine_calls:
            calls = list(end.engine_calls)
        if calls or output.called:
            reason = TaskOutcome.TOOL_CALLS if reason is TaskOutcome.STOP else reason
        usage = None
        self.outcome = reason
        if self.done:
            usage = Usage(
                prompt_tokens=self._prompt_tokens,
                completion_tokens=sum(c.tokens for c in self.choices),
                reasoning_tokens=sum(c.reasoning_tokens for c in self.choices),
            )
        stop_sequence = output.stop.matched if reason is TaskOutcome.STOP else None
        self._chunk(choice, text, calls, reasoning, finish_reason=reason, stop_sequence=stop_sequence, usage=usage)
        return usage

    def embedding(self, choice: int, vector: list[float], prompt_tokens: int) -> Usage | None:
        """An embedding task's vector for input `choice`; returns the usage once every input has one."""
        output = self.choices[choice]
        output.finished = True
        self._prompt_tokens += prompt_tokens
        usage = Usage(prompt_tokens=self._prompt_tokens, completion_tokens=0) if self.done else None
        self._publish(self._next(choice, embedding=tuple(vector), token_count=prompt_tokens, usage=usage))
        return usage

    def _emit(self, choice: int, reasoning: str, text: str) -> None:
        output = self.choices[choice]
        calls: list[ToolCallParsed] = []
        if output.forced_calls:
            text = ""  # the calls' JSON, sent as calls at the end
        elif output.splitter is not None:
            text, calls = output.splitter.add(text)
        if reasoning or text or calls:
            self._chunk(choice, text, calls, reasoning)

    def _chunk(self, choice: int, text: str, calls: list[ToolCallParsed], reasoning: str = "", **fields: Any) -> None:
        logprobs = self._logprobs.pop(choice, [])
        if not calls and not fields:
            held = self._held
            # A chunk's reasoning comes before its text: reasoning after held text (a model that thinks again)
            # starts a chunk of its own.
            if held is not None and (held[0] != choice or (reasoning and any(held[2]))):
                self.flush()
            if self._held is None:
                self._held = (choice, [], [], [])
                self._holding(self)
            self._held[1].append(reasoning)
            self._held[2].append(text)
            self._held[3].extend(logprobs)
            return
        self.flush()
        if calls:
            self.choices[choice].called = True
        tool_calls = tuple(
            ToolCall(id=f"call_{secrets.token_hex(12)}", name=call.name, arguments=call.arguments) for call in calls
        )
        self._publish(
            self._next(
                choice, text=text, reasoning=reasoning, tool_calls=tool_calls, logprobs=tuple(logprobs), **fields
            )
        )

    def flush(self) -> None:
        """Publish the reasoning and text held, as one chunk."""
        if self._held is None:
            return
        choice, reasonings, texts, logprobs = self._held
        self._held = None
        self._publish(self._next(choice, reasoning="".join(reasonings), text="".join(texts), logprobs=tuple(logprobs)))

    def prompt_progress(self, done_tokens: int, total_tokens: int) -> None:
        """The prompt is processed this far (before any output): said for a prompt of `PROGRESS_FROM_TOKENS` or
        more, at most every `PROGRESS_EVERY_S`, and once it is whole."""
        now = time.monotonic()
        if total_tokens < PROGRESS_FROM_TOKENS:
            return
        if done_tokens < total_tokens and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        progress = PromptProgress(done_tokens=done_tokens, total_tokens=total_tokens)
        self._publish(self._next(0, prompt_progress=progress))

    def _next(self, choice: int, **fields: Any) -> Chunk:
        index, self._next_index = self._next_index, self._next_index + 1
        return Chunk(task_id=self.task_id, index=index, choice=choice, **fields)

    def _token_logprob(self, token: int, scores: TokenScores) -> TokenLogprob:
        top = tuple(TopLogprob(token=self._decode_token(t), logprob=v) for t, v in scores.top)
        return TokenLogprob(token=self._decode_token(token), logprob=scores.logprob, top=top)
