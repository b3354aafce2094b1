"""jetshard on a three-server NATS cluster (routes, R3 streams and buckets): one server dies mid-traffic.

Real parts: three nats-server processes on loopback, the services with `--nats` for each server and
`--replicas 3`, a tiny generated model served from the local Hub. Chats and commands run while a server is
killed; every acknowledged command must have its outcome, and the API must keep answering chats.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
from helpers.harness import InferenceCluster, free_port, hub_cluster, until
from helpers.tiny_models import make_tiny_model
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import spawn
from jetshard_schema.events import CustomModelCardAdded, EventEnvelope
from jetshard_schema.ids import CommandId
from test_sequencer import all_events, assert_gapless, outcomes_per_command
from test_supervision import publish_surely

from jetshard.up.natsserver import MAX_PAYLOAD_BYTES, NatsServer, nats_server_binary

MODEL = "jetshard-test/tiny-r3"
SERVERS = 3


def start_nats_cluster(root: Path) -> list[NatsServer]:
    client_ports = [free_port() for _ in range(SERVERS)]
    route_ports = [free_port() for _ in range(SERVERS)]
    servers = []
    for n in range(SERVERS):
        store = root / f"nats-{n}"
        store.mkdir(parents=True)
        routes = [f"nats-route://127.0.0.1:{port}" for i, port in enumerate(route_ports) if i != n]
        config = store / "nats-server.conf"
        config.write_text(
            f"server_name: n{n}\nlisten: 127.0.0.1:{client_ports[n]}\nmax_payload: {MAX_PAYLOAD_BYTES}\n"
            f"jetstream {{ store_dir: {json.dumps(str(store / 'jetstream'))} }}\n"
            f"cluster {{ name: jetshard-test\n listen: 127.0.0.1:{route_ports[n]}\n routes: {json.dumps(routes)} }}\n"
        )
        process = spawn([str(nats_server_binary()), "-c", str(config)], root / f"nats-{n}.log")
        servers.append(NatsServer(process, f"nats://127.0.0.1:{client_ports[n]}", store))
    asyncio.run(_wait_for_jetstream([s.url for s in servers]))
    return servers


async def _wait_for_jetstream(urls: list[str], timeout_s: float = 60) -> None:
    """Until the cluster has elected its JetStream meta leader (an account info request answers)."""
    client = await nats.connect(servers=urls, max_reconnect_attempts=-1)
    try:
        await until(
            client.jetstream().account_info,
            timeout_s,
            "the NATS cluster to elect a JetStream leader",
            interval_s=0.5,
            retry_on=(nats.errors.Error, TimeoutError),
        )
    finally:
        await client.close()


@pytest.fixture(scope="module")
def r3_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("r3")
    servers = start_nats_cluster(root)
    with hub_cluster(root, {"JETSHARD_REPLICAS": "3"}, nats_servers=servers) as cluster:
        cluster.hub.add_repo(MODEL, make_tiny_model(root / "repos" / "tiny-r3", num_files=1))
        cluster.servers = servers  # type: ignore[attr-defined]
        cluster.start_core()
        cluster.serve_one_node(MODEL)
        yield cluster


def chat(api: str) -> int:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
    try:
        response = httpx.post(f"{api}/v1/chat/completions", json=body, timeout=60)
    except httpx.HTTPError:
        return 0
    if response.status_code != 200:
        print(f"chat answered {response.status_code}: {response.text[:300]}")
    return response.status_code


@pytest.mark.timeout(240)
async def test_killing_one_of_three_nats_servers_loses_nothing_acked_and_the_api_keeps_serving(
    r3_cluster: InferenceCluster,
) -> None:
    servers: list[NatsServer] = r3_cluster.servers  # type: ignore[attr-defined]
    urls = tuple(s.url for s in servers)
    client, js = await connect(NatsOptions(servers=urls, replicas=3), "r3-test")
    acked: list[CommandId] = []
    chats: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def commands() -> None:
        n = 0
        while not stop.is_set():
            acked.append(await publish_surely(js, n, "r3"))
            n += 1
            await asyncio.sleep(0.01)  # deliberate pacing: a steady stream of commands, not a flood

    async def chats_loop() -> None:
        while not stop.is_set():
            chats.append((time.monotonic(), await asyncio.to_thread(chat, r3_cluster.api)))

    try:
        traffic = [asyncio.create_task(commands()), asyncio.create_task(chats_loop())]
        await asyncio.sleep(3)  # deliberate fault timing: traffic flows before the kill
        # Clients pick their server at random from the three URLs: some services lose theirs here.
        victim = servers[1]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        killed_at = time.monotonic()
        # Traffic flows on until chats started well after the kill were answered: a stream's leader election
        # takes up to ~15 s on a loaded 2-core machine, and a chat caught in it waits that long.
        await until(
            lambda: sum(1 for at, _ in chats if at > killed_at + 5) >= 3,
            120,
            lambda: f"three chats started after the kill to be answered: {chats[-3:]}",
        )
        stop.set()
        await asyncio.gather(*traffic)

        after_kill = [status for at, status in chats if at > killed_at + 5]
        assert after_kill and set(after_kill) == {200}, chats
        first_ok = min((at for at, status in chats if at > killed_at and status == 200), default=None)
        assert first_ok is not None
        failed_around_kill = [status for at, status in chats if status != 200]
        print(
            f"\n{len(acked)} commands acked, {len(chats)} chats ({len(failed_around_kill)} failed around the kill: "
            f"{failed_around_kill}); first chat answered {first_ok - killed_at:.2f} s after the kill"
        )

        # Nothing acked is lost: each acked command has exactly one outcome, in a gapless stream.
        per: dict[CommandId, list[EventEnvelope]] = {}

        async def every_acked_command_has_an_outcome() -> bool:
            nonlocal per
            per = outcomes_per_command(assert_gapless(await all_events(js)))
            return all(c in per for c in acked)

        missing = lambda: [c for c in acked if c not in per]  # noqa: E731
        await until(every_acked_command_has_an_outcome, 60, lambda: f"outcomes of {missing()}", interval_s=0.5)
        assert {c: [type(e.event) for e in per.get(c, [])] for c in acked} == {c: [CustomModelCardAdded] for c in acked}
        # Services reconnected to the other servers: the node is still alive and a new command is answered.
        async with httpx.AsyncClient(base_url=r3_cluster.api, timeout=30) as http:
            state = (await http.get("/state")).json()
            assert [n["node_id"] for n in state["nodes"].values()] == list(r3_cluster.node_ids.values())
            assert (await http.delete("/instances/missing")).status_code == 404
    finally:
        stop.set()
        await client.close()
