"""Every NATS name jetshard uses, in one place.

| name                        | kind                 | what                                                        |
| --------------------------- | -------------------- | ----------------------------------------------------------- |
| `JETSHARD_COMMANDS`         | stream (file)        | `jetshard.cmd.>`: requests; `Nats-Msg-Id` = command id      |
| `JETSHARD_EVENTS`           | stream (file)        | `jetshard.evt.>`: facts, written by the sequencer only      |
| `JETSHARD_TASKS`            | stream (file, TTL)   | `jetshard.task.<node>.<instance>.<task>`: a task's request  |
|                             |                      | (the prompt), stored before the task is submitted, under    |
|                             |                      | the node of the leader of the instance the API names; kept  |
|                             |                      | for the task retention                                      |
| `jetshard.cmd.api.<type>`   | subject              | a user's command, through an API (`submit_task`)            |
| `jetshard.cmd.sequencer.…`  | subject              | the sequencer's own observations (`expire_node`)            |
| `jetshard.cmd.node.<node>.` | subject              | what the node's worker or downloader reports about itself   |
| `<worker|downloader>.<type>`|                      | (`report_node_profile`): the sender is in the subject, and  |
|                             |                      | the sequencer refuses a body about anything else            |
| `jetshard.evt.<type>`       | subject              | one event (`custom_model_card_added`)                       |
| `jetshard.chunks.<node>.`   | core NATS subject    | generated text of one task, not stored, published under the |
| `<task id>`                 |                      | node of its leader runner (the API takes no other node's)   |
| `jetshard.stats.…`          | core NATS subjects   | figures every few seconds, not stored (`stats.py`):         |
|                             |                      | `node.<node id>.runner.<instance id>` (an instance's leader |
|                             |                      | runner), `node.<node id>.downloader`,                       |
|                             |                      | `sequencer.<sequencer id>`                                  |
| `jetshard-snapshots`        | object store         | `state`: the State at some event sequence                   |
| `jetshard-leader`           | KV bucket, TTL       | `sequencer`: the id of the sequencer holding the lease      |
| `jetshard-liveness`         | KV bucket, TTL       | `<node id>`: the node's current session; gone = node lost   |

Key-value and object buckets are streams too (`KV_<bucket>`, `OBJ_<bucket>`); `ALL_STREAMS` names all six.
"""

from __future__ import annotations

import re

COMMANDS_STREAM = "JETSHARD_COMMANDS"
EVENTS_STREAM = "JETSHARD_EVENTS"
TASKS_STREAM = "JETSHARD_TASKS"
COMMAND_PREFIX = "jetshard.cmd"
TASK_PREFIX = "jetshard.task"
EVENT_PREFIX = "jetshard.evt"
CHUNK_PREFIX = "jetshard.chunks"
STATS_PREFIX = "jetshard.stats"

SNAPSHOT_BUCKET = "jetshard-snapshots"
SNAPSHOT_OBJECT = "state"
LEADER_BUCKET = "jetshard-leader"
LEADER_KEY = "sequencer"
LIVENESS_BUCKET = "jetshard-liveness"
REQUESTER_KEY_PREFIX = "api"
"""An API session's liveness key is `api.<session id>`: a node id holds no '.', so the two never meet."""

SEQUENCER_DURABLE = "jetshard-sequencer"


def requester_key(session_id: str) -> str:
    return f"{REQUESTER_KEY_PREFIX}.{session_id}"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


ALL_STREAMS = (
    COMMANDS_STREAM,
    EVENTS_STREAM,
    TASKS_STREAM,
    kv_stream(LEADER_BUCKET),
    kv_stream(LIVENESS_BUCKET),
    object_stream(SNAPSHOT_BUCKET),
)

MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_LAST_SEQUENCE_HEADER = "Nats-Expected-Last-Sequence"

_CAMEL_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")


def snake_case(type_name: str) -> str:
    return _CAMEL_BOUNDARY.sub("_", type_name).lower()


API_SENDER = "api"
SEQUENCER_SENDER = "sequencer"
WORKER_SENDER = "worker"
DOWNLOADER_SENDER = "downloader"


def command_subject(type_name: str, sender: str, node_id: str | None = None) -> str:
    """Where a command of `type_name` from `sender` travels: nodes' reports under their node, so that NATS
    permissions can let each node publish its own only."""
    if node_id is None:
        return f"{COMMAND_PREFIX}.{sender}.{snake_case(type_name)}"
    return f"{COMMAND_PREFIX}.node.{node_id}.{sender}.{snake_case(type_name)}"


def node_commands(node_id: str, sender: str) -> str:
    """Every command subject of one role (`worker`, `downloader`) of one node."""
    return f"{COMMAND_PREFIX}.node.{node_id}.{sender}.>"


def command_type_name(subject: str) -> str:
    """`submit_task` for `jetshard.cmd.api.submit_task`."""
    return subject.rsplit(".", 1)[-1]


def event_subject(type_name: str) -> str:
    return f"{EVENT_PREFIX}.{snake_case(type_name)}"


def task_subject(node_id: str, instance_id: str, task_id: str) -> str:
    """A task's request, under the node that reads it (its instance's leader) and the instance."""
    return f"{TASK_PREFIX}.{node_id}.{instance_id}.{task_id}"


def node_tasks(node_id: str) -> str:
    """Every request for a node's runners."""
    return f"{TASK_PREFIX}.{node_id}.>"


def chunk_subject(node_id: str, task_id: str) -> str:
    """A task's output as its leader's node publishes it."""
    return f"{CHUNK_PREFIX}.{node_id}.{task_id}"


def node_chunks(node_id: str) -> str:
    return f"{CHUNK_PREFIX}.{node_id}.>"


def task_chunks(task_id: str) -> str:
    """A task's output from any node: the API subscribes before the task is assigned, then keeps only what the
    node of its leader sent."""
    return f"{CHUNK_PREFIX}.*.{task_id}"


def chunk_sender(subject: str) -> str:
    """The node that published a chunk (`jetshard.chunks.<node>.<task>`)."""
    return subject.removeprefix(f"{CHUNK_PREFIX}.").split(".", 1)[0]


def node_stats_prefix(node_id: str) -> str:
    """Every stats subject of one node. Nodes sit under `node.` so that no node id can pass for a sequencer."""
    return f"{STATS_PREFIX}.node.{node_id}"


def runner_stats_subject(node_id: str, instance_id: str) -> str:
    return f"{node_stats_prefix(node_id)}.runner.{instance_id}"


def downloader_stats_subject(node_id: str) -> str:
    return f"{node_stats_prefix(node_id)}.downloader"


def sequencer_stats_subject(sequencer_id: str) -> str:
    return f"{STATS_PREFIX}.sequencer.{sequencer_id}"
