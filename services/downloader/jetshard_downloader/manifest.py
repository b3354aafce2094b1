"""`.jetshard-manifest.json`: the record that a jetshard download finished.

The manifest lists exactly the files that are completely on disk (name, size, sha256) and is written last,
atomically (temporary file, fsync, rename, fsync of the directory). Data files are fsynced before it, so
after a crash either the manifest is absent or older (the files it names are whole) or it is new and so are
they. In a writable directory a model without a manifest is therefore a partial download, whatever
files it holds.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import msgspec

from jetshard_downloader.paths import MANIFEST_NAME, check_repo_filename

MANIFEST_VERSION = 1


class ManifestFile(msgspec.Struct, frozen=True):
    name: str
    size: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    revision: str
    """The commit the files were downloaded from; files of two commits are never mixed in one manifest."""
    files: tuple[ManifestFile, ...]
    version: int = MANIFEST_VERSION

    def sizes(self) -> dict[str, int]:
        return {f.name: f.size for f in self.files}

    def merged(self, other: Manifest) -> Manifest:
        """This manifest plus `other`'s files (other wins on a name clash); same model and revision only."""
        if (other.model_id, other.revision) != (self.model_id, self.revision):
            raise ValueError(
                f"cannot merge manifests of {self.model_id}@{self.revision} and {other.model_id}@{other.revision}"
            )
        by_name = {f.name: f for f in self.files}
        by_name.update({f.name: f for f in other.files})
        return Manifest(
            model_id=self.model_id,
            revision=self.revision,
            files=tuple(sorted(by_name.values(), key=lambda f: f.name)),
        )


def read_manifest(model_dir: Path) -> Manifest | None:
    """The manifest of `model_dir`, or None when absent, unreadable or invalid.

    An invalid manifest is treated as absent rather than raised: the caller's question is "is this model
    complete", and a manifest that cannot be trusted means "no" (a fresh download rewrites it).
    """
    try:
        data = (model_dir / MANIFEST_NAME).read_bytes()
        manifest = msgspec.json.decode(data, type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if manifest.version != MANIFEST_VERSION:
        return None
    try:
        for f in manifest.files:
            check_repo_filename(f.name)
    except ValueError:
        return None
    return manifest


def fsync(path: Path) -> None:
    """Make what was written to the file at `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the entries just renamed into or removed from the directory `path` durable: best effort, since not
    every platform can fsync a directory (Windows)."""
    with contextlib.suppress(OSError):
        fsync(path)


def write_manifest(model_dir: Path, manifest: Manifest) -> Path:
    """Atomically replace `model_dir`'s manifest; returns its path."""
    target = model_dir / MANIFEST_NAME
    tmp = model_dir / f"{MANIFEST_NAME}.{uuid.uuid4().hex}.tmp"
    data = msgspec.json.format(msgspec.json.encode(manifest), indent=2)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(model_dir)
    return target


def remove_manifest(model_dir: Path) -> None:
    """Mark `model_dir` as partial before changing files the current manifest vouches for."""
    (model_dir / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(model_dir)
