"""SCAFFOLD (replaced by the build module at merge): where a ready llama.cpp build is."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReadyBuild:
    llama_server: Path


def find_ready_build() -> ReadyBuild | None:
    binary = Path(os.environ.get("JETSHARD_LLAMA_CPP_BIN", "/work/lcp/build/bin")) / "llama-server"
    return ReadyBuild(binary) if binary.is_file() else None
