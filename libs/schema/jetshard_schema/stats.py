"""Figures each service publishes every few seconds on core NATS (`jetshard.stats.…`): never stored, never
events. Counters count since the publishing process started; the others say how things stand now. Each
message names its interval, so a reader knows when a silent source is gone.
"""

from __future__ import annotations

import msgspec

from jetshard_schema import subjects
from jetshard_schema.ids import ValidInstanceId, ValidModelId, ValidNodeId, ValidSessionId
from jetshard_schema.types import ServingCounters


class _Stats(msgspec.Struct, frozen=True, kw_only=True, tag=True, tag_field="type"):
    interval_s: float
    """How often the source publishes."""


class RunnerStats(_Stats, frozen=True, kw_only=True):
    """An instance's leader runner (`Instance.leader_node`'s): what the instance serves."""

    node_id: ValidNodeId
    instance_id: ValidInstanceId
    model_id: ValidModelId
    counters: ServingCounters
    tokens_per_s: float
    """Tokens sampled per second over the last interval."""
    batch_size: int
    """Rows (a task's choices) in the current decode step."""
    running_rows: int
    """Rows decoding or prefilling in the engine."""
    queued_rows: int
    """Rows waiting in the engine for a place in the batch."""


class DownloadFigures(msgspec.Struct, frozen=True, kw_only=True):
    model_id: ValidModelId
    done_bytes: int
    """Of the download's files, on disk (a resumed download counts what it had already)."""
    expected_bytes: int


class DownloaderStats(_Stats, frozen=True, kw_only=True):
    """A node's downloader: the downloads under way there."""

    node_id: ValidNodeId
    downloads: tuple[DownloadFigures, ...] = ()


class SequencerStats(_Stats, frozen=True, kw_only=True):
    """One sequencer, leading or standing by."""

    sequencer_id: ValidSessionId
    leading: bool
    term: int
    """The leader key's revision when this sequencer took the lease (it grows with every new term); 0 while
    standing by."""
    events_appended: int
    """Events this sequencer appended since it started."""


Stats = RunnerStats | DownloaderStats | SequencerStats

_decoder = msgspec.json.Decoder(Stats)  # type: ignore[arg-type]


def decode_stats(data: bytes) -> Stats:
    """Raises msgspec.DecodeError (a ValidationError for a bad id) for what is not stats."""
    return _decoder.decode(data)


def stats_subject(stats: Stats) -> str:
    """Where `stats` is published: permissions let each source publish on its own subjects only, so a
    reader believes a message only where its subject is the one its content names."""
    match stats:
        case RunnerStats(node_id=node_id, instance_id=instance_id):
            return subjects.runner_stats_subject(node_id, instance_id)
        case DownloaderStats(node_id=node_id):
            return subjects.downloader_stats_subject(node_id)
        case SequencerStats(sequencer_id=sequencer_id):
            return subjects.sequencer_stats_subject(sequencer_id)
