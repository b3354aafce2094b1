"""Node identity and liveness: a stable id per machine, one node per machine however often it restarts,
and `NodeLost` once a node stops beating. Every service of a cluster uses the same `--liveness-ttl-s`
(the liveness bucket's TTL is set by whichever service creates it first)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import psutil
import pytest
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import MemoryTaken, node_profile, unused_gpu_hint, visible_gpu_indices
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.events import NodeJoined, NodeLost
from jetshard_schema.types import GpuInfo

pytestmark = pytest.mark.timeout(120)

TTL = "2"


def test_two_processes_creating_the_node_id_at_once_agree(tmp_path: Path) -> None:
    script = (
        "import sys, time; from pathlib import Path; from jetshard_bus.node import node_id_for\n"
        "base, start = Path(sys.argv[1]), float(sys.argv[2])\n"
        "time.sleep(max(0.0, start - time.time()))\n"  # deliberate timing: all processes race at one instant
        "print(' '.join(node_id_for(base / str(i)) for i in range(200)))\n"
    )
    start = str(time.time() + 3)
    runs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), start], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=60)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert len(outputs[0]) == 200
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0])) == 200
    assert [(tmp_path / str(i) / "node_id").read_text().strip() for i in range(200)] == outputs[0]
    assert not list(tmp_path.glob("*/.node_id.*"))  # no temporary file left behind


async def test_a_restarted_worker_is_the_same_node_and_a_stopped_one_is_lost(
    fresh_nats, processes, tmp_path: Path
) -> None:
    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test", BusTimings(liveness_ttl_s=2))
    joined: list[NodeJoined] = []
    lost: list[NodeLost] = []
    follower = StateFollower(js)

    def record(envelope, state, live) -> None:
        if isinstance(envelope.event, NodeJoined):
            joined.append(envelope.event)
        elif isinstance(envelope.event, NodeLost):
            lost.append(envelope.event)

    follower.add_listener(record)
    await follower.start()
    try:
        env = {"JETSHARD_CONFIG_DIR": str(tmp_path / "cfg")}
        processes.start("seq", "sequencer", "--nats", fresh_nats.url, "--liveness-ttl-s", TTL)
        processes.start_api("api", "--nats", fresh_nats.url, "--liveness-ttl-s", TTL)
        worker = processes.start("w1", "worker", "--nats", fresh_nats.url, "--liveness-ttl-s", TTL, env=env)
        await follower.wait_until(lambda s: len(s.nodes) == 1, 60)
        node_id = (tmp_path / "cfg" / "node_id").read_text().strip()
        first_session = follower.state.nodes[node_id].session_id

        processes.kill(worker, signal.SIGTERM)
        processes.start("w2", "worker", "--nats", fresh_nats.url, "--liveness-ttl-s", TTL, env=env)
        await follower.wait_until(lambda s: len(joined) >= 2, 60)
        assert [j.node_id for j in joined] == [node_id, node_id]
        assert joined[1].session_id != first_session
        assert list(follower.state.nodes) == [node_id]  # one node, not a ghost of the first run
        assert follower.state.nodes[node_id].session_id == joined[1].session_id

        # a worker that dies without a word is lost once its liveness key lapses
        worker = processes.started[-1]
        lost_before = len(lost)  # a graceful stop deletes the key: the restart above may have been a loss too
        processes.kill(worker, signal.SIGKILL)
        await follower.wait_until(lambda s: not s.nodes, 60)
        assert [event.node_id for event in lost[lost_before:]] == [node_id]

        # and comes back as the same node
        worker = processes.start("w3", "worker", "--nats", fresh_nats.url, "--liveness-ttl-s", TTL, env=env)
        await follower.wait_until(lambda s: len(s.nodes) == 1, 60)
        assert list(follower.state.nodes) == [node_id]
        assert {event.node_id for event in lost} == {node_id}

        # A node cut off (here: stopped) is lost, comes back in the same session when the cut heals, and is lost
        # again when it is cut off again, however soon: each loss is a command of its own, not a duplicate
        # JetStream drops within its window (120 s), in which the node would stay placed on.
        session = follower.state.nodes[node_id].session_id
        for _ in range(2):
            worker.send_signal(signal.SIGSTOP)
            await follower.wait_until(lambda s: not s.nodes, 30)
            worker.send_signal(signal.SIGCONT)
            await follower.wait_until(lambda s: len(s.nodes) == 1, 30)
            assert follower.state.nodes[node_id].session_id == session

        # Services whose NATS server is gone (a `jetshard up` killed with -9 takes it) stop all the same (within
        # run_service's grace, if a call to NATS holds them), without a traceback.
        fresh_nats.process.kill()
        services = dict(zip(("seq", "api", "w3"), [*processes.started[:2], worker], strict=True))
        for service in services.values():
            service.send_signal(signal.SIGTERM)
        for name, service in services.items():
            service.wait(30)
            assert "Traceback" not in processes.log(name), processes.log(name)[-3000:]
    finally:
        await follower.stop()
        await client.close()


def test_a_machine_without_an_nvidia_driver_reports_no_gpus_and_computes_on_its_cpu() -> None:
    profile = node_profile()
    assert profile.gpus == ()
    assert profile.accelerator in {"cpu", "metal"}


def test_a_node_lends_neither_what_its_models_hold_nor_what_placement_reserved_for_them_to_grow_into() -> None:
    """A runner holding 1 GiB of the 1.5 placement reserved for it (its prompt cache still empty): the half GiB the
    system shows free is not lent again, with a memory limit or without."""
    gib = 2**30
    taken = MemoryTaken(held_bytes=gib + gib // 2, unfilled_bytes=gib // 2)
    limited = node_profile(2 * gib, taken)
    assert limited.memory_total_bytes == 2 * gib and limited.memory_available_bytes == gib // 2
    system = psutil.virtual_memory().available
    lent = node_profile(None, taken).memory_available_bytes
    assert abs(lent - (system - gib // 2)) < gib // 8, (lent, system)  # the system's own use moves a little


class StandInNvml:
    """NVML as nvidia-ml-py exposes it, for one H200: a stand-in, since no GPU exists on this machine."""

    class NVMLError(Exception):
        pass

    @staticmethod
    def nvmlInit() -> None: ...
    @staticmethod
    def nvmlShutdown() -> None: ...
    @staticmethod
    def nvmlSystemGetDriverVersion() -> bytes:
        return b"580.65.06"  # older nvidia-ml-py releases answer bytes

    @staticmethod
    def nvmlDeviceGetCount() -> int:
        return 1

    @staticmethod
    def nvmlDeviceGetHandleByIndex(index: int) -> int:
        return index

    @staticmethod
    def nvmlDeviceGetName(handle: int) -> str:
        return "NVIDIA H200"

    @staticmethod
    def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=150_000_000_000, free=149_000_000_000, used=1_000_000_000)

    @staticmethod
    def nvmlDeviceGetCudaComputeCapability(handle: int) -> tuple[int, int]:
        return (9, 0)


def test_an_nvidia_gpu_is_reported_and_a_cpu_build_of_mlx_does_not_compute_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", StandInNvml)
    profile = node_profile()
    assert profile.gpus == (
        GpuInfo(
            name="NVIDIA H200",
            memory_total_bytes=150_000_000_000,
            memory_free_bytes=149_000_000_000,
            compute_capability="9.0",
            driver="580.65.06",
        ),
    )
    # This machine has mlx's CPU build (no mlx-cuda-* distribution): its runners compute on the CPU.
    assert profile.accelerator == "cpu"


@pytest.mark.parametrize(("driver", "extra"), [("580.65.06", "cuda13"), ("550.127.05", "cuda12")])
def test_a_gpu_left_unused_gets_one_line_naming_the_command_for_its_driver(
    monkeypatch: pytest.MonkeyPatch, driver: str, extra: str
) -> None:
    """What `jetshard up` and the worker print on a GPU machine with mlx's CPU build (a stand-in NVML again)."""
    monkeypatch.setitem(sys.modules, "pynvml", StandInNvml)
    monkeypatch.setattr(StandInNvml, "nvmlSystemGetDriverVersion", staticmethod(lambda: driver))
    hint = unused_gpu_hint(node_profile())
    assert hint is not None and "NVIDIA H200 is not used" in hint
    assert hint.endswith(f"`python3 -m uv run --no-group cpu --extra {extra} jetshard up`")
    assert unused_gpu_hint(msgspec.structs.replace(node_profile(), accelerator="cuda")) is None
    monkeypatch.delitem(sys.modules, "pynvml")
    assert unused_gpu_hint(node_profile()) is None  # no NVIDIA GPU: nothing to say


@pytest.mark.parametrize(
    ("setting", "indices"),
    [(None, [0, 1, 2]), ("2,0", [2, 0]), ("1,7,0", [1]), ("", []), ("-1", []), ("0,0", [0])],
)
def test_the_first_gpu_reported_is_the_one_cuda_computes_on(setting: str | None, indices: list[int]) -> None:
    """`CUDA_VISIBLE_DEVICES` reorders and hides GPUs; placement sizes shards by the first one reported."""
    assert visible_gpu_indices(3, setting) == indices
