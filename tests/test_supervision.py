"""`jetshard up` heals what dies, and the API says at once when NATS cannot be reached.

Real processes throughout: `jetshard up --no-model` with its embedded nats-server, commands published with
the bus library, every service and the server killed with SIGKILL in turn. Recovery times are printed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats.errors
import psutil
import pytest
from helpers.harness import api_until, free_port, limit_message_size, until, wait_for
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import spawn
from jetshard_schema.events import CustomModelCardAdded
from jetshard_schema.ids import CommandId
from jetshard_schema.subjects import COMMANDS_STREAM, DOWNLOADER_SENDER, LIVENESS_BUCKET, command_subject
from test_demo_model import ctrl_c, processes_mentioning, start_in_own_group, up_command
from test_sequencer import add_card, all_events, assert_gapless, outcomes_per_command

from jetshard.up.natsserver import start_nats_server
from jetshard.up.supervisor import Supervisor

FAULTS = ("sequencer", "api", "worker", "downloader", "nats-server")
COMMANDS = 1000


async def storage_reports(js: Any) -> int:
    """How many disk reports (ReportNodeStorage commands) downloaders have published."""
    subject = command_subject("ReportNodeStorage", DOWNLOADER_SENDER, "*")
    info = await js.stream_info(COMMANDS_STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


def service_process(up: psutil.Process, name: str) -> psutil.Process:
    """The process `up` runs as `name` right now (it changes with every restart)."""
    for child in up.children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if name == "nats-server" and Path(cmdline[0]).name == "nats-server":
            return child
        if cmdline[1:4] == ["-m", "jetshard", name]:
            return child
    raise AssertionError(f"`up` runs no {name}")


async def publish_surely(js: Any, n: int, prefix: str = "chaos") -> CommandId:
    """Publish until stored: across a server restart, a re-sent command is stored once (same id)."""
    command_id = CommandId(f"{prefix}-{n}")
    while True:
        try:
            await publish_command(js, add_card(f"{prefix}-{n}"), command_id, timeout_s=2)
            return command_id
        except (nats.errors.Error, TimeoutError):
            await asyncio.sleep(0.2)  # deliberate: a pause between retries while the server restarts


# A service restarting: not yet.
RESTARTING = (httpx.HTTPError, nats.errors.Error, TimeoutError)


@pytest.mark.timeout(240)
async def test_up_restarts_each_killed_service_and_nats_server_and_loses_no_command(tmp_path: Path) -> None:
    port, nats_port = free_port(), free_port()
    data, config = tmp_path / "data", tmp_path / "config"
    env = {
        **{k: v for k, v in psutil.Process().environ().items() if k not in ("JETSHARD_API", "JETSHARD_NATS")},
        "JETSHARD_DATA_DIR": str(data),
        "JETSHARD_CONFIG_DIR": str(config),
        "JETSHARD_DEFAULT_MODELS_DIR": str(tmp_path / "models"),
    }
    api = f"http://127.0.0.1:{port}"
    up = start_in_own_group(
        up_command("--offline", "--no-model", "--port", str(port), "--nats-port", str(nats_port)),
        tmp_path / "up.log",
        env,
    )
    up_log = tmp_path / "up.log"
    client = None
    try:

        def up_is_serving() -> bool:
            assert up.poll() is None, up_log.read_text()
            return "Press Ctrl-C to stop." in up_log.read_text()  # what `up` tells its user

        await until(up_is_serving, 120, lambda: up_log.read_text(), interval_s=0.2)
        admin = NatsOptions(servers=(f"nats://127.0.0.1:{nats_port}",), nkey_file=str(data / "creds" / "admin.nk"))
        client, js = await connect(admin, "chaos-test")
        http = httpx.AsyncClient(base_url=api, timeout=5)
        recovery: dict[str, float] = {}
        published: list[CommandId] = []
        per_fault = COMMANDS // len(FAULTS)

        async def publish_range(start: int) -> None:
            for n in range(start, start + per_fault):
                published.append(await publish_surely(js, n))
                await asyncio.sleep(0.002)  # deliberate pacing: a burst spread over the fault

        async def api_has(name: str) -> bool:
            return f"burst/{name}" in (await http.get("/state")).json()["custom_cards"]

        for round_, fault in enumerate(FAULTS):
            burst = asyncio.create_task(publish_range(round_ * per_fault))
            await until(lambda start=round_ * per_fault: len(published) >= start + per_fault // 4, 60)
            victim = service_process(psutil.Process(up.pid), fault)
            disk_reports = await storage_reports(js)
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            # Recovered: a command published after the kill has its outcome in the (possibly new) API's State.
            probe = await publish_surely(js, round_, "probe")
            published.append(probe)
            await until(
                lambda probe=probe: api_has(probe),
                60,
                f"the cluster to recover from killing {fault}",
                retry_on=RESTARTING,
            )
            # The node services are not on a command's path: they have recovered once they act again.
            if fault == "worker":
                await until(lambda probe=probe: (config / "cards" / f"burst--{probe}.json").exists(), 60)
            if fault == "downloader":
                # A downloader reports its disks as it starts: the restarted one's report is on the bus.
                async def reported_again(before: int = disk_reports) -> bool:
                    return await storage_reports(js) > before

                await until(reported_again, 60, "the restarted downloader to report its disks")
            recovery[fault] = time.monotonic() - killed_at
            await burst
            assert up.poll() is None, up_log.read_text()
            assert f"{fault} was killed by SIGKILL; restarting it" in up_log.read_text()
            assert f"{fault} restarted" in up_log.read_text()

        assert len(set(published)) == COMMANDS + len(FAULTS)
        await until(lambda: len(list((config / "cards").glob("*.json"))) >= len(published), 60)
        per = outcomes_per_command(assert_gapless(await all_events(js)))
        assert {c: [type(e.event) for e in per[c]] for c in published} == {c: [CustomModelCardAdded] for c in published}

        # Replicas equal: the API's (restarted, following since) and a fresh fold of the whole history.
        # The node goes on reporting while they are read: the two are compared at one sequence.
        follower = StateFollower(js)
        await follower.start()
        try:
            served = await api_until(http, lambda s: s["last_seq"] == follower.state.last_seq, "/state", 30)
            fresh = msgspec.to_builtins(follower.state)  # no await since the match: the follower is where it was
        finally:
            await follower.stop()
        assert json.dumps(served, sort_keys=True) == json.dumps(fresh, sort_keys=True)
        assert len(list((config / "cards").glob("*.json"))) == len(published)

        print("\nrecovery after kill -9 (until a new command's outcome shows in the API's State):")
        for fault, seconds in recovery.items():
            print(f"  {fault:<12} {seconds:5.2f} s")
        await http.aclose()
    finally:
        if client is not None:
            await client.close()
        stop_s = ctrl_c(up)
    print(f"Ctrl-C after the faults stopped everything in {stop_s:.2f} s")
    assert stop_s < 5
    assert processes_mentioning(str(data)) == []
    assert "Traceback" not in up_log.read_text()


async def test_the_api_answers_503_at_once_while_nats_is_down_and_serves_again_after(
    tmp_path: Path, processes: Any
) -> None:
    server = start_nats_server(tmp_path / "nats", port=-1)
    nats_port = int(server.url.rsplit(":", 1)[1])
    # The sequencer declares the streams the API waits for.
    processes.start("sequencer", "sequencer", env={"JETSHARD_NATS": server.url})
    api = processes.start_api("api", env={"JETSHARD_NATS": server.url})
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:
        assert (await http.get("/healthz")).json()["broker"] == "connected"

        server.stop()
        await until(lambda: _healthz_status(http, 503), 10, "/healthz to notice", retry_on=RESTARTING)
        health = (await http.get("/healthz")).json()
        assert health["status"] == "unavailable" and "NATS" in health["reason"], health
        for method, path, body in (
            ("GET", "/health", None),
            ("DELETE", "/instances/some-instance", None),
            ("POST", "/v1/chat/completions", {"model": "any/model", "messages": [{"role": "user", "content": "hi"}]}),
        ):
            asked = time.monotonic()
            response = await http.request(method, path, json=body)
            answered_s = time.monotonic() - asked
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "broker_unavailable"
            assert answered_s < 1, answered_s
            print(f"\n{path} answered 503 broker_unavailable in {answered_s * 1000:.0f} ms while NATS was down")

        restarted = start_nats_server(tmp_path / "nats", port=nats_port)
        try:
            back_s = await until(lambda: _healthz_status(http, 200), 30, "/healthz to recover", retry_on=RESTARTING)
            print(f"/healthz said ok again {back_s:.2f} s after nats-server restarted")
            # Answered by the sequencer again: the API's command and event paths both work.
            await until(
                lambda: _status_is(http.delete("/instances/some-instance"), 404),
                30,
                "a command's outcome",
                retry_on=RESTARTING,
            )
        finally:
            restarted.stop()


async def test_an_api_whose_liveness_jetstream_cannot_store_answers_503_until_it_can_again(
    tmp_path: Path, processes: Any
) -> None:
    """An API cut off from the cluster's JetStream, though not from its own NATS server (its machine's cable pulled
    and put back, while the streams catch up), cannot renew its session's liveness key. The sequencer then cancels
    every task the API asks for as abandoned: the API says so with a 503 (its health, and every inference request,
    which stores a task) rather than take requests to have them cancelled."""
    server = start_nats_server(tmp_path / "nats", port=-1)
    timings = {"JETSHARD_NATS": server.url, "JETSHARD_LIVENESS_TTL_S": "2"}
    processes.start("sequencer", "sequencer", env=timings)
    api = processes.start_api("api", env=timings)
    try:
        async with httpx.AsyncClient(base_url=api, timeout=30) as http:
            await until(lambda: _healthz_status(http, 200), 30, "the API to be ready", retry_on=RESTARTING)
            limit = await limit_message_size(server.url, f"KV_{LIVENESS_BUCKET}", 1)
            await until(lambda: _healthz_status(http, 503), 30, "/healthz to notice", retry_on=RESTARTING)
            health = (await http.get("/healthz")).json()
            assert health["broker"] == "connected" and "liveness" in health["reason"], health
            response = await http.get("/health")
            assert response.status_code == 503 and "abandoned" in response.text, response.text
            assert response.json()["error"]["code"] == "broker_unavailable"
            # Commands name no session: they are still taken (the sequencer answers this one).
            assert (await http.delete("/instances/some-instance")).status_code == 404
            await limit_message_size(server.url, f"KV_{LIVENESS_BUCKET}", limit)
            await until(lambda: _healthz_status(http, 200), 30, "/healthz to recover", retry_on=RESTARTING)
            assert (await http.get("/health")).status_code == 200
    finally:
        server.stop()


async def _healthz_status(http: httpx.AsyncClient, status: int) -> bool:
    return (await http.get("/healthz")).status_code == status


async def _status_is(request: Awaitable[httpx.Response], status: int) -> bool:
    return (await request).status_code == status


def test_a_crash_looping_process_is_restarted_ever_more_slowly_said_so_and_not_restarted_once_stopping(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    log_file = tmp_path / "crashing.log"
    supervisor = Supervisor((1.0,), lines.append, first_restart_delay_s=0.1, max_restart_delay_s=0.4)
    crashing = supervisor.start("crashing", lambda: spawn([sys.executable, "-c", "exit(3)"], log_file), 0, log_file)

    def restarted_four_times() -> bool:
        supervisor.tend()
        return crashing.restarts >= 4

    assert wait_for(restarted_four_times, timeout=30), lines
    delays = [float(line.split("restarting it in ")[1].split(" s")[0]) for line in lines if "restarting it in" in line]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.4], lines
    assert lines[0] == "crashing exited with status 3; restarting it in 0.1 s", lines
    assert "keeps failing: 2 restarts so far" in next(line for line in lines if "0.4 s" in line)
    assert lines[0] in log_file.read_text()  # the reason stays in the log, next to the process's own output

    supervisor.stop()
    restarts = crashing.restarts
    time.sleep(0.5)  # deliberate timing: longer than any restart delay, and still no restart
    supervisor.tend()
    assert crashing.restarts == restarts and crashing.process.poll() is not None
