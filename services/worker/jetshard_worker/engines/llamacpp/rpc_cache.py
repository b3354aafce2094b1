"""Fill a helper's `ggml-rpc-server -c` file cache from the helper's own copy of the GGUF, before the leader starts.

With `-c`, the leader's `llama-server --rpc` sends, for each weight tensor over `HASH_THRESHOLD_BYTES`, only the
tensor's 64-bit FNV-1a hash; the rpc-server loads `$LLAMA_CACHE/rpc/<hash as %016x>` if that file exists, and
otherwise receives the bytes and writes that file. Every helper already holds the GGUF, so writing those files here
means the helper's large weights never cross the network (bench/RPC_FACTS.md section 3: mid4-f16 sent 108.8 MB to a
helper with an empty cache, 4.9 MB with a filled one). Tensors at or under the threshold are always sent.

FNV-1a is a serial chain of multiplies (about a second per GB in C, minutes in Python), so it runs in a small C
function compiled once with the system compiler: a node that runs llama.cpp has one, since it compiled llama.cpp.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jetshard_schema.gguf_header import TensorInfo, parse_gguf_header

HASH_THRESHOLD_BYTES = 10 * 2**20
"""ggml-rpc.cpp's HASH_THRESHOLD (`rpc_use_hash_cache`): only a `set_tensor` of strictly more bytes than this into a
WEIGHTS buffer goes by hash; smaller ones always carry their data."""

_FNV1A64_SOURCE = """\
#include <stddef.h>
#include <stdint.h>

uint64_t fnv1a64(const uint8_t *data, size_t size) {
    uint64_t hash = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < size; i++) {
        hash ^= data[i];
        hash *= 0x100000001b3ULL;
    }
    return hash;
}
"""
"""The hash ggml-rpc.cpp's `fnv_hash` computes, over a tensor's bytes."""

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.")
_OUTPUT_LAYER_PREFIXES = ("output.", "output_norm.")
"""llama.cpp's output layer: the final norm and the output projection (with their biases where an architecture has
them)."""

ProgressCallback = Callable[[int, int], None]
"""on_progress(done_bytes, total_bytes) over the bytes of the tensors to hash."""

Fnv1a64 = Callable[[np.ndarray], int]


@dataclass(frozen=True)
class PrefillReport:
    """What `prefill` found and did."""

    files_written: int
    bytes_written: int
    files_present: int
    """Cache files that already existed with the tensor's size, left as they were."""
    bytes_present: int
    bytes_left_to_send: int
    """Bytes of this helper's tensors at or under the threshold: the leader still sends those at every start."""
    seconds: float
    skipped_reason: str | None = None
    """Why nothing was done (no C compiler); llama.cpp then sends the large tensors once and caches them itself."""


def prefill(
    model: Path,
    cache_dir: Path,
    layers: range,
    holds_output: bool,
    library_dir: Path,
    *,
    threshold_bytes: int = HASH_THRESHOLD_BYTES,
    threads: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> PrefillReport:
    """Write `cache_dir/rpc/<fnv1a64:016x>` for each tensor over `threshold_bytes` this helper will hold: blocks
    `layers` of `model`, plus the output layer if `holds_output`. `cache_dir` is the rpc-server's `LLAMA_CACHE`.

    A file that already exists with the tensor's size is kept without reading it (the rpc-server does not verify
    its files either: the name is the content's hash, and files are only ever renamed into place whole). The C hash
    function is compiled into `library_dir` on first use. `threads` tensors are hashed at once (ctypes releases the
    GIL; one FNV chain cannot be split): the machine's CPUs by default."""
    started = time.monotonic()
    if threshold_bytes < 0:
        raise ValueError(f"threshold_bytes must be at least 0, got {threshold_bytes}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    # The header alone, with our own bounded reader: the tensor table is all this needs (gguf-py's reader would read
    # every metadata array, a 128k-token vocabulary included, in Python).
    data = np.memmap(model, dtype=np.uint8, mode="r")
    header = parse_gguf_header(data.data, data.size)
    held = held_tensors(header.tensors, layers, holds_output)
    hashed = [tensor for tensor in held if tensor.size_bytes > threshold_bytes]
    left_to_send = sum(tensor.size_bytes for tensor in held if tensor.size_bytes <= threshold_bytes)
    compiler = shutil.which("cc")
    if compiler is None:
        reason = "no C compiler (`cc`) on PATH to build the FNV-1a hash: the leader will send these tensors once"
        return PrefillReport(0, 0, 0, 0, left_to_send, time.monotonic() - started, skipped_reason=reason)
    fnv1a64 = load_fnv1a64(library_dir, compiler)
    rpc_dir = cache_dir / "rpc"
    rpc_dir.mkdir(parents=True, exist_ok=True)

    def store(tensor: TensorInfo) -> tuple[bool, int]:
        start = header.data_start + tensor.offset
        tensor_bytes = data[start : start + tensor.size_bytes]
        return _store(rpc_dir / f"{fnv1a64(tensor_bytes):016x}", tensor_bytes), tensor.size_bytes

    written = present = bytes_written = bytes_present = done = 0
    total = sum(tensor.size_bytes for tensor in hashed)
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        for was_written, size in pool.map(store, hashed):
            if was_written:
                written, bytes_written = written + 1, bytes_written + size
            else:
                present, bytes_present = present + 1, bytes_present + size
            done += size
            if on_progress is not None:
                on_progress(done, total)
    return PrefillReport(
        written, bytes_written, present, bytes_present, left_to_send, time.monotonic() - started, skipped_reason=None
    )


def held_tensors(tensors: Iterable[TensorInfo], layers: range, holds_output: bool) -> list[TensorInfo]:
    """The tensors llama.cpp loads onto a helper that holds blocks `layers` (and the output layer if
    `holds_output`). A model without `output.weight` ties its output to the embedding: llama.cpp then loads
    `token_embd.weight` a second time as the output, on the device holding the output layer (the leader keeps the
    input copy)."""
    tensors = list(tensors)
    blocks = {int(match.group(1)) for tensor in tensors if (match := _BLOCK_NAME.match(tensor.name))}
    if layers.step != 1:
        raise ValueError(f"layers must be consecutive blocks (step 1), got {layers}")
    if len(layers) == 0 and not holds_output:
        raise ValueError("the helper holds nothing: layers is empty and holds_output is false")
    if len(layers) > 0 and (layers.start < 0 or layers.stop > len(blocks)):
        raise ValueError(f"layers {layers} are outside the model's {len(blocks)} blocks (0 to {len(blocks) - 1})")
    names = {tensor.name for tensor in tensors}
    tied = "output.weight" not in names

    def is_held(name: str) -> bool:
        if (match := _BLOCK_NAME.match(name)) is not None:
            return int(match.group(1)) in layers
        if not holds_output:
            return False
        return name.startswith(_OUTPUT_LAYER_PREFIXES) or (tied and name == "token_embd.weight")

    return [tensor for tensor in tensors if is_held(tensor.name)]


def _store(path: Path, data: np.ndarray) -> bool:
    """Write `data` to `path` unless a file of its size is there; True if written. Written to a temporary name in the
    same directory and renamed, so the rpc-server (or another prefill) never sees a partial file."""
    if path.is_file() and path.stat().st_size == data.nbytes:
        return False
    descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with open(descriptor, "wb") as file:
            file.write(data.data)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return True


@functools.cache
def load_fnv1a64(library_dir: Path, compiler: str) -> Fnv1a64:
    """FNV-1a 64 over a contiguous numpy array's bytes, hashed in place (no copy of a memory-mapped tensor).

    The C source is compiled with `compiler` once into `library_dir/fnv1a64-<source hash>.so` (a changed source gets
    a new name); it is compiled under a temporary name and renamed, so processes compiling at once each rename a
    whole library and none loads a partial one."""
    digest = hashlib.sha256(_FNV1A64_SOURCE.encode()).hexdigest()[:16]
    library = library_dir / f"fnv1a64-{digest}.so"
    if not library.is_file():
        library_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library_dir) as work:
            source, partial = Path(work) / "fnv1a64.c", Path(work) / "fnv1a64.so"
            source.write_text(_FNV1A64_SOURCE)
            command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(source)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling the FNV-1a hash with {compiler} failed:\n{done.stderr[-2000:]}")
            os.replace(partial, library)
    function = ctypes.CDLL(str(library)).fnv1a64
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def fnv1a64(data: np.ndarray) -> int:
        if not data.flags.c_contiguous:
            raise ValueError("fnv1a64 hashes a contiguous array's bytes; this array is a strided view")
        return int(function(data.ctypes.data, data.nbytes))

    return fnv1a64
