"""A GGUF file's header: its metadata and tensor infos, read from the file's first bytes, each checked against the
file's size. Pure: it reads a bytes-like prefix of the file and never the tensors' data.

Readers downstream trust what they find: mlx's gguflib reads far past its memory map on a tensor count of 2**62
or a string length near 2**63 (SIGSEGV), trips an assertion on an n_dims above its limit (SIGABRT), divides by
zero on an unknown tensor type or an alignment of 0; llama.cpp refuses such a file only once it is loading it on
a node. So every read here is bounded by the file's size and every value by what those readers hold, and a file
that fails is refused with a ValueError naming the problem.

The header is read from a prefix: where the prefix ends before the header does (a Hub file fetched with a Range
request), `NeedMoreBytes` says how far to read; where the *file* ends first, it is truncated (ValueError).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
"""Version 1 stored counts and lengths in 32 bits; gguflib and llama.cpp read only 2 and 3."""
MAX_DIMS = 4  # GGML_MAX_DIMS
INT_MAX = 2**31 - 1
"""mlx holds string lengths, array lengths and dimensions in a C int."""

_UINT32, _STRING, _ARRAY = 4, 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", _UINT32: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q"}
_SCALAR_FORMATS[12] = "<d"
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
"""The ggml tensor types llama.cpp reads: type -> (name, weights per block, bytes per block), as gguf-py 0.19.0's
GGML_QUANT_SIZES (the version llama-cpp-python 0.3.36's llama.cpp tree vendors) gives them."""
MLX_TENSOR_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 24, 25, 26, 30})
"""The ggml types mlx's GGUF reader accepts without dividing by zero (it converts fewer: see `gguf_card`)."""

_ALIGNMENT_KEY = "general.alignment"
# The fewest bytes one entry can take: a tensor info with an empty name and one dimension, a key-value pair with
# an empty key and a one-byte value.
_SMALLEST_TENSOR_INFO = 8 + 4 + 8 + 4 + 8
_SMALLEST_METADATA = 8 + 4 + 1
_DEFAULT_ALIGNMENT = 32
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 17
"""The largest GGUFs hold a few thousand tensors (a mixture of experts keeps each layer's experts in one); a count
beyond this is a file made to be walked, refused before the walk builds a table of it."""
MAX_METADATA = 1 << 14
"""Real files carry some tens of metadata keys (a vocabulary is one key, an array)."""
"""A header longer than this is refused, however large its file: the largest real ones (vocabularies of 260,000
tokens) are some 15 MiB, and every count a header claims is bounded only by the file's size, which a sparse file
(or a link to a disk) makes as large as it likes."""
MAX_KEPT_ARRAY = 1 << 16
"""Numeric arrays up to this long are kept (per-layer head counts); longer ones (token scores, merges) only
counted, as string arrays always are: a card needs their length, not their items."""


class NeedMoreBytes(Exception):
    """The prefix read so far ends inside the header: read at least `size` bytes of the file."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the header continues past byte {size}")
        self.size = size


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array: its item type and length, and its items where they are numbers and few."""

    item_type: int
    length: int
    items: tuple[int | float | bool, ...] | None = None


MetadataValue = int | float | bool | str | ArrayInfo


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    elements: int
    """The product of `shape`: the weights it holds."""
    offset: int
    """From the start of the data section."""
    size_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, MetadataValue]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    """Where the tensors' data begins (the header's end, aligned)."""
    file_size: int
    tensor_types: frozenset[int] = field(default_factory=frozenset)

    def text(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    def integer(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Reader:
    """Little-endian reads from a prefix of a file of `file_size` bytes, each refused when it would end past the
    file, and interrupted (`NeedMoreBytes`) when it would end past the prefix."""

    def __init__(self, data: bytes | memoryview, file_size: int) -> None:
        self.data = data
        self.file_size = file_size
        self.offset = 0

    def skip(self, count: int, what: str) -> int:
        start = self.offset
        if count > self.file_size - start:
            raise ValueError(f"{what} at byte {start} needs {count} bytes, but the file ends at byte {self.file_size}")
        if count > len(self.data) - start:
            raise NeedMoreBytes(start + count)
        self.offset += count
        return start

    def number(self, fmt: str, what: str) -> int:
        value: int = struct.unpack_from(fmt, self.data, self.skip(struct.calcsize(fmt), what))[0]
        return value

    def string(self, what: str) -> str:
        length = self.number("<Q", f"the length of {what}")
        if length > INT_MAX:
            raise ValueError(f"{what} at byte {self.offset - 8} claims a length of {length} bytes")
        start = self.skip(length, what)
        return bytes(self.data[start : start + length]).decode("utf-8", "replace")

    def value(self, value_type: int, what: str) -> MetadataValue:
        if value_type == _STRING:
            return self.string(what)
        if value_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[value_type]
            value: int | float | bool = struct.unpack_from(fmt, self.data, self.skip(_SCALAR_SIZES[value_type], what))[
                0
            ]
            return value
        raise ValueError(f"{what} has unknown value type {value_type}")

    def count(self, what: str, smallest_entry: int, most: int) -> int:
        """A count, refused when that many entries of at least `smallest_entry` bytes cannot fit in the file, or when
        it exceeds `most`."""
        count = self.number("<Q", what)
        room = (self.file_size - self.offset) // smallest_entry
        if count > room:
            raise ValueError(f"{what} is {count}, but the rest of the file has room for at most {room}")
        if count > most:
            raise ValueError(f"{what} is {count}; no model has more than {most}")
        return count


def _array(reader: _Reader, name: str) -> ArrayInfo:
    item_type = reader.number("<I", f"the item type of {name}")
    if item_type == _ARRAY:
        raise ValueError(f"{name} is an array of arrays, which jetshard does not read")
    if item_type != _STRING and item_type not in _SCALAR_SIZES:
        raise ValueError(f"{name} has items of unknown value type {item_type}")
    smallest = 8 if item_type == _STRING else _SCALAR_SIZES[item_type]
    length = reader.count(f"the length of {name}", smallest, INT_MAX)
    if item_type == _STRING:
        for j in range(length):
            reader.string(f"item {j} of {name}")
        return ArrayInfo(item_type, length)
    start = reader.skip(smallest * length, f"the items of {name}")
    if length > MAX_KEPT_ARRAY:
        return ArrayInfo(item_type, length)
    fmt = "<" + _SCALAR_FORMATS[item_type][1] * length
    return ArrayInfo(item_type, length, tuple(struct.unpack_from(fmt, reader.data, start)))


def _metadata(reader: _Reader, count: int) -> tuple[dict[str, MetadataValue], int]:
    """Read `count` metadata key-value pairs; returns them and the data alignment they set."""
    metadata: dict[str, MetadataValue] = {}
    alignment = _DEFAULT_ALIGNMENT
    for i in range(count):
        name = reader.string(f"metadata key {i}")
        if name in metadata:
            raise ValueError(f"metadata key {i} repeats the key {name[:200]!r}, which llama.cpp refuses")
        value_type = reader.number("<I", f"the type of {name}")
        if value_type == _ARRAY:
            metadata[name] = _array(reader, name)
            continue
        value = reader.value(value_type, name)
        if name == _ALIGNMENT_KEY and value_type == _UINT32:  # gguflib honours only a uint32 alignment
            assert isinstance(value, int)
            if value == 0 or value & (value - 1):
                raise ValueError(f"{name} is {value}, not a power of two")
            alignment = value
        metadata[name] = value
    return metadata, alignment


def _tensor_infos(reader: _Reader, count: int, tensor_types: frozenset[int], reader_name: str) -> list[TensorInfo]:
    tensors = []
    names: set[str] = set()
    for i in range(count):
        name = reader.string(f"the name of tensor {i}")
        if name in names:
            raise ValueError(f"tensor {i} repeats the name {name[:200]!r}, which llama.cpp refuses")
        names.add(name)
        n_dims = reader.number("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        shape = []
        for d in range(n_dims):
            dim = reader.number("<Q", f"dimension {d} of {name}")
            if dim > INT_MAX:
                raise ValueError(f"tensor {name} has a dimension of {dim}")
            shape.append(dim)
        tensor_type = reader.number("<I", f"the type of {name}")
        if tensor_type not in tensor_types:
            raise ValueError(f"tensor {name} has ggml type {tensor_type}, which {reader_name} does not read")
        _, per_block, block_bytes = GGML_TYPES[tensor_type]
        offset = reader.number("<Q", f"the data offset of {name}")
        elements = math.prod(shape)
        tensors.append(
            TensorInfo(name, tensor_type, tuple(shape), elements, offset, -(-elements // per_block) * block_bytes)
        )
    return tensors


def parse_gguf_header(
    data: bytes | memoryview,
    file_size: int,
    *,
    tensor_types: frozenset[int] = frozenset(GGML_TYPES),
    reader_name: str = "llama.cpp",
) -> GgufHeader:
    """The header of a GGUF file of `file_size` bytes whose first bytes are `data`.

    Raises ValueError naming the problem when it is not a GGUF file, its header does not hold together, a tensor
    has a type outside `tensor_types` (which `reader_name` does not read), or a tensor's data runs past the end
    of the file (a truncated file); `NeedMoreBytes` when `data` ends inside the header.
    """
    if file_size < 24:
        raise ValueError(f"the file has {file_size} bytes, fewer than a GGUF header")
    reader = _Reader(data, file_size)
    if bytes(data[:4]) != GGUF_MAGIC:
        if len(data) < 4:
            raise NeedMoreBytes(24)
        raise ValueError("it does not start with the GGUF magic bytes")
    reader.skip(4, "the magic")
    version = reader.number("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
    tensor_count = reader.count("the tensor count", _SMALLEST_TENSOR_INFO, MAX_TENSORS)
    metadata_count = reader.count("the metadata count", _SMALLEST_METADATA, MAX_METADATA)
    metadata, alignment = _metadata(reader, metadata_count)
    tensors = _tensor_infos(reader, tensor_count, tensor_types, reader_name)
    data_start = -(-reader.offset // alignment) * alignment
    for tensor in tensors:
        if data_start + tensor.offset + tensor.size_bytes > file_size:
            raise ValueError(
                f"tensor {tensor.name} ({tensor.size_bytes} bytes at byte {data_start + tensor.offset}) runs past "
                f"the end of the file at byte {file_size}: the file is truncated"
            )
    return GgufHeader(
        version=version,
        metadata=metadata,
        tensors=tuple(tensors),
        data_start=data_start,
        file_size=file_size,
        tensor_types=frozenset(t.ggml_type for t in tensors),
    )
