"""Sequencer throughput against raw JetStream under each fsync policy, and State rebuild time with and without
a snapshot.

Anchors (2-core machine): raw async publishing to a stream (ARCHITECTURE.md: ~35,000 msgs/s without fsync);
goal: commands -> events applied at a follower at >= 0.25 of the raw rate under the same policy; rebuilding
State from 100k events <= 1 s with a snapshot. The store is made under --dir: on a tmpfs an fsync costs nothing.

    uv run --group dev python bench/sequencer.py [--n 20000] [--rebuild 100000] \\
        [--fsync always --fsync interval] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from _common import nats_server
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.options import NatsOptions
from jetshard_bus.snapshots import save_snapshot, stream_created
from jetshard_schema import subjects
from jetshard_schema.cards import ModelCard
from jetshard_schema.codec import encode
from jetshard_schema.commands import AddCustomModelCard, ReportDownloadProgress
from jetshard_schema.events import DownloadProgressed, EventEnvelope
from jetshard_schema.ids import CommandId, ModelId, NodeId
from jetshard_schema.types import DownloadProgress, DownloadStatus
from nats.js.api import StreamConfig

FSYNC_POLICIES = ("always", "interval")
"""`sync_interval: always` (`jetshard up`'s servers) or nats-server's default (`jetshard up --fsync interval`)."""
RATIO_GOAL = 0.25
REBUILD_GOAL_S = 1.0


async def raw_publish_rate(url: str, n: int) -> float:
    client = await nats.connect(url)
    js = client.jetstream(publish_async_max_pending=20_000)
    await js.add_stream(StreamConfig(name="BENCH_SCRATCH", subjects=["bench.>"]))
    payload = b"x" * 200
    started = time.perf_counter()
    acks = [await js.publish_async(f"bench.{i % 16}", payload) for i in range(n)]
    await asyncio.gather(*acks)
    elapsed = time.perf_counter() - started
    await js.delete_stream("BENCH_SCRATCH")
    await client.close()
    return n / elapsed


BENCH_CARD = ModelCard(
    model_id=ModelId("bench/model"),
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    architecture="llama",
    storage_size_bytes=2**20,
    is_custom=True,
)
"""The card the commands report progress for: progress for a model without a card changes nothing (no event)."""


def progress(i: int) -> ReportDownloadProgress:
    return ReportDownloadProgress(
        model_id=BENCH_CARD.model_id,
        node_id=NodeId(f"node-{i % 4}"),
        progress=DownloadProgress(
            status=DownloadStatus.ONGOING, bytes_done=i, bytes_total=10**9, speed_bytes_per_s=1e6, directory="/models"
        ),
    )


async def sequencer_rate(url: str, n: int, log: Path) -> tuple[float, float]:
    """Events applied at a follower per second, for `n` commands through a real sequencer process."""
    client, js = await connect(NatsOptions(servers=(url,)), "bench")
    sequencer = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "jetshard", "sequencer", "--nats", url],
        stdout=open(log, "wb"),  # noqa: ASYNC230
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        kv = await js.key_value(subjects.LEADER_BUCKET)
        while True:  # wait until it leads
            try:
                await kv.get(subjects.LEADER_KEY)
                break
            except Exception:
                await asyncio.sleep(0.05)
        await publish_command(js, AddCustomModelCard(card=BENCH_CARD))
        follower = StateFollower(js)
        await follower.start()
        await follower.wait_until(lambda s: s.custom_cards.get(BENCH_CARD.model_id) is not None, 60)
        base = follower.state.last_seq
        commands = [(progress(i).subject, encode(progress(i)), CommandId(f"bench-{i}")) for i in range(n)]
        started = time.perf_counter()
        acks = [
            await js.publish_async(subject, data, headers={subjects.MSG_ID_HEADER: cid})
            for subject, data, cid in commands
        ]
        await asyncio.gather(*acks)
        published = time.perf_counter() - started
        await follower.wait_until(lambda s: s.last_seq >= base + n, 600)
        elapsed = time.perf_counter() - started
        await follower.stop()
        return n / elapsed, n / published
    finally:
        sequencer.terminate()
        sequencer.wait(10)
        await client.close()


async def rebuild_times(url: str, n: int) -> tuple[float, float, int]:
    client, js = await connect(NatsOptions(servers=(url,)), "bench-rebuild")
    info = await js.stream_info(subjects.EVENTS_STREAM)
    last = info.state.last_seq
    acks = []
    for i in range(n):
        event = DownloadProgressed(
            node_id=NodeId(f"node-{i % 8}"),
            model_id=ModelId(f"bench/m-{i % 50}"),
            progress=DownloadProgress(
                status=DownloadStatus.ONGOING, bytes_done=i, bytes_total=10**9, directory="/models"
            ),
        )
        envelope = EventEnvelope(
            command_id=CommandId(f"r-{i}"), command_seq=i + 1, index=0, count=1, at_ms=0, event=event
        )
        acks.append(await js.publish_async(event.subject, encode(envelope)))
    await asyncio.gather(*acks)
    total = last + n

    store = await js.object_store(subjects.SNAPSHOT_BUCKET)
    await store.delete(subjects.SNAPSHOT_OBJECT) if await _has_snapshot(store) else None
    started = time.perf_counter()
    follower = StateFollower(js)
    await follower.start(catch_up_timeout_s=600)
    without = time.perf_counter() - started
    assert follower.state.last_seq == total
    await follower.stop()

    await save_snapshot(js, follower.state, stream_created(await js.stream_info(subjects.EVENTS_STREAM)))
    started = time.perf_counter()
    again = StateFollower(js)
    await again.start()
    with_snapshot = time.perf_counter() - started
    assert again.state == follower.state
    await again.stop()
    await client.close()
    return without, with_snapshot, total


async def _has_snapshot(store) -> bool:
    try:
        await store.get_info(subjects.SNAPSHOT_OBJECT)
    except Exception:
        return False
    return True


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--rebuild", type=int, default=100_000)
    parser.add_argument(
        "--fsync",
        action="append",
        choices=FSYNC_POLICIES,
        help="the servers' fsync policy; repeat to compare [default: always, then interval]",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go [default: the temp directory]")
    args = parser.parse_args()
    policies: list[str] = args.fsync or list(FSYNC_POLICIES)
    rows: list[tuple[str, str, str]] = []
    events_rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for policy in policies:
            with nats_server(Path(tmp) / f"nats-{policy}", fsync=policy) as url:
                raw = await raw_publish_rate(url, args.n)
                log = Path(tmp) / f"sequencer-{policy}.log"
                events_per_s, commands_per_s = await sequencer_rate(url, args.n, log)
            events_rates[policy] = events_per_s
            ratio = events_per_s / raw
            rows += [
                (f"fsync {policy}: raw JetStream publish_async", f"{raw:,.0f} msgs/s", ""),
                (f"fsync {policy}: commands published (async)", f"{commands_per_s:,.0f} cmds/s", ""),
                (
                    f"fsync {policy}: commands -> events at a follower",
                    f"{events_per_s:,.0f} events/s",
                    f"ratio {ratio:.2f} (goal >= {RATIO_GOAL})",
                ),
            ]
        if args.rebuild:
            # Rebuilding reads the history back, which no fsync policy slows: only writing it would.
            with nats_server(Path(tmp) / "nats-rebuild", fsync="interval") as url:
                without, with_snapshot, total = await rebuild_times(url, args.rebuild)
            rows += [
                (f"State rebuild, {total:,} events, no snapshot", f"{without:.2f} s", ""),
                (f"State rebuild, {total:,} events, snapshot", f"{with_snapshot:.3f} s", f"goal <= {REBUILD_GOAL_S} s"),
            ]
    width = max(len(r[0]) for r in rows)
    print(f"\njetshard sequencer bench (N={args.n:,}, {os.cpu_count()} CPUs)")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>18}  {note}")
    if len(events_rates) == len(FSYNC_POLICIES):
        print(f"events/s, fsync always / interval: {events_rates['always'] / events_rates['interval']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
