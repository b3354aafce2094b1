"""Which repo files a shard (a layer range `[start_layer, end_layer)`) needs.

Weights: a tensor belongs to layer n when its name has a `layers.<n>.` component (`model.layers.12.mlp...`,
`backbone.layers.3...`, `language_model.model.layers.0...`). Only the layer stack of the language model
counts: when an index has several stacks (a vision tower's `encoder.layers.<n>`), the stack whose layer
numbers cover `num_layers` (else the one with most layers) is the language model's, and tensors of the
other stacks are treated like any other non-layer tensor.

Non-layer tensors: those whose name contains `embed` go to the range starting at layer 0, and so do a vision
model's vision tower and projector (`vision_model.*`, `connector.*`, ...), which feed the embeddings there; every
other (final norm, `lm_head`, rotary buffers) to the range ending at `num_layers`. With tied
embeddings (no `lm_head` tensor) the last range projects through the embedding matrix, so it needs the
embedding's file as well. Layer numbers >= `num_layers` (multi-token-prediction heads some checkpoints
carry) are needed by no range: a shard never runs them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from jetshard_downloader.paths import CONFIG_NAME, INDEX_NAME, SINGLE_WEIGHTS_NAME, check_repo_filename

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_VISION_TOWERS = ("vision_model.", "vision_tower.", "connector.", "multi_modal_projector.", "mm_projector.")
"""A vision model's tensors outside its language model (mlx-vlm's names for them): the first rank runs them."""

SUPPORT_FILE_NAMES = frozenset(
    {
        CONFIG_NAME,
        "generation_config.json",
        INDEX_NAME,
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "tiktoken.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "processor_config.json",
        "preprocessor_config.json",
    }
)
"""Top-level files a runner needs besides weights (a vision model's processor too). An allow-list, so weights in
other formats (*.bin, *.pt, *.gguf, onnx/, ...) and anything else in the repo are never fetched."""

_SUPPORT_SUFFIXES = (".tiktoken",)


def _weight_map(index: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(index, Mapping):
        raise ValueError("safetensors index must be a JSON object")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise ValueError("safetensors index has no 'weight_map' object, or it is empty")
    out: dict[str, str] = {}
    for tensor, filename in weight_map.items():
        if not isinstance(tensor, str) or not isinstance(filename, str):
            raise ValueError(f"weight_map entry {tensor!r}: {filename!r} is not a pair of strings")
        if not filename.endswith(".safetensors"):
            raise ValueError(f"weight_map maps {tensor!r} to {filename!r}, which is not a .safetensors file")
        out[tensor] = check_repo_filename(filename)
    return out


def _split_layer(name: str) -> tuple[str, int] | None:
    """(stack prefix, layer number) for a layer tensor, None for a non-layer one."""
    m = _LAYER.search(name)
    if m is None:
        return None
    return name[: m.start(1)], int(m.group(1))


def _language_stack(prefix_layers: Mapping[str, set[int]], num_layers: int) -> str | None:
    if not prefix_layers:
        return None
    covering = [p for p, layers in prefix_layers.items() if set(range(num_layers)) <= layers]
    if covering:
        return max(covering, key=lambda p: len(prefix_layers[p]))
    return max(prefix_layers, key=lambda p: len(prefix_layers[p]))


def files_for_layer_range(index: Mapping[str, Any], num_layers: int, start_layer: int, end_layer: int) -> set[str]:
    """The safetensors files holding the tensors layers `[start_layer, end_layer)` need (see module doc)."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    if not 0 <= start_layer < end_layer <= num_layers:
        raise ValueError(f"layer range [{start_layer}, {end_layer}) is not a non-empty range within [0, {num_layers})")
    weight_map = _weight_map(index)

    prefix_layers: dict[str, set[int]] = {}
    for tensor in weight_map:
        split = _split_layer(tensor)
        if split is not None:
            prefix_layers.setdefault(split[0], set()).add(split[1])
    stack = _language_stack(prefix_layers, num_layers)

    is_first = start_layer == 0
    is_last = end_layer == num_layers
    tied = not any("lm_head" in tensor for tensor in weight_map)
    needed: set[str] = set()
    for tensor, filename in weight_map.items():
        split = _split_layer(tensor)
        if split is not None and split[0] == stack:
            if start_layer <= split[1] < end_layer:
                needed.add(filename)
        elif "embed" in tensor or tensor.startswith(_VISION_TOWERS):
            if is_first or (is_last and tied):
                needed.add(filename)
        elif is_last:
            needed.add(filename)
    return needed


def support_files(all_repo_files: Iterable[str]) -> set[str]:
    """The non-weight files of a repo a runner needs: config, generation config, tokenizer, the index."""
    out = set()
    for name in all_repo_files:
        # Top level only: copies in subfolders (onnx/tokenizer.json, original/...) belong to other formats.
        if "/" in name:
            continue
        if name in SUPPORT_FILE_NAMES or name.endswith(_SUPPORT_SUFFIXES):
            out.add(check_repo_filename(name))
    return out


def required_files(
    all_repo_files: Iterable[str],
    index: Mapping[str, Any] | None,
    num_layers: int,
    start_layer: int,
    end_layer: int,
) -> set[str]:
    """Everything a shard needs: support files plus its weight files.

    `index` is the parsed `model.safetensors.index.json`, or None for a single-file model, whose one
    `model.safetensors` every shard needs.
    """
    files = list(all_repo_files)
    needed = support_files(files)
    if index is None:
        if SINGLE_WEIGHTS_NAME not in files:
            raise ValueError(f"repo has neither {INDEX_NAME} nor {SINGLE_WEIGHTS_NAME}")
        if not 0 <= start_layer < end_layer <= num_layers:
            raise ValueError(
                f"layer range [{start_layer}, {end_layer}) is not a non-empty range within [0, {num_layers})"
            )
        needed.add(SINGLE_WEIGHTS_NAME)
    else:
        weights = files_for_layer_range(index, num_layers, start_layer, end_layer)
        missing = weights - set(files)
        if missing:
            raise ValueError(f"{INDEX_NAME} names files the repo does not have: {sorted(missing)}")
        needed |= weights
    return needed
