"""A helper fills its `ggml-rpc-server -c` cache from its own GGUF (engines/llamacpp/rpc_cache.py): the file names
are llama.cpp's own, so a real rpc-server, given the prefilled cache, takes the leader's hashes and is sent no large
tensor."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers.gguf_models import Shape, llama_server, write_gguf
from jetshard_schema.gguf_header import TensorInfo, parse_gguf_header
from jetshard_worker.engines.llamacpp.rpc_cache import HASH_THRESHOLD_BYTES, held_tensors, load_fnv1a64, prefill
from jetshard_worker.engines.llamacpp.server import free_port

pytestmark = pytest.mark.timeout(120)

# Two blocks whose FFN matrices are 256 x 20736 float16 = 10.6 MB, just over ggml-rpc's 10 MiB, and the demo
# tokenizer's 49152-token embedding (25 MB, tied): 64 MB in all, 7 tensors the rpc-server caches.
WIDE_FFN = Shape("llama", 2, 256, 4, 2, 64, 20736, 4096, 10000.0, 1e-5)
# Two blocks, every tensor small: the selection test lowers the threshold instead.
SMALL = Shape("llama", 2, 256, 4, 2, 64, 512, 4096, 10000.0, 1e-5)


@pytest.fixture(scope="module")
def wide_ffn_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("rpc-cache") / "wide-ffn-f16.gguf", WIDE_FFN, seed=3)


def fnv1a64(data: bytes, library_dir: Path) -> int:
    return load_fnv1a64(library_dir, "cc")(np.frombuffer(data, dtype=np.uint8))


def cache_files(cache_dir: Path) -> dict[str, int]:
    """{file name: size} of an rpc-server cache (`LLAMA_CACHE`)."""
    return {path.name: path.stat().st_size for path in (cache_dir / "rpc").iterdir()}


def test_the_hash_is_fnv1a_64(tmp_path: Path) -> None:
    # The published FNV-1a 64 vectors (isthe.com/chongo/tech/comp/fnv).
    assert f"{fnv1a64(b'', tmp_path):016x}" == "cbf29ce484222325"
    assert f"{fnv1a64(b'a', tmp_path):016x}" == "af63dc4c8601ec8c"
    assert f"{fnv1a64(b'foobar', tmp_path):016x}" == "85944171f73967e8"
    assert [path.suffix for path in tmp_path.iterdir()] == [".so"]  # compiled once, nothing left beside it


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("rpc-cache") / "small-f16.gguf", SMALL)


@pytest.fixture(scope="module")
def small_tensors(small_model: Path) -> list[TensorInfo]:
    return list(parse_gguf_header(small_model.read_bytes(), small_model.stat().st_size).tensors)


@pytest.fixture(scope="module")
def small_bytes(small_model: Path) -> dict[str, bytes]:
    """Each tensor's bytes as gguf-py reads them: a reader of its own, beside the prefill's."""
    return {tensor.name: tensor.data.tobytes() for tensor in gguf.GGUFReader(small_model).tensors}


@pytest.mark.parametrize(
    ("layers", "holds_output", "expected"),
    [
        (range(0, 1), False, ("blk.0.",)),
        (range(1, 2), True, ("blk.1.", "output_norm.weight", "token_embd.weight")),
        (range(0, 2), True, ("blk.", "output_norm.weight", "token_embd.weight")),
        (range(0, 0), True, ("output_norm.weight", "token_embd.weight")),
    ],
)
def test_a_helper_holds_its_blocks_and_the_tied_output(
    layers: range, holds_output: bool, expected: tuple[str, ...], small_tensors: list[TensorInfo]
) -> None:
    assert "output.weight" not in {tensor.name for tensor in small_tensors}  # tied: the embedding is the output
    held = held_tensors(small_tensors, layers, holds_output)
    assert [tensor.name for tensor in held] == [
        tensor.name for tensor in small_tensors if tensor.name.startswith(expected)
    ]


def test_layers_outside_the_model_or_an_empty_helper_are_refused(small_tensors: list[TensorInfo]) -> None:
    with pytest.raises(ValueError, match=r"outside the model's 2 blocks"):
        held_tensors(small_tensors, range(1, 3), False)
    with pytest.raises(ValueError, match="holds nothing"):
        held_tensors(small_tensors, range(0), False)
    with pytest.raises(ValueError, match="consecutive"):
        held_tensors(small_tensors, range(0, 2, 2), False)


def test_prefill_writes_each_tensor_over_the_threshold_under_its_hash_once(
    small_model: Path, small_tensors: list[TensorInfo], small_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    threshold = 256 * 4  # the 256-float norms (1024 bytes) sit exactly on it: the matrices only
    held = [tensor for tensor in small_tensors if tensor.name.startswith(("blk.1.", "output_norm.", "token_embd."))]
    over = [tensor for tensor in held if tensor.size_bytes > threshold]
    assert over and len(over) < len(held)
    report = prefill(small_model, tmp_path / "cache", range(1, 2), True, tmp_path / "lib", threshold_bytes=threshold)
    assert set(cache_files(tmp_path / "cache")) == {
        f"{fnv1a64(small_bytes[tensor.name], tmp_path / 'lib'):016x}" for tensor in over
    }
    for path in (tmp_path / "cache/rpc").iterdir():  # each file holds exactly the bytes its name is the hash of
        assert f"{fnv1a64(path.read_bytes(), tmp_path / 'lib'):016x}" == path.name
    assert (report.files_written, report.bytes_written) == (len(over), sum(tensor.size_bytes for tensor in over))
    assert report.bytes_left_to_send == sum(tensor.size_bytes for tensor in held if tensor.size_bytes <= threshold)
    assert report.skipped_reason is None

    progress: list[tuple[int, int]] = []
    again = prefill(
        small_model, tmp_path / "cache", range(1, 2), True, tmp_path / "lib", threshold_bytes=threshold,
        on_progress=lambda done, total: progress.append((done, total)),
    )  # fmt: skip
    assert (again.files_written, again.files_present, again.bytes_present) == (0, len(over), report.bytes_written)
    assert len(progress) == len(over) and progress[-1] == (report.bytes_written, report.bytes_written)


def test_without_a_compiler_the_prefill_is_skipped_with_its_reason(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    report = prefill(small_model, tmp_path / "cache", range(0, 2), True, tmp_path / "lib")
    assert report.skipped_reason is not None and "no C compiler" in report.skipped_reason
    assert report.files_written == 0 and not (tmp_path / "cache").exists()


@contextlib.contextmanager
def rpc_server(build_root: Path, cache_dir: Path, log_path: Path) -> Iterator[int]:
    """`ggml-rpc-server -c` on loopback with `LLAMA_CACHE=cache_dir`; yields its port once it listens."""
    port = free_port()
    command = [str(build_root / "bin/ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-c", "-t", "1"]
    environment = {**os.environ, "LLAMA_CACHE": str(cache_dir)}
    with open(log_path, "wb") as log:
        # SIGPIPE ignored (Python's disposition, kept across exec): a peer that leaves must not kill it.
        server = subprocess.Popen(
            command, cwd=build_root, env=environment, stdout=log, stderr=subprocess.STDOUT, restore_signals=False
        )
    try:
        deadline = time.monotonic() + 10
        while True:
            # It exits 0 on a failed bind: a supervisor checks that the port listens.
            assert server.poll() is None, f"ggml-rpc-server exited:\n{log_path.read_text(errors='replace')}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, f"ggml-rpc-server not listening:\n{log_path.read_text()}"
            time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(10)


@contextlib.contextmanager
def split_across_two_helpers(build_root: Path, model: Path, caches: tuple[Path, Path], logs: Path) -> Iterator[None]:
    """A leader `llama-server` whose blocks are on two loopback helpers: block 0 on the first, block 1 and the output
    layer on the second (`-ngl 3 -ts 1,2`, bench/RPC_FACTS.md section 2); the embedding stays on the leader."""
    logs.mkdir(exist_ok=True)
    with (
        rpc_server(build_root, caches[0], logs / "rpc0.log") as first,
        rpc_server(build_root, caches[1], logs / "rpc1.log") as second,
        contextlib.chdir(build_root),
        llama_server(
            model, logs / "leader.log", "--rpc", f"127.0.0.1:{first},127.0.0.1:{second}",
            "-ngl", "3", "-ts", "1,2", "-c", "256", "-t", "1", "--no-warmup", ready_timeout_s=60,
        ),
    ):  # fmt: skip
        yield


def test_prefilled_files_are_the_ones_a_real_rpc_server_writes_and_it_takes_them(
    wide_ffn_model: Path, llama_cpp_bin: Path, tmp_path: Path
) -> None:
    build_root = llama_cpp_bin.parent
    by_llama_cpp = (tmp_path / "a0", tmp_path / "a1")
    with split_across_two_helpers(build_root, wide_ffn_model, by_llama_cpp, tmp_path / "logs-a"):
        pass
    prefilled = (tmp_path / "b0", tmp_path / "b1")
    first = prefill(wide_ffn_model, prefilled[0], range(0, 1), False, tmp_path / "lib")
    second = prefill(wide_ffn_model, prefilled[1], range(1, 2), True, tmp_path / "lib")

    assert (first.files_written, second.files_written) == (3, 4)  # 3 FFN matrices each, and the tied output
    assert all(size > HASH_THRESHOLD_BYTES for size in cache_files(by_llama_cpp[1]).values())
    for ours, theirs in zip(prefilled, by_llama_cpp, strict=True):
        assert cache_files(ours) == cache_files(theirs)

    before = {path: path.stat().st_mtime_ns for cache in prefilled for path in (cache / "rpc").iterdir()}
    with split_across_two_helpers(build_root, wide_ffn_model, prefilled, tmp_path / "logs-b"):
        pass
    after = {path: path.stat().st_mtime_ns for cache in prefilled for path in (cache / "rpc").iterdir()}
    assert after == before  # every hash found: nothing sent, nothing written
