"""Round-trip latency through the peer tunnel (jetshard_worker.peer_tunnel) against a direct loopback connection.

    .venv/bin/python bench/tunnel_latency.py [ROUNDS]

As llama.cpp's RPC uses it: a blocking client sends a request and waits for the whole response, of the same size,
from a blocking echo server (both here, in threads). The tunnel's two ends run in two processes of their own, as the
leader's and the helper's runners do: client -> forward_to_peer -> TLS over 127.0.0.1 -> serve_peer -> echo.
Prints the median and 99th percentile round trip of a 64-byte and a 200 KB message, each way, and the ratios.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from jetshard_worker.peer_tunnel import PeerIdentity, client_context, forward_to_peer, serve_peer, server_context

SIZES = (64, 200 * 1024)


def echo_forever(listening: socket.socket) -> None:
    while True:
        connection, _ = listening.accept()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=echo, args=(connection,), daemon=True).start()


def echo(connection: socket.socket) -> None:
    with connection:
        while data := connection.recv(256 * 1024):
            connection.sendall(data)


def round_trips(port: int, size: int, rounds: int) -> list[float]:
    payload = os.urandom(size)
    buffer = bytearray(size)
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        timings = []
        for _ in range(rounds + rounds // 10):  # the first tenth warms up, and is not counted
            start = time.perf_counter()
            connection.sendall(payload)
            view = memoryview(buffer)
            while view:
                received = connection.recv_into(view)
                if not received:
                    raise SystemExit("the connection closed mid-response")
                view = view[received:]
            timings.append(time.perf_counter() - start)
        assert buffer == payload
    return timings[rounds // 10 :]


def run_side(side: str, keys: Path, port: int, ports: multiprocessing.Queue[int]) -> None:
    """One runner's end of the tunnel, in a process of its own; puts the port it listens on."""

    async def serve() -> None:
        leader = PeerIdentity((keys / "leader.crt").read_text(), keys / "leader.crt", keys / "leader.key")
        helper = PeerIdentity((keys / "helper.crt").read_text(), keys / "helper.crt", keys / "helper.key")
        if side == "helper":
            listening = socket.socket()
            listening.bind(("127.0.0.1", 0))
            tunnel = await serve_peer(listening, server_context(helper, leader.certificate_pem), ("127.0.0.1", port))
        else:
            tunnel = await forward_to_peer(("127.0.0.1", port), client_context(leader, helper.certificate_pem))
        ports.put(tunnel.port)
        await asyncio.Event().wait()

    asyncio.run(serve())


def summary(timings: list[float]) -> tuple[float, float]:
    ordered = sorted(timings)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.99)] * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    listening = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=echo_forever, args=(listening,), daemon=True).start()
    echo_port = listening.getsockname()[1]
    with tempfile.TemporaryDirectory() as keys:
        PeerIdentity.create(Path(keys), "leader")
        PeerIdentity.create(Path(keys), "helper")
        context = multiprocessing.get_context("spawn")
        ports: multiprocessing.Queue[int] = context.Queue()
        helper = context.Process(target=run_side, args=("helper", Path(keys), echo_port, ports), daemon=True)
        helper.start()
        leader = context.Process(target=run_side, args=("leader", Path(keys), ports.get(timeout=30), ports))
        leader.daemon = True
        leader.start()
        tunnel_port = ports.get(timeout=30)
        print(f"{rounds} round trips each; microseconds, median / p99")
        for size in SIZES:
            direct = summary(round_trips(echo_port, size, rounds))
            tunnelled = summary(round_trips(tunnel_port, size, rounds))
            print(
                f"{size:>7} B: direct {direct[0]:8.1f} / {direct[1]:8.1f}   tunnel {tunnelled[0]:8.1f} / "
                f"{tunnelled[1]:8.1f}   ratio {tunnelled[0] / direct[0]:.2f}x median, "
                f"{tunnelled[1] / direct[1]:.2f}x p99"
            )
        helper.terminate()
        leader.terminate()


if __name__ == "__main__":
    main()
