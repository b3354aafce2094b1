"""Prometheus `/metrics` and the services' stats on `jetshard.stats`, against the session's `dialect_cluster`
(a tiny llama model on one runner; every service publishes its stats every 0.5 s there), plus the stats
board's own rules without NATS.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec
import nats
import openai
import pytest
from helpers.dialects import DialectCluster
from helpers.harness import wait_for
from jetshard_api.stats import SILENT_INTERVALS, StatsBoard
from jetshard_schema.codec import encode
from jetshard_schema.ids import InstanceId, ModelId, NodeId
from jetshard_schema.stats import DownloaderStats, RunnerStats, decode_stats, stats_subject
from jetshard_schema.subjects import STATS_PREFIX
from jetshard_schema.types import ServingCounters
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(240)

FAMILIES = {
    "jetshard_http_requests",
    "jetshard_http_errors",
    "jetshard_time_to_first_token_seconds",
    "jetshard_inter_token_latency_seconds",
    "jetshard_tokens_per_second",
    "jetshard_generated_tokens",
    "jetshard_batch_size",
    "jetshard_tasks_queued",
    "jetshard_tasks_running",
    "jetshard_prefix_cache_hits",
    "jetshard_prefix_cache_hit_tokens",
    "jetshard_prefix_cache_bytes",
    "jetshard_download_done_bytes",
    "jetshard_download_expected_bytes",
    "jetshard_events_appended",
    "jetshard_sequencer_leader",
    "jetshard_sequencer_term",
}


def scrape(api: str) -> dict[str, list[Any]]:
    """Every jetshard_* family's samples, by family name."""
    response = httpx.get(f"{api}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = text_string_to_metric_families(response.text)
    return {f.name: f.samples for f in families if f.name.startswith("jetshard_")}


def value(families: dict[str, list[Any]], sample: str, **labels: str) -> float:
    """The sample's value where its labels include `labels` (0 when there is none yet)."""
    name = sample.rpartition("_")[0] if sample.endswith(("_total", "_count", "_sum")) else sample
    for s in families[name]:
        if s.name == sample and labels.items() <= s.labels.items():
            return float(s.value)
    return 0.0


def test_metrics_move_after_a_streaming_and_a_plain_chat(dialect_cluster: DialectCluster) -> None:
    api, model = dialect_cluster.api, dialect_cluster.model
    (instance_id,) = [i["instance_id"] for i in dialect_cluster.cluster.instances_of(model)]
    before = scrape(api)
    assert FAMILIES <= before.keys(), FAMILIES - before.keys()
    assert value(before, "jetshard_tasks_queued", instance=instance_id, model=model) == 0
    # The sequencer's stats have come in by now: one of them leads.
    assert wait_for(lambda: value(scrape(api), "jetshard_sequencer_leader") == 1, timeout=15), scrape(api)

    client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", timeout=120, max_retries=0)
    question = [{"role": "user", "content": "Count to ten"}]
    stream = client.chat.completions.create(model=model, messages=question, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    reply = client.chat.completions.create(model=model, messages=question, max_tokens=8)
    assert reply.choices[0].message.content

    after = scrape(api)
    route = {"route": "/v1/chat/completions", "method": "POST", "code": "200"}
    requests = "jetshard_http_requests_total"
    assert value(after, requests, **route) == value(before, requests, **route) + 2
    ttft = "jetshard_time_to_first_token_seconds_count"
    assert value(after, ttft, model=model) == value(before, ttft, model=model) + 2
    itl = "jetshard_inter_token_latency_seconds_count"
    assert value(after, itl, model=model) > value(before, itl, model=model)
    tokens = "jetshard_generated_tokens_total"
    assert wait_for(
        lambda: value(scrape(api), tokens, instance=instance_id) >= value(before, tokens, instance=instance_id) + 2,
        timeout=15,
    ), scrape(api)[tokens[: -len("_total")]]


def test_ids_in_requests_add_no_series(dialect_cluster: DialectCluster) -> None:
    """Routes are counted by their template, and a model that does not exist gets no latency series."""
    api = dialect_cluster.api
    assert httpx.get(f"{api}/instances/no-such-instance-4711", timeout=30).status_code == 404
    assert httpx.get(f"{api}/no/such/path/4711", timeout=30).status_code == 404
    chat = {"model": "org/no-such-model-4711", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    assert httpx.post(f"{api}/v1/chat/completions", json=chat, timeout=30).status_code == 404
    families = scrape(api)
    routes = {s.labels["route"] for s in families["jetshard_http_errors"] if s.name == "jetshard_http_errors_total"}
    assert {"/instances/{instance_id}", "unmatched", "/v1/chat/completions"} <= routes, routes
    labels = {v for samples in families.values() for s in samples for v in s.labels.values()}
    assert not any("4711" in label for label in labels), labels


async def test_the_leader_runner_publishes_its_stats(dialect_cluster: DialectCluster) -> None:
    client = await nats.connect(dialect_cluster.cluster.nats.url)
    try:
        subscription = await client.subscribe(f"{STATS_PREFIX}.node.*.runner.*")
        msg = await subscription.next_msg(timeout=15)
    finally:
        await client.close()
    stats = decode_stats(msg.data)
    assert isinstance(stats, RunnerStats)
    assert msg.subject == stats_subject(stats)
    assert stats.model_id == dialect_cluster.model
    assert stats.node_id == dialect_cluster.cluster.node_ids["node-a"]
    instances = await asyncio.to_thread(dialect_cluster.cluster.instances_of, dialect_cluster.model)
    assert stats.instance_id in {i["instance_id"] for i in instances}


# --- the stats board, without NATS -----------------------------------------------------------------------


def runner_stats(node: str, instance: str, tokens: int, interval_s: float = 2.0) -> RunnerStats:
    return RunnerStats(
        interval_s=interval_s,
        node_id=NodeId(node),
        instance_id=InstanceId(instance),
        model_id=ModelId("org/model"),
        counters=ServingCounters(tokens=tokens),
        tokens_per_s=0.0,
        batch_size=0,
        running_rows=0,
        queued_rows=0,
    )


def test_the_board_keeps_each_sources_latest_figures_and_forgets_silent_ones() -> None:
    now = [100.0]
    board = StatsBoard(clock=lambda: now[0])
    first, later = runner_stats("node-a", "inst-1", 5), runner_stats("node-a", "inst-1", 9)
    board.record(stats_subject(first), encode(first))
    board.record(stats_subject(later), encode(later))
    downloads = DownloaderStats(interval_s=2.0, node_id=NodeId("node-a"))
    board.record(stats_subject(downloads), encode(downloads))
    assert board.instances() == {"inst-1": later}
    node = board.nodes()["node-a"]
    assert node.runners == {"inst-1": later} and node.downloader == downloads

    now[0] += SILENT_INTERVALS * 2.0 + 0.1
    assert board.instances() == {} and board.nodes() == {}


def test_the_board_believes_a_message_only_on_its_sources_subject() -> None:
    board = StatsBoard()
    forged = runner_stats("node-b", "inst-2", 1)
    board.record(stats_subject(runner_stats("node-a", "inst-2", 0)), encode(forged))
    board.record(f"{STATS_PREFIX}.node.node-a.downloader", b"not stats")
    bad_id = msgspec.json.encode({**msgspec.to_builtins(forged), "node_id": "node.b"})
    board.record(f"{STATS_PREFIX}.node.node.b.runner.inst-2", bad_id)
    assert board.instances() == {} and board.nodes() == {}
