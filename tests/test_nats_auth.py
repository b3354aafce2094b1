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
from typing import Any

import nats
import nats.errors
import nats.js.errors
import openai
import pytest
import pytest_asyncio
from helpers.harness import InferenceCluster, hub_cluster, until
from helpers.states import envelope_of
from helpers.tiny_models import make_tiny_model
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.inbox import inbox_prefix
from jetshard_bus.node import node_id_for
from jetshard_bus.options import NatsOptions
from jetshard_bus.snapshots import save_snapshot, stream_created
from jetshard_bus.streams import declare
from jetshard_schema import subjects
from jetshard_schema.codec import encode
from jetshard_schema.commands import CancelTask, ReportDownloadDeleted, ReportDownloadProgress, ReportNodeProfile
from jetshard_schema.events import CommandRejected, CustomModelCardDeleted, EventEnvelope, TaskAssigned
from jetshard_schema.ids import CommandId, ModelId, NodeId, TaskId
from jetshard_schema.stats import DownloaderStats, RunnerStats, SequencerStats, decode_stats
from jetshard_schema.types import (
    Chunk,
    DownloadProgress,
    DownloadStatus,
    NodeProfile,
    RejectCode,
    TaskOutcome,
    Usage,
)

from jetshard.up.auth import (
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
from jetshard.up.natsserver import NatsServer, start_nats_server

MODEL = "jetshard-test/tiny-auth"
OTHER_NODE = "node-other"
ATTACKER = "attacker"
"""The client name of every attacking connection: the server's log names it beside each violation."""
REFUSED_WITHIN_S = 1.5

pytestmark = pytest.mark.timeout(180)


class SecuredCluster(InferenceCluster):
    """The module's cluster, with each service's NATS identity and the one node's id."""

    identities: dict[str, Identity]
    node_id: str
    other_node: dict[str, Identity]
    """The worker and downloader identities of another node, `OTHER_NODE`."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCluster]:
    root = tmp_path_factory.mktemp("nats-auth")
    (root / "logs").mkdir()
    node_id = node_id_for(root / "node-a" / "config")
    identities = cluster_identities(root / "creds", node_id)
    # Another machine of the cluster, which runs nothing here: the attacker holds its keys.
    other = {role: ensure_identity(root / "creds", role, OTHER_NODE) for role in (WORKER, DOWNLOADER)}
    server = start_nats_server(
        root / "nats",
        port=-1,
        log_file=root / "logs" / "nats-server.log",
        authorization=server_authorization([*identities.values(), *other.values()]),
    )
    with hub_cluster(root, nats_servers=[server]) as cluster:
        c = SecuredCluster(**vars(cluster))
        c.identities, c.node_id, c.other_node = identities, node_id, other
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
    return envelope_of(CustomModelCardDeleted(model_id=ModelId(model_id)), command_id)


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

        # The identity's own inbox, as its services use: the only one the server lets it subscribe to.
        self.client = await nats.connect(
            self._server.url,
            name=ATTACKER,
            nkeys_seed=str(self._identity.seed_file),
            inbox_prefix=inbox_prefix(self._identity.public_key),
            error_cb=on_error,
            allow_reconnect=False,
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


async def test_only_the_sequencer_reads_commands_by_sequence(cluster: SecuredCluster) -> None:
    """The sequencer reads a command from the stream where its delivery was lost on the way
    (test_sequencer.py forces that window open); no node may read others' commands so."""
    read = {"seq": 1, "subject": f"{subjects.COMMAND_PREFIX}.>", "next": True}
    client, js = await connect(_options(cluster.nats, cluster.identities[SEQUENCER]), "test-sequencer")
    try:
        first = await js.get_msg(subjects.COMMANDS_STREAM, **read)
        assert first.subject is not None and first.subject.startswith(f"{subjects.COMMAND_PREFIX}.")
    finally:
        await client.close()
    for role in (WORKER, API):
        async with Attacker(cluster.nats, cluster.identities[role]) as (_, attacker):
            await _refused(attacker.get_msg(subjects.COMMANDS_STREAM, **read))


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


SECRET = "my locker code is 4711"


def _secret_chat(cluster: SecuredCluster) -> str:
    client = openai.OpenAI(base_url=f"{cluster.api}/v1", api_key="unused", timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SECRET}], max_tokens=24, temperature=0
    )
    return reply.choices[0].message.content or ""


async def _subscribe_refused(client: nats.NATS, attacker: Attacker, subject: str) -> None:
    """A subscription the server refuses delivers nothing, and the refusal comes as an error."""
    before = len(attacker.refusals)
    await client.subscribe(subject)
    await client.flush()
    await until(lambda: len(attacker.refusals) > before, 5, f"the server to refuse a subscription to {subject}")
    assert "subscription" in attacker.refusals[-1].lower(), attacker.refusals[-1]


async def test_only_the_node_that_serves_a_task_reads_its_prompt(
    cluster: SecuredCluster, admin: nats.js.JetStreamContext
) -> None:
    await asyncio.to_thread(_secret_chat, cluster)
    stored = await admin.get_msg(subjects.TASKS_STREAM, (await admin.stream_info(subjects.TASKS_STREAM)).state.last_seq)
    assert SECRET in (stored.data or b"").decode() and stored.subject is not None
    assert stored.subject.startswith(f"{subjects.TASK_PREFIX}.{cluster.node_id}.")  # under the node that served it
    seq = stored.seq
    for identity in (cluster.other_node[WORKER], cluster.other_node[DOWNLOADER], cluster.identities[DOWNLOADER]):
        attacker = Attacker(cluster.nats, identity)
        async with attacker as (client, js):
            await _refused(js.get_msg(subjects.TASKS_STREAM, seq))
            await _refused(js.get_msg(subjects.TASKS_STREAM, seq, direct=True))
            await _refused(js.get_msg(subjects.TASKS_STREAM, subject=stored.subject, direct=True))
            if identity.role == WORKER:
                # Its own node's read, asked with a body that names another node's message instead.
                own = subjects.task_subject(identity.node_id or "", "inst", "task")
                try:
                    reply = await client.request(
                        f"$JS.API.DIRECT.GET.{subjects.TASKS_STREAM}.{own}", f'{{"seq": {seq}}}'.encode(), timeout=2
                    )
                    assert SECRET.encode() not in reply.data, reply
                except nats.errors.Error:
                    pass
            for subject in (f"{subjects.TASK_PREFIX}.>", "_INBOX.>", f"{subjects.CHUNK_PREFIX}.>"):
                await _subscribe_refused(client, attacker, subject)
    # The node that served it may read it, by its subject only.
    async with Attacker(cluster.nats, cluster.identities[WORKER]) as (_, js):
        mine = await js.get_msg(subjects.TASKS_STREAM, subject=stored.subject, direct=True)
        assert SECRET in (mine.data or b"").decode()
        await _refused(js.get_msg(subjects.TASKS_STREAM, seq))


async def test_chunks_from_a_node_that_does_not_run_the_task_are_not_its_answer(cluster: SecuredCluster) -> None:
    """The attacker follows the events as every node may, and answers each task the moment it is assigned, before
    its runner has read the prompt: on its own node's subject (which NATS allows) and on the serving node's."""
    honest = await asyncio.to_thread(_chat, cluster)
    attacker = Attacker(cluster.nats, cluster.other_node[WORKER])
    forged: list[str] = []
    sends: list[asyncio.Future[None]] = []
    async with attacker as (client, js):
        follower = StateFollower(js)

        def answer_first(envelope: EventEnvelope, state: object, live: bool) -> None:
            if live and isinstance(envelope.event, TaskAssigned):
                task_id = envelope.event.task.task_id
                chunk = Chunk(
                    task_id=task_id,
                    index=0,
                    text="FORGED",
                    finish_reason=TaskOutcome.STOP,
                    usage=Usage(prompt_tokens=1, completion_tokens=1),
                )
                for node in (OTHER_NODE, cluster.node_id):
                    sends.append(
                        asyncio.ensure_future(client.publish(subjects.chunk_subject(node, task_id), encode(chunk)))
                    )
                forged.append(task_id)

        follower.add_listener(answer_first)
        await follower.start()
        try:
            attacked = await asyncio.to_thread(_chat, cluster)
        finally:
            await follower.stop()
        await asyncio.gather(*sends)
        await client.flush()
    assert forged, "the attacker saw no task"
    assert attacked == honest and "FORGED" not in attacked
    assert any(
        f'"{subjects.chunk_subject(cluster.node_id, forged[0])}"'.lower() in r.lower() for r in attacker.refusals
    )


async def test_a_node_speaks_for_itself_only(cluster: SecuredCluster, admin: nats.js.JetStreamContext) -> None:
    """Reports about another node, and users' commands, are refused by NATS on their own subjects; published on
    the attacker's own subjects, the sequencer refuses them for not belonging there."""
    node = NodeId(cluster.node_id)
    before = await asyncio.to_thread(cluster.get, "/state")
    huge = NodeProfile(
        hostname="evil", os="Linux", cpu_cores=256, memory_total_bytes=2 * 10**12, memory_available_bytes=2 * 10**12
    )
    failed = DownloadProgress(status=DownloadStatus.FAILED, reason="forged")
    task = TaskId("someone-elses-task")
    worker_forgeries = [
        ReportNodeProfile(node_id=NodeId("node-invented"), session_id="s", profile=huge),
        ReportNodeProfile(node_id=node, session_id="forged-session", profile=huge),
        CancelTask(task_id=task),
    ]
    downloader_forgeries = [
        ReportDownloadProgress(node_id=node, model_id=ModelId(MODEL), progress=failed),
        ReportDownloadDeleted(node_id=node, model_id=ModelId(MODEL)),
        ReportNodeProfile(node_id=node, session_id="forged-session", profile=huge),  # its own node, not its role
    ]
    follower = StateFollower(admin)
    await follower.start()
    try:
        for identity, forgeries in (
            (cluster.other_node[WORKER], worker_forgeries),
            (cluster.other_node[DOWNLOADER], downloader_forgeries),
            (cluster.identities[DOWNLOADER], downloader_forgeries[-1:]),
        ):
            async with Attacker(cluster.nats, identity) as (_, js):
                for n, command in enumerate(forgeries):
                    await _refused(publish_command(js, command))
                    if identity.node_id == OTHER_NODE:
                        own = subjects.command_subject(type(command).__name__, identity.role, identity.node_id)
                        command_id = CommandId(f"forged-{identity.role}-{n}")
                        outcome = follower.expect(command_id)
                        await js.publish(own, encode(command), headers={subjects.MSG_ID_HEADER: command_id})
                        (envelope,) = await asyncio.wait_for(outcome, 15)
                        assert isinstance(envelope.event, CommandRejected), envelope
                        assert envelope.event.code is RejectCode.FORBIDDEN, envelope.event
    finally:
        await follower.stop()
    after = await asyncio.to_thread(cluster.get, "/state")
    # What a forgery would have changed: who the nodes are and what they hold. (The real worker's own reports
    # may move a profile's free memory meanwhile.)
    assert _who(after) == _who(before) and after["downloads"] == before["downloads"]
    assert await asyncio.to_thread(_chat, cluster)


def _who(state: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Each node's session, hostname and core count, by node id."""
    return {
        node_id: (node["session_id"], node["profile"]["hostname"], node["profile"]["cpu_cores"])
        for node_id, node in state["nodes"].items()
    }


VIOLATION = re.compile(r' - "([^"]*)" - "[^"]*" - (\w+) Violation - Subject "([^"]+)"')


def test_services_were_refused_nothing(cluster: SecuredCluster) -> None:
    """Every permission violation in the server's log came from an attacker above, none from a service."""
    assert _chat(cluster)
    log = (cluster.root / "logs" / "nats-server.log").read_text(errors="replace")
    violations = VIOLATION.findall(log)
    assert any(client.endswith(f":{ATTACKER}") for client, _, _ in violations)  # the log's format is understood
    unexpected = sorted({(kind, subject) for client, kind, subject in violations if not client.endswith(ATTACKER)})
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
