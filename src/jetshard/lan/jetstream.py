"""The LAN cluster's JetStream as its machines tend it: the meta group, the witness's retirement and the streams'
three replicas, and the lock under which machines join one at a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import nats
import nats.aio.msg
import nats.errors
import nats.js.errors
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import scale
from nats.js.api import KeyValueConfig, Placement

from jetshard.up.natsserver import DATA_TAG

REPLICAS = 3
"""Copies of every stream once three machines hold data: any one of them may be lost."""


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
