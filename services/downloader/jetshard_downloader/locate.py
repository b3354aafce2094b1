"""Finding a model that is complete on this node.

Layouts:

* jetshard layout, any directory: `<dir>/<org>--<name>/` holding the repo's files.
* Hugging Face cache, read-only directories only: `<dir>/models--<org>--<name>/snapshots/<rev>/` as
  huggingface_hub leaves it (point a read-only directory at `~/.cache/huggingface/hub`). The revision
  named by `refs/main` is preferred, then other snapshots, newest first.

Read-only directories are searched first (a model someone placed there costs no disk and no download),
then writable ones, each in configured order.

Completeness, for a required file set (a shard's files, plus `config.json`; or a GGUF's `model.gguf`, plus the
other GGUF files its manifest lists: a split model's parts, the projector) or, when none is given, the whole
model in either form (its GGUF; or every weight file the safetensors index names, or `model.safetensors`, plus
`config.json`). One directory may hold both forms, a GGUF and the MLX directory converted from it, each complete
or not on its own:

* With a manifest (any directory): every required file is listed in it and is on disk with the size the
  manifest records. Sizes are checked, not hashes: hashing gigabytes on every lookup is too slow, and the
  sha256 was verified when the manifest was written.
* Writable directory without a manifest: never complete. jetshard writes the manifest last, so this is
  a download that was interrupted (or never finished); its files are kept for the next attempt to resume.
* Read-only directory without a manifest (jetshard layout or HF cache): complete when every required file
  exists. Sizes are unknown without a manifest; users put models there with other tools
  (`huggingface-cli download`, rsync) and those tools finish files by renaming, so existence is the
  signal they leave. An HF cache snapshot entry is a symlink to a blob; a dangling link is a missing file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jetshard_schema.ids import ModelId, parse_model_id

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.manifest import Manifest, read_manifest
from jetshard_downloader.paths import (
    CONFIG_NAME,
    GGUF_NAME,
    GGUF_SUFFIX,
    INDEX_NAME,
    SINGLE_WEIGHTS_NAME,
    check_ref_component,
    check_repo_filename,
    file_in,
    hf_cache_repo_path,
    model_path,
)

Layout = Literal["jetshard", "hf-cache"]


@dataclass(frozen=True)
class Found:
    """A complete copy of a model: load it from `path`."""

    path: Path
    read_only: bool
    models_dir: Path
    layout: Layout = "jetshard"


def _mlx_files(model_dir: Path) -> set[str] | None:
    """Files the whole MLX model needs, read from the index on disk; None when that cannot be determined."""
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            files = {check_repo_filename(v) for v in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if not files:
            return None
        return {CONFIG_NAME, INDEX_NAME, *files}
    return {CONFIG_NAME, SINGLE_WEIGHTS_NAME}


def _needed(model_dir: Path, required_files: set[str], manifest: Manifest | None) -> set[str]:
    """The files `required_files` stand for: a GGUF's `model.gguf` brings the other GGUF files its manifest lists
    (a split model's parts, the projector); MLX files bring `config.json`."""
    if GGUF_NAME in required_files:  # llama.cpp's file: no config.json beside it
        listed = manifest.sizes() if manifest is not None else {}
        return required_files | {name for name in listed if name.endswith(GGUF_SUFFIX)}
    return {CONFIG_NAME, *required_files}


def _complete_by_manifest(model_dir: Path, manifest: Manifest, required_files: set[str]) -> bool:
    sizes = manifest.sizes()
    for name in _needed(model_dir, required_files, manifest):
        if name == GGUF_NAME and name not in sizes:  # a split model's link to its first part, listed itself
            if not file_in(model_dir, name).is_file():
                return False
            continue
        if name not in sizes:
            return False
        try:
            if file_in(model_dir, name).stat().st_size != sizes[name]:
                return False
        except OSError:
            return False
    return True


def _complete_by_presence(model_dir: Path, required_files: set[str]) -> bool:
    # is_file() follows symlinks, so an HF cache entry whose blob is missing counts as absent.
    return all(file_in(model_dir, name).is_file() for name in _needed(model_dir, required_files, None))


def _complete_files(model_dir: Path, required_files: set[str], *, read_only: bool) -> bool:
    manifest = read_manifest(model_dir)
    if manifest is not None:
        return _complete_by_manifest(model_dir, manifest, required_files)
    if not read_only:
        return False
    return _complete_by_presence(model_dir, required_files)


def is_complete(model_dir: Path, required_files: set[str] | None, *, read_only: bool) -> bool:
    """Whether `model_dir` holds `required_files` by the rules in the module doc; None: the whole model in some
    form (a GGUF, `model.gguf`, or an MLX directory; a directory may hold both)."""
    if not model_dir.is_dir():
        return False
    if required_files is not None:
        return _complete_files(model_dir, required_files, read_only=read_only)
    if os.path.lexists(model_dir / GGUF_NAME) and _complete_files(model_dir, {GGUF_NAME}, read_only=read_only):
        return True
    mlx = _mlx_files(model_dir)
    return mlx is not None and _complete_files(model_dir, mlx, read_only=read_only)


def hf_cache_snapshots(repo_dir: Path) -> list[Path]:
    """Snapshot directories of an HF cache repo folder, the `refs/main` one first, then newest first."""
    snapshots_dir = repo_dir / "snapshots"
    if not snapshots_dir.is_dir():
        return []
    preferred: Path | None = None
    try:
        ref = check_ref_component((repo_dir / "refs" / "main").read_text(encoding="utf-8"))
        candidate = snapshots_dir / ref
        if candidate.is_dir():
            preferred = candidate
    except (OSError, ValueError):
        pass
    others = []
    for entry in snapshots_dir.iterdir():
        if entry != preferred and entry.is_dir():
            try:
                others.append((entry.stat().st_mtime, entry))
            except OSError:
                continue
    others.sort(key=lambda pair: pair[0], reverse=True)
    return ([preferred] if preferred else []) + [entry for _, entry in others]


def _validated_required(required_files: Iterable[str] | None) -> set[str] | None:
    if required_files is None:
        return None
    return {check_repo_filename(name) for name in required_files}


def find_model(dirs: ModelDirs, model_id: ModelId | str, required_files: Iterable[str] | None = None) -> Found | None:
    """The first complete copy of `model_id` (for `required_files`, or the whole model when None).

    Raises ValueError for an invalid model id or an unsafe file name, before touching the filesystem.
    """
    model_id = parse_model_id(model_id)
    required = _validated_required(required_files)
    for models_dir, read_only in dirs.search_order:
        candidate = model_path(models_dir, model_id)
        if is_complete(candidate, required, read_only=read_only):
            return Found(path=candidate, read_only=read_only, models_dir=models_dir)
        if read_only:
            for snapshot in hf_cache_snapshots(hf_cache_repo_path(models_dir, model_id)):
                if is_complete(snapshot, required, read_only=True):
                    return Found(path=snapshot, read_only=True, models_dir=models_dir, layout="hf-cache")
    return None


def bytes_on_disk(model_dir: Path) -> int:
    """Bytes under a model directory (symlinks not followed): what a resumed download would not refetch."""
    total = 0
    for root, _dirs, files in os.walk(model_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def partial_bytes_for(model_id: ModelId | str) -> Callable[[Path], int]:
    """A `partial_bytes(models_dir) -> int` for `choose_directory`: bytes of this model already there."""
    model_id = parse_model_id(model_id)

    def partial_bytes(models_dir: Path) -> int:
        return bytes_on_disk(model_path(models_dir, model_id))

    return partial_bytes
