"""A GGUF file on this node: its header read and checked (`jetshard_schema.gguf_header`) before anything else
reads it. Only the header's pages of the file are touched (a memory map), never the tensors' data."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

from jetshard_schema.gguf_header import (
    GGML_TYPES,
    MAX_HEADER_BYTES,
    MLX_TENSOR_TYPES,
    GgufHeader,
    NeedMoreBytes,
    parse_gguf_header,
)

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_gguf_header(
    path: Path, *, tensor_types: frozenset[int] = frozenset(GGML_TYPES), reader: str = "llama.cpp"
) -> GgufHeader:
    """The header of the GGUF file at `path`; ValueError naming the problem when it is not one `reader` reads
    (a FIFO or a device is not: opened without blocking, it is refused before any read), OSError when it cannot
    be read. The walk stops at `MAX_HEADER_BYTES`, whatever the counts in the header and the file's size."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"it is {_KINDS.get(stat.S_IFMT(status.st_mode), 'something')}, not a regular file")
        if status.st_size < 24:
            raise ValueError(f"the file has {status.st_size} bytes, fewer than a GGUF header")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)[:MAX_HEADER_BYTES]
            try:
                return parse_gguf_header(view, status.st_size, tensor_types=tensor_types, reader_name=reader)
            except NeedMoreBytes as more:
                raise ValueError(
                    f"its GGUF header is longer than {MAX_HEADER_BYTES >> 20} MiB (it runs past byte {more.size}); "
                    "no model llama.cpp loads has one that long"
                ) from None
            finally:
                view.release()
    finally:
        os.close(fd)


def check_gguf_header(path: Path) -> None:
    """Raise ValueError unless `path` is a GGUF file that mlx's reader can walk without crashing: header, metadata
    and tensors within the file, every tensor of a type it knows."""
    read_gguf_header(path, tensor_types=MLX_TENSOR_TYPES, reader="mlx")
