"""Session fixtures for tiny GGUF models (helpers.gguf_models): each (architecture, file type) is made once per
session, on first use; quantized files come from the llama.cpp build's `llama-quantize`. The image projector that
pairs with the tiny llama is made once too."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.gguf_models import TINY_ARCHS, llama_cpp_tool, quantize, write_tiny_gguf, write_tiny_projector


class TinyGGUFs:
    """Tiny GGUF models under `root`, written or quantized on first request and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, arch: str, file_type: str = "F16") -> Path:
        """The tiny `arch` model (one of TINY_ARCHS) as `file_type`: "F16" as written, else quantized from it
        ("Q4_K_M", "Q4_0", "Q8_0"...)."""
        if arch not in TINY_ARCHS:
            raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
        f16 = self.root / f"tiny-{arch}-F16.gguf"
        if not f16.exists():
            write_tiny_gguf(f16, arch)
        if file_type == "F16":
            return f16
        target = self.root / f"tiny-{arch}-{file_type}.gguf"
        if not target.exists():
            quantize(f16, target, file_type)
        return target

    def projector(self) -> Path:
        """The image projector (`mmproj`) that the tiny llama sees through: `TINY_PROJECTOR`."""
        path = self.root / "tiny-llama-mmproj-F16.gguf"
        if not path.exists():
            write_tiny_projector(path)
        return path


@pytest.fixture(scope="session")
def llama_cpp_bin() -> Path:
    """The llama.cpp build's binary directory (the suite's build: its absence fails the tests that need it)."""
    return llama_cpp_tool("llama-server").parent


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> TinyGGUFs:
    return TinyGGUFs(tmp_path_factory.mktemp("gguf-models"))
