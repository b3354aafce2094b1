"""Who may do what on NATS: an nkey identity per role, and each role's permissions, as data.

The server's configuration lists public keys only; each role's seed (its secret) lives in a 0600 file that
the role's processes read by path (`--nats-nkey FILE`), never on a command line.

| role                  | publishes, besides reads                                           | subscribes         |
| --------------------- | ------------------------------------------------------------------ | ------------------ |
| admin                 | anything (deletes and purges streams; `up` declares with it)       | anything           |
| sequencer             | events, its own commands (`jetshard.cmd.sequencer.>`), stream      | its inbox          |
|                       | create/update, command consumers, leader key, snapshots (and       |                    |
|                       | purging the previous snapshot's chunks), sequencer stats           |                    |
| api                   | users' commands (`jetshard.cmd.api.>`), task requests (prompts, to | chunks, stats, its |
|                       | JETSHARD_TASKS), its sessions' liveness keys                       | inbox              |
| worker (per node)     | its node's worker reports (`jetshard.cmd.node.<node>.worker.>`),   | its inbox          |
|                       | chunks under its node, its liveness key and runner stats; reads    |                    |
|                       | the task requests stored for its node only                         |                    |
| downloader (per node) | its node's downloader reports                                      | its inbox          |
|                       | (`jetshard.cmd.node.<node>.downloader.>`), downloader stats        |                    |
| viewer                | nothing (`jetshard state`, `jetshard events`)                      | stats, its inbox   |
| system                | the server's own API, in the system account: server reports, and   | anything there     |
|                       | removing a JetStream peer (`jetshard up --lan` keeps the topology) |                    |

An identity's inbox is `_INBOX.<its public key>.>`, where every reply to it comes (the client is told so by
`jetshard_bus.inbox`): an identity that could subscribe to all of `_INBOX.>` would read the replies to every
other one, a runner's request read included. The sequencer refuses a command that came on another subject than its
own (`handlers.misaddressed`), so a node's identity can report for that node only.

Every role but admin may read the event stream and the snapshots (stream info, an ordered consumer, a
message by sequence); none but admin may delete or purge `JETSHARD_EVENTS` or `JETSHARD_COMMANDS`.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import nkeys
from jetshard_bus.inbox import inbox_prefix, public_key_of
from jetshard_schema import subjects

ADMIN = "admin"
SEQUENCER = "sequencer"
API = "api"
VIEWER = "viewer"
WORKER = "worker"
DOWNLOADER = "downloader"
SYSTEM = "system"
SYSTEM_ACCOUNT = "SYS"

JS_API = "$JS.API"
SNAPSHOT_STREAM = subjects.object_stream(subjects.SNAPSHOT_BUCKET)
LIVENESS_STREAM = subjects.kv_stream(subjects.LIVENESS_BUCKET)
LEADER_STREAM = subjects.kv_stream(subjects.LEADER_BUCKET)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = ()
    """Besides the identity's own inbox."""
    publish_deny: tuple[str, ...] = field(
        default=(f"{subjects.EVENT_PREFIX}.>", f"{JS_API}.STREAM.DELETE.>", f"{JS_API}.STREAM.PURGE.>")
    )
    """Denied even where an allow above would match: what a role must never do, stated on its own."""


def _read_stream(stream: str) -> tuple[str, ...]:
    """An ordered consumer on `stream` (how followers and object-store reads fetch) and single-message reads."""
    return (
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.>",
        f"{JS_API}.CONSUMER.DELETE.{stream}.>",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


FOLLOW = (
    f"{JS_API}.INFO",
    f"{JS_API}.STREAM.NAMES",
    *(f"{JS_API}.STREAM.INFO.{stream}" for stream in subjects.ALL_STREAMS),
    *_read_stream(subjects.EVENTS_STREAM),
    *_read_stream(SNAPSHOT_STREAM),
)
"""Follow State: stream info, the events from a sequence, the snapshot."""

CHUNKS = f"{subjects.CHUNK_PREFIX}.>"
TASK_REQUESTS = f"{subjects.TASK_PREFIX}.>"
STATS = f"{subjects.STATS_PREFIX}.>"


def _liveness_key(node_id: str) -> str:
    return f"$KV.{subjects.LIVENESS_BUCKET}.{node_id}"


def _own_commands(sender: str) -> str:
    return f"{subjects.COMMAND_PREFIX}.{sender}.>"


def role_permissions(role: str, node_id: str | None = None) -> Permissions | None:
    """The permissions of `role` (None: unrestricted). Node roles need the node they speak for."""
    if role in (ADMIN, SYSTEM):
        return None
    if role == SEQUENCER:
        return Permissions(
            publish=(
                *FOLLOW,
                f"{subjects.EVENT_PREFIX}.>",
                _own_commands(subjects.SEQUENCER_SENDER),
                *(
                    f"{JS_API}.STREAM.{verb}.{stream}"
                    for verb in ("CREATE", "UPDATE")
                    for stream in subjects.ALL_STREAMS
                ),
                # Commands are read through a pull consumer per leadership term, acked once their events are stored.
                f"{JS_API}.CONSUMER.CREATE.{subjects.COMMANDS_STREAM}.>",
                f"{JS_API}.CONSUMER.DURABLE.CREATE.{subjects.COMMANDS_STREAM}.>",
                f"{JS_API}.CONSUMER.INFO.{subjects.COMMANDS_STREAM}.>",
                f"{JS_API}.CONSUMER.DELETE.{subjects.COMMANDS_STREAM}.>",
                f"{JS_API}.CONSUMER.MSG.NEXT.{subjects.COMMANDS_STREAM}.>",
                f"$JS.ACK.{subjects.COMMANDS_STREAM}.>",
                # A command whose delivery was lost on the way is read from the stream by its sequence.
                f"{JS_API}.STREAM.MSG.GET.{subjects.COMMANDS_STREAM}",
                f"$KV.{subjects.LEADER_BUCKET}.{subjects.LEADER_KEY}",
                *_read_stream(LEADER_STREAM),
                *_read_stream(LIVENESS_STREAM),
                f"$O.{subjects.SNAPSHOT_BUCKET}.>",
                # Replacing the snapshot purges the previous one's chunks, in its own bucket only.
                f"{JS_API}.STREAM.PURGE.{SNAPSHOT_STREAM}",
                subjects.sequencer_stats_subject("*"),
            ),
            publish_deny=(f"{JS_API}.STREAM.DELETE.>",),
        )
    if role == API:
        # Each API session keeps a liveness key of its own: the sequencer cancels a vanished session's tasks.
        api_liveness = _liveness_key(subjects.requester_key("*"))
        return Permissions(
            publish=(*FOLLOW, _own_commands(subjects.API_SENDER), TASK_REQUESTS, api_liveness),
            subscribe=(CHUNKS, STATS),
        )
    if role == VIEWER:
        return Permissions(publish=FOLLOW, subscribe=(STATS,))
    if role in (WORKER, DOWNLOADER):
        if node_id is None:
            raise ValueError(f"the {role} role belongs to a node: give its node id")
        if role == DOWNLOADER:
            return Permissions(
                publish=(
                    *FOLLOW,
                    subjects.node_commands(node_id, subjects.DOWNLOADER_SENDER),
                    subjects.downloader_stats_subject(node_id),
                )
            )
        return Permissions(
            publish=(
                *FOLLOW,
                subjects.node_commands(node_id, subjects.WORKER_SENDER),
                subjects.node_chunks(node_id),
                # A leader runner reads a request by its subject, which names the node: a read by sequence
                # (STREAM.MSG.GET, or DIRECT.GET with a body) could reach any node's.
                f"{JS_API}.DIRECT.GET.{subjects.TASKS_STREAM}.{subjects.node_tasks(node_id)}",
                subjects.runner_stats_subject(node_id, "*"),
                _liveness_key(node_id),
            ),
        )
    raise ValueError(f"unknown role {role!r}")


@dataclass(frozen=True)
class Identity:
    """One role's nkey: the seed file a client connects with, and the public key the server knows it by."""

    role: str
    seed_file: Path
    public_key: str
    node_id: str | None = None


def ensure_identity(creds_dir: Path, role: str, node_id: str | None = None) -> Identity:
    """The role's identity from `creds_dir`, created (0600) the first time, so restarts keep it."""
    creds_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    seed_file = creds_dir / (f"{role}-{node_id}.nk" if node_id else f"{role}.nk")
    if not seed_file.exists():
        seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
        temporary = seed_file.with_name(f".{seed_file.name}.{os.getpid()}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(seed + b"\n")
        os.replace(temporary, seed_file)
    return Identity(role=role, seed_file=seed_file, public_key=public_key_of(seed_file), node_id=node_id)


def server_authorization(identities: list[Identity]) -> str:
    """The nats-server `authorization` block admitting exactly these identities, each with its role's rights."""
    users = []
    system_users = [{"nkey": identity.public_key} for identity in identities if identity.role == SYSTEM]
    for identity in identities:
        if identity.role == SYSTEM:
            continue
        user: dict[str, object] = {"nkey": identity.public_key}
        permissions = role_permissions(identity.role, identity.node_id)
        if permissions is not None:
            inbox = f"{inbox_prefix(identity.public_key)}.>"
            user["permissions"] = {
                "publish": {"allow": list(permissions.publish), "deny": list(permissions.publish_deny)},
                "subscribe": {"allow": [inbox, *permissions.subscribe]},
            }
        users.append(user)
    # JSON is valid nats-server configuration syntax.
    blocks = f"authorization {json.dumps({'users': users}, indent=2)}\n"
    if system_users:
        # Users of the authorization block stay in the global account, where jetshard's streams are.
        blocks += (
            f"accounts {json.dumps({SYSTEM_ACCOUNT: {'users': system_users}})}\nsystem_account: {SYSTEM_ACCOUNT}\n"
        )
    return blocks


def cluster_identities(creds_dir: Path, node_id: str) -> dict[str, Identity]:
    """Every identity of a one-machine cluster (`jetshard up`), by role."""
    roles = {role: ensure_identity(creds_dir, role) for role in (ADMIN, SEQUENCER, API, VIEWER, SYSTEM)}
    return roles | {role: ensure_identity(creds_dir, role, node_id) for role in (WORKER, DOWNLOADER)}
