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

from jetshard_schema.cards import ModelCard, ModelFormat, ModelSource

from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.locate import Found, find_model, hf_cache_snapshots, is_complete
from jetshard_downloader.manifest import read_manifest
from jetshard_downloader.paths import (
    CONFIG_NAME,
    GGUF_NAME,
    GGUF_SUFFIX,
    INDEX_NAME,
    MMPROJ_NAME,
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


def default_form(card: ModelCard) -> ModelFormat:
    """The form a download that names no engine makes: MLX where the card has it (as before engines), else GGUF."""
    return ModelFormat.MLX if ModelFormat.MLX in card.formats else ModelFormat.GGUF


def sized_form(card: ModelCard) -> ModelFormat:
    """The form whose files are the card's size: the GGUF of a card read from one (its header and file sizes
    are exact, and llama.cpp holds it as it is), else the MLX directory (the packaged demo's size is an
    estimate that its conversion measures, as before engines)."""
    return ModelFormat.GGUF if card.source in (ModelSource.LOCAL_GGUF, ModelSource.HUB_GGUF) else ModelFormat.MLX


def required_local_files(
    dirs: ModelDirs, card: ModelCard, start_layer: int, end_layer: int, form: ModelFormat = ModelFormat.MLX
) -> set[str]:
    if form is ModelFormat.GGUF:  # llama.cpp loads the whole file, whatever layers a node serves
        return {GGUF_NAME}
    index = _local_index(dirs, card)
    if index is None:
        return {CONFIG_NAME, SINGLE_WEIGHTS_NAME}
    try:
        weights = files_for_layer_range(index, card.num_layers, start_layer, end_layer)
    except ValueError:
        return {CONFIG_NAME, INDEX_NAME, SINGLE_WEIGHTS_NAME}  # an unusable index: nothing counts as complete
    return {CONFIG_NAME, INDEX_NAME, *weights}


def find_shard(
    dirs: ModelDirs, card: ModelCard, start_layer: int, end_layer: int, form: ModelFormat = ModelFormat.MLX
) -> tuple[Found, int] | None:
    """The first complete copy in `form` of what layers `[start_layer, end_layer)` need, and those files' bytes."""
    required = required_local_files(dirs, card, start_layer, end_layer, form)
    found = find_model(dirs, card.model_id, required)
    if found is None:
        return None
    names = gguf_files(found.path) if form is ModelFormat.GGUF else required
    size = 0
    for name in names:
        try:
            size += os.stat(file_in(found.path, name)).st_size
        except OSError:
            continue
    return found, size


def complete_forms(
    dirs: ModelDirs, card: ModelCard, found: Found, start_layer: int, end_layer: int
) -> tuple[ModelFormat, ...]:
    """The forms of the card complete in `found`'s directory for layers `[start_layer, end_layer)`."""
    return tuple(
        form
        for form in card.formats
        if is_complete(
            found.path, required_local_files(dirs, card, start_layer, end_layer, form), read_only=found.read_only
        )
    )


def gguf_files(model_dir: Path) -> list[str]:
    """The GGUF files of a model directory: its manifest's (a split model's parts, the projector), else
    `model.gguf` and a projector beside it. `model.gguf` counts through what it names."""
    manifest = read_manifest(model_dir)
    listed = [name for name in manifest.sizes() if name.endswith(GGUF_SUFFIX)] if manifest is not None else []
    if GGUF_NAME not in listed and not any(name != MMPROJ_NAME for name in listed):
        listed.append(GGUF_NAME)
    if manifest is None and file_in(model_dir, MMPROJ_NAME).is_file():
        listed.append(MMPROJ_NAME)
    return listed


def weights_size(dirs: ModelDirs, card: ModelCard, model_dir: Path, form: ModelFormat = ModelFormat.MLX) -> int:
    """Bytes of the whole model's weight files in `form` in `model_dir` (a complete copy): its real size here."""
    if form is ModelFormat.GGUF:
        return sum(file_in(model_dir, name).stat().st_size for name in gguf_files(model_dir))
    names = required_local_files(dirs, card, 0, card.num_layers, form)
    return sum(file_in(model_dir, name).stat().st_size for name in names if name.endswith(".safetensors"))
