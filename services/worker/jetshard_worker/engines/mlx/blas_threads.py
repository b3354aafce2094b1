"""How many threads the runner's OpenBLAS multiplies with, step by step.

OpenBLAS's threads wait for work, and for each other, by spinning on `sched_yield`. Where anything else wants
the CPU (a compiler, a browser, even a `nice -n 19` loop), each yield hands the core away for a scheduler
slice, and a product split over several threads waits for the slowest of them: beside two nice-19 loops on
a 2-core machine, a decode step of the demo took ten times as long on two threads as on one. A decode step
multiplies a few rows, where a second thread gains little even on an idle machine; a long prompt's chunk
multiplies hundreds, where it pays. So steps of fewer than `PARALLEL_MIN_TOKENS` tokens multiply on the
calling thread alone, larger ones on every thread the worker gave this runner (`OPENBLAS_NUM_THREADS`).
Without an OpenBLAS loaded (the reference BLAS, a GPU) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping

import mlx.core as mx

PARALLEL_MIN_TOKENS = 256
"""Tokens in a step (rows times columns) from which its products are split over the runner's threads."""

_SETTERS = ("scipy_openblas_set_num_threads", "openblas_set_num_threads")
"""`openblas_set_num_threads` under the names it has in the libraries a runner preloads (`blas.py`): the
`scipy-openblas32` wheel's prefixed one, a system OpenBLAS's plain one."""


def loaded_openblas_setter() -> Callable[[int], None] | None:
    """The loaded OpenBLAS's `openblas_set_num_threads`, if one is loaded into this process's global scope (the
    runner's preload); None otherwise."""
    process = ctypes.CDLL(None)
    for name in _SETTERS:
        try:
            setter = getattr(process, name)
        except AttributeError:
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], None
        return setter  # type: ignore[no-any-return]
    return None


class BlasThreads:
    """Keeps the BLAS on one thread for small steps and on up to `most` for large ones."""

    def __init__(self, most: int, setter: Callable[[int], None] | None) -> None:
        if most < 1:
            raise ValueError(f"a BLAS needs at least one thread, got {most}")
        self.most = most
        self._setter = setter
        self.current = most
        """What the library runs with now: `most` as it loaded (its environment says so)."""

    @classmethod
    def of_this_process(cls, environ: Mapping[str, str] = os.environ) -> BlasThreads:
        """As OpenBLAS loaded here: with `OPENBLAS_NUM_THREADS` threads, else one per core."""
        threads = environ.get("OPENBLAS_NUM_THREADS", "")
        most = int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1
        return cls(most, loaded_openblas_setter())

    def fit(self, tokens: int) -> None:
        """Before a step of `tokens` tokens is computed."""
        wanted = self.most if tokens >= PARALLEL_MIN_TOKENS else 1
        if self._setter is None or wanted == self.current:
            return
        mx.synchronize()  # no product of an earlier step still running while the library changes its threads
        self._setter(wanted)
        self.current = wanted
