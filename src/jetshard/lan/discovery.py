"""Machines of a jetshard cluster finding each other on the local network: each announces its nats-server's
route port and its API port over mDNS/DNS-SD (zeroconf) and lists the others it hears."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

from jetshard_schema.ids import parse_name
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

SERVICE_TYPE = "_jetshard._tcp.local."
FORMAT_VERSION = b"1"
MDNS_GROUP = ("224.0.0.251", 5353)
# How long one look-up of an announced service's records may wait (zeroconf's unit: milliseconds).
LOOKUP_TIMEOUT_MS = 3000
# Anyone on the LAN can announce: a flood of made-up names must not grow the list without end.
MAX_PEERS = 256
# Probing and the first announcements take about a second; a stop waits that long for them to end so
# that its goodbye covers the service (and no half-done registration is torn down).
REGISTRATION_WAIT_S = 5

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    cluster: str
    server_name: str  # the nats-server's server_name, also the mDNS instance name: unique on the LAN
    node_id: str
    host: str  # the IPv4 address it announced
    route_port: int
    api_port: int
    proof: str = ""
    """Hex HMAC-SHA256 of the other fields under the cluster's secret (`jetshard.lan.membership.signed`): anyone may
    announce a cluster's name, only its machines can prove it. Empty: unsigned."""


class LanAddressError(ValueError):
    pass


def lan_address(explicit: str | None = None) -> str:
    """The IPv4 address of the interface that reaches the mDNS multicast group, or `explicit` once checked."""
    if explicit is not None:
        try:
            address = ipaddress.IPv4Address(explicit)
        except ValueError:
            raise LanAddressError(f"--lan-address {explicit!r} is not an IPv4 address") from None
    else:
        # A UDP connect only picks the route and the source address: nothing is sent.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(MDNS_GROUP)
            except OSError as error:
                raise LanAddressError(
                    f"no network interface reaches the local network ({error.strerror}); pass --lan-address"
                ) from None
            address = ipaddress.IPv4Address(probe.getsockname()[0])
    if address.is_loopback or address.is_unspecified or address.is_multicast:
        raise LanAddressError(
            f"{address} cannot be reached from other machines: pass --lan-address with this machine's LAN address"
        )
    return str(address)


def _is_name(value: str) -> bool:
    try:
        parse_name(value, "name")
    except ValueError:
        return False
    return True


def _port(value: bytes | int | None) -> int | None:
    if isinstance(value, bytes):
        if not value.isdigit() or len(value) > 5:
            return None
        value = int(value)
    return value if value is not None and 1 <= value <= 65535 else None


def announcement(peer: Peer) -> ServiceInfo:
    """The DNS-SD records that announce `peer`: the route port in the SRV record, the rest in the TXT."""
    return ServiceInfo(
        SERVICE_TYPE,
        f"{peer.server_name}.{SERVICE_TYPE}",
        port=peer.route_port,
        properties={
            "v": FORMAT_VERSION,
            "cluster": peer.cluster,
            "server": peer.server_name,
            "node": peer.node_id,
            "api": str(peer.api_port),
            **({"proof": peer.proof} if peer.proof else {}),
        },
        server=f"{peer.server_name}.local.",
        parsed_addresses=[peer.host],
    )


def parse_announcement(info: ServiceInfo) -> Peer | None:
    """The peer that `info` announces, or None when it is of another format version or malformed: anyone on
    the LAN can announce anything, so every field is checked before it names a route to dial."""
    properties = info.properties
    if properties.get(b"v") != FORMAT_VERSION:
        return None
    texts: dict[str, str] = {}
    for key in ("cluster", "server", "node"):
        raw = properties.get(key.encode())
        try:
            text = raw.decode("ascii") if raw is not None else ""
        except UnicodeDecodeError:
            return None
        if not _is_name(text):
            return None
        texts[key] = text
    if info.name != f"{texts['server']}.{SERVICE_TYPE}":
        return None
    route_port, api_port = _port(info.port), _port(properties.get(b"api"))
    hosts = [
        address
        for address in map(ipaddress.IPv4Address, info.parsed_addresses(IPVersion.V4Only))
        if not (address.is_loopback or address.is_unspecified or address.is_multicast)
    ]
    proof = properties.get(b"proof") or b""
    if route_port is None or api_port is None or not hosts or not re.fullmatch(rb"(?:[0-9a-f]{64})?", proof):
        return None
    return Peer(texts["cluster"], texts["server"], texts["node"], str(hosts[0]), route_port, api_port, proof.decode())


class Discovery:
    """Announces `me` on the interface of `me.host` only and remembers every peer it hears of.

    A peer whose announcement goes away is kept: a machine briefly unreachable must not be forgotten (the
    NATS routes to it retry by themselves); a newer announcement under the same name replaces the older.
    """

    def __init__(self, me: Peer) -> None:
        self.me = me
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._zeroconf: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._registration: Future[object] | None = None

    def start(self) -> None:
        """Announce and browse, on zeroconf's own threads; returns at once (also from within an event loop)."""
        zeroconf = Zeroconf(interfaces=[self.me.host], ip_version=IPVersion.V4Only, use_asyncio=False)
        self._zeroconf = zeroconf
        assert zeroconf.loop is not None
        # Registration probes that no one else uses the name, then announces (about a second): not worth
        # blocking for.
        self._registration = asyncio.run_coroutine_threadsafe(
            self._register(zeroconf, announcement(self.me)), zeroconf.loop
        )
        self._registration.add_done_callback(self._report_registration)
        self._browser = ServiceBrowser(zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    @staticmethod
    async def _register(zeroconf: Zeroconf, info: ServiceInfo) -> object:
        # The first await ends with the probing, the second with the announcements.
        return await (await zeroconf.async_register_service(info))

    def _report_registration(self, registration: Future[object]) -> None:
        if not registration.cancelled() and (error := registration.exception()) is not None:
            log.error("could not announce %s on the LAN: %r", self.me.server_name, error)

    def stop(self) -> None:
        """Say goodbye (so others know at once) and close the sockets; safe to call again."""
        zeroconf, self._zeroconf = self._zeroconf, None
        if zeroconf is None:
            return
        if self._registration is not None:
            wait([self._registration], timeout=REGISTRATION_WAIT_S)
        if self._browser is not None:
            self._browser.cancel()
            self._browser = None
        zeroconf.close()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        # Runs on the browser's own thread, where a blocking look-up is allowed.
        if state_change not in (ServiceStateChange.Added, ServiceStateChange.Updated):
            return
        info = zeroconf.get_service_info(service_type, name, timeout=LOOKUP_TIMEOUT_MS)
        peer = parse_announcement(info) if info is not None else None
        if peer is None:
            log.debug("ignored the announcement %r: unreadable or of another format", name)
            return
        if peer.server_name == self.me.server_name:
            return
        with self._lock:
            if peer.server_name in self._peers or len(self._peers) < MAX_PEERS:
                self._peers[peer.server_name] = peer

    def peers(self) -> list[Peer]:
        """Every peer heard of so far, of any cluster, sorted by server name."""
        with self._lock:
            return sorted(self._peers.values(), key=lambda peer: peer.server_name)

    def cluster_peers(self) -> list[Peer]:
        return [peer for peer in self.peers() if peer.cluster == self.me.cluster]
