"""Hostile ids, as an attacker with access to NATS would send them: every id is validated when decoded, so
a bad command is rejected, a bad event is skipped with a warning, and nothing becomes a path.

The cluster is real: nats-server, the sequencer and a worker as processes; hostile messages are published
as raw JSON, the way a client that does not use this code would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers.cards import TINY_SHAPE, tiny_card
from helpers.harness import Cluster, until
from jetshard_bus.node import node_id_for
from jetshard_schema import subjects
from jetshard_schema.cards import MAX_HIDDEN_SIZE, Quantization
from jetshard_schema.codec import decode_command, decode_event, decode_state
from jetshard_schema.events import CommandRejected, CustomModelCardAdded
from jetshard_schema.ids import NAME_MAX_LENGTH, CommandId, ModelId
from jetshard_schema.types import RejectCode

pytestmark = pytest.mark.timeout(120)

CARD = {**TINY_SHAPE, "storage_size_bytes": 1000}
PROFILE = {"hostname": "h", "os": "linux", "cpu_cores": 2, "memory_total_bytes": 1, "memory_available_bytes": 1}
DONE = {"status": "completed"}


def place(instance_id: str, model_id: str = "org/model") -> tuple[str, dict[str, Any]]:
    return "PlaceInstance", {"instance_id": instance_id, "model_id": model_id}


def add_card(model_id: str, **lies: Any) -> tuple[str, dict[str, Any]]:
    return "AddCustomModelCard", {"card": {"model_id": model_id, **CARD, **lies}}


CARD_LIES: list[tuple[dict[str, Any], str]] = [
    # Each a card field that placement, listings or the dashboard would otherwise compute with or carry everywhere,
    # and what the refusal names.
    ({"quantization": {"bits": 4, "group_size": 0}}, "quantization.group_size"),
    ({"quantization": {"bits": 0, "group_size": 64}}, "quantization.bits"),
    ({"num_layers": 10**9}, "num_layers"),
    ({"num_layers": 2**64}, "num_layers"),
    ({"num_layers": "30"}, "num_layers"),
    ({"context_length": -5}, "context_length"),
    ({"hidden_size": 2, "num_attention_heads": 4, "num_key_value_heads": 4}, "num_attention_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"storage_size_bytes": 0}, "storage_size_bytes"),
    ({"parameter_count": -1}, "parameter_count"),
    ({"parameter_count": 10**20}, "parameter_count"),  # more weights than bits in any file
    ({"architecture": "../../../../etc/passwd"}, "architecture"),
    ({"display_name": "x" * 300}, "display_name"),
    ({"source_ref": "x" * 5000}, "source_ref"),
    ({"source_sha256": "not hex"}, "source_sha256"),
    ({"checkpoint_dtype": "int1"}, "checkpoint_dtype"),
    ({"capabilities": ["completion", "vision"]}, "capabilities"),  # a llama card: no vision tower
    ({"capabilities": ["tools"] * 1000}, "capabilities"),
]


FINISHED = {"node_id": "n", "task_id": "t", "instance_id": "i", "outcome": "stop"}
"""A task's end as its node reports it, but for the usage."""
ONE_TOKEN_EACH = {"prompt_tokens": 1, "completion_tokens": 1}


def escape_target(tmp_path: Path) -> Path:
    return tmp_path / "escaped"


def hostile_commands(tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    # Relative to any scratch directory under /tmp, this climbs to the root and back down into tmp_path.
    traversal = "../../../../../../.." + str(escape_target(tmp_path))
    return [
        place(traversal),
        place("inst/../../x"),
        place("x" * (NAME_MAX_LENGTH + 1)),
        place("inst-ok", model_id="../../etc"),
        add_card("../../../tmp/card"),
        add_card("org/" + "m" * 200),
        ("ReportNodeProfile", {"node_id": "../node", "session_id": "s", "profile": {}}),
        ("DeleteInstance", {"instance_id": "inst.>"}),
        # The placement fields: out of range, of the wrong type, or no value of their enum.
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "min_nodes": 2**63}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "min_nodes": 1.5}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"parallelism": "diagonal"}}),
        ("EnsureInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"weights": "float8"}}),
        # The engine fields: no engine of the enum, of the wrong type; formats and engines a node cannot have.
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"engine": "tensorrt"}}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"engine": ["llama.cpp"]}}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"kv_cache_type": "q2"}}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"draft": "../../etc"}}),
        ("EnsureInstance", {"instance_id": "i", "model_id": "org/model", "serving": {"draft": 7}}),
        ("ReportNodeProfile", {"node_id": "n", "session_id": "s", "profile": {**PROFILE, "engines": ["vllm"]}}),
        ("ReportDownloadProgress", {"node_id": "n", "model_id": "org/model", "progress": {**DONE, "formats": ["pt"]}}),
        # An import's id, path and report: a path no node has (too long), an id that would be a subject or a path.
        ("ImportModelFile", {"import_id": "../i", "node_id": "n", "model_id": "local/m", "path": "/m.gguf"}),
        ("ImportModelFile", {"import_id": "i", "node_id": "n", "model_id": "local/m", "path": "/" + "x" * 5000}),
        ("ImportModelFile", {"import_id": "i", "node_id": "n", "model_id": "local/m", "path": ""}),
        ("ReportModelImport", {"node_id": "n", "import_id": "i.>", "model_id": "local/m", "progress": DONE}),
        # No nodes named (not "choose for me", which leaving node_ids out means), or more than a cluster may hold.
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "node_ids": []}),
        ("PlaceInstance", {"instance_id": "i", "model_id": "org/model", "node_ids": [f"n{i}" for i in range(5000)]}),
        # A node's token counts of its own task: fewer than none, or more than any context holds.
        ("ReportTaskStarted", {"node_id": "n", "task_id": "t", "instance_id": "i", "prompt_tokens": -5}),
        ("ReportTaskStarted", {"node_id": "n", "task_id": "t", "instance_id": "i", "prompt_tokens": 2**70}),
        ("ReportTaskFinished", {**FINISHED, "usage": {"prompt_tokens": 1, "completion_tokens": 2**63}}),
        ("ReportTaskFinished", {**FINISHED, "usage": {"prompt_tokens": -1, "completion_tokens": 1}}),
        ("ReportTaskFinished", {**FINISHED, "usage": ONE_TOKEN_EACH, "last_chunk_index": -3}),
        # Cards that lie: each would break placement or every listing for as long as it stayed.
        *(add_card(f"org/liar-{n}", **lies) for n, (lies, _) in enumerate(CARD_LIES)),
    ]


def test_every_id_is_checked_when_decoded() -> None:
    """Nested ids too: tuple items and dict keys of State."""
    for command_type, body in hostile_commands(Path("/tmp")):
        data = json.dumps({"type": command_type, **body}).encode()
        with pytest.raises(msgspec.ValidationError):
            decode_command(data)
    with pytest.raises(msgspec.ValidationError, match=r"node_ids\[1\]"):
        decode_command(b'{"type":"PlaceInstance","instance_id":"i","model_id":"o/m","node_ids":["a","../b"]}')
    with pytest.raises(msgspec.ValidationError, match="key"):
        decode_state(b'{"custom_cards":{"../x":{}}}')


@pytest.mark.parametrize(("lies", "field"), CARD_LIES, ids=[field for _, field in CARD_LIES])
def test_a_card_that_lies_is_refused_naming_the_field(lies: dict[str, Any], field: str) -> None:
    """Where it is decoded (a command, an event, a snapshot, a request body), and where it is built in code (from a
    Hub repo's config.json) alike."""
    data = json.dumps({"type": "AddCustomModelCard", **add_card("org/liar", **lies)[1]}).encode()
    with pytest.raises(msgspec.ValidationError, match=re.escape(field)) as refused:
        decode_command(data)
    assert "at `$.card" in str(refused.value)
    if not isinstance(lies.get("num_layers"), str):  # a value of the wrong type is only met when decoding
        with pytest.raises(ValueError, match=re.escape(field)):
            quantization = lies.get("quantization")
            tiny_card("org/liar", **lies | ({"quantization": Quantization(**quantization)} if quantization else {}))


def test_a_hostile_event_decodes_to_nothing_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    envelope = {"command_id": "c1", "command_seq": 1, "index": 0, "count": 1, "at_ms": 0}
    card_added = {"type": "CustomModelCardAdded", "card": {"model_id": "../../x", **CARD}}
    with caplog.at_level(logging.WARNING):
        assert decode_event(json.dumps({**envelope, "event": card_added}).encode()) is None
        assert decode_event(json.dumps({**envelope, "command_id": "../c", "event": card_added}).encode()) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "CustomModelCardAdded" in warnings[0]


async def publish_raw(cluster: Cluster, command_type: str, body: dict[str, Any], command_id: str) -> None:
    await cluster.js.publish(
        subjects.command_subject(command_type, subjects.API_SENDER),
        json.dumps({"type": command_type, **body}).encode(),
        headers={subjects.MSG_ID_HEADER: command_id},
    )


async def rejection_of(cluster: Cluster, command_type: str, body: dict[str, Any], command_id: str) -> CommandRejected:
    outcome = cluster.follower.expect(CommandId(command_id))
    await publish_raw(cluster, command_type, body, command_id)
    (envelope,) = await asyncio.wait_for(outcome, 15)
    assert isinstance(envelope.event, CommandRejected), envelope
    return envelope.event


async def test_hostile_commands_are_rejected_and_the_worker_survives(cluster: Cluster, tmp_path: Path) -> None:
    config_dir = tmp_path / "node"
    cards = config_dir / "cards"
    cards.mkdir(parents=True)
    # What a crash, a clumsy operator or an older version may leave: none of it may stop the worker.
    (cards / "org--garbage.json").write_text("{not json")
    (cards / "a-directory.json").mkdir()
    (cards / "notes.txt").write_text("not a card")
    worker_tmp = tmp_path / "worker-tmp"
    worker_tmp.mkdir()
    worker = cluster.processes.start(
        "worker",
        "worker",
        env={
            **cluster.env,
            "JETSHARD_CONFIG_DIR": str(config_dir),
            "JETSHARD_NATS": cluster.nats.url,
            "TMPDIR": str(worker_tmp),
        },
    )
    node_id = node_id_for(config_dir)
    # It reconciles its card directory before it joins: the leftovers were dealt with by then.
    await cluster.wait(lambda s: node_id in s.nodes, 60, "the worker to join")

    for n, (command_type, body) in enumerate(hostile_commands(tmp_path)):
        rejected = await rejection_of(cluster, command_type, body, f"hostile-{n}")
        assert rejected.code is RejectCode.INVALID
        assert "malformed command" in rejected.reason, rejected
    # The command id itself becomes part of events and of the events' Nats-Msg-Id: it is checked too.
    before = len(cluster.events)
    await publish_raw(cluster, *add_card("org/fine"), command_id="../../id")

    def refuses_the_id(event: object) -> bool:
        return isinstance(event, CommandRejected) and "invalid command id" in event.reason

    # Found among the events, not taken as the next one: the worker's own reports may come first.
    state = await cluster.wait(
        lambda s: any(map(refuses_the_id, cluster.events[before:])), what="the bad command id's rejection"
    )
    assert ModelId("org/fine") not in state.custom_cards

    # Well-formed but impossible placements: a node named twice, and a tensor split of a card with the most heads a
    # card may have, which the sequencer must not try one node count at a time.
    most = MAX_HIDDEN_SIZE
    huge = {**CARD, "hidden_size": most, "num_attention_heads": most, "num_key_value_heads": most}
    await publish_raw(cluster, "AddCustomModelCard", {"card": {"model_id": "org/huge", **huge}}, "huge-card")
    for n, (node_ids, min_nodes) in enumerate((([node_id, node_id], 1), (None, 3))):
        body = {"instance_id": f"inst-{n}", "model_id": "org/huge", "min_nodes": min_nodes}
        body |= {"serving": {"parallelism": "tensor"}} | ({"node_ids": node_ids} if node_ids else {})
        rejected = await rejection_of(cluster, "PlaceInstance", body, f"impossible-{n}")
        assert rejected.code is RejectCode.INVALID, rejected
    # On MLX: a cache quantized in groups wider than the card's 1-value heads, and the model drafting for itself.
    mlx_refusals = (({"kv_cache_type": "q8_0"}, "heads are 1 wide"), ({"draft": "org/huge"}, "is the model itself"))
    for n, (serving, says) in enumerate(mlx_refusals):
        body = {"instance_id": f"mlx-{n}", "model_id": "org/huge", "serving": {"engine": "mlx", **serving}}
        rejected = await rejection_of(cluster, "PlaceInstance", body, f"impossible-mlx-{n}")
        assert rejected.code is RejectCode.INVALID and says in rejected.reason, rejected

    assert not escape_target(tmp_path).exists()
    assert worker.poll() is None, cluster.processes.log("worker")
    await cluster.add_card("org/after-attack", num_layers=2)
    await until(lambda: (cards / "org--after-attack.json").is_file(), 30, "the card file to be written")
    assert not (cards / "org--garbage.json").exists()  # not in State: removed
    assert (cards / "a-directory.json").is_dir()  # not removable as a file: left, with a warning
    assert "could not remove" in cluster.processes.log("worker")

    cluster.processes.kill(worker, signal.SIGTERM)
    assert list(worker_tmp.iterdir()) == []  # the runners' scratch directory went with the worker


async def test_a_hostile_event_is_skipped_and_the_cluster_goes_on(cluster: Cluster) -> None:
    """An event appended straight to JETSHARD_EVENTS, as anyone with write access to the stream could."""
    await cluster.add_card("org/before", num_layers=2)
    envelope = {"command_id": "forged", "command_seq": 1, "index": 0, "count": 1, "at_ms": 0}
    forged = {"type": "CustomModelCardAdded", "card": {"model_id": "../../../tmp/forged", **CARD}}
    seq = (
        await cluster.js.publish(
            subjects.event_subject("CustomModelCardAdded"), json.dumps({**envelope, "event": forged}).encode()
        )
    ).seq
    state = await cluster.wait(lambda s: s.last_seq >= seq, what="the follower to pass the forged event")
    assert set(state.custom_cards) == {ModelId("org/before")}
    assert not any(isinstance(e, CustomModelCardAdded) and "forged" in e.card.model_id for e in cluster.events), (
        cluster.events
    )
    # The sequencer's next append expected the old last sequence: it steps down, re-reads, and goes on.
    await cluster.add_card("org/after", num_layers=2)
    state = await cluster.wait(lambda s: ModelId("org/after") in s.custom_cards, what="a card after the forgery")
    assert set(state.custom_cards) == {ModelId("org/before"), ModelId("org/after")}
