"""What proposes the tokens a greedy row's next step checks (`serving.draft`): prompt lookup, or a smaller model of
the same tokenizer run on the leader. The engine checks every proposal with the model itself (its verify steps), so
a drafter changes how fast an answer comes, never what it is."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx

from jetshard_worker.library_boundary import can_trim_prompt_cache, trim_prompt_cache

from .prompt_lookup import NGRAM_DRAFT_TOKENS, ngram_draft
from .shard import Shard

DRAFT_MODEL_TOKENS = 3
"""The most tokens a draft model proposes a step: mlx_lm.server's default (`--num-draft-tokens`)."""
DRAFT_PREFILL_TOKENS = 512
"""The draft model reads a row's context in chunks of this many tokens: its activations stay small beside the
model's own."""


class Drafter(Protocol):
    most: int
    """The most tokens it proposes a step."""

    def propose(self, row: Hashable, context: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens to follow `context`, the prompt and answer so far of `row` (the same key each step)."""
        ...

    def forget(self, row: Hashable) -> None:
        """`row` ended: what was kept for it goes."""
        ...


class PromptLookup:
    """`serving.draft: ngram`: the tokens that followed the context's end where it stood before."""

    most = NGRAM_DRAFT_TOKENS

    def propose(self, row: Hashable, context: Sequence[int], most: int) -> list[int]:
        return ngram_draft(context, most)

    def forget(self, row: Hashable) -> None:
        pass


@dataclass
class _DraftRow:
    """A row's KV cache in the draft model: its first `context_tokens` tokens of context, then `drafts_read`."""

    cache: list[Any]
    context_tokens: int = 0
    drafts_read: list[int] = field(default_factory=list)


class DraftModel:
    """`serving.draft: <model id>`: a smaller model's greedy tokens, as mlx-lm's speculative decoding drafts. Each row
    keeps a KV cache of its own in the draft model, cut back each step to what the row kept, so the draft reads only
    the tokens that are new to it. Rows draft one after another (a step of the model's costs several of a draft's)."""

    def __init__(self, shard: Shard, vocab_size: int | None, most: int = DRAFT_MODEL_TOKENS) -> None:
        if not (shard.is_first and shard.is_last):
            raise ValueError("a draft model is loaded whole, on the instance's leader")
        if not can_trim_prompt_cache(shard.make_cache()):
            raise ValueError(
                "the draft model's cache cannot be cut back (sliding-window or recurrent layers), so it cannot drop "
                "the drafts its model rejects: draft with a model of full attention, or with ngram"
            )
        self._shard = shard
        # A draft's vocabulary may be padded past the model's: it proposes none of the tokens the model has not.
        self._vocab_size = vocab_size
        self.most = most
        self._rows: dict[Hashable, _DraftRow] = {}

    def propose(self, row: Hashable, context: Sequence[int], most: int) -> list[int]:
        if most < 1:
            return []
        held = self._rows.get(row) or _DraftRow(self._shard.make_cache())
        # What the cache holds that the row kept: the context it was last given (a row's context only grows), and
        # the drafts read after it up to the first the row did not keep. The context's last token is read again
        # at least, for its logits.
        kept = held.context_tokens
        for token in held.drafts_read:
            if kept >= len(context) - 1 or context[kept] != token:
                break
            kept += 1
        trim_prompt_cache(held.cache, held.context_tokens + len(held.drafts_read) - kept)
        unread = list(context[kept:])
        cache = held.cache
        while len(unread) > DRAFT_PREFILL_TOKENS:
            self._forward(mx.array([unread[:DRAFT_PREFILL_TOKENS]], dtype=mx.int32), cache)
            mx.eval([c.state for c in cache])
            unread = unread[DRAFT_PREFILL_TOKENS:]
        logits = self._forward(mx.array([unread], dtype=mx.int32), cache)
        tokens: list[mx.array] = []
        for step in range(most):
            proposed = mx.argmax(logits[:, -1, : self._vocab_size], axis=-1)
            tokens.append(proposed)
            if step + 1 < most:
                logits = self._forward(proposed.reshape(1, 1), cache)
        drafts = cast("list[int]", mx.concatenate(tokens).tolist())
        self._rows[row] = _DraftRow(cache, len(context), drafts[:-1])  # the last draft was never read
        return drafts

    def forget(self, row: Hashable) -> None:
        self._rows.pop(row, None)

    def _forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        shard = self._shard
        return shard.head(shard.run_layers(shard.embed(tokens), cache))
