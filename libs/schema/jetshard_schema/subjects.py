"""Every NATS name jetshard uses, in one place.

| name                        | kind                 | what                                                        |
| --------------------------- | -------------------- | ----------------------------------------------------------- |
| `JETSHARD_COMMANDS`         | stream (file)        | `jetshard.cmd.>`: requests; `Nats-Msg-Id` = command id      |
| `JETSHARD_EVENTS`           | stream (file)        | `jetshard.evt.>`: facts, written by the sequencer only      |
| `JETSHARD_TASKS`            | stream (file, TTL)   | `jetshard.task.<task id>`: a task's request (the prompt),   |
|                             |                      | kept for the task retention only                            |
| `jetshard.cmd.<type>`       | subject              | one command, type in snake case (`add_custom_model_card`)   |
| `jetshard.evt.<type>`       | subject              | one event (`custom_model_card_added`)                       |
| `jetshard.chunks.<task id>` | core NATS subject    | generated text of one task, not stored                      |
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


def command_subject(type_name: str) -> str:
    return f"{COMMAND_PREFIX}.{snake_case(type_name)}"


def event_subject(type_name: str) -> str:
    return f"{EVENT_PREFIX}.{snake_case(type_name)}"


def task_subject(task_id: str) -> str:
    return f"{TASK_PREFIX}.{task_id}"


def chunk_subject(task_id: str) -> str:
    return f"{CHUNK_PREFIX}.{task_id}"


def node_stats_prefix(node_id: str) -> str:
    """Every stats subject of one node. Nodes sit under `node.` so that no node id can pass for a sequencer."""
    return f"{STATS_PREFIX}.node.{node_id}"


def runner_stats_subject(node_id: str, instance_id: str) -> str:
    return f"{node_stats_prefix(node_id)}.runner.{instance_id}"


def downloader_stats_subject(node_id: str) -> str:
    return f"{node_stats_prefix(node_id)}.downloader"


def sequencer_stats_subject(sequencer_id: str) -> str:
    return f"{STATS_PREFIX}.sequencer.{sequencer_id}"
