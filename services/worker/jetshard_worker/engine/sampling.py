"""Token sampling on the last rank, reproducible per task.

Each task owns a PRNG key split once per sampled token, so a task's samples depend only
on its seed and its logits, never on which other tasks share the process (mlx-lm's
samplers draw from the global PRNG state).
"""

from __future__ import annotations

import secrets

import mlx.core as mx

from jetshard_worker.library_boundary import apply_top_p


class TaskSampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self._key = mx.random.key(secrets.randbits(63) if seed is None else seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        """`logprobs` (batch, vocab) -> token ids (batch,)."""
        if self.greedy:
            # Same op as mlx_lm's greedy_sampler, so greedy output matches mlx-lm exactly.
            return mx.argmax(logprobs, axis=-1)
        self._key, key = mx.random.split(self._key)
        if self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)
