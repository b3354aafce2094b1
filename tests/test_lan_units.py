"""The pure parts of `jetshard up --lan`: join tokens, memberships, when the witness may go, server configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jetshard.lan.discovery import Peer
from jetshard.lan.jetstream import MetaGroup
from jetshard.lan.membership import (
    JoinToken,
    JoinTokenError,
    LanLayout,
    LanPorts,
    Membership,
    resolve_membership,
    signed,
    vouched,
)
from jetshard.up.natsserver import DATA_TAG, ClusterSettings, Fsync, ServerSettings

TOKEN = JoinToken.create("home")


def test_a_join_token_round_trips_and_carries_a_long_random_secret() -> None:
    assert JoinToken.parse(str(TOKEN)) == TOKEN
    assert JoinToken.parse(f"  {TOKEN}\n") == TOKEN  # as read from a file
    assert len(TOKEN.secret) >= 43 and JoinToken.create("home").secret != TOKEN.secret


@pytest.mark.parametrize(
    "text",
    [
        "",
        "jst1.home",
        f"jst2.home.{TOKEN.secret}",
        f"jst1..{TOKEN.secret}",
        f"jst1.a b.{TOKEN.secret}",
        f"jst1.{'x' * 33}.{TOKEN.secret}",
        "jst1.home.short",
        f'jst1.home.{TOKEN.secret}"; rm -rf /',
        f"jst1.home/../x.{TOKEN.secret}",
    ],
)
def test_anything_else_is_not_a_join_token(text: str) -> None:
    with pytest.raises(JoinTokenError, match="not a join token"):
        JoinToken.parse(text)


def test_a_first_start_founds_a_cluster_and_a_token_joins_one() -> None:
    founder = resolve_membership(None, None, None, "node-a")
    assert (founder.cluster, founder.founder, founder.joined) == ("jetshard", True, True)
    joiner = resolve_membership(None, founder.token, None, "node-b")
    assert (joiner.cluster, joiner.secret, joiner.founder, joiner.joined) == (
        "jetshard",
        founder.secret,
        False,
        False,
    )
    assert resolve_membership(None, None, "lab", "node-c").cluster == "lab"


def test_a_machine_stays_in_its_cluster() -> None:
    stored = resolve_membership(None, TOKEN, None, "node-b")
    assert resolve_membership(stored, None, None, "node-b") == stored
    assert resolve_membership(stored, TOKEN, "home", "node-b") == stored
    with pytest.raises(ValueError, match="belongs to cluster 'home'"):
        resolve_membership(stored, JoinToken.create("home"), None, "node-b")
    with pytest.raises(ValueError, match="not 'lab'"):
        resolve_membership(stored, None, "lab", "node-b")
    with pytest.raises(ValueError, match="is for cluster 'home', not 'lab'"):
        resolve_membership(None, TOKEN, "lab", "node-b")
    with pytest.raises(ValueError, match="cluster name"):
        resolve_membership(None, None, "../etc", "node-b")


def jsz(leader: str, peers: dict[str, bool]) -> dict[str, object]:
    return {"meta_cluster": {"leader": leader, "replicas": [{"name": n, "current": c} for n, c in peers.items()]}}


def test_the_witness_retires_only_once_three_data_servers_are_current() -> None:
    witness = "a-witness"
    two = MetaGroup.from_jsz("a", jsz("a", {witness: True, "b": True}))
    assert not two.witness_may_retire(witness)
    lagging = MetaGroup.from_jsz("a", jsz("a", {witness: True, "b": True, "c": False}))
    assert not lagging.witness_may_retire(witness)
    three = MetaGroup.from_jsz("a", jsz("a", {witness: True, "b": True, "c": True}))
    assert three.witness_may_retire(witness) and three.current == {"a", "b", "c", witness}
    assert not MetaGroup.from_jsz("a", {"meta_cluster": {"leader": "", "replicas": []}}).witness_may_retire(witness)
    assert MetaGroup.from_jsz("a", {"meta_cluster": "garbage"}) == MetaGroup(None, frozenset(), frozenset())


def test_a_clustered_server_config_routes_with_the_secret_and_tags_its_data(tmp_path: Path) -> None:
    membership = Membership(cluster="home", secret="s/e:c@ret", server_name="node-a", founder=True, joined=True)
    cluster = ClusterSettings(
        name=membership.cluster,
        server_name=membership.server_name,
        listen_host="10.0.0.5",
        route_port=6222,
        secret=membership.secret,
        routes=("10.0.0.6:6222",),
    )
    config = ServerSettings(tmp_path, 4222, cluster=cluster, monitor_port=8222).config()
    assert '"nats-route://jetshard:s%2Fe%3Ac%40ret@10.0.0.6:6222"' in config  # the secret quoted for a URL
    assert '"password": "s/e:c@ret"' in config and '"listen": "10.0.0.5:6222"' in config
    assert f'server_tags: ["{DATA_TAG}"]' in config and 'http: "127.0.0.1:8222"' in config
    assert 'listen: "127.0.0.1:4222"' in config  # clients stay on loopback
    joining = ServerSettings(tmp_path, cluster=dataclasses.replace(cluster, jetstream=False)).config()
    assert "jetstream: disabled" in joining and "store_dir" not in joining


def test_every_server_up_starts_syncs_writes_before_acknowledging_them_unless_told_not_to(tmp_path: Path) -> None:
    """A SIGKILLed nats-server loses nothing it acknowledged either way (the page cache survives it): only an OS
    crash or a power loss would show the difference, so the configurations are what is checked."""
    membership = Membership(cluster="home", secret="s", server_name="node-a", founder=True, joined=True)
    layout = LanLayout(tmp_path, membership, "10.0.0.5", LanPorts(client=4222, route=6222, monitor=8222), "")
    fast = dataclasses.replace(layout, fsync=Fsync.INTERVAL)
    routes = ("10.0.0.6:6222",)
    for durable, settings in (
        (True, ServerSettings(tmp_path)),  # a plain `jetshard up`
        (True, layout.server(routes, jetstream=True)),
        (True, layout.witness(routes)),
        (False, ServerSettings(tmp_path, fsync=Fsync.INTERVAL)),  # `jetshard up --fsync interval`
        (False, fast.server(routes, jetstream=True)),
        (False, fast.witness(routes)),
    ):
        config = settings.config()
        jetstream = config[config.index("jetstream {") :].split("}")[0]
        # `interval` leaves nats-server's own default, a sync every two minutes.
        assert jetstream.count("sync_interval") == jetstream.count("sync_interval: always") == durable, config


def test_only_an_announcement_signed_with_the_secret_for_its_own_address_is_a_member() -> None:
    peer = Peer(
        cluster="home", server_name="node-b", node_id="node-b", host="10.0.0.6", route_port=6222, api_port=52415
    )
    member = signed(peer, TOKEN.secret)
    assert vouched(member, TOKEN.secret)
    assert not vouched(peer, TOKEN.secret)  # unsigned: anyone may announce the name
    assert not vouched(member, JoinToken.create("home").secret)
    # A member's proof replayed for the announcer's own address or port (to collect the secret) fails.
    for forged in (dataclasses.replace(member, host="10.0.0.66"), dataclasses.replace(member, route_port=7222)):
        assert not vouched(forged, TOKEN.secret)
