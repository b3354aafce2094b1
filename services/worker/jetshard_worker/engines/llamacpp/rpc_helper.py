"""A rank of a llama.cpp instance split across nodes that is not its leader: it serves its layers to the leader's
llama-server through llama.cpp's own RPC backend (`ggml-rpc-server`), which computes them here.

`ggml-rpc-server` has no authentication and serves whoever connects first, one client at a time (bench/RPC_FACTS.md,
section 1). So it listens on loopback only, and the rank's endpoint is a tunnel that lets in the instance's leader
alone (`jetshard_worker.peer_tunnel`). Its file cache (`-c`) is filled from this node's own copy of the GGUF before
it starts (`rpc_cache`), so the leader sends hashes for the large tensors instead of their bytes.

It exits 0 when it cannot bind its port and dies of SIGPIPE when a client goes while it writes: it is started with
SIGPIPE ignored, and judged by whether it listens, never by its exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
from pathlib import Path

from jetshard_bus.lifeline import lifeline_command
from jetshard_bus.procs import describe_exit
from jetshard_schema.types import TaskOutcome, TaskRequest

from jetshard_worker import peer_tunnel
from jetshard_worker.engines.base import Admitted, OnProgress, Refused
from jetshard_worker.engines.figures import EngineFigures
from jetshard_worker.rank_tunnels import endpoint_socket, identity_of
from jetshard_worker.runner_spec import RunnerSpec

from . import rpc_cache
from .probe import ReadyBuild
from .server import ServerDied, free_port, stop_process, wait_until_ready

log = logging.getLogger(__name__)


class RpcServer:
    """One `ggml-rpc-server` on 127.0.0.1, dying with its runner."""

    def __init__(self, binary: Path, working_dir: Path, cache_dir: Path | None, threads: int | None) -> None:
        self.binary, self.working_dir, self.cache_dir, self.threads = binary, working_dir, cache_dir, threads
        self.port = 0
        self._process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float) -> None:
        self.port = free_port()
        command = [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port)]
        if self.threads is not None:
            command += ["--threads", str(self.threads)]
        environment = dict(os.environ)
        if self.cache_dir is not None:
            command.append("--cache")
            environment["LLAMA_CACHE"] = str(self.cache_dir)
        # Killed with its runner, as llama-server is; SIGPIPE ignored, so that a client that left while it wrote is
        # an error it returns from, not a signal that kills it.
        command = lifeline_command(command, signal.SIGKILL, ignore_sigpipe=True)
        self._process = await asyncio.create_subprocess_exec(
            *command, env=environment, cwd=self.working_dir, stdin=asyncio.subprocess.DEVNULL
        )

        async def listening() -> bool:
            return _listening(self.port)

        await wait_until_ready(
            self._process,
            listening,
            timeout_s,
            name="ggml-rpc-server",
            stage="before it listened",
            late=f"ggml-rpc-server did not listen on port {self.port} within {timeout_s:.0f} s",
        )

    async def wait(self) -> int:
        assert self._process is not None
        return await self._process.wait()

    async def stop(self) -> None:
        await stop_process(self._process)


def _listening(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`. A connection that says nothing and leaves costs the server
    one turn of its accept loop (it reads no greeting and closes)."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


class RpcHelperServing:
    """A helper rank as its runner drives it (`engines.base.ServingEngine`): it takes no tasks; it serves until its
    `ggml-rpc-server` ends, and says why (the leader notices a tunnel that breaks: its llama-server stops)."""

    is_leader = False
    loaded_tensors: tuple[str, ...] = ()
    weights_held_as = "GGUF (llama.cpp RPC)"

    def __init__(self, server: RpcServer, tunnel: peer_tunnel.Tunnel) -> None:
        self.server, self.tunnel = server, tunnel
        self.stats = EngineFigures()

    async def serve(self) -> None:
        returncode = await self.server.wait()
        raise ServerDied(f"ggml-rpc-server {describe_exit(returncode)}")

    async def close(self) -> None:
        await self.tunnel.close()
        await self.server.stop()

    async def admit(self, request: TaskRequest) -> Admitted[None] | Refused:
        return Refused("a llama.cpp RPC helper takes no tasks: its instance's leader does", "engine_error")

    def token_text(self, token: int) -> str:
        raise TypeError("a llama.cpp RPC helper has no tokenizer")

    def submit(self, row: None) -> None:
        raise TypeError("a llama.cpp RPC helper takes no rows")

    def cancel(self, row_id: str) -> None:
        pass  # it runs no rows

    def finish(self, row_id: str, reason: TaskOutcome) -> None:
        pass  # it runs no rows


HELPER_START_TIMEOUT_S = 60.0
CACHE_DIR_NAME = ".llama-rpc-cache"
REACH_RETRY_S = 0.25


async def load(spec: RunnerSpec, build: ReadyBuild, gguf: Path, on_progress: OnProgress) -> RpcHelperServing:
    """Fill the file cache from this node's GGUF, start `ggml-rpc-server` on loopback and open this rank's endpoint
    to the instance's leader alone."""
    plan = spec.plan
    if not await asyncio.to_thread(gguf.is_file):
        raise RuntimeError(f"{gguf} is missing: the model's GGUF file did not reach this node")
    layers = plan.end_layer - plan.start_layer
    cache_dir = cache_dir_for(gguf)
    filled = await asyncio.to_thread(
        rpc_cache.prefill,
        gguf,
        cache_dir,
        range(plan.start_layer, plan.end_layer),
        holds_output=plan.rank == plan.world_size - 1,
        library_dir=cache_dir,
        on_progress=lambda done, total: on_progress(layers * done // max(total, 1), layers),
    )
    log.info(
        "RPC file cache in %s for layers %d-%d: %d file(s) written (%.1f MB), %d already there (%.1f MB); "
        "%.1f MB of smaller tensors still come from the leader%s",
        cache_dir,
        plan.start_layer,
        plan.end_layer - 1,
        filled.files_written,
        filled.bytes_written / 1e6,
        filled.files_present,
        filled.bytes_present / 1e6,
        filled.bytes_left_to_send / 1e6,
        f" ({filled.skipped_reason})" if filled.skipped_reason else "",
    )
    server = RpcServer(build.build.rpc_server, build.build.root, cache_dir, threads=None)
    await server.start(HELPER_START_TIMEOUT_S)
    try:
        context = peer_tunnel.server_context(identity_of(spec), plan.certificates[plan.leader_rank])
        tunnel = await peer_tunnel.serve_peer(endpoint_socket(spec), context, ("127.0.0.1", server.port))
    except BaseException:
        await server.stop()
        raise
    return RpcHelperServing(server, tunnel)


async def reach_helpers(spec: RunnerSpec, timeout_s: float) -> list[peer_tunnel.Tunnel]:
    """On the leader of an instance split across nodes: a tunnel to each other rank, in rank order, once each
    answers (it fills its cache and starts its server first). None on one node."""
    plan = spec.plan
    tunnels: list[peer_tunnel.Tunnel] = []
    deadline = time.monotonic() + timeout_s
    try:
        for rank, endpoint in enumerate(plan.endpoints):
            if rank == plan.leader_rank:
                continue
            host, _, port = endpoint.rpartition(":")
            context = peer_tunnel.client_context(identity_of(spec), plan.certificates[rank])
            await _reachable((host, int(port)), context, rank, deadline)
            tunnels.append(await peer_tunnel.forward_to_peer((host, int(port)), context))
    except BaseException:
        for tunnel in tunnels:
            await tunnel.close()
        raise
    return tunnels


async def _reachable(remote: tuple[str, int], context: ssl.SSLContext, rank: int, deadline: float) -> None:
    """Wait until rank `rank` accepts this node's TLS handshake at `remote`: until it listens, its port refuses
    connections. A certificate it does not accept, or one that is not the one its endpoint named, is not waited out."""
    while True:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(*remote, ssl=context, server_hostname=""), REACH_RETRY_S * 20
            )
        except ssl.SSLCertVerificationError as error:
            message = f"rank {rank} at {remote[0]}:{remote[1]} is not the node its endpoint names: {error}"
            raise RuntimeError(message) from error
        except (OSError, TimeoutError) as error:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} at {remote[0]}:{remote[1]} did not answer: {error}") from error
            await asyncio.sleep(REACH_RETRY_S)
            continue
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
        return


def cache_dir_for(gguf: Path) -> Path:
    """Where `ggml-rpc-server` keeps its file cache for the model (`LLAMA_CACHE`): beside the GGUF, so that it goes
    with the model's directory, on the disk the downloader chose; in the user's cache when that directory is
    read-only (a GGUF in someone's own Hugging Face cache). Its files are named by their content's hash."""
    beside = gguf.parent / CACHE_DIR_NAME
    if os.access(gguf.parent, os.W_OK):
        return beside
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home_cache / "jetshard" / "llama-rpc"
