"""`apply` for the node events (and CommandRejected), their wire round-trip, and tolerant decoding."""

from __future__ import annotations

import logging

import msgspec
import pytest
from helpers.states import A, fold, raw_envelope
from jetshard_schema import codec
from jetshard_schema.events import (
    CommandRejected,
    Event,
    EventEnvelope,
    NodeJoined,
    NodeLost,
    NodeStorageUpdated,
    NodeUpdated,
)
from jetshard_schema.ids import CommandId, ModelId, NodeId
from jetshard_schema.state import Download, State, apply
from jetshard_schema.types import DownloadProgress, DownloadStatus, ModelDirInfo, NodeProfile, NodeStorage, RejectCode

PROFILE = NodeProfile(
    hostname="a", os="Linux", cpu_cores=8, memory_total_bytes=32 << 30, memory_available_bytes=24 << 30
)
DIRS = (
    ModelDirInfo(path="/models", read_only=False, free_bytes=100 << 30, total_bytes=200 << 30),
    ModelDirInfo(path="/ro", read_only=True, free_bytes=0, total_bytes=50 << 30),
)
STORAGE = NodeStorage(model_dirs=DIRS, offline=True, available_models=(ModelId("acme/tiny"),))

SAMPLES: list[Event] = [
    CommandRejected(command_type="AddCustomModelCard", code=RejectCode.CONFLICT, reason="why"),
    NodeJoined(node_id=A, session_id="s1", profile=PROFILE),
    NodeUpdated(node_id=A, profile=PROFILE),
    NodeStorageUpdated(node_id=A, storage=STORAGE),
    NodeLost(node_id=A, reason="its liveness key expired"),
]
COVERED = {type(e) for e in SAMPLES}


def test_command_rejected_changes_nothing_but_the_sequences() -> None:
    state = apply(State(last_seq=6), SAMPLES[0], seq=7, command_seq=3)
    assert state == State(last_seq=7, last_command_seq=3)


def test_last_command_seq_never_goes_back() -> None:
    state = apply(State(last_command_seq=10), SAMPLES[0], seq=1, command_seq=4)
    assert state.last_command_seq == 10


def test_node_joined_then_rejoined_with_a_new_session() -> None:
    state = fold(NodeJoined(node_id=A, session_id="s1", profile=PROFILE))
    assert state.nodes[A].session_id == "s1"
    assert state.nodes[A].profile == PROFILE
    state = fold(NodeJoined(node_id=A, session_id="s2", profile=PROFILE), state=state)
    assert list(state.nodes) == [A]
    assert state.nodes[A].session_id == "s2"


def test_node_updated_changes_the_profile_of_a_known_node_only() -> None:
    smaller = msgspec.structs.replace(PROFILE, memory_available_bytes=1 << 30)
    state = fold(NodeJoined(node_id=A, session_id="s1", profile=PROFILE), NodeUpdated(node_id=A, profile=smaller))
    assert state.nodes[A].profile == smaller
    assert state.nodes[A].session_id == "s1"
    unknown = fold(NodeUpdated(node_id=NodeId("ghost"), profile=smaller))
    assert unknown.nodes == {}
    assert unknown.last_seq == 1


def test_node_storage_updated() -> None:
    state = fold(NodeStorageUpdated(node_id=A, storage=STORAGE))
    assert state.node_storage[A] == STORAGE


def test_node_lost_forgets_the_node_its_storage_and_downloads() -> None:
    other = NodeId("node-b")
    state = fold(
        NodeJoined(node_id=A, session_id="s1", profile=PROFILE),
        NodeJoined(node_id=other, session_id="s9", profile=PROFILE),
        NodeStorageUpdated(node_id=A, storage=STORAGE),
    )
    completed = DownloadProgress(status=DownloadStatus.COMPLETED, start_layer=0, end_layer=4)
    download = Download(node_id=A, model_id=ModelId("o/m"), progress=completed)
    state = msgspec.structs.replace(state, downloads={A: {download.model_id: download}})
    state = fold(NodeLost(node_id=A, reason="gone"), state=state)
    assert list(state.nodes) == [other]
    assert state.node_storage == {}
    assert state.downloads == {}


def test_apply_never_mutates_its_input() -> None:
    before = fold(NodeJoined(node_id=A, session_id="s1", profile=PROFILE))
    snapshot = codec.encode(before)
    fold(NodeLost(node_id=A, reason="gone"), state=before)
    assert codec.encode(before) == snapshot


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trip(event: Event) -> None:
    envelope = EventEnvelope(command_id=CommandId("c1"), command_seq=4, index=0, count=1, at_ms=123, event=event)
    assert codec.decode_event(codec.encode(envelope)) == envelope


def test_state_json_round_trip() -> None:
    state = fold(*SAMPLES[:4])
    assert codec.decode_state(codec.encode(state)) == state


def test_malformed_payload_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="jetshard_schema.codec"):
        assert codec.decode_event(b"{not json") is None
        assert codec.decode_event(b'{"command_id": "c"}') is None  # an envelope without its fields
    assert sum("malformed" in r.getMessage() for r in caplog.records) == 2


def test_event_with_a_wrong_field_type_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    body = raw_envelope({"type": "NodeLost", "node_id": 42, "reason": "x"})
    with caplog.at_level(logging.WARNING, logger="jetshard_schema.codec"):
        assert codec.decode_event(msgspec.json.encode(body)) is None
    # One warning per type per process: another test may have warned about NodeLost already.
    assert all(r.levelno == logging.WARNING for r in caplog.records)
