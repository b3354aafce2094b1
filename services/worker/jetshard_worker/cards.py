"""Custom model cards persisted on the node: one JSON file per card, written atomically.

The directory is the node's own copy of what State says; nothing there can stop the worker from starting:
a card that cannot be stored, or a file that cannot be removed, is a warning.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from jetshard_schema.cards import ModelCard
from jetshard_schema.codec import encode
from jetshard_schema.ids import ModelId, model_dir_name

log = logging.getLogger(__name__)


class CardDirectory:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _file(self, model_id: ModelId) -> Path:
        # model_dir_name re-validates the id: one path component, never '..' or absolute.
        return self.path / f"{model_dir_name(model_id)}.json"

    def write(self, card: ModelCard) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.path, prefix=".card-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(encode(card))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self._file(card.model_id))
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def remove(self, model_id: ModelId) -> None:
        self._file(model_id).unlink(missing_ok=True)

    def stored(self) -> set[str]:
        """File names of the cards on disk."""
        if not self.path.is_dir():
            return set()
        return {p.name for p in self.path.glob("*.json")}

    def reconcile(self, cards: dict[ModelId, ModelCard]) -> None:
        """Make the directory hold exactly `cards`: added while down appear, deleted while down disappear."""
        wanted: dict[str, ModelCard] = {}
        for model_id, card in cards.items():
            try:
                wanted[self._file(model_id).name] = card
            except ValueError as error:
                log.warning("not storing the card %r: %s", model_id, error)
        if self.path.is_dir():
            for stale in self.path.glob(".card-*.tmp"):  # left by a write the process died in
                _remove(stale)
        for name in self.stored() - wanted.keys():
            if _remove(self.path / name):
                log.info("removed card file %s (the card was deleted)", name)
        for card in wanted.values():
            try:
                self.write(card)
            except OSError as error:
                log.warning("could not store the card %s: %s", card.model_id, error)


def _remove(path: Path) -> bool:
    try:
        path.unlink(missing_ok=True)
    except OSError as error:  # a directory or an unwritable entry where a card file was expected
        log.warning("could not remove %s: %s", path, error)
        return False
    return True
