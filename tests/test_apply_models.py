"""`apply` for the model card events, their wire round-trip, and skipping event types from a newer version."""

from __future__ import annotations

import logging

import msgspec
import pytest
from helpers.cards import tiny_card
from helpers.states import MODEL, A, B, downloaded, fold, raw_envelope
from jetshard_schema import codec
from jetshard_schema.events import (
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadFailed,
    DownloadRequested,
    Event,
    EventEnvelope,
    ModelImportProgressed,
    ModelImportRequested,
    ModelSizeMeasured,
)
from jetshard_schema.ids import CommandId, ModelId
from jetshard_schema.models import all_cards, find_card
from jetshard_schema.state import FAILED_IMPORTS_KEPT, State
from jetshard_schema.types import ImportProgress, ImportStatus

CARD = tiny_card(MODEL, num_layers=8, vocab_size=1000, storage_size_estimated=True, is_custom=True)

SAMPLES: list[Event] = [
    CustomModelCardAdded(card=CARD),
    CustomModelCardDeleted(model_id=MODEL),
    ModelSizeMeasured(model_id=MODEL, storage_size_bytes=3 << 20),
    ModelImportRequested(import_id="imp-1", node_id=A, model_id=MODEL, path="/data/tiny.gguf"),
    ModelImportProgressed(
        import_id="imp-1",
        node_id=A,
        model_id=MODEL,
        progress=ImportProgress(status=ImportStatus.ONGOING, bytes_done=1, bytes_total=2),
    ),
]
COVERED = {type(e) for e in SAMPLES}


def test_card_added_then_deleted() -> None:
    state = fold(CustomModelCardAdded(card=CARD))
    assert state.custom_cards == {MODEL: CARD}
    assert find_card(state, MODEL) is not None
    state = fold(CustomModelCardDeleted(model_id=MODEL), state=state)
    assert state.custom_cards == {}
    assert find_card(state, MODEL) is None
    assert state.last_seq == 2


def test_deleting_a_card_forgets_its_downloads_on_every_node() -> None:
    """Not left behind as failed downloads of a model the cluster no longer knows; the files stay on the disks."""
    other = ModelId("acme/other")
    state = fold(
        CustomModelCardAdded(card=CARD),
        CustomModelCardAdded(card=tiny_card(other)),
        DownloadRequested(node_id=A, model_id=MODEL, start_layer=0, end_layer=8),
        DownloadFailed(node_id=A, model_id=MODEL, reason=f"unknown model {MODEL}: no card in the catalogue"),
        downloaded(B, MODEL, 0, 8),
        downloaded(B, other, 0, 4),
    )
    state = fold(CustomModelCardDeleted(model_id=MODEL), state=state)
    assert state.download(A, MODEL) is None and state.download(B, MODEL) is None
    assert state.download(B, other) is not None
    assert codec.decode_state(codec.encode(state)) == state


def test_a_stored_card_beyond_the_bounds_is_skipped_on_replay(caplog: pytest.LogCaptureFixture) -> None:
    """A card an older version accepted (a group size of 0, which divided by zero on every listing): a replica
    replaying the history skips it with a warning, and the events about it that follow apply without it."""
    lying = {**msgspec.to_builtins(CARD), "quantization": {"bits": 4, "group_size": 0}}
    stored = msgspec.json.encode(raw_envelope({"type": "CustomModelCardAdded", "card": lying}))
    with caplog.at_level(logging.WARNING, logger="jetshard_schema.codec"):
        assert codec.decode_event(stored) is None
    assert any("group_size" in r.getMessage() for r in caplog.records)
    state = fold(ModelSizeMeasured(model_id=MODEL, storage_size_bytes=7), CustomModelCardDeleted(model_id=MODEL))
    assert find_card(state, MODEL) is None
    # A snapshot holding it does not decode either (msgspec.DecodeError): `load_snapshot` then rebuilds State from
    # the first event, skipping the card as above.
    snapshot = msgspec.json.encode({"custom_cards": {MODEL: lying}})
    with pytest.raises(msgspec.DecodeError, match="group_size"):
        codec.decode_state(snapshot)


def test_deleting_an_unknown_card_changes_nothing_else() -> None:
    state = fold(CustomModelCardDeleted(model_id=ModelId("acme/none")))
    assert state == State(last_seq=1, last_command_seq=1)


def test_an_import_is_followed_until_a_newer_one_replaces_it_and_forgotten_with_its_card() -> None:
    first = "imp-1"
    state = fold(
        ModelImportRequested(import_id=first, node_id=A, model_id=MODEL, path="/data/tiny.gguf"),
        ModelImportProgressed(
            import_id=first,
            node_id=A,
            model_id=MODEL,
            progress=ImportProgress(status=ImportStatus.ONGOING, bytes_done=5, bytes_total=10),
        ),
    )
    assert state.imports[MODEL].progress.bytes_done == 5 and state.imports[MODEL].path == "/data/tiny.gguf"
    again = "imp-2"
    state = fold(
        ModelImportRequested(import_id=again, node_id=B, model_id=MODEL, path="/other/tiny.gguf"),
        # The first attempt's last word comes after the second began: it changes nothing.
        ModelImportProgressed(
            import_id=first, node_id=A, model_id=MODEL, progress=ImportProgress(status=ImportStatus.FAILED)
        ),
        state=state,
    )
    assert state.imports[MODEL].import_id == again and state.imports[MODEL].progress.status is ImportStatus.ONGOING
    state = fold(CustomModelCardAdded(card=CARD), CustomModelCardDeleted(model_id=MODEL), state=state)
    assert MODEL not in state.imports


def test_only_the_latest_failed_imports_are_kept() -> None:
    """A failed import leaves no card to delete, and its id is whatever the client named: State keeps the latest
    FAILED_IMPORTS_KEPT of them, so that failing imports cannot grow it without end."""
    failing = []
    for n in range(FAILED_IMPORTS_KEPT + 5):
        model_id, import_id = ModelId(f"spam/x{n}"), f"imp-{n}"
        failing += [
            ModelImportRequested(import_id=import_id, node_id=A, model_id=model_id, path="/nonexistent.gguf"),
            ModelImportProgressed(
                import_id=import_id, node_id=A, model_id=model_id, progress=ImportProgress(status=ImportStatus.FAILED)
            ),
        ]
    ongoing = ModelImportRequested(import_id="imp-live", node_id=A, model_id=MODEL, path="/data/tiny.gguf")
    state = fold(ongoing, *failing)
    failed = [m for m, record in state.imports.items() if record.progress.status is ImportStatus.FAILED]
    assert failed == [f"spam/x{n}" for n in range(5, FAILED_IMPORTS_KEPT + 5)]
    assert state.imports[MODEL].progress.status is ImportStatus.ONGOING  # one under way is never dropped


def test_measured_size_replaces_the_estimate() -> None:
    state = fold(CustomModelCardAdded(card=CARD), ModelSizeMeasured(model_id=MODEL, storage_size_bytes=3 << 20))
    assert state.measured_sizes == {MODEL: 3 << 20}
    card = find_card(state, MODEL)
    assert card is not None
    assert card.storage_size_bytes == 3 << 20
    assert not card.storage_size_estimated
    assert all_cards(state)[MODEL] == card


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trip(event: Event) -> None:
    envelope = EventEnvelope(command_id=CommandId("c2"), command_seq=9, index=1, count=2, at_ms=5, event=event)
    assert codec.decode_event(codec.encode(envelope)) == envelope


def test_state_json_round_trip() -> None:
    state = fold(CustomModelCardAdded(card=CARD), ModelSizeMeasured(model_id=MODEL, storage_size_bytes=7))
    assert codec.decode_state(codec.encode(state)) == state


def test_unknown_event_type_is_skipped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    body = raw_envelope({"type": "ModelTeleportedFromTheFuture", "model_id": MODEL})
    data = msgspec.json.encode(body)
    with caplog.at_level(logging.WARNING, logger="jetshard_schema.codec"):
        assert codec.decode_event(data) is None
        assert codec.decode_event(data) is None
    warnings = [r.getMessage() for r in caplog.records if "ModelTeleportedFromTheFuture" in r.getMessage()]
    assert len(warnings) == 1


def test_unknown_fields_of_a_known_event_are_ignored() -> None:
    event = {"type": "ModelSizeMeasured", "model_id": MODEL, "storage_size_bytes": 5, "new": 1}
    body = raw_envelope(event, added_later=True)
    envelope = codec.decode_event(msgspec.json.encode(body))
    assert envelope is not None
    assert envelope.event == ModelSizeMeasured(model_id=MODEL, storage_size_bytes=5)
