"""Importing a GGUF file on this node: its card read from its header, the file put into a model directory.

The file (every part of a split model, and the projector when one is named) is checked first, then linked into
`<models dir>/<org>--<name>/` as `model.gguf` (`mmproj.gguf`; a split model's parts keep llama.cpp's part names,
`model-00001-of-00003.gguf`..., with `model.gguf` a link to the first, which llama.cpp finds the others from): a
hard link where the file is on the same filesystem (no copy, no space), else a copy. Everything is written into a
hidden staging directory with its manifest, then made the model directory in one step by `place.move_into_place`
(renamed into place, or exchanged with the copy it replaces or with what an interrupted download left); so a
failed or interrupted import leaves only a staging directory (removed on the way out, or by `convert.sweep_staging`
at the next start) and whatever was stored before as it was.

A hard link shares the file with its source: a tool that rewrites the source in place changes the model too (the
manifest's sizes catch a change of size). Tools that write GGUF files write new files, so this is rare.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.gguf_card import (
    PROJECTOR_ARCHITECTURE,
    UnsupportedGguf,
    card_from_gguf,
    split_count,
    split_part_names,
)
from jetshard_schema.gguf_header import GgufHeader
from jetshard_schema.ids import ModelId

from jetshard_downloader.choose import NoSpace, choose_directory
from jetshard_downloader.delete import remove_model_dir
from jetshard_downloader.dirs import ModelDirs, room_bytes
from jetshard_downloader.fetch import Cancelled
from jetshard_downloader.gguf_header import read_gguf_header
from jetshard_downloader.locate import find_model
from jetshard_downloader.manifest import Manifest, ManifestFile
from jetshard_downloader.paths import GGUF_NAME, MMPROJ_NAME
from jetshard_downloader.place import beside, link_or_copy, move_into_place, staged


class ImportRefused(ValueError):
    """The file cannot be imported: the message names the file and the problem, for a person."""


def read_import(model_id: ModelId, path: Path, mmproj: Path | None) -> tuple[ModelCard, list[tuple[Path, str]]]:
    """The card of the model in `path` (and `mmproj`) and the files to store, each with its name in the model
    directory; ImportRefused naming the problem otherwise. Reads headers only."""

    def header_of(file: Path, role: str) -> GgufHeader:
        try:
            return read_gguf_header(file)
        except FileNotFoundError as error:
            raise ImportRefused(f"{file} does not exist on this node") from error
        except OSError as error:
            raise ImportRefused(f"cannot read {file}: {error.strerror}") from error
        except ValueError as error:
            raise ImportRefused(f"{file} is not a readable GGUF {role}: {error}") from error

    header = header_of(path, "file")
    parts = [header]
    files = [(path, GGUF_NAME)]
    count = split_count(header)
    if count > 1:
        try:
            names = split_part_names(path.name, count)
        except UnsupportedGguf as error:
            raise ImportRefused(f"{path}: {error}") from error
        missing = [name for name in names if not (path.parent / name).is_file()]
        if missing:
            raise ImportRefused(
                f"{path} is part 1 of a model split into {count} files; missing beside it: {', '.join(missing)}"
            )
        parts = [header, *(header_of(path.parent / name, f"part of {path.name}") for name in names[1:])]
        # llama.cpp names a part by its place, and fails to load a model whose parts do not say the same.
        for number, (name, part) in enumerate(zip(names, parts, strict=True)):
            said = (part.integer("split.no"), part.integer("split.count"))
            if said != (number, count):
                raise ImportRefused(
                    f"{path.parent / name} is not part {number + 1} of the {count} of {path.name}: it says it is "
                    f"split.no {said[0]} of split.count {said[1]} (llama.cpp counts from split.no 0)"
                )
        tensors, expected = sum(len(part.tensors) for part in parts), header.integer("split.tensors.count")
        if expected is not None and tensors != expected:
            raise ImportRefused(f"the {count} parts of {path.name} hold {tensors} tensors; its first says {expected}")
        files = [(path.parent / name, name.replace(_prefix(path.name), "model", 1)) for name in names]
    if mmproj is not None:
        projector = header_of(mmproj, "projector")
        if projector.text("general.architecture") != PROJECTOR_ARCHITECTURE:
            raise ImportRefused(
                f"{mmproj} is not a projector (mmproj) file: its general.architecture is "
                f"{projector.text('general.architecture')!r}, not {PROJECTOR_ARCHITECTURE!r}"
            )
        files.append((mmproj, MMPROJ_NAME))
    try:
        card = card_from_gguf(
            model_id,
            header,
            file_sizes_bytes=[source.stat().st_size for source, _ in files],
            source=ModelSource.LOCAL_GGUF,
            source_ref=str(path),
            has_mmproj=mmproj is not None,
            other_parts=parts[1:],
        )
    except ValueError as error:
        raise ImportRefused(f"{path} cannot be imported: {error}") from error
    return card, files


def _prefix(first_part: str) -> str:
    return first_part[: -len("-00001-of-00000.gguf")]


@dataclass(frozen=True)
class StoredImport:
    directory: Path
    size_bytes: int
    sha256: str
    """The model file's (a split model's first part's), read as it was stored: its card's `source_sha256`."""


def store_import(
    dirs: ModelDirs,
    model_id: ModelId,
    files: list[tuple[Path, str]],
    *,
    replace: bool,
    on_progress: Callable[[int, int], None],
    cancel: threading.Event,
) -> StoredImport:
    """Put `files` (the model file first) into the model directory of `model_id`, all or nothing."""
    stored = find_model(dirs, model_id)
    if stored is not None and stored.read_only:
        raise ImportRefused(f"{model_id} is in {stored.path}, a read-only directory jetshard never writes to")
    if stored is not None and not replace:
        raise ImportRefused(
            f"{model_id} is already stored in {stored.path}; import it with replace (--replace) to import over it"
        )
    dirs = beside(dirs, stored)  # replaced where it is: the model stays in one directory
    total = sum(source.stat().st_size for source, _ in files)
    choice = choose_directory(dirs, model_id, total, room_bytes, {}, lambda _: 0)
    if isinstance(choice, NoSpace):
        raise ImportRefused(choice.message)
    target = choice.model_dir
    with staged(target) as out:
        out.mkdir()
        done = 0
        entries = []
        for source, name in files:

            def advance(file_done: int, before: int = done) -> None:
                if cancel.is_set():
                    raise Cancelled(f"the import of {model_id} was cancelled")
                on_progress(before + file_done, total)

            sha256 = link_or_copy(source, out / name, advance)
            size = (out / name).stat().st_size
            entries.append(ManifestFile(name, size, sha256))
            done += size
        if files[0][1] != GGUF_NAME:  # a split model: model.gguf names its first part
            os.symlink(files[0][1], out / GGUF_NAME)
        manifest = Manifest(model_id=model_id, revision="local-gguf", files=tuple(entries))
        # No complete copy is there but the one replaced (refused above otherwise): the import takes the whole
        # directory, never joining what an interrupted download of another model under this id left.
        move_into_place(out, target, manifest, replace=True)
    if stored is not None and stored.path != target:
        remove_model_dir(stored.path)
    return StoredImport(target, total, entries[0].sha256)
