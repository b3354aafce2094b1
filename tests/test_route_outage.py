"""Routes after a pulled cable: core messages (a chat's chunks) cross again within seconds of the cable coming
back, even when one side gave up on its route connections meanwhile (its writes timed out) and the other still
holds them. That side refuses the peer's new connections as duplicates until a ping finds the old ones dead, and
nats-server pings routes only every 30 s unless told otherwise (`ROUTE_PING_INTERVAL_S`).

Real parts: two nats-servers configured as `jetshard up --lan` configures them, on hosts of a network-namespace
LAN (tests/helpers/netns.py); publisher and listener run inside the hosts (tests/helpers/lan_probe.py). `ss -K`
closes one side's route sockets while the cable is out, as a write deadline does on a busy route.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from helpers.harness import until_sync, wait_for
from helpers.lan_machines import PROBE
from helpers.netns import Host, lan

from jetshard.up.natsserver import ROUTE_PING_INTERVAL_S, ClusterSettings, ServerSettings, nats_server_binary

ROUTE_PORT, MONITOR_PORT = 6222, 8222
HEAL_DEADLINE_S = 4 * ROUTE_PING_INTERVAL_S
"""Pinged every 2 s, a half-dead route is found within one ping and the peer's next attempt (every second) takes
its place; nats-server's own 30 s pings leave it up to 30 s."""


def start_server(host: Host, peer: Host, root: Path) -> None:
    settings = ServerSettings(
        store_dir=root / host.name,
        monitor_port=MONITOR_PORT,
        cluster=ClusterSettings(
            name="outage",
            server_name=host.name,
            listen_host=host.address,
            route_port=ROUTE_PORT,
            secret="route-secret",
            routes=(f"{peer.address}:{ROUTE_PORT}",),
            jetstream=False,
        ),
    )
    settings.ports_dir.mkdir(parents=True)
    config = root / f"{host.name}.conf"
    config.write_text(settings.config())
    host.popen([str(nats_server_binary()), "-c", str(config)], root / f"{host.name}.log")


def route_connections(host: Host) -> int:
    """How many route connections the host's server holds (NATS pools several per peer); 0 while it starts."""
    answer = host.run([sys.executable, PROBE, "http", "GET", f"http://127.0.0.1:{MONITOR_PORT}/routez"])
    if answer.returncode != 0:
        return 0
    return json.loads(answer.stdout.strip().splitlines()[-1])["body"]["num_routes"]


def heard(out: Path) -> int:
    return len(out.read_text().splitlines()) if out.exists() else 0


@pytest.mark.timeout(180)
def test_messages_cross_again_within_seconds_of_a_cable_coming_back_whose_routes_one_side_gave_up(
    tmp_path: Path,
) -> None:
    with lan(2, "ro") as net:
        listening, publishing = net.hosts
        start_server(listening, publishing, tmp_path)
        start_server(publishing, listening, tmp_path)
        until_sync(
            lambda: route_connections(listening) > 0 and route_connections(publishing) > 0, 30, lambda: "routes formed"
        )
        out = tmp_path / "heard.txt"
        nats_url = "nats://127.0.0.1:4222"
        listening.popen([sys.executable, PROBE, "listen", nats_url, "probe.>", str(out)], tmp_path / "listen.log")
        publishing.popen([sys.executable, PROBE, "tick", nats_url, "probe.tick"], tmp_path / "tick.log")
        until_sync(lambda: heard(out) > 0, 30, lambda: "messages crossing the route before the outage")
        # Past the first ping a server sends on a new route (a second after it connects): the listening side has
        # nothing in flight while the cable is out, so only its next ping can find its route connections dead.
        time.sleep(2)

        publishing.link_down()
        closed = publishing.run(["ss", "-K", "dst", listening.address])
        if closed.returncode != 0 or not wait_for(lambda: route_connections(publishing) == 0, 5):
            pytest.skip(f"cannot close sockets here (`ss -K` needs CONFIG_INET_DIAG_DESTROY): {closed.stderr}")
        time.sleep(3)  # the publisher's server tries to connect again, and cannot
        before = heard(out)
        publishing.link_up()

        healed_s = until_sync(
            lambda: heard(out) > before,
            HEAL_DEADLINE_S,
            lambda: f"a message across the route within {HEAL_DEADLINE_S} s of the cable coming back",
        )
        print(f"\nmessages crossed again {healed_s:.1f} s after the cable came back")
