"""The latest figures every service publishes on `jetshard.stats.>`, as the API last heard them.

`StatsBoard.record` is the pure core (a message in, the board updated); `subscribe` is the NATS shell. A
source silent for `SILENT_INTERVALS` of its own interval is gone: its figures are dropped, not kept stale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from jetshard_schema.ids import InstanceId, NodeId
from jetshard_schema.stats import DownloaderStats, RunnerStats, SequencerStats, Stats, decode_stats, stats_subject
from jetshard_schema.subjects import STATS_PREFIX

log = logging.getLogger(__name__)

SILENT_INTERVALS = 3
"""How many of its intervals a source may miss before its figures are dropped."""


@dataclass(frozen=True)
class NodeStats:
    """A node's latest figures: its instances' leader runners, and its downloader."""

    runners: dict[InstanceId, RunnerStats] = field(default_factory=dict)
    downloader: DownloaderStats | None = None


class StatsBoard:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, tuple[float, Stats]] = {}
        """Per subject (one per source), the last figures and when they came."""
        self._sampled_at: dict[InstanceId, float] = {}
        """Per instance, when its leader last said it had sampled tokens since its figures before."""
        self._subscription: Any = None

    def record(self, subject: str, data: bytes) -> None:
        """Keep a message's figures; ignore what is not stats, or names a source other than its subject's
        (permissions hold each source to its own subjects, not to what it writes)."""
        try:
            stats = decode_stats(data)
        except msgspec.DecodeError as error:
            log.debug("ignoring %s: %s", subject, error)
            return
        if stats_subject(stats) != subject:
            log.debug("ignoring %s: its figures are another source's", subject)
            return
        now = self._clock()
        self._latest[subject] = (now, stats)
        if isinstance(stats, RunnerStats) and stats.tokens_per_s > 0:
            self._sampled_at[stats.instance_id] = now

    def sampled_at(self, instance_id: InstanceId) -> float:
        """When `instance_id`'s leader last reported tokens sampled (this board's clock); 0.0 if never: the sign
        that an instance is making progress, however slowly."""
        return self._sampled_at.get(instance_id, 0.0)

    def current(self) -> list[Stats]:
        """Every source's latest figures, oldest first (where two name one instance, the newer wins), those
        gone silent dropped."""
        now = self._clock()
        silent = [s for s, (at, stats) in self._latest.items() if now - at > SILENT_INTERVALS * stats.interval_s]
        for subject in silent:
            del self._latest[subject]
        return [stats for _, stats in sorted(self._latest.values(), key=lambda entry: entry[0])]

    def instances(self) -> dict[InstanceId, RunnerStats]:
        """Per instance, its leader runner's latest figures (tokens/s, batch size, counters)."""
        return {s.instance_id: s for s in self.current() if isinstance(s, RunnerStats)}

    def nodes(self) -> dict[NodeId, NodeStats]:
        """Per node, the latest figures of its runners and its downloader."""
        nodes: dict[NodeId, NodeStats] = {}
        for stats in self.current():
            if isinstance(stats, RunnerStats):
                node = nodes.setdefault(stats.node_id, NodeStats())
                node.runners[stats.instance_id] = stats
            elif isinstance(stats, DownloaderStats):
                nodes[stats.node_id] = NodeStats(nodes.get(stats.node_id, NodeStats()).runners, stats)
        return nodes

    def sequencers(self) -> dict[str, SequencerStats]:
        return {s.sequencer_id: s for s in self.current() if isinstance(s, SequencerStats)}

    async def subscribe(self, client: Any) -> None:
        async def on_stats(msg: Any) -> None:
            self.record(msg.subject, msg.data)

        self._subscription = await client.subscribe(f"{STATS_PREFIX}.>", cb=on_stats)

    async def close(self) -> None:
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            await subscription.unsubscribe()
