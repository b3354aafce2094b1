"""`apply` for the download events and their wire round-trip."""

from __future__ import annotations

import logging

import msgspec
import pytest
from helpers.states import MODEL, A, downloaded, fold, raw_envelope
from jetshard_schema import codec
from jetshard_schema.events import (
    DownloadCancelled,
    DownloadDeleted,
    DownloadDeleteRequested,
    DownloadFailed,
    DownloadProgressed,
    DownloadRequested,
    Event,
    EventEnvelope,
)
from jetshard_schema.ids import CommandId, NodeId
from jetshard_schema.types import DownloadProgress, DownloadStatus

SAMPLES: list[Event] = [
    DownloadRequested(node_id=A, model_id=MODEL, start_layer=0, end_layer=4),
    DownloadProgressed(
        node_id=A,
        model_id=MODEL,
        progress=DownloadProgress(
            status=DownloadStatus.ONGOING,
            bytes_done=10,
            bytes_total=100,
            speed_bytes_per_s=5.0,
            eta_s=18.0,
            directory="/models",
        ),
    ),
    downloaded(A, MODEL, 0, 4, "/models", size=100),
    DownloadFailed(node_id=A, model_id=MODEL, reason="disk full"),
    DownloadCancelled(node_id=A, model_id=MODEL),
    DownloadDeleteRequested(node_id=A, model_id=MODEL),
    DownloadDeleted(node_id=A, model_id=MODEL),
]
COVERED = {type(e) for e in SAMPLES}


def test_requested_is_pending_over_its_layer_range() -> None:
    download = fold(SAMPLES[0]).download(A, MODEL)
    assert download is not None
    assert (download.progress.status, download.progress.start_layer, download.progress.end_layer) == (
        DownloadStatus.PENDING,
        0,
        4,
    )


def test_progress_moves_a_download_along_and_keeps_its_directory() -> None:
    state = fold(SAMPLES[0], SAMPLES[1])
    download = state.download(A, MODEL)
    assert download is not None
    assert download.progress.status is DownloadStatus.ONGOING
    assert (
        download.progress.bytes_done,
        download.progress.bytes_total,
        download.progress.eta_s,
        download.progress.directory,
    ) == (
        10,
        100,
        18.0,
        "/models",
    )
    state = fold(
        DownloadProgressed(
            node_id=A,
            model_id=MODEL,
            progress=DownloadProgress(status=DownloadStatus.PENDING, bytes_done=20, bytes_total=100),
        ),
        state=state,
    )
    download = state.download(A, MODEL)
    assert download is not None
    assert download.progress.status is DownloadStatus.PENDING
    assert download.progress.directory == "/models"  # an empty directory in a report keeps the known one


def test_progress_of_an_unknown_download_creates_it() -> None:
    download = fold(SAMPLES[1]).download(A, MODEL)
    assert download is not None
    assert download.progress.status is DownloadStatus.ONGOING


def test_completed() -> None:
    download = fold(SAMPLES[0], SAMPLES[1], SAMPLES[2]).download(A, MODEL)
    assert download is not None
    assert download.progress.status is DownloadStatus.COMPLETED
    assert (download.progress.bytes_done, download.progress.bytes_total, download.progress.directory) == (
        100,
        100,
        "/models",
    )


def test_requesting_a_range_inside_a_completed_download_keeps_it_completed() -> None:
    state = fold(SAMPLES[2], DownloadRequested(node_id=A, model_id=MODEL, start_layer=1, end_layer=3))
    download = state.download(A, MODEL)
    assert download is not None
    assert download.progress.status is DownloadStatus.COMPLETED
    wider = fold(DownloadRequested(node_id=A, model_id=MODEL, start_layer=0, end_layer=8), state=state)
    download = wider.download(A, MODEL)
    assert download is not None
    assert (download.progress.status, download.progress.end_layer) == (DownloadStatus.PENDING, 8)


def test_failed_and_cancelled_clear_speed_and_eta() -> None:
    failed = fold(SAMPLES[0], SAMPLES[1], SAMPLES[3]).download(A, MODEL)
    assert failed is not None
    assert (
        failed.progress.status,
        failed.progress.reason,
        failed.progress.speed_bytes_per_s,
        failed.progress.eta_s,
    ) == (
        DownloadStatus.FAILED,
        "disk full",
        0.0,
        None,
    )
    cancelled = fold(SAMPLES[0], SAMPLES[1], SAMPLES[4]).download(A, MODEL)
    assert cancelled is not None
    assert (cancelled.progress.status, cancelled.progress.speed_bytes_per_s, cancelled.progress.eta_s) == (
        DownloadStatus.CANCELLED,
        0.0,
        None,
    )


def test_delete_requested_then_deleted() -> None:
    state = fold(SAMPLES[2], SAMPLES[5])
    download = state.download(A, MODEL)
    assert download is not None
    assert download.deleting
    assert download.progress.status is DownloadStatus.COMPLETED
    state = fold(SAMPLES[6], state=state)
    assert state.download(A, MODEL) is None


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_envelope_round_trip(event: Event) -> None:
    envelope = EventEnvelope(command_id=CommandId("c3"), command_seq=2, index=0, count=1, at_ms=1, event=event)
    assert codec.decode_event(codec.encode(envelope)) == envelope


def test_state_json_round_trip() -> None:
    state = fold(
        SAMPLES[0],
        SAMPLES[1],
        DownloadRequested(node_id=NodeId("node-b"), model_id=MODEL, start_layer=4, end_layer=8),
    )
    assert codec.decode_state(codec.encode(state)) == state


def test_an_event_whose_body_is_not_an_object_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    body = raw_envelope([1, 2])
    with caplog.at_level(logging.WARNING, logger="jetshard_schema.codec"):
        assert codec.decode_event(msgspec.json.encode(body)) is None
