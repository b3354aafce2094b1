"""Stop strings: the text a client sees ends before the first one (the runner applies them to the answer only,
after a thinking model's reasoning is split from it: `jetshard_worker.text.output`).

Stop strings are matched across pieces of text: text that could still become the start of a stop string is
held back until the next piece shows whether it does. The stop text itself is never returned.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._held = ""
        self.matched: str | None = None
        """The stop string the text ended at: the one that starts first (of those, the first given)."""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def add(self, piece: str) -> str:
        """Feed the next piece of text; return the text that is now safe to send (possibly empty)."""
        if self.stopped:
            return ""
        text = self._held + piece
        found = [(at, stop) for stop in self._stop if (at := text.find(stop)) != -1]
        if found:
            at, self.matched = min(found, key=lambda place: place[0])
            self._held = ""
            return text[:at]
        keep = max((pending_prefix_length(text, stop) for stop in self._stop), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        """What is held back once the text ended (nothing after a stop string)."""
        rest, self._held = self._held, ""
        return rest


def pending_prefix_length(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`: text to hold back, as it may be the
    start of `stop`."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-length:]):
            return length
    return 0
