"""Is a shard already on this node? `find_model` with the files its layer range needs, from a local index.

Which weight files a layer range needs is written in the model's `model.safetensors.index.json`. Any copy of
the model on this node has the same index (a read-only copy, a finished shard, a partial download that got
its support files), so the first index found in search order decides the required files; without one the
model is a single `model.safetensors` (or nothing is here and the lookup finds nothing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jetshard_schema.cards import ModelCard, ModelFormat

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.locate import Found, find_model, hf_cache_snapshots
from jetshard_downloader.manifest import read_manifest
from jetshard_downloader.paths import (
    CONFIG_NAME,
    GGUF_NAME,
    INDEX_NAME,
    SINGLE_WEIGHTS_NAME,
    file_in,
    hf_cache_repo_path,
    model_path,
)
from jetshard_downloader.shard_files import files_for_layer_range


def _local_index(dirs: ModelDirs, card: ModelCard) -> dict | None:  # type: ignore[type-arg]
    for models_dir, read_only in dirs.search_order:
        candidates = [model_path(models_dir, card.model_id)]
        if read_only:
            candidates += hf_cache_snapshots(hf_cache_repo_path(models_dir, card.model_id))
        for candidate in candidates:
            try:
                index = json.loads((candidate / INDEX_NAME).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(index, dict):
                return index
    return None


def required_local_files(dirs: ModelDirs, card: ModelCard, start_layer: int, end_layer: int) -> set[str]:
    if ModelFormat.MLX not in card.formats:  # llama.cpp loads the whole file, whatever layers a node serves
        return {GGUF_NAME}
    index = _local_index(dirs, card)
    if index is None:
        return {CONFIG_NAME, SINGLE_WEIGHTS_NAME}
    try:
        weights = files_for_layer_range(index, card.num_layers, start_layer, end_layer)
    except ValueError:
        return {CONFIG_NAME, INDEX_NAME, SINGLE_WEIGHTS_NAME}  # an unusable index: nothing counts as complete
    return {CONFIG_NAME, INDEX_NAME, *weights}


def find_shard(dirs: ModelDirs, card: ModelCard, start_layer: int, end_layer: int) -> tuple[Found, int] | None:
    """The first complete copy of what layers `[start_layer, end_layer)` need, and those files' bytes."""
    required = required_local_files(dirs, card, start_layer, end_layer)
    found = find_model(dirs, card.model_id, required)
    if found is None:
        return None
    size = 0
    for name in required:
        try:
            size += os.stat(file_in(found.path, name)).st_size
        except OSError:
            continue
    return found, size


def weights_size(dirs: ModelDirs, card: ModelCard, model_dir: Path) -> int:
    """Bytes of the whole model's weight files in `model_dir` (a complete copy): its real size on this node."""
    if ModelFormat.MLX not in card.formats:
        manifest = read_manifest(model_dir)
        if manifest is not None:
            return sum(manifest.sizes().values())
        return file_in(model_dir, GGUF_NAME).stat().st_size
    names = required_local_files(dirs, card, 0, card.num_layers)
    return sum(file_in(model_dir, name).stat().st_size for name in names if name.endswith(".safetensors"))
