"""A streamed answer cut short by a process that died under it, as the openai client sees it."""

from __future__ import annotations

import time
from collections.abc import Iterable

import openai
import pytest

ERROR_DEADLINE_S = 30
"""How soon after the death a stream must end in an error."""


def stream_error(stream: Iterable[object], started: float, what: str) -> openai.APIError:
    """The error that ends `stream`, which must come within ERROR_DEADLINE_S of `started` (when `what` happened)."""
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            assert time.monotonic() - started < ERROR_DEADLINE_S, f"the stream did not end after {what}"
    assert time.monotonic() - started < ERROR_DEADLINE_S
    return caught.value
