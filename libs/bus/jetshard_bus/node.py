"""What makes a machine a node: a persistent id, a profile, and a liveness key that lapses when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import os
import platform
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
from jetshard_schema.ids import NodeId, ValidNodeId, new_id
from jetshard_schema.subjects import LIVENESS_BUCKET
from jetshard_schema.types import GpuInfo, NodeProfile
from nats.js import JetStreamContext

log = logging.getLogger(__name__)


def config_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    if explicit := environ.get("JETSHARD_CONFIG_DIR"):
        return Path(explicit).expanduser()
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "jetshard"


def node_id_for(directory: Path) -> NodeId:
    """This machine's node id, created once. The worker and downloader start together and must agree:
    the id file is written completely under a temporary name, then hard-linked into place, which fails if
    another process got there first; both then read whatever won."""
    path = directory / "node_id"
    if path.exists():
        return _read_node_id(path)
    directory.mkdir(parents=True, exist_ok=True)
    # A hostname may hold anything a node id may not (dots, spaces, non-ASCII): keep only what is allowed.
    host = re.sub(r"[^A-Za-z0-9_-]", "", socket.gethostname().split(".")[0])[:24]
    candidate = f"node-{host or 'host'}-{new_id()[:8]}"
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".node_id.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(candidate + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    finally:
        os.unlink(temp)
    return _read_node_id(path)


def _read_node_id(path: Path) -> NodeId:
    try:
        return msgspec.convert(path.read_text().strip(), ValidNodeId)
    except msgspec.ValidationError as error:
        raise ValueError(f"{path} holds no valid node id ({error}); delete it to get a new one") from None


MLX_CUDA_BUILDS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
"""The distributions of mlx's CUDA build: with one of them installed, mlx computes on the first NVIDIA GPU."""


@dataclass(frozen=True)
class MemoryTaken:
    """What a node's models take of its memory."""

    held_bytes: int = 0
    """Per runner, the more of what it holds resident and what placement reserved for it."""
    unfilled_bytes: int = 0
    """What placement reserved for the runners beyond what they hold yet: the system still shows it free, but the
    runners will grow into it (prompt caches, KV rows of a full batch), so the node does not lend it again."""


def node_profile(memory_limit_bytes: int | None = None, taken: MemoryTaken = MemoryTaken()) -> NodeProfile:
    """This machine as placement sees it: what its system has available, less what its models will still grow
    into. With `memory_limit_bytes`, the node lends at most that much of its memory to models: what they hold counts
    against the limit, the rest of the machine's use does not (its owner's own programs), and it never offers more
    than the machine has available."""
    memory = psutil.virtual_memory()
    total, available = memory.total, max(0, memory.available - taken.unfilled_bytes)
    if memory_limit_bytes is not None:
        total = min(total, memory_limit_bytes)
        available = max(0, min(available, memory_limit_bytes - taken.held_bytes))
    gpus = nvidia_gpus()
    return NodeProfile(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        cpu_cores=os.cpu_count() or 1,
        memory_total_bytes=total,
        memory_available_bytes=available,
        accelerator=_accelerator(gpus),
        gpus=gpus,
    )


def _accelerator(gpus: tuple[GpuInfo, ...]) -> str:
    """Where this machine's runners compute. Read from what is installed, not by importing mlx: the worker that
    reports it never loads mlx itself."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "metal"
    if gpus and mlx_cuda_installed():
        return "cuda"
    return "cpu"


@functools.cache
def mlx_cuda_installed() -> bool:
    """Whether one of mlx's CUDA builds is installed: read once, it does not change while the process runs."""
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    return any(name in installed for name in MLX_CUDA_BUILDS)


CUDA_13_DRIVER = 580
"""The first NVIDIA driver series that runs CUDA 13; older ones run CUDA 12 (from series 525)."""


def unused_gpu_hint(profile: NodeProfile) -> str | None:
    """One line for a machine whose NVIDIA GPU its runners do not use (mlx here is its CPU build): how to use it,
    with the CUDA build its driver runs."""
    if not profile.gpus or profile.accelerator != "cpu":
        return None
    gpu = profile.gpus[0]
    series = gpu.driver.split(".", 1)[0]
    extra = "cuda13" if not series.isdigit() or int(series) >= CUDA_13_DRIVER else "cuda12"
    return (
        f"this machine's {gpu.name} is not used: mlx here is its CPU build. To compute on the GPU, start with "
        f"`python3 -m uv run --no-group cpu --extra {extra} jetshard up`"
    )


def nvidia_gpus() -> tuple[GpuInfo, ...]:
    """This machine's NVIDIA GPUs through NVML (nvidia-ml-py); none where NVML or its driver is missing."""
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py comes with the worker, on Linux only
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no NVIDIA driver: a machine without an NVIDIA GPU
        return ()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in visible_gpu_indices(pynvml.nvmlDeviceGetCount(), os.environ.get("CUDA_VISIBLE_DEVICES")):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(
                GpuInfo(
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_total_bytes=int(memory.total),
                    memory_free_bytes=int(memory.free),
                    compute_capability=f"{major}.{minor}",
                    driver=driver,
                )
            )
        return tuple(gpus)
    except pynvml.NVMLError as error:  # a GPU that fails its query (fallen off the bus): report none, say why
        log.warning("NVML could not describe this machine's GPUs: %s", error)
        return ()
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def visible_gpu_indices(count: int, cuda_visible_devices: str | None) -> list[int]:
    """NVML's indices of the GPUs CUDA shows this process, in CUDA's order: CUDA's device 0, the one a runner
    computes on, comes first. `CUDA_VISIBLE_DEVICES` lists indices; CUDA stops at the first entry that is not a
    valid one (a UUID is taken as hiding the rest: resolving UUIDs is not done)."""
    if cuda_visible_devices is None:
        return list(range(count))
    visible: list[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) >= count or int(entry) in visible:
            break
        visible.append(int(entry))
    return visible


def _text(value: str | bytes) -> str:
    """NVML's strings: bytes from older nvidia-ml-py releases, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Liveness:
    """When a liveness key was last stored, so that its owner knows whether the cluster still counts it alive: the
    bucket's TTL removes the key `ttl_s` after that."""

    ttl_s: float
    stored_at: float = field(default_factory=time.monotonic)
    """`time.monotonic()`; at first its owner's start, which the first store follows at once."""

    def lapsed_s(self) -> float | None:
        """How long the key has gone unstored, once that is its TTL or more (the cluster counts its owner gone, and
        cancels what it asked for); None before."""
        unstored_s = time.monotonic() - self.stored_at
        return unstored_s if unstored_s >= self.ttl_s else None


async def keep_alive(js: JetStreamContext, key: str, session_id: str, liveness: Liveness, stop: asyncio.Event) -> None:
    """Refresh a liveness key (a node's, or an API session's) well within its TTL (`liveness.ttl_s`) until `stop`,
    noting each store in `liveness`; then delete it."""
    kv = await js.key_value(LIVENESS_BUCKET)
    while not stop.is_set():
        try:
            await kv.put(key, session_id.encode())
            liveness.stored_at = time.monotonic()
        except Exception as error:  # NATS down for a moment: the next beat retries
            log.warning("liveness update failed: %s", error)
        with contextlib.suppress(TimeoutError):
            # Five beats per TTL: a node survives a few seconds of a starved CPU without being declared lost.
            await asyncio.wait_for(stop.wait(), liveness.ttl_s / 5)
    with contextlib.suppress(Exception):
        await kv.delete(key)


def local_address(client: Any) -> str:
    """The address this machine uses to reach NATS (`client`, a connected nats-py client): peers that reach the
    same server can reach it too."""
    url = client.connected_url
    if url is None or not url.hostname:
        return "127.0.0.1"
    # Connecting a UDP socket sends nothing; it only asks the kernel which local address routes there.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((url.hostname, url.port or 4222))
        except OSError:
            return "127.0.0.1"
        return str(probe.getsockname()[0])
