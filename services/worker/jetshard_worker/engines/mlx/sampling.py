"""Token sampling on the last rank, reproducible per task.

Each task owns a PRNG key split once per sampled token, so a task's samples depend only
on its seed and its logits, never on which other tasks share the process (mlx-lm's
samplers draw from the global PRNG state).
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from jetshard_schema.sampling import TokenSampling

from jetshard_worker.library_boundary import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)


class TaskSampler:
    """Cuts the distribution to the `top_k` most likely tokens, then to the `top_p` nucleus, then to the tokens at
    least `min_p` times as likely as the most likely one (llama.cpp's order and vLLM's), and draws at
    `temperature`; 0, 1 and 0 cut nothing. The values are its request's, which checked them (`GenerationRequest`)."""

    def __init__(self, sampling: TokenSampling, seed: int | None) -> None:
        self.sampling = sampling
        self._key = mx.random.key(secrets.randbits(63) if seed is None else seed)

    @property
    def greedy(self) -> bool:
        """Argmax: no cut changes which token is the most likely."""
        return self.sampling.temperature == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        """`logprobs` (batch, vocab) -> token ids (batch,)."""
        if self.greedy:
            # Same op as mlx_lm's greedy_sampler, so greedy output matches mlx-lm exactly.
            return mx.argmax(logprobs, axis=-1)
        self._key, key = mx.random.split(self._key)
        return self._draw(logprobs, key)

    def ahead(self, logprobs: mx.array) -> mx.array:
        """`logprobs` (positions, vocab), the task's at consecutive positions (a step that checks drafted tokens) ->
        the token each position draws, with the key it would draw with were the ones before it kept: the tokens it
        keeps are those it would sample without drafting. `advance` then spends the keys of the tokens kept."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        key, tokens = self._key, []
        for position in range(logprobs.shape[0]):
            key, drawing = mx.random.split(key)
            tokens.append(self._draw(logprobs[position : position + 1], drawing))
        return mx.concatenate(tokens)

    def advance(self, kept: int) -> None:
        """`kept` tokens drawn by `ahead` were kept: the next draws with the key after theirs."""
        if not self.greedy:
            for _ in range(kept):
                self._key, _ = mx.random.split(self._key)

    def _draw(self, logprobs: mx.array, key: mx.array) -> mx.array:
        if 0 < self.sampling.top_k < logprobs.shape[-1]:  # mlx-lm refuses a k that keeps the whole vocabulary
            logprobs = apply_top_k(logprobs, self.sampling.top_k)
        if self.sampling.top_p < 1:
            logprobs = apply_top_p(logprobs, self.sampling.top_p)
        if self.sampling.min_p > 0:
            logprobs = apply_min_p(logprobs, self.sampling.min_p)
        return mx.random.categorical(logprobs * (1.0 / self.sampling.temperature), key=key)


class Penalties:
    """A task's repetition, presence and frequency penalties, with mlx-lm's processors, on the logits (before the
    softmax, where transformers, vLLM and llama.cpp apply them: the repetition penalty is a factor, which the
    softmax does not undo).

    The repetition penalty looks at the prompt and the answer, as transformers, vLLM and llama.cpp do; the presence
    and frequency penalties at the answer only, OpenAI's definition (and vLLM's): a chat's prompt repeats its
    template's tokens, the end-of-turn token among them, which would otherwise be penalised once per turn. With
    `last_n` each looks at the last `last_n` tokens of the sequence only (Ollama's `repeat_last_n`); 0 turns them
    all off. The values are its request's, which checked them (`GenerationRequest`).
    """

    def __init__(self, prompt_length: int, sampling: TokenSampling, last_n: int | None) -> None:
        self.prompt_length = prompt_length
        self.last_n = last_n
        # mlx-lm's processors look at their last `context_size` tokens: here the window is cut before they see it.
        repetition = sampling.repetition_penalty
        self._repetition = make_repetition_penalty(repetition, 2**31 - 1) if repetition != 1 else None
        self._answer = [
            make(penalty, 2**31 - 1)
            for make, penalty in (
                (make_presence_penalty, sampling.presence_penalty),
                (make_frequency_penalty, sampling.frequency_penalty),
            )
            if penalty != 0
        ]

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self._repetition is not None or bool(self._answer))

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        """`history`: the prompt and the tokens generated so far; `logits` (1, vocab)."""
        start = 0 if self.last_n is None else max(0, history.size - self.last_n)
        if self._repetition is not None and start < history.size:
            logits = self._repetition(history[start:], logits)
        answer_start = max(start, self.prompt_length)
        if answer_start < history.size:
            for penalty in self._answer:
                logits = penalty(history[answer_start:], logits)
        return logits
