"""A GGUF file's header, metadata and tensor infos checked against the file's size before mlx reads it.

mlx's reader (gguflib) trusts every count, length and offset it finds: a tensor count of 2**62 or a string
length near 2**63 sends it reading far past the end of its memory map (SIGSEGV), an n_dims above its limit
trips an assertion (SIGABRT), an unknown tensor type or an alignment of 0 would divide by zero. Any of these
kills the process that converts (the CLI, a downloader) with no message. So the file is walked here first,
every read bounded by the file's size and every value by what gguflib and mlx hold, and a file that fails
is refused with a ValueError that names the problem.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

GGUF_MAGIC = b"GGUF"
# Version 1 stored counts and lengths in 32 bits; gguflib reads every version as 2/3.
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
_INT_MAX = 2**31 - 1  # mlx holds string lengths, array lengths and dimensions in a C int

_UINT32, _STRING, _ARRAY = 4, 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, _UINT32: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# The ggml tensor types mlx reads: type -> (name, weights per block, bytes per block).
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    30: ("BF16", 1, 2),
}
_ALIGNMENT_KEY = b"general.alignment"
# The fewest bytes one entry can take: a tensor info with an empty name and one dimension, a key-value pair
# with an empty key and a one-byte value.
_SMALLEST_TENSOR_INFO = 8 + 4 + 8 + 4 + 8
_SMALLEST_METADATA = 8 + 4 + 1
_DEFAULT_ALIGNMENT = 32


class _Reader:
    """Little-endian reads from a memory map, each refused when it would end past the file."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0

    def skip(self, count: int, what: str) -> int:
        start = self.offset
        if count > len(self.data) - start:
            raise ValueError(f"{what} at byte {start} needs {count} bytes, but the file ends at byte {len(self.data)}")
        self.offset += count
        return start

    def number(self, fmt: str, what: str) -> int:
        value: int = struct.unpack_from(fmt, self.data, self.skip(struct.calcsize(fmt), what))[0]
        return value

    def string(self, what: str) -> bytes:
        length = self.number("<Q", f"the length of {what}")
        if length > _INT_MAX:
            raise ValueError(f"{what} at byte {self.offset - 8} claims a length of {length} bytes")
        start = self.skip(length, what)
        return self.data[start : start + length]

    def value(self, value_type: int, what: str) -> None:
        if value_type == _STRING:
            self.string(what)
        elif value_type in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[value_type], what)
        else:
            raise ValueError(f"{what} has unknown value type {value_type}")


def _count(reader: _Reader, what: str, smallest_entry: int) -> int:
    """A count read from the file, refused when that many entries of at least `smallest_entry` bytes each
    cannot fit in the rest of it."""
    count = reader.number("<Q", what)
    room = (len(reader.data) - reader.offset) // smallest_entry
    if count > room:
        raise ValueError(f"{what} is {count}, but the rest of the file has room for at most {room}")
    return count


def _metadata(reader: _Reader, count: int) -> int:
    """Walk `count` metadata key-value pairs; returns the data alignment they set."""
    alignment = _DEFAULT_ALIGNMENT
    for i in range(count):
        key = reader.string(f"metadata key {i}")
        name = key.decode("utf-8", "replace")
        value_type = reader.number("<I", f"the type of {name}")
        if value_type == _ARRAY:
            item_type = reader.number("<I", f"the item type of {name}")
            if item_type == _ARRAY:
                raise ValueError(f"{name} is an array of arrays, which mlx does not read")
            if item_type != _STRING and item_type not in _SCALAR_SIZES:
                raise ValueError(f"{name} has items of unknown value type {item_type}")
            smallest = 8 if item_type == _STRING else _SCALAR_SIZES[item_type]
            length = _count(reader, f"the length of {name}", smallest)
            if length > _INT_MAX:
                raise ValueError(f"{name} claims {length} items")
            if item_type == _STRING:
                for j in range(length):
                    reader.string(f"item {j} of {name}")
            else:
                reader.skip(smallest * length, f"the items of {name}")
        elif key == _ALIGNMENT_KEY and value_type == _UINT32:  # gguflib honours only a uint32 alignment
            alignment = reader.number("<I", name)
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"{name} is {alignment}, not a power of two")
        else:
            reader.value(value_type, name)
    return alignment


def _tensor_infos(reader: _Reader, count: int) -> list[tuple[str, int, int]]:
    """Walk `count` tensor infos; returns (name, offset in the data section, bytes) of each tensor."""
    tensors = []
    for i in range(count):
        name = reader.string(f"the name of tensor {i}").decode("utf-8", "replace")
        n_dims = reader.number("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        weights = 1
        for d in range(n_dims):
            dim = reader.number("<Q", f"dimension {d} of {name}")
            if dim > _INT_MAX:
                raise ValueError(f"tensor {name} has a dimension of {dim}")
            weights *= dim
        tensor_type = reader.number("<I", f"the type of {name}")
        if tensor_type not in TENSOR_TYPES:
            raise ValueError(f"tensor {name} has ggml type {tensor_type}, which mlx does not read")
        _, per_block, block_bytes = TENSOR_TYPES[tensor_type]
        offset = reader.number("<Q", f"the data offset of {name}")
        tensors.append((name, offset, -(-weights // per_block) * block_bytes))
    return tensors


def check_gguf_header(path: Path) -> None:
    """Raise ValueError unless `path` is a GGUF file whose header, metadata and tensors all lie within it."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"the file has {size} bytes, fewer than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            reader = _Reader(data)
            if reader.data[:4] != GGUF_MAGIC:
                raise ValueError("it does not start with the GGUF magic bytes")
            reader.skip(4, "the magic")
            version = reader.number("<I", "the version")
            if version not in SUPPORTED_VERSIONS:
                raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
            tensor_count = _count(reader, "the tensor count", _SMALLEST_TENSOR_INFO)
            metadata_count = _count(reader, "the metadata count", _SMALLEST_METADATA)
            alignment = _metadata(reader, metadata_count)
            tensors = _tensor_infos(reader, tensor_count)
            data_start = -(-reader.offset // alignment) * alignment
            for name, offset, length in tensors:
                if data_start + offset + length > size:
                    raise ValueError(
                        f"tensor {name} ({length} bytes at byte {data_start + offset}) runs past the end of the file "
                        f"at byte {size}"
                    )
