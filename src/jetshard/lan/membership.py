"""Who a machine is in its LAN cluster: the join token, the proof its announcements carry, its membership
(`<data dir>/lan.json`), and the layout of the nats-servers that membership gives it."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from jetshard.lan.discovery import Peer
from jetshard.up.natsserver import ClusterSettings, Fsync, RouteTls, ServerSettings

DEFAULT_CLUSTER = "jetshard"
CLUSTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
TOKEN_PREFIX = "jst1"
MEMBERSHIP_FILE = "lan.json"


class JoinTokenError(ValueError):
    pass


@dataclass(frozen=True)
class JoinToken:
    """What a machine needs to join: the cluster's name and its secret. Printed by the first machine."""

    cluster: str
    secret: str

    @classmethod
    def create(cls, cluster: str) -> JoinToken:
        return cls(checked_cluster_name(cluster), secrets.token_urlsafe(32))

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        prefix, _, rest = text.strip().partition(".")
        cluster, _, secret = rest.rpartition(".")
        if (
            prefix != TOKEN_PREFIX
            or not CLUSTER_NAME.fullmatch(cluster)
            or not re.fullmatch(r"[A-Za-z0-9_-]{32,128}", secret)
        ):
            raise JoinTokenError(
                f"not a join token: expected {TOKEN_PREFIX}.<cluster>.<secret>, as the first machine's "
                "`jetshard up --lan` printed it"
            )
        return cls(cluster, secret)

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}.{self.cluster}.{self.secret}"


def _proof(peer: Peer, secret: str) -> str:
    fields = (peer.cluster, peer.server_name, peer.node_id, peer.host, str(peer.route_port), str(peer.api_port))
    return hmac.new(secret.encode(), "\n".join(fields).encode(), hashlib.sha256).hexdigest()


def signed(peer: Peer, secret: str) -> Peer:
    """`peer` with the proof that its announcer knows the cluster's secret."""
    return replace(peer, proof=_proof(peer, secret))


def vouched(peer: Peer, secret: str) -> bool:
    """Whether `peer` was announced by a machine that knows `secret`, for exactly these host and ports: a route
    to anything else would hand the secret (which routes send on connecting) to whoever announced it."""
    return bool(peer.proof) and hmac.compare_digest(peer.proof, _proof(peer, secret))


def checked_cluster_name(name: str) -> str:
    if not CLUSTER_NAME.fullmatch(name):
        raise ValueError(f"cluster name {name!r}: use 1 to 32 letters, digits, '-' or '_'")
    return name


class Membership(msgspec.Struct, frozen=True, kw_only=True):
    """This machine's place in its LAN cluster, fixed at its first `up --lan` (`<data dir>/lan.json`, 0600)."""

    cluster: str
    secret: str
    server_name: str
    """Its nats-server's name: JetStream's peers know each other by it, so it never changes."""
    founder: bool
    """The first machine: it created the cluster and runs the witness until three machines hold data."""
    joined: bool
    """Its server runs JetStream: the founder's from the start, a joiner's once it reached the cluster."""
    witness_retired: bool = False
    routes: tuple[str, ...] = ()
    """Every peer's route (`host:port`) this machine has known: tried again at each start, before discovery
    answers, and kept when a peer is away (NATS retries configured routes by itself)."""

    @property
    def token(self) -> JoinToken:
        return JoinToken(self.cluster, self.secret)

    @property
    def witness_name(self) -> str:
        return f"{self.server_name}-witness"


def resolve_membership(
    stored: Membership | None, token: JoinToken | None, cluster: str | None, server_name: str
) -> Membership:
    """The membership to run with: the stored one (a token or name for another cluster is an error), else a
    new joiner's (with a token) or a new founder's."""
    if cluster is not None:
        checked_cluster_name(cluster)
    if stored is not None:
        if token is not None and (token.cluster, token.secret) != (stored.cluster, stored.secret):
            raise ValueError(
                f"this data dir belongs to cluster {stored.cluster!r}; to join another, use another --data-dir"
            )
        if cluster is not None and cluster != stored.cluster:
            raise ValueError(f"this data dir belongs to cluster {stored.cluster!r}, not {cluster!r}")
        return stored
    if token is not None:
        if cluster is not None and cluster != token.cluster:
            raise ValueError(f"the join token is for cluster {token.cluster!r}, not {cluster!r}")
        return Membership(
            cluster=token.cluster, secret=token.secret, server_name=server_name, founder=False, joined=False
        )
    new = JoinToken.create(cluster or DEFAULT_CLUSTER)
    return Membership(cluster=new.cluster, secret=new.secret, server_name=server_name, founder=True, joined=True)


def load_membership(root: Path) -> Membership | None:
    try:
        return msgspec.json.decode((root / MEMBERSHIP_FILE).read_bytes(), type=Membership)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ValueError(f"{root / MEMBERSHIP_FILE} is damaged ({error})") from None


def save_membership(root: Path, membership: Membership) -> None:
    path = root / MEMBERSHIP_FILE
    temporary = path.with_name(f".{MEMBERSHIP_FILE}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the secret
    with os.fdopen(descriptor, "wb") as file:
        file.write(msgspec.json.encode(membership))
    os.replace(temporary, path)


@dataclass(frozen=True)
class LanPorts:
    client: int
    route: int
    monitor: int

    @property
    def witness_route(self) -> int:
        return self.route + 1


@dataclass(frozen=True)
class LanLayout:
    """How this machine's servers are configured, given who it is and which peers it knows."""

    root: Path
    membership: Membership
    address: str
    ports: LanPorts
    authorization: str
    tls: RouteTls | None = None
    fsync: Fsync = Fsync.ALWAYS

    def server(self, routes: tuple[str, ...], jetstream: bool) -> ServerSettings:
        cluster = self._cluster(self.membership.server_name, self.ports.route, routes, jetstream)
        return ServerSettings(
            self.root / "nats",
            self.ports.client,
            "127.0.0.1",
            self.authorization,
            cluster,
            self.ports.monitor,
            self.fsync,
        )

    def witness(self, routes: tuple[str, ...]) -> ServerSettings:
        """Beside the founder's server, routed to it and to every peer (NATS routes form a full mesh); its client
        port is any free one, as nothing but routes reach it."""
        own = route_of(self.address, self.ports.route)
        cluster = self._cluster(self.membership.witness_name, self.ports.witness_route, (own, *routes), True)
        return ServerSettings(
            self.root / "nats-witness", -1, "127.0.0.1", self.authorization, replace(cluster, tags=()), fsync=self.fsync
        )

    @property
    def witness_route(self) -> str:
        return route_of(self.address, self.ports.witness_route)

    def _cluster(self, server_name: str, route_port: int, routes: tuple[str, ...], jetstream: bool) -> ClusterSettings:
        return ClusterSettings(
            name=self.membership.cluster,
            server_name=server_name,
            listen_host=self.address,
            route_port=route_port,
            secret=self.membership.secret,
            routes=routes,
            jetstream=jetstream,
            tls=self.tls,
        )


def route_of(host: str, port: int) -> str:
    return f"{host}:{port}"
