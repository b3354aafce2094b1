"""Machines finding each other on the LAN: announcements read defensively, and real mDNS between hosts made
of network namespaces (root only)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.harness import wait_for
from helpers.netns import Host, Lan, lan
from zeroconf import ServiceInfo

from jetshard.lan.discovery import SERVICE_TYPE, LanAddressError, Peer, announcement, lan_address, parse_announcement

PEER = Peer(cluster="alpha", server_name="srv-1", node_id="node_1", host="10.77.0.1", route_port=6222, api_port=8000)
# Multicast on a fresh bridge, probing and the first queries take a few seconds; this only catches a hang.
DEADLINE_S = 30
# How long a peer whose announcement went away must stay listed in this test (zeroconf drops a record 1 s
# after its goodbye).
KEPT_S = 2.5

# Runs inside a host: announces itself, prints what it sees whenever that changes, says goodbye on SIGTERM.
ANNOUNCER = """
import dataclasses, json, signal, sys, time
from jetshard.lan.discovery import Discovery, Peer, lan_address
cluster, server, route_port, api_port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
discovery = Discovery(Peer(cluster, server, "node-" + server, lan_address(), route_port, api_port))
def goodbye(*_):
    discovery.stop()
    sys.exit(0)
signal.signal(signal.SIGTERM, goodbye)
discovery.start()
seen = None
while True:
    now = {key: [dataclasses.asdict(peer) for peer in peers]
           for key, peers in (("peers", discovery.peers()), ("cluster_peers", discovery.cluster_peers()))}
    if now != seen:
        print(json.dumps(now), flush=True)
        seen = now
    time.sleep(0.1)
"""


def hostile(
    name: str = f"srv-1.{SERVICE_TYPE}", port: int = 6222, addresses: list[str] | None = None, **changes: Any
) -> ServiceInfo:
    """PEER's announcement with `changes` to its TXT properties (`...` leaves one out)."""
    properties: dict[str, Any] = {"v": "1", "cluster": "alpha", "server": "srv-1", "node": "node_1", "api": "8000"}
    properties.update(changes)
    return ServiceInfo(
        SERVICE_TYPE,
        name,
        port=port,
        properties={key: value for key, value in properties.items() if value is not ...},
        parsed_addresses=["10.77.0.1"] if addresses is None else addresses,
    )


def test_an_announcement_reads_back_as_the_peer_that_made_it() -> None:
    assert parse_announcement(announcement(PEER)) == PEER
    assert parse_announcement(hostile()) == PEER
    assert parse_announcement(hostile(addresses=["127.0.0.1", "10.77.0.1"])) == PEER
    proved = dataclasses.replace(PEER, proof="ab" * 32)
    assert parse_announcement(announcement(proved)) == proved


@pytest.mark.parametrize(
    "info",
    [
        hostile(v="2"),
        hostile(v=...),
        hostile(cluster=...),
        hostile(cluster="al pha"),
        hostile(cluster="a" * 65),
        hostile(node="-node"),
        hostile(node="nöde"),
        hostile(node=b"\xff\xfe"),
        hostile(node="node_1\n"),
        hostile(server="srv-2"),  # the instance name says srv-1
        hostile(name=f"srv 1.{SERVICE_TYPE}", server="srv 1"),
        hostile(api=...),
        hostile(api="0"),
        hostile(api="65536"),
        hostile(api="80a"),
        hostile(api="-80"),
        hostile(api="000000080"),
        hostile(port=0),
        hostile(addresses=[]),
        hostile(addresses=["127.0.0.1"]),
        hostile(addresses=["0.0.0.0"]),
        hostile(addresses=["224.0.0.251"]),
        hostile(addresses=["fe80::1"]),
        hostile(proof="AB" * 32),
        hostile(proof="ab" * 31),
        hostile(proof="zz" * 32),
        hostile(proof="ab" * 33),
    ],
)
def test_a_malformed_or_foreign_announcement_is_ignored(info: ServiceInfo) -> None:
    assert parse_announcement(info) is None


def test_an_explicit_lan_address_is_checked() -> None:
    assert lan_address("192.168.1.20") == "192.168.1.20"
    for wrong in ("127.0.0.1", "0.0.0.0", "my-laptop", "::1"):
        with pytest.raises(LanAddressError, match="--lan-address"):
            lan_address(wrong)


@pytest.fixture(scope="module")
def network() -> Iterator[Lan]:
    with lan(3, prefix="jsdisc") as hosts:
        yield hosts


def test_lan_address_is_the_address_of_the_interface_on_the_lan(network: Lan) -> None:
    for host in network.hosts:
        probe = "from jetshard.lan.discovery import lan_address; print(lan_address())"
        result = host.run([sys.executable, "-c", probe])
        assert result.stdout.strip() == host.address, result.stderr


@pytest.mark.parametrize(
    "setup", ["", "ip link set lo up && ip route add 224.0.0.0/4 dev lo &&"], ids=["no interface", "loopback only"]
)
def test_lan_address_without_a_lan_says_to_pass_one(setup: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("a network namespace of its own needs root (unshare --net)")
    probe = "from jetshard.lan.discovery import lan_address; lan_address()"
    result = subprocess.run(
        ["unshare", "--net", "sh", "-c", f"{setup} exec {sys.executable} -c '{probe}'"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "LanAddressError" in result.stderr and "pass --lan-address" in result.stderr, result.stderr


def announce(host: Host, log: Path, cluster: str, route_port: int, api_port: int) -> subprocess.Popen[bytes]:
    return host.popen([sys.executable, "-c", ANNOUNCER, cluster, host.name, str(route_port), str(api_port)], log)


def seen(log: Path, condition: Callable[[dict[str, list[dict[str, Any]]]], bool]) -> dict[str, list[dict[str, Any]]]:
    """The latest view printed to `log`, once it satisfies `condition`."""

    def latest() -> dict[str, list[dict[str, Any]]]:
        lines = log.read_text().splitlines() if log.exists() else []
        views = [json.loads(line) for line in lines if line.startswith("{")]
        return views[-1] if views else {}

    if not wait_for(lambda: (view := latest()) and condition(view), timeout=DEADLINE_S, interval=0.1):
        raise AssertionError(f"{log.name} never saw what was expected; log:\n{log.read_text()}")
    return latest()


def names(peers: list[dict[str, Any]]) -> set[str]:
    return {peer["server_name"] for peer in peers}


def test_hosts_find_each_other_and_keep_a_host_that_went_away(network: Lan, tmp_path: Path) -> None:
    one, two, three = network.hosts
    logs = {host.name: tmp_path / f"{host.name}.log" for host in network.hosts}
    announcers = [
        announce(one, logs[one.name], "alpha", 6222, 8000),
        announce(two, logs[two.name], "alpha", 6223, 8001),
        announce(three, logs[three.name], "beta", 6224, 8002),
    ]
    try:
        view = seen(logs[one.name], lambda view: names(view["cluster_peers"]) == {two.name})
        assert view["cluster_peers"] == [
            {
                "cluster": "alpha",
                "server_name": two.name,
                "node_id": f"node-{two.name}",
                "host": two.address,
                "route_port": 6223,
                "api_port": 8001,
                "proof": "",  # this test's announcers sign nothing
            }
        ]
        seen(
            logs[two.name],
            lambda view: [(p["host"], p["route_port"]) for p in view["cluster_peers"]] == [(one.address, 6222)],
        )
        view = seen(logs[three.name], lambda view: names(view["peers"]) == {one.name, two.name})
        assert view["cluster_peers"] == []
        seen(logs[one.name], lambda view: names(view["peers"]) == {two.name, three.name})

        two.link_down()
        time.sleep(KEPT_S)  # deliberate timing: time passes while it is gone, and a cluster peer is still kept
        seen(logs[one.name], lambda view: two.name in names(view["cluster_peers"]))
        two.link_up()

        # A clean goodbye (the service removed at once everywhere) does not forget the host either...
        announcers[1].terminate()
        announcers[1].wait(DEADLINE_S)
        time.sleep(KEPT_S)  # deliberate timing: time passes while it is gone, and a cluster peer is still kept
        seen(logs[one.name], lambda view: two.name in names(view["cluster_peers"]))
        # ...and its announcement after a restart replaces the one kept.
        announcers[1] = announce(two, tmp_path / "two-again.log", "alpha", 6230, 8030)
        view = seen(logs[one.name], lambda view: [p["route_port"] for p in view["cluster_peers"]] == [6230])
        assert view["cluster_peers"][0]["api_port"] == 8030
    finally:
        for announcer in announcers:
            announcer.kill()
            announcer.wait()
