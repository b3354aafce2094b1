"""A rank's tunnels to the other ranks of its instance (`jetshard_worker.peer_tunnel`), as its runner opens them.

The MLX ring backend is plain TCP that trusts whoever connects first: rank r listens on its hostfile entry and takes
its left neighbour (rank r-1 mod n) to be the first connection there, and connects to its right neighbour's entry
(rank r+1 mod n) and nothing else. So on the network a rank exposes only its TLS listener, on the port its endpoint
advertises, which admits the left neighbour's certificate alone and pipes it to mlx's listener on 127.0.0.1; and mlx
reaches its right neighbour through a forwarder on 127.0.0.1, pinned to that neighbour's certificate. Each rank writes
its own hostfile: its own entry is its loopback listener, its right neighbour's entry the forwarder, every other entry
a placeholder mlx never uses.

The tunnels run in a process of their own (`python -m jetshard_worker.rank_tunnels`), not on the runner's event loop:
`mx.distributed.init` holds the GIL while it waits in accept() and connect(), and the tunnels must carry the very
connections it waits for. The process dies with its runner (`jetshard_bus.lifeline`) and is stopped by it
(`RingTunnels.close`).

Ordering: the runner binds (and holds) mlx's loopback port, starts the tunnel process and waits for its forwarder's
port, writes the hostfile, then joins the ring. mlx's connect to the forwarder succeeds at once, whatever lies
beyond; so the forwarder waits (RING_FORM_S) for the neighbour's TLS listener, which refuses connections until the
neighbour's runner starts its tunnels, and that listener in turn waits for its rank's mlx listener, which appears
only as that rank joins the ring. mlx's bytes flow once the whole path is up. A path that does not come up within
RING_FORM_S ends the tunnel process with the reason in the runner's log, and the runner fails with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
from jetshard_bus.lifeline import lifeline_command
from jetshard_bus.procs import describe_exit

from jetshard_worker import peer_tunnel
from jetshard_worker.runner_spec import RunnerSpec

log = logging.getLogger(__name__)

RING_FORM_S = 300.0
"""How long one rank's path to its right neighbour may take to come up: the neighbour may still load its shard."""
TUNNELS_START_S = 60.0
"""How long the tunnel process may take to start (Python's start and imports) and say its forwarder's port."""
STOP_GRACE_S = 5.0
FLUSH_S = 1.0
"""How long the tunnel process, told to stop, lets what it holds reach the neighbours (the leader's STOP)."""
UNUSED_ENTRY = "127.0.0.1:1"
"""A hostfile entry mlx parses but never uses: neither this rank's nor its right neighbour's."""


def identity_of(spec: RunnerSpec) -> peer_tunnel.PeerIdentity:
    """The worker session's identity, which this rank presents on its tunnels."""
    if spec.identity is None:
        raise RuntimeError("the worker gave this rank no identity for its tunnels")
    certificate = Path(spec.identity.certificate_path)
    return peer_tunnel.PeerIdentity(certificate.read_text(), certificate, Path(spec.identity.key_path))


def endpoint_socket(spec: RunnerSpec) -> socket.socket:
    """The socket bound to the port this rank's endpoint names: the worker's, handed over, or (a worker that
    restarted reported it in an earlier life) bound here again."""
    if spec.ring_socket_fd is not None:
        return socket.socket(fileno=spec.ring_socket_fd)
    host, port = split_endpoint(spec.plan.endpoints[spec.plan.rank])
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((host, port))
    return listening


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def hold_loopback_port() -> socket.socket:
    """A socket bound (not listening) to a port the kernel picks on 127.0.0.1, for mlx's ring listener: held until
    mlx's listener, which sets SO_REUSEADDR too, has bound the same port, so nothing else takes it meanwhile.
    Meanwhile a connection to it is refused, as if nothing were there."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
    except OSError:
        sock.close()
        raise
    return sock


def ring_hostfile_entries(rank: int, world_size: int, listen_port: int, forward_port: int) -> list[list[str]]:
    """Rank `rank`'s own hostfile: its loopback listener, its right neighbour's forwarder, placeholders elsewhere."""
    if world_size < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {world_size}")
    entries = [[UNUSED_ENTRY] for _ in range(world_size)]
    entries[rank] = [f"127.0.0.1:{listen_port}"]
    entries[(rank + 1) % world_size] = [f"127.0.0.1:{forward_port}"]
    return entries


class RingTunnelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the tunnel process is told on its command line."""

    certificate_path: str
    key_path: str
    listen_fd: int
    """The socket bound to this rank's advertised port."""
    left_certificate: str
    """The PEM of the left neighbour, the one peer the listener admits."""
    ring_port: int
    """mlx's listener on 127.0.0.1."""
    right_endpoint: str
    right_certificate: str
    form_s: float = RING_FORM_S


class RingTunnels:
    """The runner's handle on its tunnel process and the hostfile that names its tunnels."""

    def __init__(self, process: asyncio.subprocess.Process, hostfile: Path, held: socket.socket) -> None:
        self.process, self.hostfile, self._held = process, hostfile, held

    def release_ring_port(self) -> None:
        """mlx's listener bound the port (and, the ring formed, has closed again): stop holding it."""
        self._held.close()

    def failure(self) -> str | None:
        """Why the tunnels are gone, if they are."""
        code = self.process.returncode
        if code is None:
            return None
        return f"the ring's tunnel process (pid {self.process.pid}) {describe_exit(code)}; its log says why"

    async def wait(self) -> str:
        await self.process.wait()
        failure = self.failure()
        assert failure is not None
        return failure

    async def close(self) -> None:
        self._held.close()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()


async def open_ring_tunnels(spec: RunnerSpec, hostfile: Path, form_s: float = RING_FORM_S) -> RingTunnels:
    """Start this rank's tunnel process and write its hostfile to `hostfile`; the rank then joins the ring with it."""
    plan = spec.plan
    n, rank = plan.world_size, plan.rank
    if spec.identity is None:
        raise RuntimeError("the worker gave this rank no identity for its tunnels")
    if len(plan.certificates) != n or len(plan.endpoints) != n:
        raise RuntimeError(f"the plan names {len(plan.endpoints)} endpoints and {len(plan.certificates)} certificates")
    held = hold_loopback_port()
    try:
        listening = endpoint_socket(spec)
        try:
            tunnel_spec = RingTunnelSpec(
                certificate_path=spec.identity.certificate_path,
                key_path=spec.identity.key_path,
                listen_fd=listening.fileno(),
                left_certificate=plan.certificates[(rank - 1) % n],
                ring_port=held.getsockname()[1],
                right_endpoint=plan.endpoints[(rank + 1) % n],
                right_certificate=plan.certificates[(rank + 1) % n],
                form_s=form_s,
            )
            command = [sys.executable, "-m", __name__, msgspec.json.encode(tunnel_spec).decode()]
            # Forked from the event loop's thread, which lives as long as the runner: the lifeline's parent-death
            # signal follows the thread that forked, not the process.
            process = await asyncio.create_subprocess_exec(
                *lifeline_command(command, signal.SIGKILL),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(listening.fileno(),),
            )
        finally:
            listening.close()  # the tunnel process has its own copy
        tunnels = RingTunnels(process, hostfile, held)
    except BaseException:
        held.close()
        raise
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), TUNNELS_START_S)
        if not line.strip().isdigit():
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            raise RuntimeError(f"the ring's tunnels did not start: {tunnels.failure() or 'no port said'}")
        entries = ring_hostfile_entries(rank, n, tunnel_spec.ring_port, int(line))
        await asyncio.to_thread(hostfile.write_text, json.dumps(entries))
    except BaseException:
        await tunnels.close()
        raise
    return tunnels


async def _serve(spec: RingTunnelSpec, identity: peer_tunnel.PeerIdentity) -> int:
    """The tunnel process: serve until terminated; return a failure status when a ring path fails."""
    failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    def fail(side: str) -> Callable[[BaseException], None]:
        def on_error(error: BaseException) -> None:
            if not failed.done():
                failed.set_result(f"{side}: {error!r}")

        return on_error

    listening = socket.socket(fileno=spec.listen_fd)
    server_context = peer_tunnel.server_context(identity, spec.left_certificate)
    listener = await peer_tunnel.serve_peer(
        listening, server_context, ("127.0.0.1", spec.ring_port), connect_retry_s=spec.form_s
    )
    listener.on_error = fail(f"the left neighbour's connection found no ring listener on 127.0.0.1:{spec.ring_port}")
    right = split_endpoint(spec.right_endpoint)
    forwarder = await peer_tunnel.forward_to_peer(
        right, peer_tunnel.client_context(identity, spec.right_certificate), connect_retry_s=spec.form_s
    )
    forwarder.on_error = fail(f"the right neighbour at {spec.right_endpoint} could not be reached")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(f"{forwarder.port}\n")
    sys.stdout.flush()
    stopping: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await asyncio.gather(listener.flush(FLUSH_S), forwarder.flush(FLUSH_S))
        await listener.close()
        await forwarder.close()
    if failed.done():
        log.error("ring tunnel failed, the ring cannot form: %s", failed.result())
        return 1
    return 0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = msgspec.json.decode(sys.argv[1], type=RingTunnelSpec)
    certificate = Path(spec.certificate_path)
    identity = peer_tunnel.PeerIdentity(certificate.read_text(), certificate, Path(spec.key_path))
    sys.exit(asyncio.run(_serve(spec, identity)))


if __name__ == "__main__":
    main()
