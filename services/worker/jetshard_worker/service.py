"""The worker shell: joins the cluster as this machine's node, keeps custom cards on disk, hosts runners."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect, disconnect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import Liveness, keep_alive, local_address, node_id_for, node_profile, unused_gpu_hint
from jetshard_schema.commands import ReportNodeProfile
from jetshard_schema.events import (
    CustomModelCardAdded,
    CustomModelCardDeleted,
    EventEnvelope,
    RunnerStatusChanged,
)
from jetshard_schema.state import State
from jetshard_schema.types import NodeProfile, RunnerReport, RunnerStatus

from jetshard_worker.blas import runner_blas
from jetshard_worker.cards import CardDirectory
from jetshard_worker.config import WorkerConfig
from jetshard_worker.engines.llamacpp.background import NodeEngines, build_llama_cpp
from jetshard_worker.runners import RunnerSupervisor

log = logging.getLogger(__name__)


async def run_worker(config: WorkerConfig, stop: asyncio.Event) -> None:
    node_id = node_id_for(config.config_dir)
    session_id = config.session_id
    client, js = await connect(config.nats, f"jetshard-worker {node_id}", config.timings, declare_streams=False)
    cards = CardDirectory(config.card_dir or config.config_dir / "cards")
    follower = StateFollower(js)
    supervisor = RunnerSupervisor(
        js,
        node_id,
        session_id,
        config.nats,
        config.runner_start_timeout_s,
        config.advertise_host or local_address(client),
    )

    memory_moved = supervisor.memory_moved

    def on_event(envelope: EventEnvelope, state: State, live: bool) -> None:
        match envelope.event:
            case CustomModelCardAdded(card=card):
                cards.write(card)
            case CustomModelCardDeleted(model_id=model_id):
                cards.remove(model_id)
            case RunnerStatusChanged(instance_id=instance_id, runner=RunnerReport(status=RunnerStatus.READY)):
                instance = state.instances.get(instance_id)
                if instance is not None and instance.shard_for(node_id) is not None:
                    memory_moved.set()  # once the last rank is ready, the instance is: State must see it held
        if live:
            supervisor.on_state(state)

    follower.add_listener(on_event)
    await follower.start()
    # Before the node announces itself: once State shows this session, its card directory matches State.
    cards.reconcile(follower.state.custom_cards)
    heartbeat = asyncio.create_task(keep_alive(js, node_id, session_id, Liveness(config.timings.liveness_ttl_s), stop))
    engines = await asyncio.to_thread(NodeEngines)

    def measure() -> NodeProfile:
        return node_profile(config.memory_limit_bytes(), supervisor.memory_taken())

    profile = msgspec.structs.replace(
        measure(), fast_blas=await asyncio.to_thread(_fast_blas_here), engines=engines.engines
    )
    if (hint := unused_gpu_hint(profile)) is not None:
        log.warning("%s", hint)
    reporting = asyncio.create_task(
        _report_profile(
            js, node_id, session_id, profile, measure, engines, memory_moved, config.profile_interval_s, stop
        )
    )
    building = (
        asyncio.create_task(build_llama_cpp(engines, config.llama_cpp_cpu_variants))
        if config.build_llama_cpp and not engines.llama_cpp_ready
        else None
    )
    log.info("worker for node %s (session %s) started; cards in %s", node_id, session_id, cards.path)
    try:
        await supervisor.start(follower.state)
        await stop.wait()
    finally:
        if building is not None:
            building.cancel()  # kills the build's process group; its half-made directory is removed next time
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await building
        await supervisor.shutdown()
        for task in (heartbeat, reporting):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 5)
        await follower.stop()
        await disconnect(client)


def _fast_blas_here() -> bool:
    blas = runner_blas()
    log.info("runners multiply with %s", blas.describe())
    return blas.library is not None


async def _report_profile(  # type: ignore[no-untyped-def]
    js,
    node_id,
    session_id,
    first: NodeProfile,
    measure: Callable[[], NodeProfile],
    engines: NodeEngines,
    memory_moved: asyncio.Event,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Report the profile now, periodically and as soon as the engines change or memory moved; the sequencer keeps
    only meaningful changes."""
    profile = first
    while not stop.is_set():
        try:
            await publish_command(js, ReportNodeProfile(node_id=node_id, session_id=session_id, profile=profile))
        except Exception as error:
            log.warning("profile report failed: %s", error)
        events = (stop, engines.changed, memory_moved)
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        engines.changed.clear()
        memory_moved.clear()
        # NVML's queries can take a while on an idle GPU: off the loop that beats the node's liveness.
        profile = msgspec.structs.replace(
            await asyncio.to_thread(measure), fast_blas=first.fast_blas, engines=engines.engines
        )
