"""An authenticated, encrypted TCP tunnel between two ranks of one instance.

llama.cpp's `ggml-rpc-server` serves whoever connects, and the MLX ring between ranks is plain TCP: neither may be
reachable from the LAN. So the helper binds its server to 127.0.0.1 and exposes it only through `serve_peer`, a TLS 1.3
listener that admits exactly one client certificate, the leader's; the leader reaches it through `forward_to_peer`, a
forwarder on 127.0.0.1 that opens one TLS connection, pinned to the helper's certificate, per local connection.

Each worker session makes a fresh self-signed identity (`PeerIdentity.create`); the certificates' PEMs travel through
the cluster's authenticated event log, so each side knows the one certificate its peer must present. That certificate
is the context's only trust anchor, which pins it: a certificate verifies only if it is the anchor itself or was
signed by the anchor's key, and OpenSSL refuses the latter: the anchor is CA:FALSE, without keyCertSign. Either way
only the holder of the peer's key gets in.

The tunnel pipes bytes with asyncio Protocols, not streams: a chunk received is written to the other side within the
same callback, with no task to wake per message, and backpressure is the transports' own (pause/resume reading).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import cast

# The identity and the pinning contexts live in jetshard_bus (the downloader's file server uses them too); the
# tunnels' users keep reaching them here.
from jetshard_bus.tls_identity import PeerIdentity, client_context, server_context

__all__ = ["PeerIdentity", "Tunnel", "client_context", "forward_to_peer", "serve_peer", "server_context"]

# A peer whose network is cut (a cable pulled: no RST, no FIN) is given up after this long, with data in flight
# (TCP_USER_TIMEOUT) or idle (keepalive: 2 s idle, then 3 probes 1 s apart).
PEER_TIMEOUT_S = 5
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_PROBES = 3
# A stranger that connects and says nothing must not hold a connection (and its memory) for longer than this.
HANDSHAKE_TIMEOUT_S = 5
# llama.cpp's RPC messages are up to hundreds of KB: one must fit in a write buffer whole, or the pipe would stop
# reading mid-message. (asyncio's transports already read 256 KiB at a time, plain and TLS alike.)
WRITE_BUFFER_HIGH = 1024 * 1024
# How often a connector that waits for its target to listen (`connect_retry_s`) tries again.
CONNECT_RETRY_INTERVAL_S = 0.25
FLUSH_POLL_S = 0.01


class Tunnel:
    """One side of a tunnel: a listening server and every connection it pipes. `port` is where it listens;
    `close()` stops listening and cuts every live connection, both of its ends, at once."""

    def __init__(self) -> None:
        self.port = 0
        self.on_error: Callable[[BaseException], None] | None = None
        """Called with why, when the other end of an accepted connection could not be opened (the connection is
        closed at once either way)."""
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.Transport] = set()
        self._connecting: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop accepting, abandon connections being opened and abort every live one (the ends see EOF)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connecting):
            task.cancel()
        for transport in list(self._transports):
            transport.abort()
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def flush(self, timeout_s: float) -> None:
        """Stop accepting and wait, up to `timeout_s`, until every live connection has sent what it holds (a last
        message read from one end and not yet written to the other); `close()` then loses nothing."""
        if self._server is not None:
            self._server.close()
        for _ in range(max(1, round(timeout_s / FLUSH_POLL_S))):
            if not any(transport.get_write_buffer_size() for transport in self._transports):
                return
            await asyncio.sleep(FLUSH_POLL_S)

    def _start(self, accepted: _Pipe, opening: Coroutine[None, None, _Pipe]) -> None:
        """Pipe `accepted` to the connection `opening` opens, once open; close `accepted` at once if it fails."""

        async def join() -> None:
            try:
                opened = await opening
            except (TimeoutError, OSError) as error:
                # Said with a closed connection, at once: llama.cpp's client sees a failure, not a hang.
                accepted.transport.close()
                if self.on_error is not None and not isinstance(error, _Abandoned):
                    self.on_error(error)
                return
            if accepted.transport.is_closing():
                opened.transport.close()
                return
            accepted.join(opened)
            opened.join(accepted)
            accepted.transport.resume_reading()

        task = asyncio.create_task(join())
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)


class _Pipe(asyncio.Protocol):
    """One end of a piped connection: what it receives it writes to its partner's transport; when it closes (an EOF
    closes it: llama.cpp's RPC has no use for half-closed connections), its partner closes after what it has to send.
    `to_peer`: its socket goes to a peer over the network, not over loopback."""

    def __init__(self, tunnel: Tunnel, *, to_peer: bool) -> None:
        self.tunnel = tunnel
        self.to_peer = to_peer
        self.partner: _Pipe | None = None
        self.early: list[bytes] = []
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: uvloop's (the runners' loop) are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)
        self.tunnel._transports.add(self.transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _tune(sock, to_peer=self.to_peer)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)

    def data_received(self, data: bytes) -> None:
        if self.partner is not None:
            self.partner.transport.write(data)
        else:
            # Reading is paused until the partner is open, but a transport may hand over what it had already read
            # (uvloop's TLS transport does): kept for the partner, never dropped.
            self.early.append(data)

    def join(self, partner: _Pipe) -> None:
        self.partner = partner
        for data in self.early:
            partner.transport.write(data)
        self.early.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel._transports.discard(self.transport)
        if self.partner is not None:
            self.partner.transport.close()

    def pause_writing(self) -> None:
        # This end cannot send as fast as its partner receives: stop reading from the partner until it drains.
        if self.partner is not None:
            self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.partner is not None:
            self.partner.transport.resume_reading()


class _Accepted(_Pipe):
    """The end a tunnel's server accepted; it reads nothing until its partner is connected."""

    def __init__(self, tunnel: Tunnel, connect: _Connector, *, to_peer: bool) -> None:
        super().__init__(tunnel, to_peer=to_peer)
        self.connect = connect

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.pause_reading()
        self.tunnel._start(self, self.connect.open(self.tunnel, self))


class _Abandoned(ConnectionAbortedError):
    """The accepted connection closed while its other end was still being waited for."""


class _Connector:
    """Opens the other end of a piped connection: to the target (loopback) or to the remote peer (TLS).

    `retry_s`: for how long a connection that fails (refused: nothing listens there yet; a peer that does not answer)
    is tried again, every CONNECT_RETRY_INTERVAL_S, while the accepted end is still open. A certificate that does not
    verify, or a peer that refuses this one, is not tried again."""

    def __init__(
        self, address: tuple[str, int], context: ssl.SSLContext | None = None, *, retry_s: float = 0.0
    ) -> None:
        self.address = address
        self.context = context
        self.retry_s = retry_s

    async def open(self, tunnel: Tunnel, accepted: _Pipe) -> _Pipe:
        to_peer = self.context is not None
        deadline = time.monotonic() + self.retry_s
        while True:
            opening = asyncio.get_running_loop().create_connection(
                lambda: _Pipe(tunnel, to_peer=to_peer),
                *self.address,
                ssl=self.context,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if to_peer else None,
            )
            try:
                # A peer whose network is down never answers the SYN: give up as a cut connection would be given up.
                _, opened = await asyncio.wait_for(opening, PEER_TIMEOUT_S + HANDSHAKE_TIMEOUT_S)
            except ssl.SSLError:
                raise
            except (TimeoutError, OSError):
                if time.monotonic() + CONNECT_RETRY_INTERVAL_S > deadline:
                    raise
                await asyncio.sleep(CONNECT_RETRY_INTERVAL_S)
                if accepted.transport.is_closing():
                    raise _Abandoned("the accepted connection closed while its other end was waited for") from None
                continue
            return opened


async def serve_peer(
    listening: socket.socket, context: ssl.SSLContext, target: tuple[str, int], *, connect_retry_s: float = 0.0
) -> Tunnel:
    """Serve the TLS peers `context` admits on `listening`, piping each to a new plain TCP connection to `target`.

    `listening` is already bound (the worker binds the port it advertised before the runner starts, and hands it
    over); it is listened on here if it is not yet. `target` must be a loopback address: the plain bytes never leave
    the host. A peer is connected to the target only after its handshake, certificate included, passes, so the target
    never sees a connection from anyone else; a peer that does not complete the handshake within
    HANDSHAKE_TIMEOUT_S is dropped. `connect_retry_s`: how long an admitted peer waits for the target to listen (the
    MLX ring's listener appears only once its rank joins the ring); 0, the connection is closed at once if the target
    refuses it. Returns the Tunnel, whose `port` is the listening socket's."""
    if listening.type != socket.SOCK_STREAM:
        raise ValueError(f"serve_peer needs a TCP socket, not {listening.type!r}")
    bound_port = listening.getsockname()[1]
    if bound_port == 0:
        raise ValueError("serve_peer needs a bound socket: bind it to the port the worker advertised first")
    try:
        loopback = ipaddress.ip_address(target[0]).is_loopback
    except ValueError:
        raise ValueError(f"serve_peer's target must be a loopback IP address, not {target[0]!r}") from None
    if not loopback:
        raise ValueError(f"serve_peer's target must be a loopback address, not {target[0]!r}: its bytes are plain")
    tunnel = Tunnel()
    connect = _Connector(target, retry_s=connect_retry_s)
    tunnel._server = await asyncio.get_running_loop().create_server(
        lambda: _Accepted(tunnel, connect, to_peer=True),
        sock=listening,
        ssl=context,
        ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
    )
    tunnel.port = bound_port
    return tunnel


async def forward_to_peer(remote: tuple[str, int], context: ssl.SSLContext, *, connect_retry_s: float = 0.0) -> Tunnel:
    """Listen on 127.0.0.1 (an ephemeral port: the Tunnel's `port`) and pipe each local connection to a new TLS
    connection to `remote`, which must present the certificate `context` pins. If that connection cannot be made
    (tried again for up to `connect_retry_s` while `remote` refuses it or does not answer), the local one is closed."""
    tunnel = Tunnel()
    connect = _Connector(remote, context, retry_s=connect_retry_s)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Accepted(tunnel, connect, to_peer=False), "127.0.0.1", 0
    )
    tunnel._server = server
    tunnel.port = server.sockets[0].getsockname()[1]
    return tunnel


def _tune(sock: socket.socket, *, to_peer: bool) -> None:
    """No Nagle delay on any socket (llama.cpp's RPC is request/response: a held-back tail is pure latency); on a
    socket to a peer, keepalive and TCP_USER_TIMEOUT too, so that a peer cut off the network is given up within
    about PEER_TIMEOUT_S whether data is in flight or not."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not to_peer:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    elif hasattr(socket, "TCP_KEEPALIVE"):  # macOS names the idle time TCP_KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPALIVE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux only; on macOS, keepalive alone detects an idle cut
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, PEER_TIMEOUT_S * 1000)
