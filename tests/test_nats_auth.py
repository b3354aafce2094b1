"""Credentials and least privilege on NATS, against a real nats-server configured like `jetshard up`'s.

One cluster for the module (nats-server with nkey identities, a sequencer, an API and one node, each with
its own identity) serving a tiny model. Attacks come from clients holding the API's or a node's
credentials; afterwards the cluster must still answer a chat, and the server must have refused nothing
the services themselves needed.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import openai
import pytest
import pytest_asyncio
from helpers.harness import InferenceCluster, hub_cluster, until
from helpers.tiny_models import make_tiny_model
from jetshard_bus.auth import (
    ADMIN,
    API,
    DOWNLOADER,
    SEQUENCER,
    VIEWER,
    WORKER,
    Identity,
    cluster_identities,
    ensure_identity,
    server_authorization,
)
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.natsserver import NatsServer, start_nats_server
from jetshard_bus.node import node_id_for
from jetshard_bus.options import NatsOptions
from jetshard_bus.snapshots import save_snapshot, stream_created
from jetshard_bus.streams import declare
from jetshard_schema import subjects
from jetshard_schema.codec import encode
from jetshard_schema.events import CustomModelCardDeleted, EventEnvelope
from jetshard_schema.ids import CommandId, ModelId
from jetshard_schema.stats import DownloaderStats, RunnerStats, SequencerStats, decode_stats

MODEL = "jetshard-test/tiny-auth"
REFUSED_WITHIN_S = 1.5

pytestmark = pytest.mark.timeout(180)


class SecuredCluster(InferenceCluster):
    """The module's cluster, with each service's NATS identity and the one node's id."""

    identities: dict[str, Identity]
    node_id: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCluster]:
    root = tmp_path_factory.mktemp("nats-auth")
    (root / "logs").mkdir()
    node_id = node_id_for(root / "node-a" / "config")
    identities = cluster_identities(root / "creds", node_id)
    server = start_nats_server(
        root / "nats",
        port=-1,
        log_file=root / "logs" / "nats-server.log",
        authorization=server_authorization(list(identities.values())),
    )
    with hub_cluster(root, nats_servers=[server]) as cluster:
        c = SecuredCluster(**vars(cluster))
        c.identities, c.node_id = identities, node_id
        c.hub.add_repo(MODEL, make_tiny_model(root / "repos" / "tiny-auth", arch="llama", num_layers=4, num_files=2))
        base = c.base_env
        # Frequent snapshots: the sequencer writes (and replaces) some under its identity.
        c.processes.start("sequencer", "sequencer", "--snapshot-every", "5", env=_as(base, identities[SEQUENCER]))
        c.base_env = _as(base, identities[API])
        c.start_api()
        # One node: a worker and a downloader, each with the node's identity for its role.
        node_env = c.node_env("node-a")
        c.workers["node-a"] = c.processes.start("node-a-worker", "worker", env=_as(node_env, identities[WORKER]))
        c.downloaders["node-a"] = c.processes.start(
            "node-a-downloader", "downloader", env=_as(node_env, identities[DOWNLOADER])
        )
        c.wait_nodes(1)
        c.add_model(MODEL)
        c.wait_instance(c.place(MODEL, min_nodes=1))
        yield c


def _as(env: dict[str, str], identity: Identity) -> dict[str, str]:
    return {**env, "JETSHARD_NATS_NKEY": str(identity.seed_file)}


def _options(server: NatsServer, identity: Identity | None) -> NatsOptions:
    return NatsOptions(servers=(server.url,), nkey_file=str(identity.seed_file) if identity else None)


def _envelope(command_id: str, model_id: str) -> EventEnvelope:
    return EventEnvelope(
        command_id=CommandId(command_id),
        command_seq=1,
        index=0,
        count=1,
        at_ms=0,
        event=CustomModelCardDeleted(model_id=ModelId(model_id)),
    )


def _chat(cluster: SecuredCluster) -> str:
    client = openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    return reply.choices[0].message.content or ""


async def test_anonymous_client_is_refused(cluster: SecuredCluster) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(cluster.nats.url, allow_reconnect=False, connect_timeout=2)


class Attacker:
    """A client holding some role's credentials; records what the server refused it."""

    def __init__(self, server: NatsServer, identity: Identity) -> None:
        self._server = server
        self._identity = identity
        self.refusals: list[str] = []

    async def __aenter__(self) -> tuple[nats.NATS, nats.js.JetStreamContext]:
        async def on_error(error: Exception) -> None:
            self.refusals.append(str(error))

        self.client = await nats.connect(
            self._server.url, nkeys_seed=str(self._identity.seed_file), error_cb=on_error, allow_reconnect=False
        )
        return self.client, self.client.jetstream()

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()


@pytest_asyncio.fixture
async def admin(cluster: SecuredCluster) -> AsyncIterator[nats.js.JetStreamContext]:
    client, js = await connect(_options(cluster.nats, cluster.identities[ADMIN]), "test-admin")
    yield js
    await client.close()


async def _refused(attempt: object) -> None:
    """A publish or request the server refuses gets no answer: nats-py sees a timeout."""
    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
        await asyncio.wait_for(attempt, REFUSED_WITHIN_S)  # type: ignore[arg-type]


async def test_api_and_node_identities_cannot_forge_events_or_delete_streams(
    cluster: SecuredCluster, admin: nats.js.JetStreamContext
) -> None:
    before = await admin.stream_info(subjects.EVENTS_STREAM)
    card_removed = _envelope("forged", MODEL)
    for role in (API, WORKER, DOWNLOADER, VIEWER):
        attacker = Attacker(cluster.nats, cluster.identities[role])
        async with attacker as (_, js):
            leader = await js.key_value(subjects.LEADER_BUCKET)
            await asyncio.gather(
                _refused(js.publish(card_removed.event.subject, encode(card_removed))),
                _refused(js.delete_stream(subjects.EVENTS_STREAM)),
                _refused(js.purge_stream(subjects.EVENTS_STREAM)),
                _refused(js.delete_stream(subjects.COMMANDS_STREAM)),
                _refused(leader.delete(subjects.LEADER_KEY)),
            )
        refused = {m.group(1) for r in attacker.refusals if (m := re.search(r'violation for publish to "(.+)"', r))}
        assert refused == {
            card_removed.event.subject,
            f"$js.api.stream.delete.{subjects.EVENTS_STREAM}".lower(),
            f"$js.api.stream.purge.{subjects.EVENTS_STREAM}".lower(),
            f"$js.api.stream.delete.{subjects.COMMANDS_STREAM}".lower(),
            f"$kv.{subjects.LEADER_BUCKET}.{subjects.LEADER_KEY}",
        }, (role, attacker.refusals)
    after = await admin.stream_info(subjects.EVENTS_STREAM)
    assert after.created == before.created
    assert after.state.first_seq == before.state.first_seq
    assert MODEL in {card["model_id"] for card in await asyncio.to_thread(cluster.get, "/models")}
    assert await asyncio.to_thread(_chat, cluster)


async def test_a_node_keeps_only_its_own_liveness_key(cluster: SecuredCluster) -> None:
    other_node = "node-someone-else"
    async with Attacker(cluster.nats, cluster.identities[WORKER]) as (_, js):
        kv = await js.key_value(subjects.LIVENESS_BUCKET)
        await _refused(kv.put(other_node, b"forged"))
        await _refused(kv.delete(other_node))
        assert await kv.put(cluster.node_id, b"its own")
    async with Attacker(cluster.nats, cluster.identities[API]) as (_, js):
        kv = await js.key_value(subjects.LIVENESS_BUCKET)
        await _refused(kv.delete(cluster.node_id))
    assert [n["node_id"] for n in await asyncio.to_thread(cluster.get, "/nodes")] == [cluster.node_id]


async def test_the_events_stream_refuses_deletes_and_purges_even_from_admin(
    admin: nats.js.JetStreamContext,
) -> None:
    info = await admin.stream_info(subjects.EVENTS_STREAM)
    assert info.config.deny_delete and info.config.deny_purge
    with pytest.raises(nats.js.errors.APIError):
        await admin.purge_stream(subjects.EVENTS_STREAM)
    with pytest.raises(nats.js.errors.APIError):
        await admin.delete_msg(subjects.EVENTS_STREAM, info.state.last_seq)


async def test_a_node_publishes_only_its_own_stats_and_the_viewer_reads_them(cluster: SecuredCluster) -> None:
    node = cluster.node_id
    attempts = {
        # role: (another's subject, its own)
        WORKER: (
            subjects.runner_stats_subject("node-someone-else", "forged"),
            subjects.runner_stats_subject(node, "x"),
        ),
        DOWNLOADER: (subjects.runner_stats_subject(node, "forged"), subjects.downloader_stats_subject(node)),
    }
    async with Attacker(cluster.nats, cluster.identities[VIEWER]) as (reader, _):
        heard = await reader.subscribe(f"{subjects.STATS_PREFIX}.>")
        for role, (forged, own) in attempts.items():
            attacker = Attacker(cluster.nats, cluster.identities[role])
            async with attacker as (client, _):
                await client.publish(forged, b"{}")
                await client.publish(own, b"{}")
                await client.flush()
                await until(lambda a=attacker: a.refusals, 5, f"the server to refuse {role}")  # type: ignore[misc]
            refused = {m.group(1) for r in attacker.refusals if (m := re.search(r'violation for publish to "(.+)"', r))}
            assert refused == {forged.lower()}, (role, attacker.refusals)
        kinds: set[type] = set()
        test_subjects: set[str] = set()
        while kinds != {RunnerStats, DownloaderStats, SequencerStats}:  # every service's, within a few intervals
            msg = await heard.next_msg(timeout=15)
            if msg.data == b"{}":
                test_subjects.add(msg.subject)
            else:
                kinds.add(type(decode_stats(msg.data)))
    assert test_subjects <= {own for _, own in attempts.values()}, test_subjects


def test_services_were_refused_nothing(cluster: SecuredCluster) -> None:
    """Every permission violation in the server's log came from an attacker above, none from a service."""
    assert _chat(cluster)
    log = (cluster.root / "logs" / "nats-server.log").read_text(errors="replace")
    violations = re.findall(r'Permissions Violation for (\w+) to "([^"]+)"', log)
    attacks = re.compile(
        r"^(jetshard\.evt\.|\$JS\.API\.STREAM\.(DELETE|PURGE)\.|\$KV\.jetshard-|jetshard\.stats\..*\.forged$)"
    )
    unexpected = sorted({v for v in violations if not attacks.match(v[1])})
    assert unexpected == [], unexpected


async def test_a_recreated_events_stream_is_rebuilt_from_not_skipped(tmp_path: Path) -> None:
    """A snapshot names the stream incarnation it was folded from: after the events stream is deleted and
    declared again, a follower ignores the old snapshot instead of skipping the new stream's events."""
    admin_identity = ensure_identity(tmp_path / "creds", ADMIN)
    server = start_nats_server(tmp_path / "nats", port=-1, authorization=server_authorization([admin_identity]))
    try:
        client, js = await connect(_options(server, admin_identity), "test-admin")
        for n in range(3):
            envelope = _envelope(f"c{n}", "m")
            await js.publish(envelope.event.subject, encode(envelope))
        follower = StateFollower(js)
        await follower.start()
        await follower.stop()
        await save_snapshot(js, follower.state, stream_created(await js.stream_info(subjects.EVENTS_STREAM)))
        assert follower.state.last_seq == 3

        await js.delete_stream(subjects.EVENTS_STREAM)
        await declare(js)
        envelope = _envelope("after", "m")
        await js.publish(envelope.event.subject, encode(envelope))
        rebuilt = StateFollower(js)
        await rebuilt.start()
        await rebuilt.stop()
        assert rebuilt.state.last_seq == 1
        await client.close()
    finally:
        server.stop()
