"""The step message that travels around the pipeline ring.

Every step starts on the last rank (the only one that decides anything) and goes
last -> rank 0 -> rank 1 -> ... -> last. Each hop carries a fixed-size int32 header,
then (for compute ops) a payload whose shape and dtype the header declares, because
`mx.distributed.recv` must know both before any byte arrives.

Payload per hop: last -> rank 0 carries token ids `(batch, length)` int32 (a DECODE's length is 1, or 1 and the
tokens drafted after it); rank i -> i+1
carries hidden states `(batch, length, width)` in the activation dtype. A vision prompt's images go to rank 0
once, before its prefill (IMAGES, bytes); rank 0 sends on a byte in their place.
"""

from __future__ import annotations

import logging
import select
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import cast

import mlx.core as mx

from jetshard_worker.library_boundary import ring_socket_from_previous_rank

log = logging.getLogger(__name__)


class Op(IntEnum):
    STOP = 1  # every rank forwards it, then leaves run_forever()
    PREFILL = 2  # the next columns of cohort `slot`'s prompts into its cache (payload: its rows); nothing is sampled
    DECODE = 3  # one token for each row of micro-batch `group`, in row order; the last rank samples
    RELEASE = 4  # the slot's task is over: drop its row from its micro-batch (FLAG_COHORT: drop cohort `slot`)
    HELLO = 5  # once at start: check that the ranks' layer ranges tile the model (payload: HELLO_*)
    JOIN = 6  # move cohort `slot`'s cache into micro-batch `group`, its rows last (payload: JOIN_*, a row each)
    EVICT = 7  # drop the saved prefix cache `prefix`
    GATHER = 8  # start prefill cohort `slot`: one batched cache of its rows' starting caches (payload: GATHER_*)
    IMAGES = 9  # cohort `slot` (one row) is a vision prompt: rank 0 embeds it with its images (payload: `images`)
    ROLLBACK = 10  # drop what each row of micro-batch `group` did not keep of its last DECODE (payload: ROLLBACK_*)


# HELLO payload (int32): the next layer expected, the model's layer count, and the first rank
# whose range did not fit (-1: none yet) with that range.
HELLO_NEXT, HELLO_NUM_LAYERS, HELLO_BAD_RANK, HELLO_BAD_START, HELLO_BAD_END = range(5)
# GATHER payload (int32), a row per prompt of the cohort: its task's slot; the saved prefix its cache starts from
# (-1: an empty cache) and how many of that prefix's tokens it keeps; how many tokens it will prefill (the rows
# with fewer are padded on the right, as mlx-lm's batch caches expect).
GATHER_SLOT, GATHER_PREFIX, GATHER_PREFIX_LEN, GATHER_TOKENS = range(4)
# JOIN payload (int32), a row per prompt of the cohort: the saved prefix to keep its cache as (-1: none), and the
# tokens in that cache.
JOIN_SAVE, JOIN_SAVE_LEN = range(2)
# ROLLBACK payload (int32), a row per row of the micro-batch, in its order: how many of the positions its last DECODE
# wrote (its last token and the drafted ones after it) its cache drops from its end.
(ROLLBACK_DROP,) = range(1)

FLAG_COHORT = 1  # RELEASE: `slot` names a prefill cohort whose tasks all ended before it joined

HEADER_LEN = 10

# The index of a dtype here is its code in the header; append only.
DTYPES: tuple[mx.Dtype, ...] = (mx.int32, mx.float32, mx.float16, mx.bfloat16, mx.uint8)


@dataclass(frozen=True)
class Header:
    op: Op
    slot: int = 0  # the task (RELEASE) or the prefill cohort (GATHER, PREFILL, JOIN) the step belongs to
    flags: int = 0
    batch: int = 0  # rows in the payload; 0 for ops without payload
    length: int = 0  # tokens per row
    width: int = 0  # hidden size; 0 when the payload is token ids
    dtype: mx.Dtype = mx.int32
    seq: int = 0  # step counter set by the last rank, checked when the step comes back
    prefix: int = -1  # the saved prefix cache EVICT drops
    group: int = 0  # the micro-batch a DECODE runs or a JOIN joins

    def to_array(self) -> mx.array:
        values = [
            int(self.op),
            self.slot,
            self.flags,
            self.batch,
            self.length,
            self.width,
            DTYPES.index(self.dtype),
            self.seq,
            self.prefix,
            self.group,
        ]
        return mx.array(values, dtype=mx.int32)

    @classmethod
    def from_array(cls, array: mx.array) -> Header:
        values = [int(v) for v in cast("list[int]", array.tolist())]
        if len(values) != HEADER_LEN:
            raise ValueError(f"step header must have {HEADER_LEN} ints, got {len(values)}")
        op, slot, flags, batch, length, width, dtype_code, seq, prefix, group = values
        if not 0 <= dtype_code < len(DTYPES):
            raise ValueError(f"step header names unknown dtype code {dtype_code}")
        return cls(Op(op), slot, flags, batch, length, width, DTYPES[dtype_code], seq, prefix, group)

    @property
    def has_payload(self) -> bool:
        return self.op in (Op.PREFILL, Op.DECODE, Op.HELLO, Op.GATHER, Op.JOIN, Op.IMAGES, Op.ROLLBACK)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        if self.width == 0:
            return (self.batch, self.length)
        return (self.batch, self.length, self.width)

    def with_payload(self, payload: mx.array) -> Header:
        width = payload.shape[-1] if payload.ndim == 3 else 0
        return replace(self, batch=payload.shape[0], length=payload.shape[1], width=width, dtype=payload.dtype)


class Link:
    """Point-to-point messages between this rank and its ring neighbours.

    `listen_port` is this rank's port in the hostfile. mlx's ring backend busy-polls a
    non-blocking socket while a recv is pending, burning a core for as long as the previous
    rank takes (forever, when idle). Knowing the port lets us find that socket and sleep in
    select() until the next message starts arriving, and only then hand the recv to mlx.
    """

    def __init__(self, group: mx.distributed.Group, listen_port: int | None = None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.next_rank = (self.rank + 1) % self.size
        self.prev_rank = (self.rank - 1) % self.size
        self._incoming = ring_socket_from_previous_rank(listen_port) if listen_port is not None else None
        if listen_port is not None and self._incoming is None:
            log.warning("rank %d: no socket accepted on port %d; recv will busy-wait", self.rank, listen_port)

    def send(self, header: Header, payload: mx.array | None = None, extra: list | None = None) -> None:
        """Send header then payload to the next rank; `extra` arrays (KV cache state) are
        evaluated with the payload."""
        if payload is not None:
            if header.payload_shape != tuple(payload.shape) or header.dtype != payload.dtype:
                raise ValueError(
                    f"payload {tuple(payload.shape)} {payload.dtype} does not match the header's "
                    f"{header.payload_shape} {header.dtype}"
                )
            # Compute before announcing: the receiver spins from the header until the payload.
            mx.eval(payload, extra or [])
        # Separate evals keep the order on the wire: the receiver reads the header to size the payload.
        mx.eval(mx.distributed.send(header.to_array(), self.next_rank, group=self.group))
        if payload is not None:
            mx.eval(mx.distributed.send(payload, self.next_rank, group=self.group))

    def recv(self) -> tuple[Header, mx.array | None]:
        if self._incoming is not None:
            select.select([self._incoming], [], [])
        raw = mx.distributed.recv((HEADER_LEN,), mx.int32, self.prev_rank, group=self.group)
        mx.eval(raw)
        header = Header.from_array(raw)
        if not header.has_payload:
            return header, None
        payload = mx.distributed.recv(header.payload_shape, header.dtype, self.prev_rank, group=self.group)
        mx.eval(payload)
        return header, payload
