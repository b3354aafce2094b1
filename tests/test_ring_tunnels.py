"""The MLX ring through the ranks' tunnels (`jetshard_worker.rank_tunnels`), between real processes on 127.0.0.1:
a stranger at a rank's advertised endpoint, in plain TCP or in TLS with a certificate of its own, is turned away
without taking the single connection mlx's listener accepts, and the ring still forms and computes."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from jetshard_bus.options import NatsOptions
from jetshard_schema.ids import InstanceId, ModelId, NodeId
from jetshard_worker.peer_tunnel import PeerIdentity
from jetshard_worker.planning import RunnerKey, RunnerPlan
from jetshard_worker.rank_tunnels import ring_hostfile_entries
from jetshard_worker.runner_spec import PeerIdentityFiles, RunnerSpec
from jetshard_worker.runners import hold_ring_port

pytest.importorskip("mlx.core")

HELPER = Path(__file__).parent / "helpers" / "ring_rank.py"
# Generous: a test fails on a hang, never on a slow machine.
DEADLINE_S = 120


def test_hostfile_names_own_listener_and_right_forwarder_only() -> None:
    assert ring_hostfile_entries(0, 2, 10, 20) == [["127.0.0.1:10"], ["127.0.0.1:20"]]
    assert ring_hostfile_entries(1, 2, 10, 20) == [["127.0.0.1:20"], ["127.0.0.1:10"]]
    assert ring_hostfile_entries(2, 4, 10, 20) == [["127.0.0.1:1"], ["127.0.0.1:1"], ["127.0.0.1:10"], ["127.0.0.1:20"]]
    assert ring_hostfile_entries(3, 4, 10, 20) == [["127.0.0.1:20"], ["127.0.0.1:1"], ["127.0.0.1:1"], ["127.0.0.1:10"]]


def _start_rank(spec: RunnerSpec, hostfile: Path, fd: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, str(HELPER), msgspec.json.encode(spec).decode(), str(hostfile)],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(fd,),
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "listening"
    return process


def _turned_away(port: int, context: ssl.SSLContext | None) -> None:
    """Connect to 127.0.0.1:`port` and find the connection closed on us without a byte from beyond."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        if context is None:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(4096) == b""
            return
        # TLS 1.3: the client's handshake ends before the server has checked the client's certificate, whose
        # refusal comes as an alert on the first read.
        with context.wrap_socket(sock) as tls, pytest.raises((ssl.SSLError, ConnectionResetError, EOFError)):
            tls.sendall(b"\0" * 64)
            if tls.recv(4096) == b"":
                raise EOFError


def test_strangers_are_turned_away_and_the_ring_still_forms(tmp_path: Path) -> None:
    identities = [PeerIdentity.create(tmp_path / f"node{rank}", f"node{rank}") for rank in range(2)]
    stranger = PeerIdentity.create(tmp_path / "stranger", "stranger")
    held = [hold_ring_port("127.0.0.1") for _ in range(2)]
    endpoints = tuple(f"127.0.0.1:{sock.getsockname()[1]}" for sock in held)
    specs = [
        RunnerSpec(
            nats=NatsOptions(),
            plan=RunnerPlan(
                key=RunnerKey(InstanceId("inst-ring"), 0),
                model_id=ModelId("test/tiny"),
                rank=rank,
                world_size=2,
                start_layer=0,
                end_layer=1,
                model_dir=str(tmp_path),
                endpoints=endpoints,
                certificates=tuple(identity.certificate_pem for identity in identities),
            ),
            node_id=NodeId(f"node{rank}"),
            worker_session="s",
            hostfile=str(tmp_path / f"hosts{rank}.json"),
            ring_socket_fd=held[rank].fileno(),
            identity=PeerIdentityFiles(str(identities[rank].certificate_path), str(identities[rank].key_path)),
        )
        for rank in range(2)
    ]
    processes: list[subprocess.Popen[str]] = []
    try:
        # Rank 0 serves its endpoint and waits in mlx's accept for its left neighbour, rank 1, which is not there.
        processes.append(_start_rank(specs[0], tmp_path / "hosts0.json", held[0].fileno()))
        held[0].close()
        rank0_port = int(endpoints[0].rpartition(":")[2])
        # A stranger's certificate, even presented for a server it trusts (rank 0's own), gets nowhere.
        stranger_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        stranger_context.check_hostname = False
        stranger_context.load_cert_chain(stranger.certificate_path, stranger.key_path)
        stranger_context.load_verify_locations(cadata=identities[0].certificate_pem)
        _turned_away(rank0_port, None)
        _turned_away(rank0_port, stranger_context)
        # No certificate at all.
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.check_hostname = False
        anonymous.verify_mode = ssl.CERT_NONE
        _turned_away(rank0_port, anonymous)
        time.sleep(0.5)
        assert processes[0].poll() is None, "rank 0 must still wait for its real neighbour"
        # Its real neighbour still gets in: mlx's one accept was not taken by a stranger.
        processes.append(_start_rank(specs[1], tmp_path / "hosts1.json", held[1].fileno()))
        held[1].close()
        for process in processes:
            out, _ = process.communicate(timeout=DEADLINE_S)
            assert process.returncode == 0, out
            assert "sum 3" in out
        # Only the tunnels listened on the advertised ports, and they are gone with their ranks.
        for endpoint in endpoints:
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", int(endpoint.rpartition(":")[2]))) != 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for sock in held:
            sock.close()
        for path in tmp_path.glob("hosts*.json"):
            assert os.path.getsize(path) > 0
