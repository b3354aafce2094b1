"""Pipeline-parallel generation with continuous batching; every decision is made on the last rank.

The last rank ("leader") owns the request queue, the samplers and all per-step decisions. Up to `max_batch`
tasks decode together, one token each per (B, 1) step. New prompts are prefilled together, as mlx-lm's
BatchGenerator does: a cohort of up to `max_prefill_batch` waiting prompts of similar length shares one batched
KV cache (the shorter ones padded on the right), filled a bounded chunk of columns between two of the batch's
decode steps (so a long prompt does not freeze the others' streams), then joins the batch as its last rows; a
finished task's row leaves it. Every change to a KV cache is one step message that travels around the ring in
the order the leader decides it (see `protocol`): GATHER starts a cohort's cache, PREFILL fills it, JOIN moves
it into the batch, DECODE runs the batch's rows, RELEASE drops a row. So every rank holds the same rows in the
same order without deciding anything.

Tensor parallelism (a shard whose every layer is split across the ranks, `Shard.tensor_ranks` > 1) runs the same
steps: the leader (the last rank) sends each step to the others just as it runs it itself, and every rank runs it
at once on the same inputs, the layers summing their partial outputs over the ring (mlx's all-reduces, which
must meet in the same order on every rank: so the leader sends a step only once the previous one is under way
here, and keeps one micro-batch). Only the leader applies the head and samples; the token it samples reaches
the others as the next step's input.

Batching is exact here: mlx-lm's batch caches (left padding, masks) give each row bit for bit the logits it
gets alone, and each task samples with its own PRNG key, so neither greedy nor seeded output depends on
what else shares the batch.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
import numpy as np
from jetshard_schema.sampling import GREEDY, TokenSampling
from jetshard_schema.types import TaskOutcome

from jetshard_worker.engines.figures import EngineFigures
from jetshard_worker.library_boundary import can_trim_prompt_cache
from jetshard_worker.ring_hostfile import ring_listen_port

from .blas_threads import BlasThreads
from .drafting import Drafter
from .images import pack_prompt
from .prefixes import PrefixHit, PrefixIndex
from .protocol import (
    FLAG_COHORT,
    HELLO_BAD_END,
    HELLO_BAD_RANK,
    HELLO_BAD_START,
    HELLO_NEXT,
    HELLO_NUM_LAYERS,
    JOIN_SAVE,
    JOIN_SAVE_LEN,
    Header,
    Link,
    Op,
)
from .rank_caches import RankCaches
from .sampling import Penalties, TaskSampler
from .shard import Shard

log = logging.getLogger(__name__)

# Why a task ends is the outcome the runner reports: STOP for an EOS token or a stop string the caller saw,
# LENGTH at max_tokens, CANCELLED; the engine never ends a task with ERROR.
StartedCallback = Callable[[str, int], None]
TokenCallback = Callable[[str, int, int, "TaskOutcome | None", "TokenScores | None"], None]
FinishedCallback = Callable[[str, TaskOutcome, int, int], None]
EmbeddingCallback = Callable[[str, list[float]], None]
PrefillCallback = Callable[[str, int, int], None]
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
# A waiting prompt joins a cohort while the padded tokens stay within this share of the real ones, plus a few:
# short prompts always go together, a long one does not make short ones compute its length.
COHORT_PADDING = 1.5
COHORT_PADDING_TOKENS = 64

MAX_UNDRAFTED_STEPS = 16
"""The most steps a row whose drafts keep missing decodes without drafting before it tries again."""


@dataclass(frozen=True)
class GenerationRequest:
    task_id: str
    prompt_tokens: Sequence[int]
    max_tokens: int
    sampling: TokenSampling = GREEDY
    """How its tokens are drawn; a `ResolvedSampling`'s own max_tokens is not read (`max_tokens` is the bound)."""
    repeat_last_n: int | None = None
    """The penalties' window (see `Penalties`); None: the whole sequence."""
    seed: int | None = None
    # None: the model's own EOS ids (config.json and generation_config.json).
    eos_token_ids: frozenset[int] | None = None
    logits_processors: tuple[LogitsProcessor, ...] = ()
    top_logprobs: int | None = None
    """Report each token's TokenScores with this many alternatives; None reports none."""
    embed: bool = False
    """Generate nothing: prefill the whole prompt and hand out its embedding (the mean of the final norm's
    outputs over the prompt, L2-normalised) through `on_embedding`."""
    images: Mapping[str, np.ndarray] | None = None
    """A vision prompt's image arrays as the model's processor made them besides its `input_ids` (which are
    `prompt_tokens`): rank 0 puts the images' features in place of their tokens. Such a prompt is prefilled
    alone; the prefix cache knows its image tokens by the images' content (`prefix_key`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))
        if not self.task_id:
            raise ValueError("task_id must be a non-empty string")
        if not self.prompt_tokens:
            raise ValueError(f"task {self.task_id}: prompt_tokens must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"task {self.task_id}: max_tokens must be >= 1, got {self.max_tokens}")
        sampling = self.sampling
        if sampling.temperature < 0:
            raise ValueError(f"task {self.task_id}: temperature must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"task {self.task_id}: top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k < 0:
            raise ValueError(f"task {self.task_id}: top_k must be >= 0, got {sampling.top_k}")
        if not 0 <= sampling.min_p <= 1:
            raise ValueError(f"task {self.task_id}: min_p must be in [0, 1], got {sampling.min_p}")
        if sampling.repetition_penalty <= 0:
            raise ValueError(f"task {self.task_id}: repetition_penalty must be > 0, got {sampling.repetition_penalty}")
        if self.repeat_last_n is not None and self.repeat_last_n < 0:
            raise ValueError(f"task {self.task_id}: repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"task {self.task_id}: seed must be in [0, 2**64), got {self.seed}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"task {self.task_id}: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")


@dataclass(eq=False)
class _Task:
    request: GenerationRequest
    slot: int
    sampler: TaskSampler
    penalties: Penalties | None
    """None when its request sets none."""
    eos: frozenset[int]
    generated: list[int] = field(default_factory=list)  # tokens sampled, EOS included
    prefix_key: tuple[int, ...] = ()
    """Its prompt as the prefix cache knows it (see `_prefix_key`)."""
    restore: PrefixHit | None = None  # the saved prefix its cache starts from
    finished: bool = False
    pooled: mx.array | None = None  # an embedding task's sum of final-norm outputs over the prompt so far
    history: mx.array | None = None  # its prompt and generated ids, for its logits processors; grown, never rebuilt
    drafts_missed: int = 0  # its drafting steps in a row that proposed nothing the model kept
    undrafted_steps: int = 0  # steps it decodes without drafting before it drafts again

    def to_prefill(self) -> Sequence[int]:
        """The prompt tokens its cache still needs: after the restored prefix, and all but the last one, which
        goes in with its first decode step (mlx_lm.generate_step's schedule); an embedding needs every one."""
        prompt = self.request.prompt_tokens
        start = 0 if self.restore is None else self.restore.tokens
        return prompt[start:] if self.request.embed else prompt[start:-1]

    def drafted(self, kept: int) -> None:
        """After drafting for it: `kept` of the tokens proposed were kept (0 where none were proposed). Where the
        drafts stop matching, drafting costs a step that waits for the last one's tokens, and a draft widens it for
        nothing: a row whose drafts keep missing waits twice as many steps each time before the next."""
        self.drafts_missed = 0 if kept else self.drafts_missed + 1
        self.undrafted_steps = min(2**self.drafts_missed - 1, MAX_UNDRAFTED_STEPS)

    @property
    def processes_logits(self) -> bool:
        """Whether its logits go through processors (penalties, its request's own), which read its history."""
        return self.penalties is not None or bool(self.request.logits_processors)

    def processor_history(self) -> mx.array:
        """What mlx-lm hands a logits processor: the prompt and every token generated so far."""
        if self.history is None:
            self.history = mx.array([*self.request.prompt_tokens, *self.generated], dtype=mx.int32)
        elif (missing := len(self.request.prompt_tokens) + len(self.generated) - self.history.size) > 0:
            self.history = mx.concatenate([self.history, mx.array(self.generated[-missing:], dtype=mx.int32)])
        return self.history


@dataclass(eq=False)
class _Cohort:
    """Prompts prefilled together, into one batched KV cache on every rank, joining a micro-batch as one."""

    id: int
    tasks: list[_Task]
    """Its rows, in order; a task that ended keeps its row (and slot) until the cohort has joined."""
    done: int = 0
    """Columns of the padded prompts sent in PREFILL steps."""

    @property
    def width(self) -> int:
        return max((len(t.to_prefill()) for t in self.tasks), default=0)

    @property
    def live(self) -> list[_Task]:
        return [t for t in self.tasks if not t.finished]

    def columns(self, start: int, stop: int) -> mx.array:
        """Columns [start, stop) of its prompts, right-padded with 0 as mlx-lm pads them."""
        rows = [list(t.to_prefill()[start:stop]) for t in self.tasks]
        return mx.array([row + [0] * (stop - start - len(row)) for row in rows], dtype=mx.int32)


def cohort_fits(lengths: Sequence[int]) -> bool:
    """Whether prompts of `lengths` tokens prefill well together: padding them to the longest wastes little."""
    return len(lengths) * max(lengths) <= COHORT_PADDING * sum(lengths) + COHORT_PADDING_TOKENS


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
    cohort: _Cohort | None = None  # PREFILL
    rows: list[_Task] | None = None  # DECODE: its rows, in order
    drafts: list[list[int]] | None = None  # a DECODE that verifies: the tokens drafted after each row's last
    payload: mx.array | None = None  # a single rank's token ids, embedded when the step comes back


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
class EngineStats(EngineFigures):
    """What the engine did since it started: the figures the runner reports, and the pipeline's own."""

    max_prefill_rows: int = 0  # the most prompts prefilled together
    max_micro_batches: int = 0  # the most micro-batches under way around the ring at once
    # What the previous rank's hidden states came as: names, plain data like every field here (mlx's dtypes cannot
    # even be deep-copied).
    arrived_dtypes: set[str] = field(default_factory=set)


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
        on_prefill: PrefillCallback | None = None,
        max_batch: int = 8,
        prefill_step_size: int = 2048,
        interleaved_prefill_tokens: int | None = None,
        prefix_cache_bytes: int = 512 * 2**20,
        max_prefill_batch: int = 8,
        kv_bits: int | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        size = 1 if group is None else group.size()
        rank = 0 if group is None else group.rank()
        self._tensor = shard.tensor_ranks > 1
        if self._tensor and (shard.tensor_ranks, shard.tensor_rank) != (size, rank):
            raise ValueError(
                f"this shard is slice {shard.tensor_rank} of {shard.tensor_ranks} tensor-parallel ranks, "
                f"but runs as rank {rank} of {size}"
            )
        if not self._tensor and shard.is_first != (rank == 0):
            raise ValueError(
                f"rank {rank} holds layers [{shard.start_layer}, {shard.end_layer}); only rank 0 may "
                "and must start at layer 0"
            )
        if not self._tensor and shard.is_last != (rank == size - 1):
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
        if max_prefill_batch < 1:
            raise ValueError(f"max_prefill_batch must be >= 1, got {max_prefill_batch}")
        self.shard = shard
        self.rank = rank
        self.size = size
        self.max_batch = max_batch
        self.max_prefill_batch = max_prefill_batch
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
        self.on_prefill = on_prefill
        self._link = Link(group, ring_listen_port(rank)) if group is not None and size > 1 else None
        self._control: queue.Queue[_Control] = queue.Queue()
        self._lock = threading.Lock()
        self._task_ids: set[str] = set()  # queued or running, to refuse duplicates
        # Every rank of the instance is given the same `kv_bits`: the leader's step messages do not carry it.
        self._caches = RankCaches(shard, kv_bits)
        # Prompts' KV caches kept for later prompts that start the same way (a conversation's next turn, a
        # shared system prompt): only the leader decides, the other ranks follow its steps.
        self._prefixes = PrefixIndex(prefix_cache_bytes)
        self._pending: deque[GenerationRequest] = deque()
        self._prefilling: _Cohort | None = None
        self._cohorts = 0  # cohorts started: the next one's id
        # Whether a saved prefix can be cut to a shorter one (not for sliding-window caches).
        self._trimmable_cache = can_trim_prompt_cache(shard.make_cache())
        # The drafter proposes tokens after each row's last (`_send_decode`); a cache that cannot be cut
        # (sliding-window, recurrent layers) cannot drop the ones the model does not keep.
        self.drafter = drafter if self._trimmable_cache else None
        # The decoding rows, split in micro-batches: with one per rank, each rank computes one while the
        # others compute the rest, so no rank of the ring waits for another. Tensor ranks compute every step
        # together: one.
        self._groups = [_Group(g) for g in range(1 if self._tensor else size)]
        self._in_flight: deque[_Sent] = deque()  # steps sent around the ring (or queued on one rank), in order
        self._seq = 0
        self._shutdown_requested = False
        self.stats = EngineStats()
        self._blas_threads = BlasThreads.of_this_process()

    @property
    def is_leader(self) -> bool:
        return self.rank == self.size - 1

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
        if self._link is not None and not self._tensor:
            self._check_layout()
        while True:
            self._count_rows()
            idle = not (self._in_flight or self._prefilling or self._pending or self._decoding())
            if not self._apply_control(block=idle):
                break
            if self._prefilling is None and self._pending and self._decoding() < self.max_batch:
                self._start_cohort()
            for group in self._groups:
                if group.rows and not group.in_flight:
                    self._send_decode(group)
            if self._in_flight:
                self._come_back(*self._receive())
        while self._in_flight:  # shutting down: what is still under way comes back before the STOP
            if self._tensor:
                self._in_flight.popleft()  # not sent to the other tensor ranks yet
            else:
                self._receive()
        if self._link is not None:
            self._round_trip(Header(Op.STOP))

    def _follow(self) -> None:
        assert self._link is not None
        caches = self._caches
        # The steps that change this rank's caches by the table they carry, and carry it on unchanged.
        by_table = {Op.GATHER: caches.gather, Op.JOIN: caches.join, Op.ROLLBACK: caches.rollback}
        while True:
            header, payload = self._link.recv()
            if self._tensor:
                self._pass_on_tensor_step(header, payload)
            match header.op:
                case Op.STOP:
                    self._forward(header)
                    return
                case Op.RELEASE:
                    caches.release(header)
                    self._forward(header)
                case Op.GATHER | Op.JOIN | Op.ROLLBACK:
                    assert payload is not None
                    by_table[header.op](header, payload)
                    self._forward(header, payload)
                case Op.EVICT:
                    caches.evict(header.prefix)
                    self._forward(header)
                case Op.HELLO:
                    assert payload is not None
                    self._link.send(header, self._hello_hop(payload))
                case Op.IMAGES:
                    assert payload is not None
                    caches.images(header, payload)
                    if self.shard.is_first:  # the others need none of it
                        payload = mx.zeros((1, 1), dtype=mx.uint8)
                    self._forward(header.with_payload(payload), payload)
                case Op.PREFILL | Op.DECODE:
                    assert payload is not None
                    if header.op == Op.PREFILL:
                        cache = caches.for_prefill(header)
                    else:
                        cache = caches.for_decode(header)
                    h = caches.embed(header, payload) if self.shard.is_first else self._arrived(payload)
                    h = self._run_layers(h, cache)
                    if self._tensor:
                        mx.eval(h, [c.state for c in cache])  # every all-reduce the leader's step runs
                    else:
                        self._link.send(header.with_payload(h), h, extra=[c.state for c in cache])

    def _run_layers(self, hidden: mx.array, cache: list[Any]) -> mx.array:
        """This rank's layers over a step's hidden states, the BLAS on as many threads as the step is worth."""
        self._blas_threads.fit(hidden.shape[0] * hidden.shape[1])
        return self.shard.run_layers(hidden, cache)

    def _arrived(self, hidden: mx.array) -> mx.array:
        if self._link is not None:  # a single rank's "arrivals" are its own embeddings
            self.stats.arrived_dtypes.add(str(hidden.dtype).removeprefix("mlx.core."))
        return self.shard.arrived(hidden)

    def _forward(self, header: Header, payload: mx.array | None = None) -> None:
        """A pipeline step done here goes on to the next rank (a tensor rank passed it on as it came)."""
        if not self._tensor:
            assert self._link is not None
            self._link.send(header, payload)

    def _pass_on_tensor_step(self, header: Header, payload: mx.array | None) -> None:
        """Hand the leader's step to the next tensor rank before running it here, so they run it together; the
        rank before the leader passes it on to no one (the leader has it)."""
        assert self._link is not None
        if self._link.next_rank != self.size - 1:
            self._link.send(header, payload)

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
        return decoding if self._prefilling is None else [*decoding, *self._prefilling.live]

    def _decoding(self) -> int:
        return sum(len(group.rows) for group in self._groups)

    def _count_rows(self) -> None:
        self.stats.batch_size = self._decoding()
        self.stats.running_rows = len(self._running())
        self.stats.queued_rows = len(self._pending)

    def _start_cohort(self) -> None:
        """Start prefilling the first waiting prompt, with the next ones that fit beside it (an embedding alone:
        it pools its rows' hidden states, which padding would change)."""
        first = self._pending.popleft()
        cohort = _Cohort(self._cohorts, [])
        self._cohorts += 1
        self._prefilling = cohort
        cohort.tasks.append(self._start(first))
        # The cohort joins the micro-batch with the fewest rows: no more than keeps the micro-batches even.
        waiting = len(self._pending) + 1
        even = (self._decoding() + waiting) // len(self._groups) - min(len(g.rows) for g in self._groups)
        room = min(self.max_prefill_batch, self.max_batch - self._decoding(), max(1, even))
        if not (first.embed or first.images is not None):
            for request in list(self._pending):
                if len(cohort.tasks) >= room:
                    break
                if request.embed or request.images is not None:
                    continue  # prefilled alone
                if any(self._shares_prefix(request, t.request) for t in cohort.tasks):
                    continue  # one that starts as a row of this cohort does starts from that row's saved cache
                task = self._start(request, announce=False)
                if cohort_fits([len(t.to_prefill()) for t in [*cohort.tasks, task]]):
                    self._pending.remove(request)
                    cohort.tasks.append(task)
                    _notify(self.on_started, request.task_id, len(request.prompt_tokens))
                else:
                    self._unstart(task)
        self.stats.max_prefill_rows = max(self.stats.max_prefill_rows, len(cohort.tasks))
        table = mx.array(
            [
                [
                    t.slot,
                    -1 if t.restore is None else t.restore.entry,
                    0 if t.restore is None else t.restore.tokens,
                    len(t.to_prefill()),
                ]
                for t in cohort.tasks
            ],
            dtype=mx.int32,
        )
        self._send(_Sent(Header(Op.GATHER, cohort.id).with_payload(table)), table)
        if first.images is not None:
            prompt = pack_prompt(first.prompt_tokens, first.images)
            self._send(_Sent(Header(Op.IMAGES, cohort.id).with_payload(prompt)), prompt)
        self._send_prefill(cohort)

    def _start(self, request: GenerationRequest, announce: bool = True) -> _Task:
        used = {task.slot for task in self._slots_held()}
        slot = next(s for s in range(len(used) + 1) if s not in used)
        eos = self.shard.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        sampler = TaskSampler(request.sampling, request.seed)
        penalties = Penalties(len(request.prompt_tokens), request.sampling, request.repeat_last_n)
        task = _Task(
            request=request,
            slot=slot,
            sampler=sampler,
            penalties=penalties if penalties.active else None,
            eos=frozenset(eos),
            prefix_key=self._prefix_key(request),
        )
        hit = None if request.embed else self._prefixes.find(task.prefix_key[:-1])
        if hit is not None:
            task.restore = hit
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += hit.tokens
        if announce:
            _notify(self.on_started, request.task_id, len(request.prompt_tokens))
        return task

    def _prefix_key(self, request: GenerationRequest) -> tuple[int, ...]:
        """The prompt as the prefix cache knows it: its tokens, with a vision prompt's image tokens, which are the
        same whatever the picture, replaced by a (negative, so never a token) digest of its images. A follow-up
        question about the same pictures starts from the cache of the first; other pictures share only what comes
        before them."""
        tokens = tuple(request.prompt_tokens)
        if request.images is None:
            return tokens
        digest = hashlib.blake2b(digest_size=8)
        for name, array in sorted(request.images.items()):
            digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        images = -1 - int.from_bytes(digest.digest()[:7], "little")
        image_token = self.shard.image_token_id
        return tuple(images if token == image_token else token for token in tokens)

    def _shares_prefix(self, a: GenerationRequest, b: GenerationRequest) -> bool:
        """Whether the prompts begin with enough of the same tokens for one to start from the other's cache."""
        shared = self._prefixes.min_tokens
        return len(a.prompt_tokens) > shared and a.prompt_tokens[:shared] == b.prompt_tokens[:shared]

    def _unstart(self, task: _Task) -> None:
        """A task `_start` made that stays queued after all: its prefix hit is not counted."""
        if task.restore is not None:
            self.stats.prefix_hits -= 1
            self.stats.prefix_hit_tokens -= task.restore.tokens

    def _slots_held(self) -> list[_Task]:
        """Every task whose slot the ranks still use: a cohort's ended rows keep theirs until it has joined."""
        decoding = [task for group in self._groups for task in group.rows]
        return decoding if self._prefilling is None else [*decoding, *self._prefilling.tasks]

    # --- sending steps: what every rank will do

    def _send_prefill(self, cohort: _Cohort) -> None:
        """The cohort's next columns, or, once they are all in its cache, its join (or an embedding's end)."""
        self._report_prefill(cohort)
        if cohort.done >= cohort.width:
            if cohort.tasks[0].request.embed:
                self._finish_embedding(cohort.tasks[0])
            else:
                self._send_join(cohort)
            return
        n = min(self._prefill_chunk(len(cohort.tasks)), cohort.width - cohort.done)
        ids = cohort.columns(cohort.done, cohort.done + n)
        cohort.done += n
        self._send(_Sent(Header(Op.PREFILL, cohort.id).with_payload(ids), cohort=cohort), ids)

    def _report_prefill(self, cohort: _Cohort) -> None:
        """How far each prompt of the cohort is processed: its restored prefix and the columns in its cache (its
        last token goes in with its first decode step, so a prompt is whole once every column is in)."""
        for task in cohort.live:
            if task.request.embed:
                continue
            total, left = len(task.request.prompt_tokens), len(task.to_prefill())
            done = total if cohort.done >= cohort.width else total - left + min(cohort.done, left)
            _notify(self.on_prefill, task.request.task_id, done, total)

    def _prefill_chunk(self, rows: int) -> int:
        """Columns for the next PREFILL of `rows` prompts: `prefill_step_size` tokens while nothing decodes, else
        about one decode step's worth."""
        if not self._decoding():
            tokens = self.prefill_step_size
        elif self.interleaved_prefill_tokens is not None:
            tokens = self.interleaved_prefill_tokens
        else:
            tokens = self._timing.tokens_per_step(self.prefill_step_size)
        return max(1, tokens // rows)

    def _finish_embedding(self, task: _Task) -> None:
        assert task.pooled is not None
        mean = task.pooled[0] / len(task.request.prompt_tokens)
        vector = mean / mx.maximum(mx.linalg.norm(mean), 1e-12)
        _notify(self.on_embedding, task.request.task_id, cast("list[float]", vector.tolist()))
        self._finish(task, TaskOutcome.STOP)

    def _send_join(self, cohort: _Cohort) -> None:
        """Join the cohort to the micro-batch with the fewest rows, keeping each prompt's cache as a saved prefix
        where the prefix index wants it; its rows whose tasks ended meanwhile leave again at once."""
        group = min(self._groups, key=lambda g: len(g.rows))
        # The cohort's cache size for the whole model, from this rank's share of the layers, shared out by tokens.
        # Tensor ranks each hold their share of every layer's heads.
        cohort_bytes = self._caches.cohort_bytes(cohort.id) * self.shard.num_layers // len(self.shard.layers)
        cohort_bytes *= self.shard.tensor_ranks
        padded_tokens = max(1, len(cohort.tasks) * max(len(t.request.prompt_tokens) for t in cohort.tasks))
        saves, evicted = [], []
        for task in cohort.tasks:
            kept = len(task.request.prompt_tokens) - 1
            saved = None
            if not task.finished and task.to_prefill():
                size = cohort_bytes * kept // padded_tokens
                saved, dropped = self._prefixes.add(task.prefix_key[:-1], size, self._trimmable_cache)
                evicted += dropped
            saves.append([-1 if saved is None else saved, kept])
        table = mx.array(saves, dtype=mx.int32)
        assert table.shape[1] == max(JOIN_SAVE, JOIN_SAVE_LEN) + 1
        self._send(_Sent(Header(Op.JOIN, cohort.id, group=group.index).with_payload(table)), table)
        for prefix in evicted:
            self._send(_Sent(Header(Op.EVICT, prefix=prefix)))
        self.stats.prefix_cache_entries, self.stats.prefix_cache_bytes = len(self._prefixes), self._prefixes.size_bytes
        self._prefilling = None
        group.rows.extend(cohort.live)
        for task in cohort.tasks:
            if task.finished:
                self._send(_Sent(Header(Op.RELEASE, task.slot)))

    def _send_decode(self, group: _Group) -> None:
        drafts = self._drafts(group) if self._drafting(group.rows) else None
        if drafts is None:
            for task in group.rows:
                task.undrafted_steps = max(0, task.undrafted_steps - 1)
        rows = list(group.rows)
        if not rows:  # every row ended with the tokens just read
            return
        if drafts is None:
            inputs = self._inputs(rows, group.launched).reshape(-1, 1)
        else:
            # Each row's last token and its drafts, padded to the widest: a pad is a draft no row keeps.
            width = 1 + max(map(len, drafts))
            lines = [[t.generated[-1], *d, *[0] * (width - 1 - len(d))] for t, d in zip(rows, drafts, strict=True)]
            inputs = mx.array(lines, dtype=mx.int32)
        self.stats.max_rows = max(self.stats.max_rows, self._decoding())
        group.in_flight = True
        self.stats.max_micro_batches = max(self.stats.max_micro_batches, sum(g.in_flight for g in self._groups))
        header = Header(Op.DECODE, group=group.index).with_payload(inputs)
        self._send(_Sent(header, rows=rows, drafts=drafts), inputs)

    def _drafting(self, rows: list[_Task]) -> bool:
        """Whether the micro-batch drafts its next step: no row with a logits processor or logprobs asked (a row
        of either kind decodes one token a step, and so does its micro-batch), and one row due to draft."""
        return (
            self.drafter is not None
            and all(not t.processes_logits and t.request.top_logprobs is None and t.generated for t in rows)
            and any(not t.undrafted_steps for t in rows)
        )

    def _drafts(self, group: _Group) -> list[list[int]] | None:
        """The tokens the drafter proposes after each row's last, once the group's last step is read; None where it
        proposes none (the step then decodes as without drafting)."""
        assert self.drafter is not None
        if group.launched is not None:
            self._read(group.launched)
            group.launched = None
        drafts: list[list[int]] = []
        for task in group.rows:
            if task.undrafted_steps:
                task.undrafted_steps -= 1
                drafts.append([])
                continue
            room = task.request.max_tokens - len(task.generated) - 1  # the step's own token comes too
            context = [*task.request.prompt_tokens, *task.generated]
            draft = self.drafter.propose(task, context, min(self.drafter.most, room))
            if not draft:
                task.drafted(0)
            drafts.append(draft)
        return drafts if any(drafts) else None

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
        """Around the ring, or, on a single rank and on tensor ranks, straight into the queue of steps to come back
        (embedded), which sends a tensor rank's to the others as it runs it."""
        self._seq += 1
        header = replace(sent.header, seq=self._seq)
        if self._link is None or self._tensor:
            self._in_flight.append(replace(sent, header=header, payload=payload))
        else:
            self._in_flight.append(replace(sent, header=header))
            self._link.send(header, payload)

    def _receive(self) -> tuple[_Sent, mx.array | None]:
        sent = self._in_flight.popleft()
        if self._link is None or self._tensor:
            if self._link is not None:
                # Tensor ranks: sent now, as this rank runs it, after the previous step's all-reduces went out.
                self._link.send(sent.header, sent.payload)
            if sent.payload is not None and sent.header.op in (Op.PREFILL, Op.DECODE):
                return sent, self._caches.embed(sent.header, sent.payload)
            return sent, sent.payload  # GATHER's and JOIN's tables: back as they went
        back, data = self._link.recv()
        if (back.op, back.slot, back.seq) != (sent.header.op, sent.header.slot, sent.header.seq):
            raise RuntimeError(
                f"pipeline out of step: sent {sent.header.op.name} slot {sent.header.slot} seq {sent.header.seq}, "
                f"got back {back.op.name} slot {back.slot} seq {back.seq}"
            )
        return sent, data

    # --- steps coming back: the leader's own layers and caches, sampling

    def _come_back(self, sent: _Sent, data: mx.array | None) -> None:
        """`data`: the hidden states a PREFILL or DECODE step brings back, the table a GATHER or JOIN carried."""
        header = sent.header
        match header.op:
            case Op.GATHER:
                assert data is not None
                self._caches.gather(header, data)
            case Op.IMAGES:  # on a single rank: this one embeds them
                assert data is not None
                self._caches.images(header, data)
            case Op.PREFILL:
                assert data is not None and sent.cohort is not None
                self._prefilled(sent.cohort, header, data)
            case Op.DECODE:
                assert data is not None and sent.rows is not None
                if sent.drafts is None:
                    self._decoded(self._groups[header.group], sent.rows, header, data)
                else:
                    self._verified(self._groups[header.group], sent.rows, sent.drafts, header, data)
            case Op.ROLLBACK:
                assert data is not None
                self._caches.rollback(header, data)
            case Op.JOIN:
                assert data is not None
                self._caches.join(header, data)
                mx.clear_cache()  # the prefill's activations; mlx-lm frees them the same way
            case Op.RELEASE:
                self._caches.release(header)
                if not self._running():
                    mx.clear_cache()  # idle: hand the freed KV caches back, as mlx-lm does between requests
            case Op.EVICT:
                self._caches.evict(header.prefix)

    def _prefilled(self, cohort: _Cohort, header: Header, hidden: mx.array) -> None:
        for group in self._groups:
            if group.launched is not None:
                mx.eval(group.launched.tokens)  # time the chunk alone, not a decode step still running
        started = time.perf_counter()
        cache = self._caches.for_prefill(header)
        h = self._run_layers(self._arrived(hidden), cache)
        first = cohort.tasks[0]
        if first.request.embed:  # alone in its cohort: no padding in the mean
            pooled = self.shard.final_norm(h).astype(mx.float32).sum(axis=1)
            first.pooled = pooled if first.pooled is None else first.pooled + pooled
        # A tensor rank runs every all-reduce of the step, as the others do, though no later layer needs the last.
        mx.eval([c.state for c in cache], first.pooled, h if self._tensor else [])
        self._timing.prefilled(header.batch * header.length, time.perf_counter() - started)
        if cohort is self._prefilling:  # else every task of it ended, and it was dropped
            self._send_prefill(cohort)

    def _decoded(self, group: _Group, rows: list[_Task], header: Header, hidden: mx.array) -> None:
        """Sample the rows' next tokens, then hand out the tokens of the group's step before: building and
        running this step's graph (`mx.async_eval`) overlaps reading and handing out the last one, as in
        mlx_lm's generate_step. A logits processor needs its row's previous token first: then it is read first."""
        group.in_flight = False
        previous, group.launched = group.launched, None
        if previous is not None and any(t.processes_logits for t in rows):
            self._read(previous)
            previous = None
        h = self._run_layers(self._arrived(hidden), self._caches.for_decode(header))
        tokens, scores = self._sample(rows, self.shard.head(h)[:, -1, :])
        mx.async_eval(tokens, *(scores or ()))
        group.launched = _Launched(rows, tokens, scores)
        if previous is not None:
            if group.index == 0:
                self._timing.read()
            self._read(previous)

    def _verified(
        self, group: _Group, rows: list[_Task], drafts: list[list[int]], header: Header, hidden: mx.array
    ) -> None:
        """A step that checked drafted tokens: each row draws a token at every position, as it would have there
        had the drafts before it been its own (`TaskSampler.ahead`), and keeps its drafts up to the first it did
        not draw, and the token it drew there: the tokens it gives without drafting (a sampled row: with the same
        seed). Every rank's caches then drop the positions of the drafts not kept (ROLLBACK), before the group's
        next step."""
        group.in_flight = False
        h = self._run_layers(self._arrived(hidden), self._caches.for_decode(header))
        logits = self.shard.head(h)
        if all(t.sampler.greedy for t in rows):
            drawn = mx.argmax(logits, axis=-1)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            drawn = mx.stack([t.sampler.ahead(logprobs[i]) for i, t in enumerate(rows)])
        chosen = cast("list[list[int]]", drawn.tolist())
        drops: dict[_Task, int] = {}
        for task, draft, tokens in zip(rows, drafts, chosen, strict=True):
            kept = next((i for i, token in enumerate(draft) if tokens[i] != token), len(draft))
            self.stats.drafted_tokens += len(draft)
            self.stats.accepted_tokens += kept
            drops[task] = len(tokens) - 1 - kept
            task.sampler.advance(kept + 1)
            if draft:
                task.drafted(kept)
            for token in tokens[: kept + 1]:
                if task.finished:  # it ended before this token: the rest of its step is void
                    break
                self._accept(task, token)
        if group.rows and any(drops.get(t, 0) for t in group.rows):
            # Rows that joined since the step went out wrote nothing in it.
            table = mx.array([[drops.get(t, 0)] for t in group.rows], dtype=mx.int32)
            self._send(_Sent(Header(Op.ROLLBACK, group=group.index).with_payload(table)), table)
        if group.index == 0:
            self._timing.read()

    def _sample(
        self, rows: list[_Task], logits: mx.array
    ) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array] | None]:
        """The rows' next tokens, and their scores when a row asked for them."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(t.sampler.greedy and not t.processes_logits for t in rows):
            # Same op as mlx_lm's greedy_sampler, so greedy output matches mlx-lm exactly.
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            sampled = []
            for i, task in enumerate(rows):
                row = logprobs[i : i + 1]
                if task.processes_logits:
                    history = task.processor_history()
                    if task.penalties is not None:
                        penalised = task.penalties(history, logits[i : i + 1])
                        row = penalised - mx.logsumexp(penalised, axis=-1, keepdims=True)
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
        """End `task`; unless `release` is False (shutting down), its row leaves every rank's caches: now if it
        decodes, when its cohort joins if that is still prefilling, or with the cohort if none of it is left."""
        task.finished = True
        cohort = self._prefilling
        if cohort is not None and task in cohort.tasks:
            if not cohort.live:
                if release:
                    self._send(_Sent(Header(Op.RELEASE, cohort.id, FLAG_COHORT)))
                self._prefilling = None
        else:
            for group in self._groups:
                if task in group.rows:
                    group.rows.remove(task)
            if release:
                self._send(_Sent(Header(Op.RELEASE, task.slot)))
        if self.drafter is not None:
            self.drafter.forget(task)
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
