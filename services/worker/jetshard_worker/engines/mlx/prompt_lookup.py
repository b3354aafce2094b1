"""Prompt-lookup drafting (`serving.draft: ngram` on MLX): the tokens that followed the context's last few where
they stood before, proposed for the model to check in one step (the engine's verify steps).

No second model: it pays where an answer repeats its prompt or itself (a code edit, a quoted passage), and costs a
step a little wider where it proposes nothing worth keeping."""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_DRAFT_TOKENS = 4
"""The most tokens proposed a step: each is a position more for every rank to compute, so a long run pays only where
the text repeats long runs; llama.cpp's prompt lookup proposes up to 16 on a GPU, where positions cost little."""
NGRAM_SIZES = (3, 2)
"""The lengths of the context's end looked for, longest first: a single token recurs too often to predict much."""


def ngram_draft(context: Sequence[int], most: int) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of `context`'s last n tokens (n in
    `NGRAM_SIZES`, the longest found first); none where no such run recurs."""
    if most < 1:
        return []
    for size in NGRAM_SIZES:
        if len(context) <= size:
            continue
        tail = list(context[-size:])
        last = tail[-1]
        for start in range(len(context) - size - 1, -1, -1):
            if context[start + size - 1] == last and list(context[start : start + size]) == tail:
                return list(context[start + size : start + size + most])
    return []
