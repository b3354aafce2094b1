"""A GGUF file on this node: its header read and checked (`jetshard_schema.gguf_header`) before anything else
reads it. Only the header's pages of the file are touched (a memory map), never the tensors' data."""

from __future__ import annotations

import mmap
from pathlib import Path

from jetshard_schema.gguf_header import GGML_TYPES, MLX_TENSOR_TYPES, GgufHeader, parse_gguf_header


def read_gguf_header(
    path: Path, *, tensor_types: frozenset[int] = frozenset(GGML_TYPES), reader: str = "llama.cpp"
) -> GgufHeader:
    """The header of the GGUF file at `path`; ValueError naming the problem when it is not one `reader` reads,
    OSError when it cannot be read."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"the file has {size} bytes, fewer than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            try:
                return parse_gguf_header(view, size, tensor_types=tensor_types, reader_name=reader)
            finally:
                view.release()


def check_gguf_header(path: Path) -> None:
    """Raise ValueError unless `path` is a GGUF file that mlx's reader can walk without crashing: header, metadata
    and tensors within the file, every tensor of a type it knows."""
    read_gguf_header(path, tensor_types=MLX_TENSOR_TYPES, reader="mlx")
