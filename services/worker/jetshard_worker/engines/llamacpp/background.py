"""The worker's side of the llama.cpp build: which engines this node runs now, and building llama.cpp in the
background when it cannot yet, so that a new node serves on MLX at once and adds llama.cpp when it is ready."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys

from jetshard_schema.types import Engine

from jetshard_worker.engines.llamacpp.build import BuildError, CpuVariants, find_toolchain
from jetshard_worker.engines.llamacpp.probe import ready_build

log = logging.getLogger(__name__)

BUILD_NICENESS = 10
"""The build runs below the runners' priority: serving on MLX stays responsive while it compiles."""
LOG_EVERY_PERCENT = 5.0


class NodeEngines:
    """The engines this node can run, and an event set when they change (so the profile is reported at once)."""

    def __init__(self) -> None:
        self.engines: tuple[Engine, ...] = (Engine.MLX, Engine.LLAMA_CPP) if ready_build() else (Engine.MLX,)
        self.changed = asyncio.Event()

    @property
    def llama_cpp_ready(self) -> bool:
        return Engine.LLAMA_CPP in self.engines

    def add_llama_cpp(self) -> None:
        if not self.llama_cpp_ready:
            self.engines = (*self.engines, Engine.LLAMA_CPP)
            self.changed.set()


async def build_llama_cpp(engines: NodeEngines, variants: CpuVariants = CpuVariants.ALL) -> None:
    """Build and probe llama.cpp in a process of its own (`nice`d, its own process group, killed with the worker),
    logging its progress; on success, `engines` gains llama.cpp. A machine without a compiler is told what to
    install, and serves on MLX."""
    try:
        await asyncio.to_thread(find_toolchain)
    except BuildError as error:
        log.warning("llama.cpp is not built: %s", error)
        return
    command = [sys.executable, "-m", "jetshard_worker.engines.llamacpp", variants.value]
    if nice := shutil.which("nice"):
        command = [nice, "-n", str(BUILD_NICENESS), *command]
    log.info("building llama.cpp (%s CPU variants) in the background; MLX serves meanwhile", variants.value)
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    assert process.stdout is not None
    logged: tuple[str, float] | None = None
    try:
        async for raw in process.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                log.info("llama.cpp build: %s", raw.decode(errors="replace").rstrip())
                continue
            if "ready" in line:
                log.info("llama.cpp is ready: %s", line["ready"])
            elif "error" in line:
                log.warning("llama.cpp build failed: %s", line["error"])
            elif _worth_logging(line, logged):
                logged = (line["phase"], line.get("percent") or 0.0)
                percent = "" if line.get("percent") is None else f" {line['percent']:.0f}%"
                log.info("llama.cpp build: %s%s %s", line["phase"], percent, line.get("detail", ""))
        code = await process.wait()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            await process.wait()
    if code == 0 and await asyncio.to_thread(ready_build) is not None:
        engines.add_llama_cpp()


def _worth_logging(line: dict[str, object], logged: tuple[str, float] | None) -> bool:
    """A line for each new phase and every `LOG_EVERY_PERCENT` of one: cmake reports each of hundreds of files."""
    percent = line.get("percent")
    if logged is None or line.get("phase") != logged[0] or not isinstance(percent, int | float):
        return True
    return percent - logged[1] >= LOG_EVERY_PERCENT
