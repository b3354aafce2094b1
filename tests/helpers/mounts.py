"""Size-limited and read-only tmpfs mounts: real full and read-only disks for the storage tests (root only)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: "1m", "99000k") mounted at `path` for the block; skips without root."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): "
            f"{result.stderr.strip() or result.returncode}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path: Path) -> None:
    result = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot remount {path} read-only: {result.stderr.strip()}")
