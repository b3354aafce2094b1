"""Pipeline-parallel generation with continuous batching; every decision is made on the last rank.

The last rank ("leader") owns the request queue, the samplers and all per-step decisions. Up to `max_batch`
tasks decode together, one token each per (B, 1) step. A new task's prompt is prefilled into a KV cache of its
own, a bounded chunk between two of the batch's decode steps (so a long prompt does not freeze the others'
streams), then joins the batch as its last row; a finished task's row leaves it. Every change to a KV cache
is one step message that travels around the ring in the order the leader decides it (see `protocol`):
PREFILL fills a slot's own cache, JOIN moves it into the batch, DECODE runs the batch's rows, RELEASE drops a
slot. So every rank holds the same rows in the same order without deciding anything.

Batching is exact here: mlx-lm's batch caches (left padding, masks) give each row bit for bit the logits it
gets alone, and each task samples with its own PRNG key, so neither greedy nor seeded output depends on
what else shares the batch.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
from jetshard_schema.types import TaskOutcome
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from .distributed import ring_listen_port
from .prefixes import PrefixHit, PrefixIndex
from .protocol import (
    FLAG_RESET,
    FLAG_RESTORE,
    FLAG_SAVE,
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
TokenCallback = Callable[[str, int, int, "TaskOutcome | None", "TokenScores | None"], None]
FinishedCallback = Callable[[str, TaskOutcome, int, int], None]
EmbeddingCallback = Callable[[str, list[float]], None]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's shape: (the row's prompt and generated token ids, its logprobs (1, vocab)) -> logprobs."""

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenScores:
    """A sampled token's log-probability under the model (log-softmax of its logits: before temperature, top_p
    and logits processors, as OpenAI reports them) and the `top_logprobs` most likely tokens at its place."""

    logprob: float
    top: list[tuple[int, float]]


# How long the idle leader sleeps on its queue between checks; it wakes at once on a request.
IDLE_POLL_S = 0.5
# Prefill chunks between decode steps before their cost is measured, and never smaller than (tokens).
FIRST_INTERLEAVED_CHUNK = 64
MIN_INTERLEAVED_CHUNK = 16


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
    logits_processors: tuple[LogitsProcessor, ...] = ()
    top_logprobs: int | None = None
    """Report each token's TokenScores with this many alternatives; None reports none."""
    embed: bool = False
    """Generate nothing: prefill the whole prompt and hand out its embedding (the mean of the final norm's
    outputs over the prompt, L2-normalised) through `on_embedding`."""

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
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"task {self.task_id}: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")


@dataclass(eq=False)
class _Task:
    request: GenerationRequest
    slot: int
    sampler: TaskSampler
    eos: frozenset[int]
    prompt_done: int = 0  # prompt tokens in the task's own KV cache; all but the last before it joins
    generated: list[int] = field(default_factory=list)  # tokens sampled, EOS included
    cache_started: bool = False  # a step with FLAG_RESET went out for its slot
    prefilled: bool = False  # a PREFILL went out for it
    restore: PrefixHit | None = None  # the saved prefix its cache starts from
    finished: bool = False
    pooled: mx.array | None = None  # an embedding task's sum of final-norm outputs over the prompt so far


@dataclass
class _Launched:
    """A micro-batch's last sampled tokens, maybe still being computed, not yet handed out; row i is rows[i]."""

    rows: list[_Task]
    tokens: mx.array
    scores: tuple[mx.array, mx.array, mx.array] | None = None
    """When a row asked for them: every row's token logprob (B,), its top ids (B, k) and their logprobs (B, k)."""


@dataclass(eq=False)
class _Group:
    """A micro-batch of decoding rows, as of the last step the leader sent (its caches follow when steps come
    back)."""

    index: int
    rows: list[_Task] = field(default_factory=list)
    in_flight: bool = False  # a DECODE of it is under way: the next one needs that one's tokens
    launched: _Launched | None = None


@dataclass(frozen=True)
class _Sent:
    """A step under way, and what the leader needs when it comes back."""

    header: Header
    task: _Task | None = None  # PREFILL, JOIN
    rows: list[_Task] | None = None  # DECODE: its rows, in order
    payload: mx.array | None = None  # a single rank's token ids, embedded when the step comes back


class _RankCaches:
    """One rank's KV caches: each prefilling slot's own, each micro-batch's (its rows' caches merged; row i of
    group g is slot `rows[g][i]`), and the saved prefixes. The leader and the followers change them through the
    same methods, from the same step headers, in the same order."""

    def __init__(self, shard: Shard) -> None:
        self._shard = shard
        self._own: dict[int, tuple[list[Any], int]] = {}  # slot -> (cache, tokens in it)
        self._saved: dict[int, tuple[list[Any], int]] = {}  # prefix -> (cache, tokens in it); never mutated
        self.rows: dict[int, list[int]] = {}
        self._batches: dict[int, list[Any]] = {}

    def for_prefill(self, header: Header) -> list[Any]:
        cache, tokens = self._own_cache(header)
        self._own[header.slot] = (cache, tokens + header.length)
        return cache

    def join(self, header: Header) -> None:
        own, tokens = self._own_cache(header)
        self._own.pop(header.slot, None)
        if header.flags & FLAG_SAVE:
            self._saved[header.prefix] = (own, tokens)  # merging copies it into the batch: it stays as it is
        # mlx-lm's batch caches: each layer's cache type knows how to merge into its batched form.
        merged = [type(layer).merge([layer]) for layer in own]
        rows = self.rows.setdefault(header.group, [])
        if rows:
            for batched, joining in zip(self._batches[header.group], merged, strict=True):
                batched.extend(joining)
        else:
            self._batches[header.group] = merged
        rows.append(header.slot)

    def release(self, slot: int) -> None:
        group = next((g for g, rows in self.rows.items() if slot in rows), None)
        if group is None:
            self._own.pop(slot, None)
            return
        keep = [i for i, row in enumerate(self.rows[group]) if row != slot]
        self.rows[group] = [self.rows[group][i] for i in keep]
        if not keep:
            del self._batches[group]
            return
        for layer in self._batches[group]:
            layer.filter(keep)

    def own(self, slot: int) -> list[Any] | None:
        found = self._own.get(slot)
        return None if found is None else found[0]

    def evict(self, prefix: int) -> None:
        self._saved.pop(prefix, None)

    def for_decode(self, header: Header) -> list[Any]:
        rows = self.rows.get(header.group, [])
        if header.batch != len(rows):
            raise RuntimeError(
                f"a decode step carries {header.batch} rows, micro-batch {header.group} holds {len(rows)}"
            )
        return self._batches[header.group]

    def _own_cache(self, header: Header) -> tuple[list[Any], int]:
        if not header.flags & FLAG_RESET:
            if header.slot not in self._own:
                raise RuntimeError(f"a {header.op.name} step names slot {header.slot}, which has no cache")
            return self._own[header.slot]
        if not header.flags & FLAG_RESTORE:
            return self._shard.make_cache(), 0
        if header.prefix not in self._saved:
            raise RuntimeError(f"slot {header.slot} starts from saved prefix {header.prefix}, which this rank lacks")
        saved, tokens = self._saved[header.prefix]
        cache = copy.deepcopy(saved)
        if tokens > header.prefix_len:
            trim_prompt_cache(cache, tokens - header.prefix_len)
        return cache, header.prefix_len


@dataclass
class _StepTiming:
    """How long a decode step and a prefilled token take here, to size prefill chunks between steps."""

    step_s: float | None = None
    token_s: float | None = None
    _last_read: float | None = None
    _prefilled_since: bool = False

    def read(self) -> None:
        """A decode step's tokens were read: the time since the last read is one step, unless a prefill chunk
        ran in between."""
        now = time.perf_counter()
        if self._last_read is not None and not self._prefilled_since:
            self.step_s = _smoothed(self.step_s, now - self._last_read)
        self._last_read, self._prefilled_since = now, False

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.token_s = _smoothed(self.token_s, seconds / tokens)
        self._prefilled_since = True

    def tokens_per_step(self, most: int) -> int:
        if self.step_s is None or self.token_s is None:
            return min(most, FIRST_INTERLEAVED_CHUNK)
        return max(MIN_INTERLEAVED_CHUNK, min(most, int(self.step_s / self.token_s)))


def _smoothed(previous: float | None, sample: float) -> float:
    return sample if previous is None else 0.8 * previous + 0.2 * sample


@dataclass
class EngineStats:
    """What the engine did since it started; the runner reports the fields `ServingCounters` names."""

    steps: int = 0  # forward passes this rank ran (prefill chunks and decode steps)
    tokens: int = 0  # tokens sampled (leader only)
    max_rows: int = 0  # the most tasks decoding at once
    max_micro_batches: int = 0  # the most micro-batches under way around the ring at once
    prefix_hits: int = 0  # tasks whose prompt started from a saved prefix
    prefix_hit_tokens: int = 0  # prompt tokens those tasks did not prefill
    prefix_cache_entries: int = 0  # saved prefix caches
    prefix_cache_bytes: int = 0  # their size, for the whole model
    # How things stand now (leader only): rows in the current decode step, decoding or prefilling, waiting.
    batch_size: int = 0
    running_rows: int = 0
    queued_rows: int = 0


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


class PipelineEngine:
    """One rank of a pipeline. On the last rank it also takes requests, batches them and samples.

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
        on_embedding: EmbeddingCallback | None = None,
        max_batch: int = 8,
        prefill_step_size: int = 2048,
        interleaved_prefill_tokens: int | None = None,
        prefix_cache_bytes: int = 512 * 2**20,
        micro_batches: int | None = None,
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
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if interleaved_prefill_tokens is not None and interleaved_prefill_tokens < 1:
            raise ValueError(f"interleaved_prefill_tokens must be >= 1, got {interleaved_prefill_tokens}")
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.shard = shard
        self.rank = rank
        self.size = size
        self.max_batch = max_batch
        # A prompt is prefilled in chunks of prefill_step_size while nothing decodes (mlx-lm's schedule), and in
        # smaller ones between the batch's decode steps: interleaved_prefill_tokens, or by default as many as
        # take about one decode step (measured as it runs), so the others' next token comes at most about
        # twice as late while a long prompt arrives.
        self.prefill_step_size = prefill_step_size
        self.interleaved_prefill_tokens = interleaved_prefill_tokens
        self._timing = _StepTiming()
        self.on_started = on_started
        self.on_token = on_token
        self.on_finished = on_finished
        self.on_embedding = on_embedding
        self._link = Link(group, ring_listen_port(rank)) if group is not None and size > 1 else None
        self._control: queue.Queue[_Control] = queue.Queue()
        self._lock = threading.Lock()
        self._task_ids: set[str] = set()  # queued or running, to refuse duplicates
        self._caches = _RankCaches(shard)
        # Prompts' KV caches kept for later prompts that start the same way (a conversation's next turn, a
        # shared system prompt): only the leader decides, the other ranks follow its steps.
        self._prefixes = PrefixIndex(prefix_cache_bytes)
        self._pending: deque[GenerationRequest] = deque()
        self._prefilling: _Task | None = None
        # The decoding rows, split in micro-batches: with one per rank, each rank computes one while the
        # others compute the rest, so no rank of the ring waits for another.
        self._groups = [_Group(g) for g in range(micro_batches or size)]
        self._in_flight: deque[_Sent] = deque()  # steps sent around the ring (or queued on one rank), in order
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
        """Send steps and handle each as it comes back. The leader decides what the other ranks will do when it
        sends a step, and changes its own caches when the step comes back, after every rank did, so its
        caches go through the same changes in the same order as theirs."""
        if self._link is not None:
            self._check_layout()
        while True:
            self._count_rows()
            idle = not (self._in_flight or self._prefilling or self._pending or self._decoding())
            if not self._apply_control(block=idle):
                break
            if self._prefilling is None and self._pending and self._decoding() < self.max_batch:
                self._prefilling = self._start(self._pending.popleft())
                self._send_prefill(self._prefilling)
            for group in self._groups:
                if group.rows and not group.in_flight:
                    self._send_decode(group)
            if self._in_flight:
                self._come_back(*self._receive())
        while self._in_flight:  # shutting down: what is still under way comes back before the STOP
            self._receive()
        if self._link is not None:
            self._round_trip(Header(Op.STOP))

    def _follow(self) -> None:
        assert self._link is not None
        caches = self._caches
        while True:
            header, payload = self._link.recv()
            match header.op:
                case Op.STOP:
                    self._link.send(header)
                    return
                case Op.RELEASE:
                    caches.release(header.slot)
                    self._link.send(header)
                case Op.JOIN:
                    caches.join(header)
                    self._link.send(header)
                case Op.EVICT:
                    caches.evict(header.prefix)
                    self._link.send(header)
                case Op.HELLO:
                    assert payload is not None
                    self._link.send(header, self._hello_hop(payload))
                case Op.PREFILL | Op.DECODE:
                    assert payload is not None
                    if header.op == Op.PREFILL:
                        cache = caches.for_prefill(header)
                    else:
                        cache = caches.for_decode(header)
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
        for task in self._running():
            if task.request.task_id == task_id:
                self._finish(task, reason)
                return
        for queued in self._pending:
            if queued.task_id == task_id:
                self._pending.remove(queued)
                self._forget(task_id)
                self._emit_finished(task_id, reason, len(queued.prompt_tokens), 0)
                return

    def _cancel_all(self) -> None:
        """On shutdown: no RELEASE goes out, the STOP that follows ends every rank."""
        for task in self._running():
            self._finish(task, TaskOutcome.CANCELLED, release=False)
        while self._pending:
            queued = self._pending.popleft()
            self._forget(queued.task_id)
            self._emit_finished(queued.task_id, TaskOutcome.CANCELLED, len(queued.prompt_tokens), 0)

    def _running(self) -> list[_Task]:
        decoding = [task for group in self._groups for task in group.rows]
        return decoding if self._prefilling is None else [*decoding, self._prefilling]

    def _decoding(self) -> int:
        return sum(len(group.rows) for group in self._groups)

    def _count_rows(self) -> None:
        self.stats.batch_size = self._decoding()
        self.stats.running_rows = self.stats.batch_size + (self._prefilling is not None)
        self.stats.queued_rows = len(self._pending)

    def _start(self, request: GenerationRequest) -> _Task:
        used = {task.slot for task in self._running()}
        slot = next(s for s in range(len(used) + 1) if s not in used)
        eos = self.shard.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        sampler = TaskSampler(request.temperature, request.top_p, request.seed)
        task = _Task(request=request, slot=slot, sampler=sampler, eos=frozenset(eos))
        hit = None if request.embed else self._prefixes.find(request.prompt_tokens[:-1])
        if hit is not None:
            task.restore = hit
            task.prompt_done = hit.tokens
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += hit.tokens
        _notify(self.on_started, request.task_id, len(request.prompt_tokens))
        return task

    # --- sending steps: what every rank will do

    def _send_prefill(self, task: _Task) -> None:
        """The task's next prompt chunk, or, once all but its last token are in its cache, its join.
        Same schedule as mlx_lm.generate_step: the last prompt token's logits give the first token."""
        prompt = task.request.prompt_tokens
        # An embedding needs every prompt token's hidden state; a generation's last token goes in with its join.
        remaining = len(prompt) - task.prompt_done - (0 if task.request.embed else 1)
        if remaining <= 0:
            if task.request.embed:
                self._finish_embedding(task)
            else:
                self._send_join(task)
            return
        n = min(self._prefill_chunk(), remaining)
        ids = mx.array([prompt[task.prompt_done : task.prompt_done + n]], dtype=mx.int32)
        task.prompt_done += n
        task.prefilled = True
        self._send(_Sent(self._slot_header(Op.PREFILL, task).with_payload(ids), task=task), ids)

    def _prefill_chunk(self) -> int:
        if not self._decoding():
            return self.prefill_step_size
        if self.interleaved_prefill_tokens is not None:
            return self.interleaved_prefill_tokens
        return self._timing.tokens_per_step(self.prefill_step_size)

    def _finish_embedding(self, task: _Task) -> None:
        assert task.pooled is not None
        mean = task.pooled[0] / len(task.request.prompt_tokens)
        vector = mean / mx.maximum(mx.linalg.norm(mean), 1e-12)
        _notify(self.on_embedding, task.request.task_id, cast("list[float]", vector.tolist()))
        self._finish(task, TaskOutcome.STOP)

    def _send_join(self, task: _Task) -> None:
        group = min(self._groups, key=lambda g: len(g.rows))
        header = replace(self._slot_header(Op.JOIN, task), group=group.index)
        evicted: list[int] = []
        # Up to date: the task's last prefill chunk has come back. (Without one, the slot may still hold an
        # earlier task's cache whose RELEASE is under way.)
        own = self._caches.own(task.slot) if task.prefilled else None
        if own is not None:
            # The cache's size for the whole model, from this rank's share of the layers.
            size = sum(c.nbytes for c in own) * self.shard.num_layers // len(self.shard.layers)
            saved, evicted = self._prefixes.add(task.request.prompt_tokens[:-1], size, can_trim_prompt_cache(own))
            if saved is not None:
                header = replace(header, flags=header.flags | FLAG_SAVE, prefix=saved)
        self._send(_Sent(header, task=task))
        for prefix in evicted:
            self._send(_Sent(Header(Op.EVICT, prefix=prefix)))
        self.stats.prefix_cache_entries, self.stats.prefix_cache_bytes = len(self._prefixes), self._prefixes.size_bytes
        group.rows.append(task)
        self._prefilling = None

    def _slot_header(self, op: Op, task: _Task) -> Header:
        """A step for the task's slot; its first one also says what its cache starts from."""
        if task.cache_started:
            return Header(op, task.slot)
        task.cache_started = True
        if task.restore is None:
            return Header(op, task.slot, FLAG_RESET)
        hit = task.restore
        return Header(op, task.slot, FLAG_RESET | FLAG_RESTORE, prefix=hit.entry, prefix_len=hit.tokens)

    def _send_decode(self, group: _Group) -> None:
        rows = list(group.rows)
        inputs = self._inputs(rows, group.launched).reshape(-1, 1)
        self.stats.max_rows = max(self.stats.max_rows, self._decoding())
        group.in_flight = True
        self.stats.max_micro_batches = max(self.stats.max_micro_batches, sum(g.in_flight for g in self._groups))
        self._send(_Sent(Header(Op.DECODE, group=group.index).with_payload(inputs), rows=rows), inputs)

    def _inputs(self, rows: list[_Task], previous: _Launched | None) -> mx.array:
        """Each row's input token: the one the group's last step sampled for it (maybe still lazy), else the
        last one it was handed, else (it just joined) its last prompt token. Rows that joined since that step
        come last (JOIN appends), so the carried rows are a prefix."""
        carried = [] if previous is None else [previous.rows.index(t) for t in rows if t in previous.rows]
        known = [t.generated[-1] if t.generated else t.request.prompt_tokens[-1] for t in rows[len(carried) :]]
        parts = []
        if carried:
            assert previous is not None
            parts.append(previous.tokens if len(carried) == len(previous.rows) else previous.tokens[mx.array(carried)])
        if known:
            parts.append(mx.array(known, dtype=previous.tokens.dtype if previous is not None else mx.int32))
        return mx.concatenate(parts).astype(mx.int32)

    def _send(self, sent: _Sent, payload: mx.array | None = None) -> None:
        """Around the ring, or, on a single rank, straight into the queue of steps to come back (embedded)."""
        self._seq += 1
        header = replace(sent.header, seq=self._seq)
        if self._link is None:
            self._in_flight.append(replace(sent, header=header, payload=payload))
        else:
            self._in_flight.append(replace(sent, header=header))
            self._link.send(header, payload)

    def _receive(self) -> tuple[_Sent, mx.array | None]:
        sent = self._in_flight.popleft()
        if self._link is None:
            return sent, None if sent.payload is None else self.shard.embed(sent.payload)
        back, data = self._link.recv()
        if (back.op, back.slot, back.seq) != (sent.header.op, sent.header.slot, sent.header.seq):
            raise RuntimeError(
                f"pipeline out of step: sent {sent.header.op.name} slot {sent.header.slot} seq {sent.header.seq}, "
                f"got back {back.op.name} slot {back.slot} seq {back.seq}"
            )
        return sent, data

    # --- steps coming back: the leader's own layers and caches, sampling

    def _come_back(self, sent: _Sent, hidden: mx.array | None) -> None:
        header = sent.header
        match header.op:
            case Op.PREFILL:
                assert hidden is not None and sent.task is not None
                self._prefilled(sent.task, header, hidden)
            case Op.DECODE:
                assert hidden is not None and sent.rows is not None
                self._decoded(self._groups[header.group], sent.rows, header, hidden)
            case Op.JOIN:
                self._caches.join(header)
                mx.clear_cache()  # the prefill's activations; mlx-lm frees them the same way
            case Op.RELEASE:
                self._caches.release(header.slot)
                if not self._running():
                    mx.clear_cache()  # idle: hand the freed KV caches back, as mlx-lm does between requests
            case Op.EVICT:
                self._caches.evict(header.prefix)

    def _prefilled(self, task: _Task, header: Header, hidden: mx.array) -> None:
        for group in self._groups:
            if group.launched is not None:
                mx.eval(group.launched.tokens)  # time the chunk alone, not a decode step still running
        started = time.perf_counter()
        cache = self._caches.for_prefill(header)
        h = self.shard.run_layers(hidden, cache)
        if task.request.embed:
            pooled = self.shard.final_norm(h).astype(mx.float32).sum(axis=1)
            task.pooled = pooled if task.pooled is None else task.pooled + pooled
        mx.eval([c.state for c in cache], task.pooled)
        self._timing.prefilled(header.length, time.perf_counter() - started)
        self.stats.steps += 1
        if not task.finished:
            self._send_prefill(task)

    def _decoded(self, group: _Group, rows: list[_Task], header: Header, hidden: mx.array) -> None:
        """Sample the rows' next tokens, then hand out the tokens of the group's step before: building and
        running this step's graph (`mx.async_eval`) overlaps reading and handing out the last one, as in
        mlx_lm's generate_step. A logits processor needs its row's previous token first: then it is read first."""
        group.in_flight = False
        previous, group.launched = group.launched, None
        if previous is not None and any(t.request.logits_processors for t in rows):
            self._read(previous)
            previous = None
        h = self.shard.run_layers(hidden, self._caches.for_decode(header))
        self.stats.steps += 1
        tokens, scores = self._sample(rows, self.shard.head(h)[:, -1, :])
        mx.async_eval(tokens, *(scores or ()))
        group.launched = _Launched(rows, tokens, scores)
        if previous is not None:
            if group.index == 0:
                self._timing.read()
            self._read(previous)

    def _sample(
        self, rows: list[_Task], logits: mx.array
    ) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array] | None]:
        """The rows' next tokens, and their scores when a row asked for them."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(t.sampler.greedy and not t.request.logits_processors for t in rows):
            # Same op as mlx_lm's greedy_sampler, so greedy output matches mlx-lm exactly.
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            sampled = []
            for i, task in enumerate(rows):
                row = logprobs[i : i + 1]
                if task.request.logits_processors:
                    history = mx.array([*task.request.prompt_tokens, *task.generated], dtype=mx.int32)
                    for processor in task.request.logits_processors:
                        row = processor(history, row)
                sampled.append(task.sampler(row))
            tokens = mx.concatenate(sampled)
        wanted = [t.request.top_logprobs for t in rows if t.request.top_logprobs is not None]
        if not wanted:
            return tokens, None
        chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        k = max(1, *wanted)
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        return tokens, (chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1))

    def _read(self, launched: _Launched) -> None:
        scores = None if launched.scores is None else [cast("list[Any]", a.tolist()) for a in launched.scores]
        for i, (task, token) in enumerate(zip(launched.rows, cast("list[int]", launched.tokens.tolist()), strict=True)):
            if not task.finished:  # else it ended after the step went out: the step's token for it is void
                self._accept(task, token, None if scores is None else _row_scores(task, scores, i))

    def _accept(self, task: _Task, token: int, scores: TokenScores | None = None) -> None:
        task.generated.append(token)
        self.stats.tokens += 1
        request = task.request
        if token in task.eos:
            self._finish(task, TaskOutcome.STOP)
            return
        index = len(task.generated) - 1
        if len(task.generated) >= request.max_tokens:
            self._emit_token(request.task_id, token, index, TaskOutcome.LENGTH, scores)
            self._finish(task, TaskOutcome.LENGTH)
        else:
            self._emit_token(request.task_id, token, index, None, scores)

    def _round_trip(self, header: Header, payload: mx.array | None = None) -> mx.array | None:
        """One step around the ring and back, with nothing else under way (start and stop)."""
        assert not self._in_flight
        self._send(_Sent(header), payload)
        return self._receive()[1]

    def _finish(self, task: _Task, reason: TaskOutcome, release: bool = True) -> None:
        task.finished = True
        for group in self._groups:
            if task in group.rows:
                group.rows.remove(task)
        if self._prefilling is task:
            self._prefilling = None
        if task.cache_started and release:
            self._send(_Sent(Header(Op.RELEASE, task.slot)))
        request = task.request
        self._forget(request.task_id)
        self._emit_finished(request.task_id, reason, len(request.prompt_tokens), len(task.generated))

    def _forget(self, task_id: str) -> None:
        with self._lock:
            self._task_ids.discard(task_id)

    def _emit_token(
        self, task_id: str, token: int, index: int, reason: TaskOutcome | None, scores: TokenScores | None
    ) -> None:
        _notify(self.on_token, task_id, token, index, reason, scores)

    def _emit_finished(self, task_id: str, reason: TaskOutcome, prompt_tokens: int, completion_tokens: int) -> None:
        _notify(self.on_finished, task_id, reason, prompt_tokens, completion_tokens)

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"{what}() is only available on the last rank ({self.size - 1}); this is rank {self.rank}"
            )


def _row_scores(task: _Task, scores: list[list[Any]], row: int) -> TokenScores | None:
    k = task.request.top_logprobs
    if k is None:
        return None
    chosen, top_ids, top_logprobs = scores
    top = sorted(zip(top_ids[row], top_logprobs[row], strict=True), key=lambda pair: -pair[1])[:k]
    return TokenScores(logprob=chosen[row], top=[(int(i), float(v)) for i, v in top])


def _notify(callback: Callable[..., None] | None, task_id: str, *args: object) -> None:
    if callback is None:
        return
    try:
        callback(task_id, *args)
    except Exception:
        # A failing consumer must not stall the ring for every other rank and task.
        log.exception("%s failed for task %s", getattr(callback, "__name__", "callback"), task_id)
