"""A Llama-3.2-1B-shaped GGUF with random weights, quantized with the llama.cpp build's `llama-quantize`.

Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads over 8 key/value heads (head 64), FFN 8192, a 128256-token
vocabulary and the output projection tied to the embedding. The vocabulary is the demo SmolLM2 tokenizer's 49152
tokens padded with filler tokens to 128256 (Llama 3's own tokenizer is not installed anywhere): what the
model costs to run depends on its shape, not on which tokens it has, and prompts tokenize as for SmolLM2.

The float16 file (~2.5 GB) is written once, quantized to every file type asked for, then deleted; the quantized
files stay in the bench cache (`bench_cache_dir()`, ~0.7-0.8 GB each).

    uv run --group dev python bench/gguf_models.py   # makes Q4_0 and Q4_K_M (a few minutes), prints their paths
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _common import bench_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.gguf_models import Shape, file_type_of, quantize, write_gguf

LLAMA_1B_SHAPE = Shape(
    arch="llama",
    layers=16,
    hidden=2048,
    heads=32,
    kv_heads=8,
    head_dim=64,
    ffn=8192,
    context=131072,
    rope_freq_base=500000.0,
    rms_eps=1e-5,
)
LLAMA_1B_VOCAB = 128256
LLAMA_1B_FILE_TYPES = ("Q4_0", "Q4_K_M")


def llama_1b_path(file_type: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or bench_cache_dir()) / f"llama-3.2-1b-shape-{file_type}.gguf"


def llama_1b_ggufs(
    file_types: Sequence[str] = LLAMA_1B_FILE_TYPES, cache_dir: Path | None = None, log: Callable[[str], None] = print
) -> dict[str, Path]:
    """The 1B-shaped model as each of `file_types`, made (all from one float16 file) where not cached yet."""
    paths = {file_type: llama_1b_path(file_type, cache_dir) for file_type in file_types}
    missing = [file_type for file_type, path in paths.items() if not path.exists()]
    if missing:
        f16 = llama_1b_path("F16", cache_dir)
        try:
            if not f16.exists():
                log(f"writing {f16} (random weights, ~2.5 GB)…")
                started = time.monotonic()
                write_gguf(f16, LLAMA_1B_SHAPE, vocab_size=LLAMA_1B_VOCAB, name="Llama-3.2-1B shape, random weights")
                log(f"  written in {time.monotonic() - started:.0f} s")
            for file_type in missing:
                log(f"quantizing to {file_type}…")
                started = time.monotonic()
                quantize(f16, paths[file_type], file_type)
                log(f"  {paths[file_type]} in {time.monotonic() - started:.0f} s")
        finally:
            f16.unlink(missing_ok=True)
    for file_type, path in paths.items():
        if file_type_of(path) != file_type:
            raise RuntimeError(f"{path} holds {file_type_of(path)}, not {file_type}: delete it to make it again")
    return paths


def main() -> None:
    for file_type, path in llama_1b_ggufs().items():
        print(f"{file_type}: {path} ({path.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
