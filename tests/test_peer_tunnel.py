"""The peer tunnel on real sockets over 127.0.0.1: bytes pass unchanged, only the pinned peer reaches the target,
a wrong pin fails at once, closing cuts live connections, and peer sockets carry the cut-cable options."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvloop
from cryptography import x509
from jetshard_worker.peer_tunnel import (
    PEER_TIMEOUT_S,
    PeerIdentity,
    Tunnel,
    client_context,
    forward_to_peer,
    serve_peer,
    server_context,
)

# Generous: a test fails on a hang, never on a slow machine.
DEADLINE_S = 10


@dataclass
class EchoTarget:
    """The helper's rpc-server stand-in: echoes what it reads until EOF; `connections` are those that reached it."""

    port: int = 0
    connections: list[asyncio.Task[None]] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.append(task)
        while data := await reader.read(256 * 1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def all_ended(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.connections), DEADLINE_S)


@dataclass
class Lan:
    leader: PeerIdentity
    helper: PeerIdentity
    stranger: PeerIdentity
    target: EchoTarget
    served: Tunnel
    forwarded: Tunnel


@pytest.fixture
async def lan(tmp_path: Path) -> AsyncIterator[Lan]:
    async with open_lan(tmp_path) as opened:
        yield opened


@contextlib.asynccontextmanager
async def open_lan(tmp_path: Path) -> AsyncIterator[Lan]:
    leader = PeerIdentity.create(tmp_path / "leader", "leader")
    helper = PeerIdentity.create(tmp_path / "helper", "helper")
    stranger = PeerIdentity.create(tmp_path / "stranger", "stranger")
    target = EchoTarget()
    target_server = await asyncio.start_server(target.handle, "127.0.0.1", 0)
    target.port = target_server.sockets[0].getsockname()[1]
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    served = await serve_peer(listening, server_context(helper, leader.certificate_pem), ("127.0.0.1", target.port))
    forwarded = await forward_to_peer(("127.0.0.1", served.port), client_context(leader, helper.certificate_pem))
    try:
        yield Lan(leader, helper, stranger, target, served, forwarded)
    finally:
        await forwarded.close()
        await served.close()
        await target.all_ended()
        target_server.close()
        await target_server.wait_closed()


async def round_trip(port: int, payload: bytes, rounds: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(rounds):
            writer.write(payload)
            await writer.drain()
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), DEADLINE_S)
            assert echoed == payload
    finally:
        writer.close()


async def is_shut_out(connecting: Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> bool:
    """Whether a connection is refused or closed on its sender (within the deadline: a hang fails the test)."""
    try:
        reader, writer = await asyncio.wait_for(connecting, DEADLINE_S)
    except (OSError, asyncio.IncompleteReadError):
        return True
    try:
        writer.write(b"hello target")
        return await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
    except OSError:  # ssl.SSLError (the server's alert) and ConnectionResetError
        return True
    finally:
        writer.close()


def test_an_identity_is_a_fresh_self_signed_certificate_with_a_private_key(tmp_path: Path) -> None:
    identity = PeerIdentity.create(tmp_path / "keys", "rank0")
    assert stat.S_IMODE(os.stat(identity.key_path).st_mode) == 0o600
    assert identity.certificate_path.read_text() == identity.certificate_pem
    certificate = x509.load_pem_x509_certificate(identity.certificate_pem.encode())
    assert certificate.issuer == certificate.subject
    now = datetime.datetime.now(datetime.UTC)
    assert certificate.not_valid_before_utc < now - datetime.timedelta(minutes=30)  # a peer's clock may lag
    assert certificate.not_valid_after_utc > now + datetime.timedelta(days=7)
    assert PeerIdentity.create(tmp_path / "keys", "rank1").certificate_pem != identity.certificate_pem


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\0b"])
def test_an_identity_name_is_a_plain_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        PeerIdentity.create(tmp_path, name)


def test_a_context_pins_exactly_one_pem_certificate(tmp_path: Path) -> None:
    one = PeerIdentity.create(tmp_path, "one")
    two = PeerIdentity.create(tmp_path, "two")
    with pytest.raises(ValueError, match="allowed_peer_pem is not a PEM certificate"):
        server_context(one, "not a certificate")
    with pytest.raises(ValueError, match="server_pem must hold exactly one certificate, not 2"):
        client_context(one, one.certificate_pem + two.certificate_pem)


async def test_serve_peer_takes_only_a_bound_socket_and_a_loopback_target(tmp_path: Path) -> None:
    identity = PeerIdentity.create(tmp_path, "one")
    context = server_context(identity, identity.certificate_pem)
    with socket.socket() as unbound, pytest.raises(ValueError, match="bound socket"):
        await serve_peer(unbound, context, ("127.0.0.1", 1))
    with socket.socket(type=socket.SOCK_DGRAM) as datagram, pytest.raises(ValueError, match="TCP socket"):
        await serve_peer(datagram, context, ("127.0.0.1", 1))
    with socket.socket() as bound, pytest.raises(ValueError, match="loopback"):
        bound.bind(("127.0.0.1", 0))
        await serve_peer(bound, context, ("192.0.2.1", 1))
    with socket.socket() as bound, pytest.raises(ValueError, match="loopback IP address, not 'localhost'"):
        bound.bind(("127.0.0.1", 0))
        await serve_peer(bound, context, ("localhost", 1))


async def test_bytes_pass_unchanged_both_ways(lan: Lan) -> None:
    await round_trip(lan.forwarded.port, os.urandom(1024 * 1024), rounds=4)
    await round_trip(lan.forwarded.port, os.urandom(64), rounds=20)
    assert len(lan.target.connections) == 2


def test_the_tunnel_serves_on_uvloop_as_the_runners_run_it(tmp_path: Path) -> None:
    """The runners' event loop is uvloop's, whose transports are not asyncio's classes (only alike)."""

    async def scenario() -> None:
        async with open_lan(tmp_path) as lan:
            await round_trip(lan.forwarded.port, os.urandom(1024 * 1024), rounds=2)
            stranger = client_context(lan.stranger, lan.helper.certificate_pem)
            assert await is_shut_out(asyncio.open_connection("127.0.0.1", lan.served.port, ssl=stranger))
            assert len(lan.target.connections) == 1

    uvloop.run(scenario())


async def test_strangers_never_reach_the_target_and_do_not_hold_up_the_leader(lan: Lan) -> None:
    # One that connects and stays silent: its handshake is pending all along.
    _, silent_writer = await asyncio.open_connection("127.0.0.1", lan.served.port)
    no_certificate = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_certificate.check_hostname = False
    no_certificate.verify_mode = ssl.CERT_NONE
    another_certificate = client_context(lan.stranger, lan.helper.certificate_pem)
    for context in (no_certificate, another_certificate):
        assert await is_shut_out(
            asyncio.ensure_future(asyncio.open_connection("127.0.0.1", lan.served.port, ssl=context))
        )
    plain = asyncio.ensure_future(asyncio.open_connection("127.0.0.1", lan.served.port))
    assert await is_shut_out(plain)
    await round_trip(lan.forwarded.port, os.urandom(4096), rounds=3)
    assert len(lan.target.connections) == 1
    silent_writer.close()


async def test_a_forwarder_pinned_to_another_certificate_closes_the_local_connection(lan: Lan) -> None:
    wrong = await forward_to_peer(
        ("127.0.0.1", lan.served.port), client_context(lan.leader, lan.stranger.certificate_pem)
    )
    try:
        assert await is_shut_out(asyncio.ensure_future(asyncio.open_connection("127.0.0.1", wrong.port)))
    finally:
        await wrong.close()
    assert len(lan.target.connections) == 0


async def test_a_forwarder_to_nobody_closes_the_local_connection(lan: Lan) -> None:
    with socket.socket() as closed_port:
        closed_port.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused
        nobody = await forward_to_peer(
            closed_port.getsockname(), client_context(lan.leader, lan.helper.certificate_pem)
        )
        try:
            assert await is_shut_out(asyncio.ensure_future(asyncio.open_connection("127.0.0.1", nobody.port)))
        finally:
            await nobody.close()


@pytest.mark.parametrize("closing", ["forwarded", "served"])
async def test_closing_a_tunnel_cuts_its_live_connections(lan: Lan, closing: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", lan.forwarded.port)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), DEADLINE_S) == b"ping"
    await getattr(lan, closing).close()
    await lan.target.all_ended()
    assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
    writer.close()


async def test_peer_sockets_give_up_on_a_silent_peer_within_seconds(lan: Lan) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", lan.forwarded.port)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), DEADLINE_S) == b"ping"
    sockets = [
        transport.get_extra_info("socket") for tunnel in (lan.forwarded, lan.served) for transport in tunnel._transports
    ]
    assert len(sockets) == 4  # each tunnel: one end on loopback, one to the peer
    to_peer = [sock for sock in sockets if lan.served.port in (sock.getsockname()[1], sock.getpeername()[1])]
    assert len(to_peer) == 2
    for sock in sockets:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    for sock in to_peer:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == PEER_TIMEOUT_S * 1000
    writer.close()
