"""An optimized BLAS for runners on Linux CPUs.

The `mlx[cpu]` wheel bundles the reference BLAS (about 6 GFLOP/s on a small x86 machine). OpenBLAS, preloaded
before MLX loads, multiplies float32 at about 195 GFLOP/s there, and float32 decode runs 2-12x faster than
quantized decode (quantized layers use MLX's own kernels and do not gain). MLX takes `cblas_sgemm` and
friends from whichever loaded library defines them first, so LD_PRELOAD is enough.

The library comes from the `cmeel-openblas` wheel, a dependency of the worker on Linux, so no system package
is needed. That build links `libgfortran.so.5`, which a bare machine lacks; the gfortran runtime that
auditwheel vendors (renamed) into the `mlx[cpu]` and numpy wheels serves, through a link under its usual name
in a directory the runner's LD_LIBRARY_PATH names. A system OpenBLAS is the fallback.

`JETSHARD_BLAS`: `auto` (default), `0` (the reference BLAS), or the path of a library to preload.
"""

from __future__ import annotations

import ctypes.util
import functools
import glob
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

_SYSTEM_CANDIDATES = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_GFORTRAN = "libgfortran.so.5"

log = logging.getLogger(__name__)


def blas_threads(cpu_cores: int, runners: int) -> int:
    """BLAS threads for each of `runners` runners sharing `cpu_cores` cores: more threads than cores in total
    only make the runners' thread pools preempt each other."""
    if cpu_cores < 1 or runners < 1:
        raise ValueError(f"blas_threads needs at least one core and one runner, got {cpu_cores} and {runners}")
    return max(1, cpu_cores // runners)


def _packaged_openblas() -> Path | None:
    try:
        files = importlib.metadata.files("cmeel-openblas") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "libopenblas.so.0":
            return Path(str(file.locate()))
    return None


def blas_candidates(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The libraries a runner may preload, best first; none for the reference BLAS."""
    setting = environ.get("JETSHARD_BLAS", "auto")
    if sys.platform != "linux" or setting.lower() in ("0", "no", "false", "off"):
        return []
    if setting.lower() != "auto":
        if not os.path.exists(setting):
            raise ValueError(f"JETSHARD_BLAS={setting!r}: no such file (use auto, 0 or a library's path)")
        return [Path(setting)]
    packaged = _packaged_openblas()
    system = [Path(found) for pattern in _SYSTEM_CANDIDATES for found in sorted(glob.glob(pattern))[:1]]
    return ([packaged] if packaged is not None and packaged.exists() else []) + system


def _vendored_gfortran(library: Path) -> Path | None:
    """A gfortran 5 runtime that a wheel in the same site-packages vendors (`mlx_cpu.libs/libgfortran-….so.5…`)."""
    for site in library.parents:
        found = sorted(glob.glob(str(site / "*.libs" / "libgfortran-*.so.5*")))
        if found:
            return Path(found[0])
    return None


def _gfortran_dirs(library: Path, link_dir: Path) -> list[str] | None:
    """Directories for LD_LIBRARY_PATH that let `library` find libgfortran.so.5 (none when it needs none or the
    system has it), or None when nothing provides it: the loader would refuse to start the runner."""
    if library.parent.name != "lib" or library.parent.parent.name != "cmeel.prefix":
        return []
    runtime = _vendored_gfortran(library)
    if runtime is None:
        return [] if ctypes.util.find_library("gfortran") else None
    link = link_dir / _GFORTRAN
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(runtime)
    # The vendored runtime finds its renamed libquadmath through $ORIGIN, which the loader takes from the
    # link's directory, not the target's: the target's directory is named too.
    return [str(link_dir), str(runtime.parent)]


def runner_environment(link_dir: Path, threads: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` plus what makes a runner load the first BLAS that works here, with `threads` threads;
    `link_dir` is a private directory for the library links it may need."""
    for library in blas_candidates(environ):
        search = _gfortran_dirs(library, link_dir)
        if search is None:
            log.warning("%s needs libgfortran.so.5, which nothing here provides", library)
            continue
        env = dict(environ)
        env["LD_PRELOAD"] = ":".join(p for p in (str(library), environ.get("LD_PRELOAD", "")) if p)
        if search:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (*search, environ.get("LD_LIBRARY_PATH", "")) if p)
        failure = _fails_here(str(library), tuple(sorted(env.items())))
        if failure:
            log.warning("%s %s on this machine", library, failure)
            continue
        # Both names, as a user's JETSHARD_BLAS may point at MKL; a thread count the user set is kept.
        for name in _THREAD_VARIABLES:
            env.setdefault(name, str(threads))
        return env
    return dict(environ)


def has_fast_blas(link_dir: Path, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether runners started here multiply with a BLAS other than MLX's reference one."""
    return runner_environment(link_dir, 1, environ).get("LD_PRELOAD") != environ.get("LD_PRELOAD")


_PROBE = """
import ctypes, sys
blas = ctypes.CDLL(sys.argv[1])
n = 96
a = (ctypes.c_float * (n * n))(*([1.0] * (n * n)))
c = (ctypes.c_float * (n * n))()
for transpose_a, transpose_b in ((111, 111), (112, 111), (111, 112)):
    blas.cblas_sgemm(101, transpose_a, transpose_b, n, n, n, ctypes.c_float(1.0), a, n, a, n, ctypes.c_float(0.0), c, n)
    assert c[0] == n and c[n * n - 1] == n, (c[0], c[n * n - 1])
"""


@functools.cache
def _fails_here(library: str, env: tuple[tuple[str, str], ...]) -> str:
    """How multiplying with `library` in a runner's `env` fails on this machine, or "" when it works. A build
    for a newer processor than this one (AVX-512 kernels on an AVX2 machine) dies of SIGILL in its first
    sgemm, which would kill every runner, so it is tried first in a process of its own."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, library], env=dict(env), capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "did not finish a small matrix product in 60 s"
    if probe.returncode < 0:
        return f"crashed with {signal.Signals(-probe.returncode).name} in a matrix product"
    if probe.returncode > 0:
        last_line = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        return f"failed a matrix product ({last_line})"
    return ""
