"""Deleting a model from this node's writable directories; read-only directories are never touched."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from jetshard_schema.ids import ModelId, parse_model_id

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.paths import TOMBSTONE, hf_cache_repo_path, model_path, side_directory, sweep_side_directories


class ReadOnlyModelError(Exception):
    """The model lives only in read-only directories, which jetshard never deletes from."""


@dataclass(frozen=True)
class Deleted:
    removed: tuple[Path, ...]
    """Model directories removed from writable directories."""
    kept_read_only: tuple[Path, ...]
    """Copies left in read-only directories (the model stays usable from there)."""


def _read_only_copies(dirs: ModelDirs, model_id: ModelId) -> tuple[Path, ...]:
    found = []
    for d in dirs.read_only:
        for candidate in (model_path(d, model_id), hf_cache_repo_path(d, model_id)):
            if candidate.exists():
                found.append(candidate)
    return tuple(found)


def remove_model_dir(path: Path) -> None:
    """Remove one model directory (a link: only the link), atomically as far as a reader can tell."""
    if path.is_symlink():
        # A link someone placed in a models directory points at data that is not ours: drop the link only.
        path.unlink()
        return
    # Rename first: the directory (and its manifest) disappears atomically, so a concurrent find_model never
    # sees a half-deleted model that still looks complete, and a crash mid-delete leaves only a tombstone.
    tombstone = side_directory(path, TOMBSTONE)
    path.rename(tombstone)
    shutil.rmtree(tombstone)


def delete_model(dirs: ModelDirs, model_id: ModelId | str) -> Deleted:
    """Remove `model_id` from every writable directory.

    Raises ValueError for an invalid id (so no crafted id reaches the filesystem) and ReadOnlyModelError when
    the model exists only in read-only directories. A model found nowhere is not an error (deletes are
    retried and replayed): the result is simply empty.
    """
    model_id = parse_model_id(model_id)
    removed = []
    for d in dirs.writable:
        candidate = model_path(d, model_id)
        if candidate.exists() or candidate.is_symlink():
            remove_model_dir(candidate)
            removed.append(candidate)
    kept = _read_only_copies(dirs, model_id)
    if not removed and kept:
        raise ReadOnlyModelError(
            f"{model_id} is only in read-only model directories ({', '.join(map(str, kept))}); "
            "jetshard never deletes from those: remove it yourself or stop listing the directory in "
            "JETSHARD_MODELS_READ_ONLY_DIRS"
        )
    return Deleted(removed=tuple(removed), kept_read_only=kept)


def sweep_tombstones(models_dir: Path) -> int:
    """Finish deletes a crash interrupted (run at startup on each writable directory); returns how many."""
    return sweep_side_directories(models_dir, TOMBSTONE)
