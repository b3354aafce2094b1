"""Choosing the writable directory a download goes to. Pure: all I/O comes in through the callables.

Order:
1. a writable directory that already holds part of this model, if the rest fits: resuming there reuses
   the bytes already fetched and keeps a model's shards together in one directory;
2. otherwise the first writable directory (configured order: the default first) where the rest fits;
3. otherwise NoSpace, with a message naming the space needed and every directory checked.

"Fits" means `room_bytes(dir) - reserved[dir] >= bytes_needed - partial_bytes(dir)`: `reserved` holds
the bytes still expected by downloads already running into each directory (not counting this one), so
two downloads started at the same moment cannot both count the same free space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jetshard_schema.ids import ModelId, parse_model_id

from jetshard_downloader.dirs import KEPT_FREE_FRACTION, KEPT_FREE_MAX_BYTES, ModelDirs
from jetshard_downloader.paths import model_path


@dataclass(frozen=True)
class Choice:
    models_dir: Path
    model_dir: Path
    """`<models_dir>/<org>--<name>`, where the files go."""
    bytes_remaining: int
    """What still has to be downloaded there (bytes_needed minus what is already there)."""
    resumes: bool
    """True when the directory already held part of this model."""


@dataclass(frozen=True)
class CheckedDir:
    models_dir: Path
    room_bytes: int
    """Its disk's free space less what is kept free (`dirs.room_bytes`)."""
    reserved_bytes: int
    partial_bytes: int


@dataclass(frozen=True)
class NoSpace:
    bytes_needed: int
    checked: tuple[CheckedDir, ...]
    message: str


def format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _no_space_message(model_id: str, bytes_needed: int, checked: tuple[CheckedDir, ...]) -> str:
    if not checked:
        return (
            f"cannot store {model_id} ({format_bytes(bytes_needed)}): no writable model directory (each is "
            "configured read-only or on a read-only filesystem); set JETSHARD_DEFAULT_MODELS_DIR or "
            "JETSHARD_MODELS_DIRS"
        )
    lines = [f"not enough disk space for {model_id}: {format_bytes(bytes_needed)} needed; checked:"]
    for c in checked:
        detail = f"{format_bytes(c.room_bytes)} free for models"
        if c.reserved_bytes:
            detail += f", {format_bytes(c.reserved_bytes)} reserved by downloads in progress"
        if c.partial_bytes:
            detail += f", {format_bytes(c.partial_bytes)} of this model already there"
        lines.append(f"  {c.models_dir}: {detail}")
    lines.append(
        "free some space or add a directory with JETSHARD_MODELS_DIRS (models leave "
        f"{KEPT_FREE_FRACTION:.0%} of a disk, at most {format_bytes(KEPT_FREE_MAX_BYTES)}, free)"
    )
    return "\n".join(lines)


def choose_directory(
    dirs: ModelDirs,
    model_id: ModelId | str,
    bytes_needed: int,
    room_bytes: Callable[[Path], int],
    reserved: Mapping[Path, int],
    partial_bytes: Callable[[Path], int],
) -> Choice | NoSpace:
    """Pick the writable directory for downloading `bytes_needed` bytes of `model_id` (see module doc).

    `room_bytes(models_dir)` and `partial_bytes(models_dir)` (bytes of this model already in
    `<models_dir>/<org>--<name>`, e.g. `locate.partial_bytes_for(model_id)`) are called once per writable
    directory.
    """
    model_id = parse_model_id(model_id)
    if bytes_needed < 0:
        raise ValueError(f"bytes_needed must be >= 0, got {bytes_needed}")

    checked = tuple(
        CheckedDir(
            models_dir=d,
            room_bytes=max(0, room_bytes(d)),
            reserved_bytes=max(0, reserved.get(d, 0)),
            partial_bytes=max(0, partial_bytes(d)),
        )
        for d in dirs.writable
    )

    def remaining(c: CheckedDir) -> int:
        return max(0, bytes_needed - c.partial_bytes)

    def fits(c: CheckedDir) -> bool:
        return c.room_bytes - c.reserved_bytes >= remaining(c)

    def choice(c: CheckedDir) -> Choice:
        return Choice(
            models_dir=c.models_dir,
            model_dir=model_path(c.models_dir, model_id),
            bytes_remaining=remaining(c),
            resumes=c.partial_bytes > 0,
        )

    for c in checked:
        if c.partial_bytes > 0 and fits(c):
            return choice(c)
    for c in checked:
        if fits(c):
            return choice(c)
    return NoSpace(
        bytes_needed=bytes_needed, checked=checked, message=_no_space_message(model_id, bytes_needed, checked)
    )
