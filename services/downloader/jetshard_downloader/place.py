"""Putting a staged form of a model into its model directory, all or nothing.

A conversion, an import or a packaged GGUF is written into a hidden staging directory first. Where the model
directory does not exist yet, the staged directory, its manifest written, becomes it in one rename. Where it
exists and holds another form of the model (the GGUF an MLX directory is converted from, or the MLX directory a
GGUF joins), the staged files move in beside it and the manifest, rewritten last and atomically, lists both: a
crash in between leaves files the manifest does not vouch for, never a form that looks complete and is not.
A replacement (`replace`), or a form meeting a directory no manifest vouches for (what a crash or another tool
left), takes the directory's place whole, in one exchange.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.locate import Found
from jetshard_downloader.manifest import Manifest, fsync_dir, read_manifest, write_manifest
from jetshard_downloader.paths import STAGING, exchange_directories, file_in, side_directory

_CHUNK = 8 * 1024 * 1024


def beside(dirs: ModelDirs, stored: Found | None) -> ModelDirs:
    """`dirs` with the writable directory holding `stored` first: a model's forms, and its replacement, stay in
    one directory where it has room (and no stale copy is found first)."""
    if stored is None or stored.read_only:
        return dirs
    return dataclasses.replace(
        dirs, writable=(stored.models_dir, *(d for d in dirs.writable if d != stored.models_dir))
    )


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """Where to stage a form of the model directory `target` (not made yet: the caller makes it), inside a hidden
    staging directory beside `target` that goes on the way out with whatever is left in it (one a crash left goes
    at the next start: `convert.sweep_staging`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = side_directory(target, STAGING)
    staging.mkdir()
    try:
        yield staging / target.name
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def link_or_copy(source: Path, destination: Path, on_bytes: Callable[[int], None]) -> str:
    """A hard link where the filesystem allows it, else a copy; returns the file's sha256 (the manifest's), read
    as it is stored. `on_bytes` sees the bytes done so far after each chunk (progress; it raises to stop)."""

    def read_through(f: BinaryIO, write: Callable[[bytes], object]) -> str:
        digest = hashlib.sha256()
        done = 0
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            write(chunk)
            done += len(chunk)
            on_bytes(done)
        return digest.hexdigest()

    try:
        # The file a link names (a Hugging Face cache snapshot's relative one too), never the link itself: Linux's
        # link(2) links a symbolic link as it is, whatever os.link's follow_symlinks says before Python 3.13.
        os.link(source.resolve(strict=True), destination)
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    else:
        with open(destination, "rb") as f:
            return read_through(f, lambda _: None)
    with open(source, "rb") as src, open(destination, "wb") as dst:
        sha256 = read_through(src, dst.write)
        dst.flush()
        os.fsync(dst.fileno())
    return sha256


def move_into_place(out: Path, target: Path, manifest: Manifest, *, replace: bool = False) -> None:
    """Make the staged directory `out`, whose files `manifest` lists, the model directory `target` (see module
    doc); `out` is left to its staging directory's removal."""
    write_manifest(out, manifest)  # a directory of its own (a join moves only the files it lists)
    if replace or not target.exists():
        try:
            os.rename(out, target)
            fsync_dir(target.parent)
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if replace or read_manifest(target) is None:
        # What was there (the copy replaced, or what a crash or another tool left, which no manifest vouches
        # for) goes to the staging directory, and with it.
        exchange_directories(out, target)
        fsync_dir(target.parent)
        return
    _join(out, target, manifest)


def _join(out: Path, target: Path, manifest: Manifest) -> None:
    """Move `manifest`'s files from `out` into `target` beside what its own manifest lists; the manifest last."""
    existing = read_manifest(target)
    kept = {f.name: f for f in existing.files} if existing is not None else {}
    changed = [f for f in manifest.files if kept.get(f.name) != f]
    if existing is not None and any(f.name in kept for f in changed):
        # Files the manifest vouches for are about to change: it stops vouching for them first.
        stale = {f.name for f in changed}
        write_manifest(
            target,
            Manifest(
                model_id=existing.model_id,
                revision=existing.revision,
                files=tuple(f for f in existing.files if f.name not in stale),
            ),
        )
    for entry in changed:
        destination = file_in(target, entry.name)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(file_in(out, entry.name), destination)
        fsync_dir(destination.parent)
    kept.update({f.name: f for f in manifest.files})
    revision = existing.revision if existing is not None else manifest.revision
    write_manifest(
        target,
        Manifest(
            model_id=manifest.model_id, revision=revision, files=tuple(sorted(kept.values(), key=lambda f: f.name))
        ),
    )
