"""`jetshard up --lan`: the machines of a network find each other and their embedded nats-servers form one
cluster over NATS routes.

Why it is shaped so:
- Each machine's services connect to their own server on loopback; the network sees only the route port,
  which admits only servers that know the cluster's secret (the join token carries it).
- A clustered JetStream elects its meta leader only among two or more JetStream servers (nats-server expects
  two at a first start and, alone, waits for routes forever). So the first machine runs a small second server
  beside its own, the *witness*: a JetStream peer that holds none of jetshard's streams (those are placed on
  servers tagged `DATA_TAG`). One machine alone works, and so do two: the second may go at any time; without
  the first, which holds the data, JetStream stops, as it must.
- Once three data servers are current in the meta group, the witness leaves it (the first machine would
  otherwise hold two votes of four) and every stream and bucket moves to three replicas: from then on the
  cluster survives the loss of any one machine.
- A joining machine starts its server with JetStream off until its routes reach the cluster's JetStream, so it
  never bootstraps a meta group of its own: two meta groups never merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import nats
import nats.aio.msg
import nats.errors
import nats.js.errors
from jetshard_bus.natsserver import DATA_TAG, ClusterSettings, Fsync, RouteTls, ServerSettings
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import scale
from nats.js.api import KeyValueConfig, Placement

from jetshard.discovery import Peer

DEFAULT_CLUSTER = "jetshard"
CLUSTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
TOKEN_PREFIX = "jst1"
MEMBERSHIP_FILE = "lan.json"
REPLICAS = 3
"""Copies of every stream once three machines hold data: any one of them may be lost."""


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


@dataclass(frozen=True)
class MetaGroup:
    """The JetStream meta group as one server's JetStream report (`/jsz`) shows it."""

    leader: str | None
    current: frozenset[str]
    """Peers (this server included) that are in touch with the group."""
    known: frozenset[str]

    @classmethod
    def from_jsz(cls, server_name: str, jsz: dict[str, object]) -> MetaGroup:
        meta = jsz.get("meta_cluster")
        if not isinstance(meta, dict):
            return cls(None, frozenset(), frozenset())
        peers = [p for p in meta.get("replicas") or [] if isinstance(p, dict) and isinstance(p.get("name"), str)]
        current = {p["name"] for p in peers if p.get("current") and not p.get("offline")}
        leader = meta.get("leader")
        return cls(
            leader if isinstance(leader, str) and leader else None,
            frozenset({server_name, *current}),
            frozenset({server_name, *(p["name"] for p in peers)}),
        )

    def witness_may_retire(self, witness: str) -> bool:
        """Three data servers are current: without the witness the group keeps a majority after any loss."""
        return self.leader is not None and len(self.current - {witness}) >= REPLICAS


def meta_leader(monitor_port: int) -> str | None:
    """The meta group's leader as this machine's server knows it (its monitoring endpoint's `/jsz`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/jsz", timeout=2) as response:
        meta = json.load(response).get("meta_cluster")
    leader = meta.get("leader") if isinstance(meta, dict) else None
    return leader if isinstance(leader, str) and leader else None


async def meta_group(system: NatsOptions, wait_s: float = 1.0) -> MetaGroup:
    """The meta group as its leader sees it (only the leader knows which peers are current): every server
    answers a system-account ping for its JetStream report; the leader's lists the peers."""
    client = await nats.connect(**system.connect_kwargs())
    try:
        inbox = client.new_inbox()
        reports: list[dict[str, object]] = []

        async def collect(message: nats.aio.msg.Msg) -> None:
            with contextlib.suppress(ValueError):
                reports.append(json.loads(message.data))

        subscription = await client.subscribe(inbox, cb=collect)
        await client.publish("$SYS.REQ.SERVER.PING.JSZ", b"{}", reply=inbox)
        await asyncio.sleep(wait_s)
        await subscription.unsubscribe()
    finally:
        await client.close()
    for report in reports:
        server, data = report.get("server"), report.get("data")
        if isinstance(server, dict) and isinstance(data, dict):
            group = MetaGroup.from_jsz(str(server.get("name")), data)
            if group.leader == server.get("name"):
                return group
    return MetaGroup(None, frozenset(), frozenset())


async def remove_peer(system: NatsOptions, server: str) -> dict[str, object]:
    """Ask the meta group to forget `server` (a system-account request); JetStream's answer."""
    client = await nats.connect(**system.connect_kwargs())
    try:
        reply = await client.request("$JS.API.SERVER.REMOVE", json.dumps({"peer": server}).encode(), timeout=10)
    finally:
        await client.close()
    answer = json.loads(reply.data)
    return answer if isinstance(answer, dict) else {}


async def retire_witness(system: NatsOptions, admin: NatsOptions, witness: str) -> None:
    """Remove the witness from the meta group, then give every stream three replicas."""
    answer = await remove_peer(system, witness)
    if not answer.get("success") and "not a member" not in json.dumps(answer.get("error", "")):
        raise RuntimeError(f"JetStream did not remove the witness: {answer.get('error')}")
    await ensure_replicas(admin)


async def ensure_replicas(admin: NatsOptions) -> list[str]:
    client = await nats.connect(**admin.connect_kwargs())
    try:
        return await scale(client.jetstream(), REPLICAS)
    finally:
        await client.close()


JOIN_BUCKET = "jetshard-join"
JOIN_LOCK_TTL_S = 120.0
"""A machine that died holding the join lock holds it no longer than this."""


async def acquire_join_lock(admin: NatsOptions, server_name: str, timeout_s: float) -> bool:
    """Take the cluster's join lock (through the routes, this server's JetStream still off).

    Machines join the meta group one at a time: two servers that start JetStream with empty stores together
    can vote for each other and elect a leader with an empty log, which would drop the cluster's streams. One
    newcomer alone cannot win a vote, as every member's log is ahead of its own."""
    client = await nats.connect(**admin.connect_kwargs())
    try:
        js = client.jetstream(timeout=5)
        config = KeyValueConfig(
            bucket=JOIN_BUCKET, ttl=JOIN_LOCK_TTL_S, history=1, placement=Placement(tags=[DATA_TAG])
        )
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                kv = await js.create_key_value(config)
                await kv.create("lock", server_name.encode())
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                await asyncio.sleep(1)  # another machine is joining
            except nats.errors.Error:
                await asyncio.sleep(1)  # the meta group is busy (a leader election): try again
        return False
    finally:
        await client.close()


async def release_join_lock(admin: NatsOptions, system: NatsOptions, server_name: str, timeout_s: float) -> None:
    """Once this server is a current member of the meta group, let the next machine join."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if server_name in (await meta_group(system)).current:
            break
    client = await nats.connect(**admin.connect_kwargs())
    try:
        kv = await client.jetstream(timeout=5).key_value(JOIN_BUCKET)
        await kv.delete("lock")
    finally:
        await client.close()


async def wait_for_cluster_jetstream(admin: NatsOptions, timeout_s: float, refused: Callable[[], bool]) -> bool:
    """Whether the cluster's JetStream answered through this machine's server (JetStream off) within the time,
    unless `refused()` says the cluster turned this machine away first."""
    client = await nats.connect(**{**admin.connect_kwargs(), "max_reconnect_attempts": -1})
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline and not refused():
            try:
                await client.jetstream(timeout=2).account_info()
                return True
            except Exception:  # no responders yet: routes not up, or refused
                await asyncio.sleep(0.5)
        return False
    finally:
        await client.close()
