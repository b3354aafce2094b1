"""Turning sampled tokens into the text a client sees: streaming detokenization and stop strings.

Stop strings are matched across chunk boundaries: text that could still become the start of a stop
string is held back until the next token shows whether it does. The stop text itself is never returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, detokenizer: Any, stop: Sequence[str]) -> None:
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to send (possibly empty)."""
        self._detokenizer.add_token(token)
        return self._release(self._detokenizer.last_segment)

    def finish(self) -> str:
        """The rest of the text once generation ended for another reason than a stop string."""
        self._detokenizer.finalize()
        tail = self._release(self._detokenizer.last_segment)
        if self.stopped:
            return tail
        rest, self._held = self._held, ""
        return tail + rest

    def _release(self, segment: str) -> str:
        if self.stopped:
            return ""
        text = self._held + segment
        found = [at for stop in self._stop if (at := text.find(stop)) != -1]
        if found:
            self.stopped = True
            self._held = ""
            return text[: min(found)]
        keep = max((pending_prefix_length(text, stop) for stop in self._stop), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def pending_prefix_length(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`: text to hold back, as it may be the
    start of `stop`."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-length:]):
            return length
    return 0
