"""Load one contiguous layer range of an mlx-lm model, and run it.

The model object is mlx-lm's own class for the architecture (so the layers are exactly
mlx-lm's), but `model.model.layers` holds only the owned layers and the embedding, final
norm and lm_head exist only on the ranks that need them. The forward pass is ours, because
mlx-lm's `Model.__call__` always runs embedding -> all layers -> head.

A vision model (an MLX checkpoint of mlx-vlm's layout: `language_model.*`, `vision_model.*`, `connector.*`) is
its language model, loaded the same way from `text_config`, plus, on the first rank only, mlx-vlm's vision tower
and projector, which turn a prompt's images into embeddings in place of their tokens. The other ranks see only
hidden states, as for any model.
"""

from __future__ import annotations

import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from jetshard_schema.cards import VISION_ARCHITECTURES
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear
from mlx.utils import tree_flatten, tree_unflatten

from jetshard_worker import library_boundary
from jetshard_worker.library_boundary import (
    create_attention_mask,
    infer_quant_config,
    load_config,
    make_prompt_cache,
    prompt_embeddings,
    vision_model,
    vision_weights,
)

ProgressCallback = Callable[[int, int], None]

# The modules (after mlx-lm's remapping, e.g. mistral -> llama) whose decoder forward is
# embed -> [scale] -> layers(h, mask, cache) -> norm -> lm_head | tied embedding, and the
# embedding scale their `__call__` applies. Others may add state our forward would skip
# (softcapping, per-layer inputs, ...), so they are refused rather than silently wrong.
_EMBED_SCALE: dict[str, Callable[[mx.array, Any], mx.array] | None] = {
    "llama": None,
    "qwen2": None,
    "qwen3": None,
    "gemma": lambda h, args: h * (args.hidden_size**0.5),
}

HOLDABLE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
"""The dtypes a shard's weights can be converted to at load."""
# mlx's sharded linears of a quantized model (tensor parallelism), which are no QuantizedLinear.
_QuantizedSlice = QuantizedAllToShardedLinear | QuantizedShardedToAllLinear

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_ANY_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LANGUAGE_MODEL = "language_model."
"""A vision checkpoint's language model tensors; the others are its vision tower's and projector's."""


@dataclass
class Shard:
    model: nn.Module
    config: dict[str, Any]
    arch: str
    start_layer: int
    end_layer: int
    num_layers: int
    tied_embeddings: bool
    eos_token_ids: frozenset[int]
    loaded_tensors: frozenset[str] = field(default_factory=frozenset)
    weights_dtype: str = ""
    """What the weights are held as: `float32`, `bfloat16`, `4-bit affine`..."""
    activation_dtype: mx.Dtype = mx.float32
    """What the layers compute in: hidden states from a rank holding another dtype are cast to it on arrival."""
    tensor_rank: int = 0
    tensor_ranks: int = 1
    """Tensor parallelism: every layer is split across `tensor_ranks` ranks, this one holding slice `tensor_rank`
    (1: the layers are whole)."""
    has_head: bool = True
    """Whether it holds the final norm and the head: the last pipeline rank, or the last tensor rank (which alone
    samples)."""
    vision_config: dict[str, Any] | None = None
    """A vision model's whole config.json (`config` is its language model's); None for a text model."""
    vision: nn.Module | None = None
    """On a vision model's first rank: mlx-vlm's model holding the vision tower and projector, its language model
    reduced to this shard's embedding (all mlx-vlm reads of it when it merges image features)."""

    @property
    def takes_images(self) -> bool:
        return self.vision_config is not None

    @property
    def image_token_id(self) -> int | None:
        """The token a vision model's processor writes for each of an image's features; None for a text model."""
        if self.vision_config is None:
            return None
        token = self.vision_config.get("image_token_index", self.vision_config.get("image_token_id"))
        return None if token is None else int(token)

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.num_layers

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.model.layers

    def make_cache(self) -> list[Any]:
        # The model's own make_cache (sliding-window layers...) iterates model.layers, which now
        # are the owned layers only, so the cache list lines up with them.
        return make_prompt_cache(self.model)

    def embed(self, tokens: mx.array) -> mx.array:
        if not self.is_first:
            raise ValueError(f"shard [{self.start_layer}, {self.end_layer}) has no embedding input")
        h = self.model.model.embed_tokens(tokens)
        scale = _EMBED_SCALE[self.arch]
        return h if scale is None else scale(h, self.model.model.args)

    def arrived(self, h: mx.array) -> mx.array:
        """Hidden states from the previous rank, in this rank's activation dtype. Ranks may hold different dtypes
        (float32 on a CPU with a fast BLAS beside bfloat16 on a GPU): each sends its output as it computed it, the
        step header names that dtype, and the receiver casts. Uncast, a bfloat16 rank fed float32 states would
        compute and keep its KV cache in float32 by promotion: twice the memory placement counted for it."""
        return h if h.dtype == self.activation_dtype else h.astype(self.activation_dtype)

    def embed_prompt(self, input_ids: mx.array, inputs: Mapping[str, mx.array]) -> mx.array:
        """A prompt's input embeddings (1, L, hidden) with its images' features in place of their tokens: `inputs`
        are the processor's arrays besides `input_ids` (1, L) (pixel values...)."""
        if self.vision is None:
            raise ValueError(f"shard [{self.start_layer}, {self.end_layer}) has no vision tower")
        return prompt_embeddings(self.vision, input_ids, inputs)

    def run_layers(self, h: mx.array, cache: list[Any]) -> mx.array:
        sliding_window = getattr(self.model.model, "sliding_window", None)
        masks: dict[bool, Any] = {}
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            sliding = bool(getattr(layer, "use_sliding", False))
            if sliding not in masks:
                window = sliding_window if sliding else None
                masks[sliding] = create_attention_mask(h, layer_cache, window_size=window)
            h = layer(h, masks[sliding], layer_cache)
        return h

    def final_norm(self, h: mx.array) -> mx.array:
        """The last layer's output as the head sees it: what an embedding pools."""
        if not self.has_head:
            raise ValueError(f"shard [{self.start_layer}, {self.end_layer}) has no final norm")
        return self.model.model.norm(h)

    def head(self, h: mx.array) -> mx.array:
        if not self.has_head:
            raise ValueError(f"shard [{self.start_layer}, {self.end_layer}) has no lm_head")
        h = self.final_norm(h)
        if self.tied_embeddings:
            return self.model.model.embed_tokens.as_linear(h)
        return self.model.lm_head(h)


def load_shard(
    model_dir: Path,
    start_layer: int,
    end_layer: int | None,
    on_progress: ProgressCallback | None = None,
    *,
    dtype: mx.Dtype | None = None,
    tensor_group: mx.distributed.Group | None = None,
) -> Shard:
    """Build the mlx-lm model of `model_dir` holding layers `[start_layer, end_layer)` only (`end_layer` None: to
    the last), reading only the tensors that range needs. `dtype` (None: the checkpoint's own) dequantizes quantized
    layers and casts the other floating weights to it: float32 on a CPU with a fast BLAS, which multiplies that
    several times faster than quantized kernels; bfloat16 or float16 for a full-precision checkpoint on a GPU.
    With a `tensor_group` of several ranks this rank keeps only its slice of each layer (see `split_every_layer`)."""
    if dtype is not None and dtype not in HOLDABLE_DTYPES:
        raise ValueError(f"weights can be held as {', '.join(map(str, HOLDABLE_DTYPES))}, not {dtype}")
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    full_config = config if config.get("model_type") in VISION_ARCHITECTURES else None
    if full_config is not None:
        config = _language_config(full_config)
    model_class, args_class = model_classes(config)
    arch = model_class.__module__.rsplit(".", 1)[-1]
    # Parameters are created lazily, so building all layers costs no memory: the ones we drop
    # are never evaluated.
    model = model_class(args_class.from_dict(config))
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), list):
        raise ValueError(f"mlx-lm module {arch!r} has no decoder layer list at model.model.layers")
    num_layers = len(inner.layers)
    if end_layer is None:
        end_layer = num_layers
    if not 0 <= start_layer < end_layer <= num_layers:
        raise ValueError(
            f"layer range [{start_layer}, {end_layer}) is not a non-empty range within the model's {num_layers} layers"
        )
    tied = "lm_head" not in model
    # `is_last`: holds the final norm and the head, which of the tensor ranks only the last needs.
    is_first, is_last = start_layer == 0, end_layer == num_layers and _samples(tensor_group)
    wants_embedding = is_first or (is_last and tied)

    def needed(name: str) -> bool:
        match = _ANY_LAYER_KEY.search(name)
        if match:
            return start_layer <= int(match.group(1)) < end_layer
        if "embed_tokens" in name:
            return wants_embedding
        return is_last  # final norm, lm_head

    if full_config is None:
        weights = _read_weights(model_dir, needed)
        tower: dict[str, mx.array] = {}
    else:
        # The vision tower and projector feed the embeddings: only the first rank runs them.
        raw = _read_weights(
            model_dir, lambda name: needed(_language_name(name)) if name.startswith(_LANGUAGE_MODEL) else is_first
        )
        weights = {_language_name(name): value for name, value in raw.items() if name.startswith(_LANGUAGE_MODEL)}
        tower = {name: value for name, value in raw.items() if not name.startswith(_LANGUAGE_MODEL)}
    loaded = frozenset(weights) | frozenset(tower)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights

    quantization = config.get("quantization")
    if quantization is None and config.get("quantization_config"):
        raise ValueError(
            "checkpoints with a 'quantization_config' only (AWQ, GPTQ, fp8...) are not supported by the "
            "shard engine; convert them with mlx_lm.convert first"
        )
    if quantization is not None:
        _quantize(model, config, quantization, weights, needed)

    inner.layers = inner.layers[start_layer:end_layer]
    if not wants_embedding:
        del inner["embed_tokens"]
    if not is_last:
        del inner["norm"]
        if not tied:
            del model["lm_head"]
    model.eval()
    model.load_weights(list(_renumber(weights, start_layer).items()), strict=True)
    vision = None if full_config is None or not is_first else _load_vision(full_config, tower)
    if dtype is not None:
        # Lazy: each layer is dequantized as the loop below evaluates it, so the quantized and converted copies
        # of the whole shard never coexist.
        _convert(model, dtype)
        if vision is not None:
            _convert(vision, dtype)
    if vision is not None:
        # Shared once the embedding is final (a converted one replaces a quantized one).
        vision.language_model = _SharedEmbedding(inner.embed_tokens)
    tensor_ranks = 1 if tensor_group is None else tensor_group.size()
    if tensor_ranks > 1:
        assert tensor_group is not None
        split_every_layer(model, config, tensor_group, start_layer, end_layer)
    weights_dtype = _weights_dtype(model)

    total = end_layer - start_layer
    if on_progress is not None:
        on_progress(0, total)
    extra = [m.parameters() for name, m in inner.items() if name != "layers" and isinstance(m, nn.Module)]
    if "lm_head" in model:
        extra.append(model.lm_head.parameters())
    if vision is not None:
        extra += [vision.parameters(), _buffers(vision)]
    mx.eval(extra)
    for done, layer in enumerate(inner.layers, start=1):
        mx.eval(layer.parameters(), _buffers(layer))
        if on_progress is not None:
            on_progress(done, total)

    return Shard(
        model=model,
        config=config,
        arch=arch,
        start_layer=start_layer,
        end_layer=end_layer,
        num_layers=num_layers,
        tied_embeddings=tied,
        eos_token_ids=eos_token_ids(model_dir),
        loaded_tensors=loaded,
        weights_dtype=weights_dtype,
        activation_dtype=_activation_dtype(inner.layers[0]),
        tensor_rank=0 if tensor_group is None else tensor_group.rank(),
        tensor_ranks=tensor_ranks,
        has_head=is_last,
        vision_config=full_config,
        vision=vision,
    )


def _samples(tensor_group: mx.distributed.Group | None) -> bool:
    """Whether this rank of `tensor_group` (None: no tensor parallelism) is the one that samples: the last."""
    return tensor_group is None or tensor_group.rank() == tensor_group.size() - 1


def split_every_layer(
    model: nn.Module, config: Mapping[str, Any], group: mx.distributed.Group, start: int, end: int
) -> None:
    """Tensor parallelism: keep this rank's slice of every layer of `model` (weights still lazy, so only the slices
    are read into memory), whose attention and MLP then sum their outputs over `group` (two all-reduces a layer).
    Every rank holds the whole embedding, the last also the final norm and head. Refused unless the rank holds every
    layer, mlx-lm splits the architecture, and the attention and key/value heads divide evenly over the ranks
    (mlx-lm would silently split them unevenly)."""
    ranks = group.size()
    num_layers = len(model.model.layers)
    if (start, end) != (0, num_layers):
        raise ValueError(f"a tensor-parallel rank holds every layer, not [{start}, {end}) of the model's {num_layers}")
    problem = tensor_split_problem(config, ranks)
    if problem is not None:
        raise ValueError(problem)
    library_boundary.shard_across(model, group)


def tensor_split_problem(config: Mapping[str, Any], ranks: int) -> str | None:
    """Why the model of `config` cannot be split across `ranks` tensor-parallel ranks, or None if it can."""
    model_class, _ = model_classes(config)
    if not library_boundary.splits_across_ranks(model_class):
        return f"mlx-lm cannot split {model_class.__module__.rsplit('.', 1)[-1]!r} models across tensor-parallel ranks"
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % ranks or kv_heads % ranks:
        return (
            f"the model's {heads} attention heads and {kv_heads} key/value heads do not both divide by "
            f"{ranks} tensor-parallel ranks"
        )
    return None


def _language_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision model's language model config, as mlx-lm's class for it takes it, with the checkpoint's
    quantization (mlx-vlm keeps it at the top level). mlx-vlm's language models of these architectures always hold
    an lm_head, so an MLX checkpoint of one carries it even when the original tied it to the embedding."""
    language = config.get("text_config")
    if not isinstance(language, dict):
        raise ValueError(f"vision model type {config['model_type']!r} without a 'text_config' object")
    quantization = {key: config[key] for key in ("quantization", "quantization_config") if key in config}
    return {**language, **quantization, "tie_word_embeddings": False}


def _language_name(name: str) -> str:
    """A vision checkpoint's language model tensor under the name mlx-lm's model has for it."""
    rest = name.removeprefix(_LANGUAGE_MODEL)
    return rest if rest.startswith("lm_head.") else f"model.{rest}"


class _SharedEmbedding(nn.Module):
    """All of its language model mlx-vlm's vision model reads when it merges image features: the embedding, here
    the shard's own (so it is held once)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens


def _load_vision(config: dict[str, Any], tower: dict[str, mx.array]) -> nn.Module:
    """mlx-vlm's model for `config` holding the checkpoint's vision tower and projector (`tower`), quantized
    where the checkpoint is, without its language model."""
    vision = vision_model(config)
    del vision["language_model"]
    tower = vision_weights(vision, tower)
    quantization = config.get("quantization")
    if quantization is not None and any(name.endswith(".scales") for name in tower):
        nn.quantize(
            vision,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda path, module: hasattr(module, "to_quantized") and f"{path}.scales" in tower,
        )
    vision.eval()
    vision.load_weights(list(tower.items()), strict=True)
    return vision


def model_classes(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's model class and its arguments class for `config` (a vision model's: its language model's), found
    as mlx-lm's loader finds them. An architecture the shard engine's forward pass does not know is refused."""
    if config.get("model_type") in VISION_ARCHITECTURES:
        config = _language_config(dict(config))
    try:
        model_class, args_class = library_boundary.model_classes(config)
    except ValueError:  # mlx-lm has no module for the model type
        module = "no mlx-lm module"
    else:
        module_name = model_class.__module__.rsplit(".", 1)[-1]
        if module_name in _EMBED_SCALE:
            return model_class, args_class
        module = f"mlx-lm module {module_name!r}"
    raise ValueError(
        f"model type {config['model_type']!r} ({module}) is not supported by the shard engine; "
        f"supported: {sorted(_EMBED_SCALE)}"
    )


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The union of config.json's and generation_config.json's eos ids (mlx-lm keeps only one)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            if name == "config.json":
                raise ValueError(f"{path} is not valid JSON: {exc}") from exc
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _read_weights(model_dir: Path, needed: Callable[[str], bool]) -> dict[str, mx.array]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted({file for name, file in weight_map.items() if needed(name)})
    else:
        files = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors holding the needed tensors in {model_dir}")
    weights: dict[str, mx.array] = {}
    for file in files:
        # mx.load maps the file lazily: tensors we drop here are never read.
        tensors = mx.load(str(model_dir / file))
        assert isinstance(tensors, dict)  # safetensors always load as a name -> array mapping
        for name, value in tensors.items():
            if needed(name):
                weights[name] = value
    return weights


def _quantize(
    model: nn.Module,
    config: dict[str, Any],
    quantization: dict[str, Any],
    weights: dict[str, mx.array],
    needed: Callable[[str], bool],
) -> None:
    # Mirrors mlx_lm.utils.load_model's predicate, on global module paths (the layers are not
    # renumbered yet), skipping modules this rank drops anyway.
    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not needed(path + "."):
            return False
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        # Only some layers hold an nvfp4 tensor scale: those whose to_quantized takes one.
        if f"{path}.global_scale" in weights and "global_scale" in inspect.signature(module.to_quantized).parameters:
            params["global_scale"] = True
        return params

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def _convert(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized linear and embedding layers by plain ones holding the dequantized weights in `dtype`, and
    cast the remaining floating parameters (norms, unquantized layers) to `dtype`."""
    replaced: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        # Scales and biases are widened first: mx.dequantize computes in the scales' dtype, and a 16-bit
        # product would round every weight to 16 bits again.
        biases = module.get("biases")
        weight = mx.dequantize(
            module.weight,
            module.scales.astype(mx.float32),
            None if biases is None else biases.astype(mx.float32),
            module.group_size,
            module.bits,
            module.mode,
            global_scale=module.get("global_scale"),
        )
        out_dims, in_dims = weight.shape
        plain: nn.Module
        if isinstance(module, nn.QuantizedLinear):
            plain = nn.Linear(in_dims, out_dims, bias="bias" in module)
            if "bias" in module:
                plain.bias = module.bias
        else:
            plain = nn.Embedding(out_dims, in_dims)
        plain.weight = weight.astype(dtype)
        replaced.append((name, plain))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    model.apply(lambda x: x.astype(dtype) if x.dtype in HOLDABLE_DTYPES else x)


def _activation_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a decoder layer computes in: that of most of its floating parameters (a quantized layer's scales
    are in it; its packed weights are integers)."""
    parameters: list[tuple[str, mx.array]] = tree_flatten(layer.parameters())  # type: ignore[assignment]
    sizes: Counter[mx.Dtype] = Counter()
    for _, p in parameters:
        if mx.issubdtype(p.dtype, mx.floating):
            sizes[p.dtype] += p.size
    return sizes.most_common(1)[0][0] if sizes else mx.float32


def _buffers(module: nn.Module) -> list[mx.array]:
    """Arrays a module keeps outside its parameters, under a private name (mlx-lm's `Llama3RoPE._freqs`, which
    every Llama 3.x checkpoint has). Left lazy they belong to the loading thread's stream, and the engine's thread
    cannot evaluate them: its first forward pass fails ("There is no Stream(cpu, 0) in current thread")."""
    return [
        value
        for _, m in module.named_modules()
        for key, value in m.items()
        if key.startswith("_") and isinstance(value, mx.array)  # parameters() leaves out private keys
    ]


def _weights_dtype(model: nn.Module) -> str:
    quantized = {
        f"{m.bits}-bit {m.mode}"
        for _, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding | _QuantizedSlice)
    }
    if quantized:
        return ", ".join(sorted(quantized))
    parameters: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    floating = {str(p.dtype).removeprefix("mlx.core.") for _, p in parameters if mx.issubdtype(p.dtype, mx.floating)}
    return ", ".join(sorted(floating))


def _renumber(weights: dict[str, mx.array], start_layer: int) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        match = _LAYER_KEY.match(name)
        if match:
            name = f"model.layers.{int(match.group(1)) - start_layer}.{name[match.end() :]}"
        elif _ANY_LAYER_KEY.search(name):
            raise ValueError(f"layer tensor {name!r} is not under model.layers; unsupported layout")
        out[name] = value
    return out
