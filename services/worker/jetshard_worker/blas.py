"""An optimized BLAS for runners on Linux CPUs.

The `mlx[cpu]` wheel links the reference BLAS (4.5 GFLOP/s for a 1024² float32 product on a 2-core AVX2
machine). MLX takes `cblas_sgemm`, `cblas_dgemm` and `cblas_cgemm` from whichever loaded library defines them
first, so an OpenBLAS preloaded (LD_PRELOAD) before MLX loads computes every float32 product, at 15-40 times the
speed, and float32 decode beats quantized decode (whose layers use MLX's own kernels and gain nothing).

The OpenBLAS is numpy's and scipy's, the `scipy-openblas32` wheel: built with DYNAMIC_ARCH for x86-64 and arm64,
so it picks its kernels for the processor it finds at load time (Haswell, Zen, SkylakeX, Neoverse, generic ARMv8
NEON, ...), LP64 like MLX's cblas, needing nothing but libc. Its symbols carry a prefix, so that it never
clashes with another BLAS in a process; a runner needs MLX's three products under their plain names, so a copy
with just those renamed (`patchelf --rename-dynamic-symbols`) is made once, in the user's cache. A system
OpenBLAS is the fallback. (`cmeel-openblas`, used before, is built for one target, SkylakeX on x86-64 and
Neoverse N2 on arm64, and dies of SIGILL on processors without AVX-512 or SVE.)

`JETSHARD_BLAS`: `auto` (default), `0` (the reference BLAS), or the path of a library to preload.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_SYSTEM_CANDIDATES = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MLX_BLAS_CALLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
"""What `libmlx.so` takes from a BLAS (`nm -D -u`): the products; its LAPACK calls stay with the reference."""
SCIPY_OPENBLAS_PREFIX = "scipy_"
"""What scipy-openblas32 puts before every symbol (its pkg-config's BLAS_SYMBOL_PREFIX)."""

log = logging.getLogger(__name__)


def blas_threads(cpu_cores: int, runners: int) -> int:
    """BLAS threads for each of `runners` runners sharing `cpu_cores` cores: more threads than cores in total
    only make the runners' thread pools preempt each other."""
    if cpu_cores < 1 or runners < 1:
        raise ValueError(f"blas_threads needs at least one core and one runner, got {cpu_cores} and {runners}")
    return max(1, cpu_cores // runners)


def _blas_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jetshard" / "blas"


@functools.cache
def packaged_openblas() -> Path | None:
    """The `scipy-openblas32` library with MLX's calls under their plain names, made on first use; None where the
    wheel (or patchelf, which renames them) is missing or the copy cannot be made."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    source = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    built = _blas_cache_dir() / f"libopenblas-scipy32-{scipy_openblas32.__version__}.so"
    if built.exists():
        return built
    patchelf = shutil.which("patchelf", path=sysconfig.get_path("scripts")) or shutil.which("patchelf")
    if patchelf is None:
        log.warning("patchelf is not installed: the runners keep the reference BLAS")
        return None
    try:
        return _renamed_copy(patchelf, source, built)
    except OSError as error:  # a cache directory that cannot be written: a read-only home, a full disk
        log.warning("could not make %s (%s): the runners keep the reference BLAS", built, error)
        return None


def _renamed_copy(patchelf: str, source: Path, built: Path) -> Path | None:
    built.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=built.parent) as work:
        copy, renames = Path(work) / built.name, Path(work) / "renames"
        shutil.copyfile(source, copy)
        renames.write_text("".join(f"{SCIPY_OPENBLAS_PREFIX}{name} {name}\n" for name in MLX_BLAS_CALLS))
        done = subprocess.run(
            [patchelf, "--rename-dynamic-symbols", str(renames), str(copy)], capture_output=True, text=True
        )
        if done.returncode != 0:
            log.warning("could not rename %s's symbols: %s", source, done.stderr.strip())
            return None
        copy.replace(built)  # whole or not at all: several workers may make it at once
    return built


def blas_candidates(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The libraries a runner may preload, best first; none for the reference BLAS."""
    setting = environ.get("JETSHARD_BLAS", "auto")
    if sys.platform != "linux" or setting.lower() in ("0", "no", "false", "off"):
        return []
    if setting.lower() != "auto":
        if not os.path.exists(setting):
            raise ValueError(f"JETSHARD_BLAS={setting!r}: no such file (use auto, 0 or a library's path)")
        return [Path(setting)]
    packaged = packaged_openblas()
    system = [Path(found) for pattern in _SYSTEM_CANDIDATES for found in sorted(glob.glob(pattern))[:1]]
    return ([packaged] if packaged is not None else []) + system


@dataclass(frozen=True)
class RunnerBlas:
    """The BLAS a runner multiplies with: the library preloaded (None: the reference BLAS) and, for an OpenBLAS,
    the kernels it chose for this processor."""

    library: Path | None
    kernels: str = ""

    def describe(self) -> str:
        if self.library is None:
            return "the reference BLAS of the mlx[cpu] wheel"
        return f"{self.library}" + (f" ({self.kernels} kernels)" if self.kernels else "")


def runner_blas(environ: Mapping[str, str] = os.environ) -> RunnerBlas:
    """The first BLAS candidate that multiplies correctly on this machine."""
    for library in blas_candidates(environ):
        probe = _probe(str(library), tuple(sorted(_preloading(library, environ).items())))
        if probe.failure:
            log.warning("%s %s on this machine", library, probe.failure)
            continue
        return RunnerBlas(library, probe.kernels)
    return RunnerBlas(None)


def runner_environment(threads: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` plus what makes a runner load the first BLAS that works here, with `threads` threads."""
    chosen = runner_blas(environ).library
    if chosen is None:
        return dict(environ)
    env = _preloading(chosen, environ)
    # Both names, as a user's JETSHARD_BLAS may point at MKL; a thread count the user set is kept.
    for name in _THREAD_VARIABLES:
        env.setdefault(name, str(threads))
    return env


def _preloading(library: Path, environ: Mapping[str, str]) -> dict[str, str]:
    return {**environ, "LD_PRELOAD": ":".join(p for p in (str(library), environ.get("LD_PRELOAD", "")) if p)}


_PROBE = """
import ctypes, sys
blas = ctypes.CDLL(sys.argv[1])
n = 96
a = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
c = (ctypes.c_float * (n * n))()
for transpose_a, transpose_b in ((111, 111), (112, 111), (111, 112)):
    blas.cblas_sgemm(101, transpose_a, transpose_b, n, n, n, ctypes.c_float(1.0), a, n, a, n, ctypes.c_float(0.0), c, n)
    assert c[0] == n and c[n * n - 1] == n, (c[0], c[n * n - 1])
for name in ("openblas_get_corename", "scipy_openblas_get_corename"):
    if hasattr(blas, name):
        getattr(blas, name).restype = ctypes.c_char_p
        print(getattr(blas, name)().decode())
        break
"""


@dataclass(frozen=True)
class _Probe:
    failure: str = ""
    """How a matrix product with the library failed; empty when it worked."""
    kernels: str = ""


@functools.cache
def _probe(library: str, env: tuple[tuple[str, str], ...]) -> _Probe:
    """Multiply with `library` in a runner's `env`, in a process of its own: a build for a newer processor than
    this one (AVX-512 kernels on an AVX2 machine) dies of SIGILL in its first sgemm, which would kill every
    runner."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, library], env=dict(env), capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return _Probe("did not finish a small matrix product in 60 s")
    if probe.returncode < 0:
        return _Probe(f"crashed with {signal.Signals(-probe.returncode).name} in a matrix product")
    if probe.returncode > 0:
        last_line = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        return _Probe(f"failed a matrix product ({last_line})")
    return _Probe(kernels=probe.stdout.strip())
