"""Pipeline-parallel generation across ranks, with every decision made on the last rank.

The last rank ("leader") owns the request queue, the sampler and all per-step decisions.
Each step it sends one message around the ring (see `protocol`) naming the op, the task's
slot and the tokens; the other ranks only follow messages, so ranks cannot disagree about
which task a step belongs to, when a task starts (fresh KV cache) or ends (cache dropped).

Tasks run one at a time in FIFO order for now. A step already names its slot and carries a
batch dimension, so continuous batching can later interleave tasks between decode steps
without changing the followers' loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from jetshard_schema.types import TaskOutcome

from .distributed import ring_listen_port
from .protocol import (
    FLAG_RESET,
    HELLO_BAD_END,
    HELLO_BAD_RANK,
    HELLO_BAD_START,
    HELLO_NEXT,
    HELLO_NUM_LAYERS,
    Header,
    Link,
    Op,
)
from .sampling import TaskSampler
from .shard import Shard

log = logging.getLogger(__name__)

# Why a task ends is the outcome the runner reports: STOP for an EOS token or a stop string the caller saw,
# LENGTH at max_tokens, CANCELLED; the engine never ends a task with ERROR.
StartedCallback = Callable[[str, int], None]
TokenCallback = Callable[[str, int, int, TaskOutcome | None], None]
FinishedCallback = Callable[[str, TaskOutcome, int, int], None]

# How long the idle leader sleeps on its queue between checks; it wakes at once on a request.
IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class GenerationRequest:
    task_id: str
    prompt_tokens: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # None: the model's own EOS ids (config.json and generation_config.json).
    eos_token_ids: frozenset[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))
        if not self.task_id:
            raise ValueError("task_id must be a non-empty string")
        if not self.prompt_tokens:
            raise ValueError(f"task {self.task_id}: prompt_tokens must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"task {self.task_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"task {self.task_id}: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"task {self.task_id}: top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"task {self.task_id}: seed must be in [0, 2**64), got {self.seed}")


@dataclass
class _Task:
    request: GenerationRequest
    slot: int
    sampler: TaskSampler
    eos: frozenset[int]
    prompt_done: int = 0  # prompt tokens already in the KV cache
    generated: int = 0  # tokens sampled, EOS included
    last_token: int = -1
    started: bool = False
    ahead: mx.array | None = None  # single rank: the next token, already being computed (see _decode_ahead)


# Messages from the caller's threads to the leader's loop, which alone touches the queue and the caches.
@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest


@dataclass(frozen=True)
class _Finish:
    task_id: str
    reason: TaskOutcome


@dataclass(frozen=True)
class _Shutdown:
    pass


_Control = _Submit | _Finish | _Shutdown


@dataclass
class EngineStats:
    steps: int = 0  # forward passes this rank ran (prefill chunks and decode steps)
    tokens: int = 0  # tokens sampled (leader only)


class PipelineEngine:
    """One rank of a pipeline. On the last rank it also takes requests and samples.

    `group` is the ring group (`mx.distributed.init(backend="ring")`), or None (or a group of
    size 1) for a single process holding the whole model.
    """

    def __init__(
        self,
        shard: Shard,
        group: mx.distributed.Group | None = None,
        *,
        on_started: StartedCallback | None = None,
        on_token: TokenCallback | None = None,
        on_finished: FinishedCallback | None = None,
        prefill_step_size: int = 2048,
    ) -> None:
        size = 1 if group is None else group.size()
        rank = 0 if group is None else group.rank()
        if shard.is_first != (rank == 0):
            raise ValueError(
                f"rank {rank} holds layers [{shard.start_layer}, {shard.end_layer}); only rank 0 may "
                "and must start at layer 0"
            )
        if shard.is_last != (rank == size - 1):
            raise ValueError(
                f"rank {rank} of {size} holds layers [{shard.start_layer}, {shard.end_layer}) of "
                f"{shard.num_layers}; only the last rank may and must hold the last layer"
            )
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.shard = shard
        self.rank = rank
        self.size = size
        self.prefill_step_size = prefill_step_size
        self.on_started = on_started
        self.on_token = on_token
        self.on_finished = on_finished
        self._link = Link(group, ring_listen_port(rank)) if group is not None and size > 1 else None
        self._control: queue.Queue[_Control] = queue.Queue()
        self._lock = threading.Lock()
        self._task_ids: set[str] = set()  # queued or running, to refuse duplicates
        self._pending: deque[GenerationRequest] = deque()
        self._active: _Task | None = None
        self._caches: dict[int, list[Any]] = {}
        self._seq = 0
        self._shutdown_requested = False
        self.stats = EngineStats()

    @property
    def is_leader(self) -> bool:
        return self.shard.is_last

    # ----------------------------------------------------------------- thread-safe API (leader)

    def submit(self, request: GenerationRequest) -> None:
        self._require_leader("submit")
        with self._lock:
            if self._shutdown_requested:
                raise RuntimeError("engine is shut down or shutting down")
            if request.task_id in self._task_ids:
                raise ValueError(f"task {request.task_id} is already queued or running")
            self._task_ids.add(request.task_id)
        self._control.put(_Submit(request))

    def finish(self, task_id: str, reason: TaskOutcome = TaskOutcome.STOP) -> None:
        """End a task before its next step with `reason` (e.g. STOP after a stop string).
        Unknown or already finished tasks are ignored: the caller may race the engine."""
        self._require_leader("finish")
        self._control.put(_Finish(task_id, reason))

    def cancel(self, task_id: str) -> None:
        self.finish(task_id, TaskOutcome.CANCELLED)

    def shutdown(self) -> None:
        """Cancel every task and stop all ranks; run_forever() returns on each of them."""
        self._require_leader("shutdown")
        with self._lock:
            self._shutdown_requested = True
        self._control.put(_Shutdown())

    # ----------------------------------------------------------------- loop

    def run_forever(self) -> None:
        """Serve until shutdown (leader) or until the leader's STOP arrives (other ranks).

        May run on any thread (load the shard on any thread too)."""
        try:
            # A stream of its own, as mlx_lm's generate_step uses: measured a few per cent faster decode on CPU.
            with mx.stream(mx.new_stream(mx.default_device())):
                if self.is_leader:
                    self._lead()
                else:
                    self._follow()
        finally:
            with self._lock:
                self._shutdown_requested = True  # later submits fail instead of waiting forever
            if threading.current_thread() is not threading.main_thread():
                # mlx 0.32 keeps per-thread stream state whose teardown at interpreter exit
                # aborts the process ("terminate called without an active exception", exit 134)
                # unless the thread that used it releases it first (ml-explore/mlx#3126).
                mx.clear_streams()

    def _lead(self) -> None:
        if self._link is not None:
            self._check_layout()
        while True:
            idle = self._active is None and not self._pending
            if not self._apply_control(block=idle):
                break
            if self._active is None:
                if not self._pending:
                    continue
                self._active = self._start(self._pending.popleft())
            self._step(self._active)
        if self._link is not None:
            self._round_trip(Header(Op.STOP))

    def _follow(self) -> None:
        assert self._link is not None
        caches: dict[int, list[Any]] = {}
        while True:
            header, payload = self._link.recv()
            if header.op == Op.STOP:
                self._link.send(header)
                return
            if header.op == Op.RELEASE:
                caches.pop(header.slot, None)
                self._link.send(header)
                continue
            assert payload is not None
            if header.op == Op.HELLO:
                self._link.send(header, self._hello_hop(payload))
                continue
            if header.flags & FLAG_RESET:
                caches[header.slot] = self.shard.make_cache()
            cache = caches.get(header.slot)
            if cache is None:
                raise RuntimeError(f"rank {self.rank}: step {header.seq} names slot {header.slot}, which has no cache")
            h = self.shard.embed(payload) if self.shard.is_first else payload
            h = self.shard.run_layers(h, cache)
            self._link.send(header.with_payload(h), h, extra=[c.state for c in cache])
            self.stats.steps += 1

    # ----------------------------------------------------------------- layout check

    def _hello_hop(self, payload: mx.array) -> mx.array:
        values = cast("list[list[int]]", payload.tolist())[0]
        shard = self.shard
        fits = values[HELLO_NEXT] == shard.start_layer and values[HELLO_NUM_LAYERS] == shard.num_layers
        if values[HELLO_BAD_RANK] < 0 and not fits:
            values[HELLO_BAD_RANK] = self.rank
            values[HELLO_BAD_START] = self.shard.start_layer
            values[HELLO_BAD_END] = self.shard.end_layer
        values[HELLO_NEXT] = self.shard.end_layer
        return mx.array([values], dtype=mx.int32)

    def _check_layout(self) -> None:
        """Refuse to serve unless ranks 0..n-1 hold consecutive ranges covering every layer:
        a gap or overlap would not fail, it would silently generate garbage."""
        hello = mx.array([[0, self.shard.num_layers, -1, 0, 0]], dtype=mx.int32)
        back = self._round_trip(Header(Op.HELLO).with_payload(hello), hello)
        assert back is not None
        values = cast("list[list[int]]", back.tolist())[0]
        if values[HELLO_BAD_RANK] < 0 and values[HELLO_NEXT] != self.shard.start_layer:
            values[HELLO_BAD_RANK] = self.rank
            values[HELLO_BAD_START], values[HELLO_BAD_END] = self.shard.start_layer, self.shard.end_layer
        if values[HELLO_BAD_RANK] >= 0:
            self._round_trip(Header(Op.STOP))
            n = self.shard.num_layers
            raise ValueError(
                f"rank {values[HELLO_BAD_RANK]} holds layers [{values[HELLO_BAD_START]}, "
                f"{values[HELLO_BAD_END]}), which does not continue the previous ranks' layers of a "
                f"{n}-layer model; the ranks' ranges must tile [0, {n})"
            )

    # ----------------------------------------------------------------- leader internals

    def _apply_control(self, block: bool) -> bool:
        """Apply queued requests/finishes; False once shutdown was asked for."""
        items: list[_Control] = []
        if block:
            try:
                items.append(self._control.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self._control.get_nowait())
            except queue.Empty:
                break
        for item in items:
            match item:
                case _Submit(request):
                    self._pending.append(request)
                case _Finish(task_id, reason):
                    self._finish_by_id(task_id, reason)
                case _Shutdown():
                    self._cancel_all()
                    return False
        return True

    def _finish_by_id(self, task_id: str, reason: TaskOutcome) -> None:
        if self._active is not None and self._active.request.task_id == task_id:
            self._finish(self._active, reason)
            return
        for queued in list(self._pending):
            if queued.task_id == task_id:
                self._pending.remove(queued)
                self._forget(task_id)
                self._emit_finished(task_id, reason, len(queued.prompt_tokens), 0)
                return

    def _cancel_all(self) -> None:
        if self._active is not None:
            self._finish(self._active, TaskOutcome.CANCELLED, release=False)
        while self._pending:
            queued = self._pending.popleft()
            self._forget(queued.task_id)
            self._emit_finished(queued.task_id, TaskOutcome.CANCELLED, len(queued.prompt_tokens), 0)

    def _start(self, request: GenerationRequest) -> _Task:
        slot = next(s for s in range(len(self._caches) + 1) if s not in self._caches)
        eos = self.shard.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        sampler = TaskSampler(request.temperature, request.top_p, request.seed)
        self._caches[slot] = []  # reserved; filled by the step that carries FLAG_RESET
        _notify(self.on_started, request.task_id, len(request.prompt_tokens))
        return _Task(request=request, slot=slot, sampler=sampler, eos=frozenset(eos))

    def _step(self, task: _Task) -> None:
        # Same schedule as mlx_lm.generate_step: every prompt token but the last in chunks of
        # prefill_step_size (no logits), then the last one alone, whose logits give token 1.
        prompt = task.request.prompt_tokens
        if task.prompt_done < len(prompt) - 1:
            n = min(self.prefill_step_size, len(prompt) - 1 - task.prompt_done)
            self._compute(Op.PREFILL, task, prompt[task.prompt_done : task.prompt_done + n])
            task.prompt_done += n
            return
        if task.prompt_done == len(prompt) - 1:
            tokens: Sequence[int] = prompt[-1:]
            task.prompt_done = len(prompt)
        else:
            tokens = (task.last_token,)
        token = self._decode_ahead(task, tokens) if self._link is None else self._compute(Op.DECODE, task, tokens)
        assert token is not None
        task.generated += 1
        self.stats.tokens += 1
        request = task.request
        if token in task.eos:
            self._finish(task, TaskOutcome.STOP)
            return
        task.last_token = token
        if task.generated >= request.max_tokens:
            self._emit_token(request.task_id, token, task.generated - 1, TaskOutcome.LENGTH)
            self._finish(task, TaskOutcome.LENGTH)
        else:
            self._emit_token(request.task_id, token, task.generated - 1, None)

    def _compute(self, op: Op, task: _Task, tokens: Sequence[int]) -> int | None:
        """Run one step through all ranks; the sampled token for DECODE."""
        flags = 0 if task.started else FLAG_RESET
        task.started = True
        if flags & FLAG_RESET:
            self._caches[task.slot] = self.shard.make_cache()
        cache = self._caches[task.slot]
        ids = mx.array([list(tokens)], dtype=mx.int32)
        if self._link is None:
            h = self.shard.embed(ids)
        else:
            received = self._round_trip(Header(op, task.slot, flags).with_payload(ids), ids)
            assert received is not None  # the previous rank always returns hidden states for a step
            h = received
        h = self.shard.run_layers(h, cache)
        self.stats.steps += 1
        if op == Op.PREFILL:
            mx.eval([c.state for c in cache])
            return None
        token = self._next_token(task, h)
        mx.eval(token)
        return int(cast(int, token.item()))

    def _decode_ahead(self, task: _Task, tokens: Sequence[int]) -> int:
        """One decode step on a single rank, the way mlx_lm's generate_step runs it: while this step's token
        is read back, the next step's graph is already built and evaluating (`mx.async_eval`) with that
        token as its input, so building a graph never leaves the CPU idle. If the task ends instead, the
        step ahead only advanced a KV cache that is dropped with the task."""
        if not task.started:  # a one-token prompt: this is the task's first step
            task.started = True
            self._caches[task.slot] = self.shard.make_cache()
        current = task.ahead if task.ahead is not None else self._sample(task, mx.array([list(tokens)], dtype=mx.int32))
        task.ahead = None
        if task.generated + 1 < task.request.max_tokens:
            task.ahead = self._sample(task, current.reshape(1, 1))
            mx.async_eval(task.ahead)
        return int(cast(int, current.item()))

    def _sample(self, task: _Task, ids: mx.array) -> mx.array:
        """The lazy next token after `ids` (shape (1, n)) on a single rank."""
        h = self.shard.run_layers(self.shard.embed(ids), self._caches[task.slot])
        self.stats.steps += 1
        return self._next_token(task, h)

    def _next_token(self, task: _Task, h: mx.array) -> mx.array:
        logits = self.shard.head(h)[:, -1, :]
        return task.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def _round_trip(self, header: Header, payload: mx.array | None = None) -> mx.array | None:
        assert self._link is not None
        self._seq += 1
        sent = Header(
            header.op, header.slot, header.flags, header.batch, header.length, header.width, header.dtype, self._seq
        )
        self._link.send(sent, payload)
        back, data = self._link.recv()
        if (back.op, back.slot, back.seq) != (sent.op, sent.slot, sent.seq):
            raise RuntimeError(
                f"pipeline out of step: sent {sent.op.name} slot {sent.slot} seq {sent.seq}, got back "
                f"{back.op.name} slot {back.slot} seq {back.seq}"
            )
        return data

    def _finish(self, task: _Task, reason: TaskOutcome, release: bool = True) -> None:
        if self._active is task:
            self._active = None
        self._caches.pop(task.slot, None)
        request = task.request
        self._forget(request.task_id)
        self._emit_finished(request.task_id, reason, len(request.prompt_tokens), task.generated)
        if release and self._link is not None and task.started:
            self._round_trip(Header(Op.RELEASE, task.slot))

    def _forget(self, task_id: str) -> None:
        with self._lock:
            self._task_ids.discard(task_id)

    def _emit_token(self, task_id: str, token: int, index: int, reason: TaskOutcome | None) -> None:
        _notify(self.on_token, task_id, token, index, reason)

    def _emit_finished(self, task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        _notify(self.on_finished, task_id, reason, prompt_tokens, completion_tokens)

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"{what}() is only available on the last rank ({self.size - 1}); this is rank {self.rank}"
            )


def _notify(callback: Callable[..., None] | None, task_id: str, *args: object) -> None:
    if callback is None:
        return
    try:
        callback(task_id, *args)
    except Exception:
        # A failing consumer must not stall the ring for every other rank and task.
        log.exception("%s failed for task %s", getattr(callback, "__name__", "callback"), task_id)
