"""What a model directory holds, as a test compares it with its source."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_files(model_dir: Path) -> set[str]:
    """The files under `model_dir`, as relative POSIX paths, leaving out the hidden ones at its top (the
    downloader's manifest and partial downloads)."""
    return {
        p.relative_to(model_dir).as_posix()
        for p in model_dir.rglob("*")
        if p.is_file() and not p.relative_to(model_dir).as_posix().startswith(".")
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
