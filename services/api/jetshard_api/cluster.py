"""The API's view of the cluster: a State replica, and commands published with read-your-writes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import nats.errors
from jetshard_bus.commands import publish_command
from jetshard_bus.follower import Listener, StateFollower
from jetshard_bus.node import Liveness
from jetshard_bus.tracing import inject
from jetshard_schema.codec import encode
from jetshard_schema.commands import Command
from jetshard_schema.events import CommandRejected, Event, EventEnvelope, InstanceDeleted, TaskFinished
from jetshard_schema.ids import InstanceId, TaskId, new_command_id, new_id
from jetshard_schema.state import Instance, State
from jetshard_schema.subjects import MSG_ID_HEADER, task_subject
from jetshard_schema.types import TaskRef, TaskRequest
from jetshard_schema.view import EventLine, event_line
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from jetshard_api.errors import REJECT_STATUS, ApiError
from jetshard_api.metrics import ApiMetrics
from jetshard_api.stats import StatsBoard

log = logging.getLogger(__name__)

ELECTION_WAIT_S = 15.0
"""How long a publish waits for a stream without a leader (a few seconds of raft election, longer on a loaded
machine) before the request is answered 503."""
RECENT_EVENTS = 50
"""The latest events kept to start a dashboard's log with (those since the snapshot the API started from)."""
T = TypeVar("T")


def broker_unavailable(why: str = "") -> ApiError:
    detail = f" ({why})" if why else ""
    return ApiError(
        503,
        f"the message broker (NATS) is unreachable{detail}; the cluster cannot take requests until it is back",
        "broker_unavailable",
    )


class Cluster:
    def __init__(
        self,
        client: Client,
        js: JetStreamContext,
        follower: StateFollower,
        command_timeout_s: float,
        liveness_ttl_s: float,
        session_id: str | None = None,
    ) -> None:
        self.client = client
        self.js = js
        self.follower = follower
        self.command_timeout_s = command_timeout_s
        self.session_id = session_id or new_id()
        """This API process's session: its tasks name it, and are cancelled when its liveness key lapses."""
        self.liveness = Liveness(liveness_ttl_s)
        """When the session's liveness key was last stored (`keep_alive` notes it)."""
        self._background: set[asyncio.Task[None]] = set()
        self._finishing: dict[TaskId, asyncio.Future[TaskFinished]] = {}
        self._recent: deque[tuple[int, EventEnvelope]] = deque(maxlen=RECENT_EVENTS)
        self.stats = StatsBoard()
        """The services' latest figures from `jetshard.stats`, once `run_api` subscribed it."""
        self.naming: Counter[InstanceId] = Counter()
        """Tasks this API has named an instance for and not seen assigned yet (`admission.route` counts them)."""
        self.metrics = ApiMetrics(lambda: self.state, self.stats)
        follower.add_listener(self._on_event)

    @property
    def state(self) -> State:
        return self.follower.state

    @property
    def connected(self) -> bool:
        """Whether the API reaches NATS now."""
        return bool(self.client.is_connected)

    def require_broker(self) -> None:
        """Raise 503 at once while NATS is unreachable: a request would otherwise wait out its timeout."""
        if not self.connected:
            raise broker_unavailable()

    def require_session(self) -> None:
        """As `require_broker`, and raise 503 while the cluster counts this API's session gone: a task it asked for
        would be cancelled as abandoned as soon as the sequencer saw it."""
        self.require_broker()
        if (lapsed_s := self.liveness.lapsed_s()) is not None:
            raise broker_unavailable(
                f"JetStream has not stored this API's liveness for {lapsed_s:.0f} s, so the cluster takes its "
                "requests as abandoned"
            )

    async def wait_until(self, predicate: Callable[[State], bool], timeout_s: float) -> State:
        """The first State for which `predicate` holds (this one, or one an event makes); TimeoutError after
        `timeout_s`."""
        return await self.follower.wait_until(predicate, timeout_s)

    @contextlib.contextmanager
    def listening(self, listener: Listener) -> Iterator[None]:
        """`listener` called with every event applied while inside."""
        self.follower.add_listener(listener)
        try:
            yield
        finally:
            self.follower.remove_listener(listener)

    async def subscribe(self, subject: str, on_message: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """A core NATS subscription (a task's chunks, which are not stored)."""
        return await self.client.subscribe(subject, cb=on_message)

    def recent_event_lines(self) -> list[EventLine]:
        return [event_line(seq, envelope) for seq, envelope in self._recent]

    def deletion_reason(self, instance_id: InstanceId) -> str | None:
        """Why `instance_id` was deleted (its node lost, unloaded, on request), where the recent events still say."""
        for _, envelope in reversed(self._recent):
            event = envelope.event
            if isinstance(event, InstanceDeleted) and event.instance_id == instance_id:
                return event.reason
        return None

    def _on_event(self, envelope: EventEnvelope, state: State, live: bool) -> None:
        self._recent.append((state.last_seq, envelope))
        event = envelope.event
        if isinstance(event, TaskFinished):
            future = self._finishing.get(event.task_id)
            if future is not None and not future.done():
                future.set_result(event)

    def expect_finish(self, task_id: TaskId) -> asyncio.Future[TaskFinished]:
        """A future of `task_id`'s TaskFinished, resolved by the time State no longer holds the task (a task
        that leaves State any other way never resolves it). Call before submitting; `forget_finish` after."""
        future: asyncio.Future[TaskFinished] = asyncio.get_running_loop().create_future()
        self._finishing[task_id] = future
        return future

    def forget_finish(self, task_id: TaskId) -> None:
        self._finishing.pop(task_id, None)

    @contextlib.contextmanager
    def naming_for(self, instance_id: InstanceId) -> Iterator[None]:
        """A task is named for `instance_id` meanwhile: the routes of the tasks that come then count it."""
        self.naming[instance_id] += 1
        try:
            yield
        finally:
            self.naming[instance_id] -= 1
            if not self.naming[instance_id]:
                del self.naming[instance_id]

    async def submit(self, command: Command, timeout_s: float | None = None) -> list[Event]:
        """Publish `command`; return its events once applied here, or raise ApiError (rejected / 503 / 504)."""
        self.require_broker()
        command_id = new_command_id()
        outcome = self.follower.expect(command_id)
        try:
            await self._stored(lambda: publish_command(self.js, command, command_id))
            envelopes = await asyncio.wait_for(outcome, timeout_s or self.command_timeout_s)
        except TimeoutError as error:
            raise ApiError(
                504, f"{type(command).__name__} was not processed in time; is a sequencer running?", "command_timeout"
            ) from error
        finally:
            self.follower.forget(command_id)
        events = [e.event for e in envelopes]
        for event in events:
            if isinstance(event, CommandRejected):
                retry = {"Retry-After": str(event.retry_after_s)} if event.retry_after_s is not None else None
                raise ApiError(REJECT_STATUS[event.code], event.reason, str(event.code), headers=retry)
        return events

    def task_ref(self, request: TaskRequest) -> TaskRef:
        """The task as the command and State name it: the request (its prompt) stays out of every permanent log."""
        return TaskRef(
            task_id=request.task_id,
            model_id=request.model_id,
            kind=request.kind,
            requester=self.session_id,
            keep_alive_ms=request.keep_alive_ms,
        )

    async def store_request(self, request: TaskRequest, instance: Instance) -> None:
        """Keep a task's request in JETSHARD_TASKS, before the task is submitted, under the leader node of the
        instance it is named for: the only node whose identity may read it there. Its headers carry the request's
        trace context to that runner."""
        self.require_session()
        subject = task_subject(instance.leader_node, instance.instance_id, request.task_id)
        # The message id makes a repeated store harmless; it names the instance too, since a task refused for
        # one instance is stored again for another.
        await self._stored(
            lambda: self.js.publish(subject, encode(request), headers=inject({MSG_ID_HEADER: subject}), timeout=5.0)
        )

    async def _stored(self, publish: Callable[[], Awaitable[T]]) -> T:
        """A JetStream publish, tried again while the stream elects a new leader (a NATS server of a cluster
        went away): the message id makes a repeat harmless. 503 once NATS itself is unreachable, or the
        stream stays leaderless longer than `ELECTION_WAIT_S`."""
        deadline = time.monotonic() + ELECTION_WAIT_S
        while True:
            try:
                return await publish()
            except (nats.errors.Error, TimeoutError) as error:
                if not self.connected or time.monotonic() >= deadline:
                    raise broker_unavailable(f"{type(error).__name__}: {error}".rstrip(": ")) from error
                await asyncio.sleep(0.25)

    async def publish(self, command: Command) -> None:
        """Publish without waiting for the outcome (fire-and-forget reports such as a cancel)."""
        self.require_broker()
        await publish_command(self.js, command)

    def publish_soon(self, command: Command) -> None:
        """Publish `command` in the background, from code that must not await (a cancelled caller's clean-up).
        The task is kept until it ends, and a failure is logged: the sequencer's requester expiry is the
        backstop for a cancel that could not be sent."""
        task = asyncio.create_task(self.publish(command))
        self._background.add(task)
        task.add_done_callback(self._published)

    def _published(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not publish a command: %s", task.exception())

    async def close(self) -> None:
        """Let the background publishes finish (briefly), then stop them."""
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        for task in self._background:
            task.cancel()
