"""Prometheus metrics of one API (`GET /metrics`), on a registry of its own, every family registered at start.

Measured here: HTTP requests and errors by route template and status, and per model the time to the first
token and between tokens, in the request path every dialect shares. Read at scrape time: the figures the
services publish on `jetshard.stats` (the `StatsBoard`) and the tasks in State.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from jetshard_schema.state import State
from jetshard_schema.stats import DownloadFigures, RunnerStats, SequencerStats
from jetshard_schema.types import Chunk
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from jetshard_api.stats import StatsBoard

TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 20.0, 40.0, 80.0)
"""From a few tens of milliseconds (a cached prefix on a small model) to over a minute (a long prompt behind a
full queue)."""
INTER_TOKEN_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
"""From a small model's decode step to a large batch's step on a ring of slow machines."""
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED_ROUTE = "unmatched"
"""The route label of a request no route matched: its raw path is anyone's to choose."""

# No `_created` series beside each counter and histogram (process-wide): twice the lines, and Prometheus
# reads a reset from the counter itself.
disable_created_metrics()


class ApiMetrics:
    def __init__(self, state: Callable[[], State], board: StatsBoard) -> None:
        self._state = state
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jetshard_http_requests",
            "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "code"],
            registry=self.registry,
        )
        self.errors = Counter(
            "jetshard_http_errors",
            "HTTP requests answered with a status of 400 or more, by route template, method and status code.",
            ["route", "method", "code"],
            registry=self.registry,
        )
        self.time_to_first_token = self._per_model_histogram(
            "jetshard_time_to_first_token_seconds",
            "From a task's submission (its model ready) to its first output, streaming or not, by model.",
            TIME_TO_FIRST_TOKEN_BUCKETS_S,
        )
        self.inter_token_latency = self._per_model_histogram(
            "jetshard_inter_token_latency_seconds",
            "Between two pieces of one choice's output (a piece is mostly one token), by model.",
            INTER_TOKEN_LATENCY_BUCKETS_S,
        )
        self.registry.register(ClusterCollector(state, board))

    def _per_model_histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, ["model"], buckets=buckets, registry=self.registry)

    def count_response(self, scope: Any, status: int) -> None:
        route = scope.get("path_template") or UNMATCHED_ROUTE
        method = scope.get("method", "")
        labels = (route, method if method in METHODS else "other", str(status))
        self.requests.labels(*labels).inc()
        if status >= 400:
            self.errors.labels(*labels).inc()

    def token_timer(self, model_id: str) -> TokenTimer:
        return TokenTimer(self, model_id)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition in the format `accept` prefers (Prometheus' text format by default), and its type."""
        for model_id in {instance.model_id for instance in self._state().instances.values()}:
            # Every served model's latency series, at zero before its first request.
            self.time_to_first_token.labels(model_id)
            self.inter_token_latency.labels(model_id)
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class TokenTimer:
    """One task's output times: its first output after `start`, then the gaps within each choice. A model's
    series starts with its first output: a request naming a model that does not exist adds none."""

    def __init__(self, metrics: ApiMetrics, model_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._model_id = model_id
        self._clock = clock
        self._started: float | None = None
        self._last: dict[int, float] = {}
        """When each choice's output last came."""

    def start(self) -> None:
        self._started = self._clock()

    def chunk(self, chunk: Chunk) -> None:
        if self._started is None or not (chunk.text or chunk.tool_calls):
            return  # an embedding, or only the end of the output
        now = self._clock()
        last = self._last.get(chunk.choice)
        if not self._last:
            self._metrics.time_to_first_token.labels(self._model_id).observe(now - self._started)
        elif last is not None:
            self._metrics.inter_token_latency.labels(self._model_id).observe(now - last)
        self._last[chunk.choice] = now


Row = TypeVar("Row")


@dataclass(frozen=True)
class _Series(Generic[Row]):
    """A family the collector fills at scrape time: a sample per row, of the row's `value`."""

    family: type[GaugeMetricFamily] | type[CounterMetricFamily]
    name: str
    documentation: str
    value: Callable[[Row], float]


def _families(
    series: Sequence[_Series[Row]], labels: list[str], rows: Iterable[tuple[list[str], Row]]
) -> Sequence[Metric]:
    """The series' families, with a sample per row (its label values, and each series' value of it)."""
    families = [s.family(s.name, s.documentation, labels=labels) for s in series]
    for label_values, row in rows:
        for s, family in zip(series, families, strict=True):
            family.add_metric(label_values, s.value(row))
    return families


INSTANCE_SERIES: tuple[_Series[RunnerStats], ...] = (
    _Series(
        GaugeMetricFamily,
        "jetshard_tokens_per_second",
        "Tokens an instance sampled per second, lately.",
        lambda s: s.tokens_per_s,
    ),
    _Series(
        CounterMetricFamily,
        "jetshard_generated_tokens",
        "Tokens an instance sampled since its leader runner started.",
        lambda s: s.counters.tokens,
    ),
    _Series(
        GaugeMetricFamily,
        "jetshard_batch_size",
        "Rows (a task's choices) in an instance's current decode step.",
        lambda s: s.batch_size,
    ),
    _Series(
        CounterMetricFamily,
        "jetshard_prefix_cache_hits",
        "Tasks whose prompt started from an instance's saved prefix cache.",
        lambda s: s.counters.prefix_hits,
    ),
    _Series(
        CounterMetricFamily,
        "jetshard_prefix_cache_hit_tokens",
        "Prompt tokens prefix-cache hits did not prefill.",
        lambda s: s.counters.prefix_hit_tokens,
    ),
    _Series(
        GaugeMetricFamily,
        "jetshard_prefix_cache_bytes",
        "Size of an instance's saved prefix caches.",
        lambda s: s.counters.prefix_cache_bytes,
    ),
    _Series(
        CounterMetricFamily,
        "jetshard_draft_tokens",
        "Tokens an instance drafted for its model to check (serving.draft).",
        lambda s: s.counters.drafted_tokens,
    ),
    _Series(
        CounterMetricFamily,
        "jetshard_draft_accepted_tokens",
        "Drafted tokens the model kept: over jetshard_draft_tokens, the acceptance rate.",
        lambda s: s.counters.accepted_tokens,
    ),
)
DOWNLOAD_SERIES: tuple[_Series[DownloadFigures], ...] = (
    _Series(
        GaugeMetricFamily,
        "jetshard_download_done_bytes",
        "Bytes of a download under way that are on disk.",
        lambda d: d.done_bytes,
    ),
    _Series(
        GaugeMetricFamily,
        "jetshard_download_expected_bytes",
        "Bytes a download under way fetches in all.",
        lambda d: d.expected_bytes,
    ),
)
SEQUENCER_SERIES: tuple[_Series[SequencerStats], ...] = (
    _Series(
        CounterMetricFamily,
        "jetshard_events_appended",
        "Events a sequencer appended since it started.",
        lambda s: s.events_appended,
    ),
    _Series(
        GaugeMetricFamily,
        "jetshard_sequencer_leader",
        "1 for the sequencer that leads.",
        lambda s: 1 if s.leading else 0,
    ),
    _Series(
        GaugeMetricFamily,
        "jetshard_sequencer_term",
        "The leadership term a sequencer leads (0: standing by).",
        lambda s: s.term,
    ),
)


class ClusterCollector:
    """Gauges and counters read at scrape time from the stats board and State."""

    def __init__(self, state: Callable[[], State], board: StatsBoard) -> None:
        self._state = state
        self._board = board

    def collect(self) -> Iterator[Metric]:
        yield from self._instances()
        yield from self._downloads()
        yield from self._sequencers()

    def _instances(self) -> Iterator[Metric]:
        labels = ["instance", "model"]
        rows = (([instance_id, stats.model_id], stats) for instance_id, stats in self._board.instances().items())
        yield from _families(INSTANCE_SERIES, labels, rows)
        queued = GaugeMetricFamily(
            "jetshard_tasks_queued", "Tasks assigned to an instance that have not started.", labels=labels
        )
        running = GaugeMetricFamily("jetshard_tasks_running", "Tasks an instance is running.", labels=labels)
        state = self._state()
        started = Tally(t.instance_id for t in state.tasks.values() if t.started)
        waiting = Tally(t.instance_id for t in state.tasks.values() if not t.started)
        for instance_id, instance in state.instances.items():
            queued.add_metric([instance_id, instance.model_id], waiting[instance_id])
            running.add_metric([instance_id, instance.model_id], started[instance_id])
        yield from (queued, running)

    def _downloads(self) -> Iterator[Metric]:
        rows = (
            ([node_id, download.model_id], download)
            for node_id, node in self._board.nodes().items()
            for download in (node.downloader.downloads if node.downloader else ())
        )
        yield from _families(DOWNLOAD_SERIES, ["node", "model"], rows)

    def _sequencers(self) -> Iterator[Metric]:
        rows = (([sequencer_id], stats) for sequencer_id, stats in self._board.sequencers().items())
        yield from _families(SEQUENCER_SERIES, ["sequencer"], rows)
