"""Prompt lookup's drafts (`engines.mlx.prompt_lookup`): what follows the context's end where it stood before."""

from __future__ import annotations

from jetshard_worker.engines.mlx.prompt_lookup import ngram_draft


def test_the_tokens_after_the_latest_earlier_run_of_the_last_three_are_proposed() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    assert ngram_draft(context, 2) == [6, 7]  # the run at 6-8 is the latest before the end, not the one at 1-3
    assert ngram_draft(context, 10) == [6, 7, 2, 3, 4]  # up to the end of the context


def test_two_tokens_are_looked_for_where_three_never_recur() -> None:
    assert ngram_draft([8, 5, 6, 7, 1, 5, 6], 3) == [7, 1, 5]
    assert ngram_draft([8, 5, 6, 7, 1, 9, 6], 3) == []  # a single token is not enough
    assert ngram_draft([5, 6], 3) == []


def test_nothing_is_proposed_where_no_room_is_left() -> None:
    assert ngram_draft([1, 2, 3, 1, 2, 3], 0) == []
    assert ngram_draft([1, 2, 3, 1, 2, 3], -1) == []
