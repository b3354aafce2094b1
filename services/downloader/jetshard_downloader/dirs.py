"""Where models live on this node: one default writable directory, more writable ones, read-only ones.

Environment (all optional; an unset or empty variable leaves exactly the default):

* `JETSHARD_DEFAULT_MODELS_DIR`: the default directory, always the first writable one.
  Default: `$XDG_DATA_HOME/jetshard/models`, with `XDG_DATA_HOME` defaulting to `~/.local/share`.
* `JETSHARD_MODELS_DIRS`: more writable directories, colon-separated, tried in order after the default.
* `JETSHARD_MODELS_READ_ONLY_DIRS`: colon-separated directories that are searched (first) but never
  written to or deleted from.

Rules: `~` is expanded, relative paths are made absolute against the current directory, empty entries
are ignored and duplicates removed (the first occurrence keeps its place). A directory listed both as
writable and as read-only is read-only: a user who says "never write here" must be obeyed even when
another setting disagrees. That includes the default directory: listing it read-only makes it read-only
and leaves it out of `writable` (a node that only serves models from a shared mount can do exactly
that); `default_dir` still names it, so messages can say what was configured.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

ENV_DEFAULT_DIR = "JETSHARD_DEFAULT_MODELS_DIR"
ENV_MODELS_DIRS = "JETSHARD_MODELS_DIRS"
ENV_READ_ONLY_DIRS = "JETSHARD_MODELS_READ_ONLY_DIRS"


def _home(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME")
    return Path(home) if home else Path.home()


def _normalize(raw: str | os.PathLike[str], environ: Mapping[str, str]) -> Path:
    text = os.fspath(raw)
    # `~` is expanded against the given environment, not the process's, so from_env is testable and a
    # service started with an explicit environment sees the same paths as its configuration says.
    if text == "~" or text.startswith("~/"):
        text = str(_home(environ)) + text[1:]
    else:
        text = os.path.expanduser(text)
    # normpath, not resolve(): a directory that does not exist yet (created on first download) must still
    # be accepted, and symlinked mounts should keep the name the user gave them.
    return Path(os.path.normpath(os.path.abspath(text)))


def _split(value: str | None) -> list[str]:
    if not value:
        return []
    return [part.strip() for part in value.split(":") if part.strip()]


def _dedupe(paths: Iterable[Path]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(paths))


def default_models_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_DATA_HOME/jetshard/models`; the XDG spec says a relative XDG_DATA_HOME is to be ignored."""
    xdg = environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else _home(environ) / ".local" / "share"
    return _normalize(base / "jetshard" / "models", environ)


@dataclass(frozen=True)
class ModelDirs:
    """The model directories of one node.

    `default_dir`: the configured default directory (first in `writable` unless it was made read-only).
    `writable`: directories downloads may go to and deletes may remove from, in preference order.
    `read_only`: directories searched before the writable ones; never written or deleted.
    The two tuples are disjoint.
    """

    default_dir: Path
    writable: tuple[Path, ...]
    read_only: tuple[Path, ...]

    def __post_init__(self) -> None:
        overlap = set(self.writable) & set(self.read_only)
        if overlap:
            raise ValueError(f"directories both writable and read-only: {sorted(map(str, overlap))}")

    @property
    def search_order(self) -> tuple[tuple[Path, bool], ...]:
        """(directory, read_only) pairs in the order models are looked for: read-only ones first."""
        return tuple((d, True) for d in self.read_only) + tuple((d, False) for d in self.writable)

    @classmethod
    def from_options(
        cls,
        default_dir: str | os.PathLike[str] | None = None,
        models_dirs: Iterable[str | os.PathLike[str]] = (),
        read_only_dirs: Iterable[str | os.PathLike[str]] = (),
        *,
        environ: Mapping[str, str] = os.environ,
    ) -> ModelDirs:
        """Build from explicit values (CLI flags); `default_dir=None` means the XDG default."""
        default = _normalize(default_dir, environ) if default_dir else default_models_dir(environ)
        read_only = _dedupe(_normalize(p, environ) for p in read_only_dirs if os.fspath(p).strip())
        ro = set(read_only)
        writable = _dedupe(
            p for p in (default, *(_normalize(p, environ) for p in models_dirs if os.fspath(p).strip())) if p not in ro
        )
        return cls(default_dir=default, writable=writable, read_only=read_only)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ModelDirs:
        default = environ.get(ENV_DEFAULT_DIR, "").strip() or None
        return cls.from_options(
            default,
            _split(environ.get(ENV_MODELS_DIRS)),
            _split(environ.get(ENV_READ_ONLY_DIRS)),
            environ=environ,
        )


class DirectoryInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One model directory as reported to the cluster (plain data: it travels in Report commands)."""

    path: str
    read_only: bool
    is_default: bool
    exists: bool
    free_bytes: int
    """Free space of the filesystem that holds (or will hold) the directory; 0 when it cannot be measured."""
    total_bytes: int


class DiskUsage(Protocol):
    """What `shutil.disk_usage` returns, as far as this module reads it."""

    @property
    def total(self) -> int: ...

    @property
    def free(self) -> int: ...


def _existing_ancestor(path: Path) -> Path | None:
    # A writable directory is created on first download; until then its filesystem is its nearest existing
    # ancestor's, which is where the bytes will land.
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def on_read_only_filesystem(path: Path) -> bool:
    """Whether the filesystem `path` is on (or would be created on) is mounted read-only."""
    anchor = _existing_ancestor(path)
    if anchor is None:
        return False
    try:
        return bool(os.statvfs(anchor).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def minding_read_only_filesystems(dirs: ModelDirs) -> ModelDirs:
    """`dirs` with every writable directory whose filesystem is mounted read-only counted read-only: a download
    or delete there could only fail, and its free space is none a model can use."""
    mounted = tuple(d for d in dirs.writable if on_read_only_filesystem(d))
    if not mounted:
        return dirs
    writable = tuple(d for d in dirs.writable if d not in mounted)
    return ModelDirs(default_dir=dirs.default_dir, writable=writable, read_only=dirs.read_only + mounted)


KEPT_FREE_FRACTION = 0.01
KEPT_FREE_MAX_BYTES = 2**30
"""What no model takes of a disk: 1% of it, at most 1 GiB. The system, and the cluster's history where it shares the
disk, still have room once models filled the rest: a JetStream stream that finds no room for a write fails until
nats-server restarts, and with it every command of the cluster."""


def kept_free_bytes(total_bytes: int) -> int:
    """The free space no model takes of a disk of `total_bytes` (see `KEPT_FREE_FRACTION`)."""
    return min(KEPT_FREE_MAX_BYTES, int(total_bytes * KEPT_FREE_FRACTION))


def room_bytes(path: Path, disk_usage: Callable[[Path], DiskUsage] = shutil.disk_usage) -> int:
    """The bytes a model may take where `path` is or would be created: the free space less what is kept free; 0
    when nothing along the path can be measured."""
    anchor = _existing_ancestor(path)
    if anchor is None:
        return 0
    try:
        usage = disk_usage(anchor)
    except OSError:
        return 0
    return max(0, int(usage.free) - kept_free_bytes(int(usage.total)))


def directory_report(
    dirs: ModelDirs,
    disk_usage: Callable[[Path], DiskUsage] = shutil.disk_usage,
) -> tuple[DirectoryInfo, ...]:
    """Every directory in search order with its free space and whether it is read-only."""
    out = []
    for path, read_only in dirs.search_order:
        anchor = _existing_ancestor(path)
        total = free = 0
        if anchor is not None:
            try:
                usage = disk_usage(anchor)
                total, free = int(usage.total), int(usage.free)
            except OSError:
                pass
        out.append(
            DirectoryInfo(
                path=str(path),
                read_only=read_only,
                is_default=path == dirs.default_dir,
                exists=path.is_dir(),
                free_bytes=free,
                total_bytes=total,
            )
        )
    return tuple(out)
