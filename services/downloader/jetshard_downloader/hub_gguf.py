"""A `hub-gguf` card's files fetched from the Hub and stored as llama.cpp's: `model.gguf` (a split model's parts as
`model-00001-of-0000N.gguf`..., `model.gguf` a link to the first), and `mmproj.gguf` for the projector, as an import
stores them (`import_file`).

The files are fetched by `fetch.fetch_files` (partial files resumed with Range requests, progress, cancellation, each
file's size and sha256 checked against the Hub's listing) under their repo names into `<model dir>/.jetshard-download/`:
a place that stays where it is, so a download interrupted (the downloader killed, a cancel) continues from the bytes
it has, and those bytes count as this model's where `choose_directory` picks a directory. Once every file is whole,
they move into a staging directory under their stored names and `place.move_into_place` makes that the model
directory, all or nothing; the download folder goes with whatever the directory held before, or is removed.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

from jetshard_schema.cards import ModelCard
from jetshard_schema.gguf_card import SPLIT_NAME, HubGgufRef, split_part_names

from jetshard_downloader.fetch import (
    FetchError,
    NotFoundOnHub,
    ProgressCallback,
    RemoteFile,
    RepoListing,
    fetch_files,
)
from jetshard_downloader.manifest import Manifest, ManifestFile
from jetshard_downloader.paths import GGUF_NAME, MMPROJ_NAME, file_in
from jetshard_downloader.place import move_into_place, staged

DOWNLOAD_DIR = ".jetshard-download"
"""Inside a model directory: the files of a Hub GGUF being fetched (no repo file can take a `.jetshard` name)."""


class SourceChanged(FetchError):
    """The repo's file is no longer the one the card was read from."""


def hub_gguf_ref(card: ModelCard) -> HubGgufRef:
    try:
        return HubGgufRef.parse(card.source_ref)
    except ValueError as error:
        raise FetchError(f"{card.model_id}: {error}") from error


def hub_gguf_files(card: ModelCard, listing: RepoListing) -> list[tuple[RemoteFile, str]]:
    """The repo files the card's model is, each with its name in the model directory; NotFoundOnHub naming any the
    repo lacks now, SourceChanged where the GGUF's sha256 is not the card's any more."""
    ref = hub_gguf_ref(card)
    split = SPLIT_NAME.match(ref.file)
    count = int(split["count"]) if split is not None and int(split["part"]) == 1 else 1
    if count > 1:
        stored = split_part_names(f"model-00001-of-{count:05d}.gguf", count)
        names = list(zip(split_part_names(ref.file, count), stored, strict=True))
    else:
        names = [(ref.file, GGUF_NAME)]
    if ref.mmproj:
        names.append((ref.mmproj, MMPROJ_NAME))
    by_name = {f.name: f for f in listing.files}
    missing = [name for name, _ in names if name not in by_name]
    if missing:
        raise NotFoundOnHub(f"{ref.repo} has no file {', '.join(missing)} any more; {card.model_id} is made of it")
    listed_sha256 = (by_name[ref.file].sha256 or "").lower()
    if card.source_sha256 and listed_sha256 and listed_sha256 != card.source_sha256:
        raise SourceChanged(
            f"{ref.repo}/{ref.file} changed on the Hub since the card of {card.model_id} was read from it (sha256 "
            f"{listed_sha256}, the card's {card.source_sha256}); delete the card and add it again"
        )
    return [(by_name[name], stored) for name, stored in names]


def fetch_hub_gguf(
    card: ModelCard,
    listing: RepoListing,
    files: list[tuple[RemoteFile, str]],
    model_dir: Path,
    *,
    on_progress: ProgressCallback,
    cancel: threading.Event,
    token: str | bool | None,
    endpoint: str | None,
    environ: Mapping[str, str],
) -> int:
    """Fetch `files` (from `hub_gguf_files`) of the listed commit and make them the GGUF form of the card's model in
    `model_dir` (see module doc); returns the bytes stored. Raises FetchError subclasses as `fetch_files` does."""
    download_dir = model_dir / DOWNLOAD_DIR
    fetched = fetch_files(
        listing.model_id,
        listing.revision,
        download_dir,
        [remote for remote, _ in files],
        on_progress=on_progress,
        cancel=cancel,
        token=token,
        endpoint=endpoint,
        environ=environ,
    )
    hashes = {entry.name: entry for entry in fetched.files}
    with staged(model_dir) as out:
        out.mkdir()
        entries = []
        for remote, name in files:
            os.replace(file_in(download_dir, remote.name), out / name)
            entries.append(ManifestFile(name, hashes[remote.name].size, hashes[remote.name].sha256))
        if files[0][1] != GGUF_NAME:  # a split model: model.gguf names its first part
            os.symlink(files[0][1], out / GGUF_NAME)
        manifest = Manifest(model_id=card.model_id, revision=listing.revision, files=tuple(entries))
        move_into_place(out, model_dir, manifest)
    shutil.rmtree(download_dir, ignore_errors=True)  # where the model directory joined another form
    return sum(entry.size for entry in entries)
