"""The BLAS a runner loads, and how runners sharing a machine split its cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jetshard_worker import blas
from jetshard_worker.blas import (
    MLX_BLAS_CALLS,
    blas_candidates,
    blas_threads,
    packaged_openblas,
    runner_blas,
    runner_environment,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is for Linux CPUs")


@pytest.mark.parametrize(
    ("cores", "runners", "threads"),
    [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 3, 5), (16, 4, 4), (1, 1, 1), (64, 1, 64)],
)
def test_runners_split_the_cores(cores: int, runners: int, threads: int) -> None:
    assert blas_threads(cores, runners) == threads


@pytest.mark.parametrize(("cores", "runners"), [(0, 1), (2, 0)])
def test_thread_split_refuses_nonsense(cores: int, runners: int) -> None:
    with pytest.raises(ValueError, match="at least one core and one runner"):
        blas_threads(cores, runners)


def test_reference_blas_when_switched_off(tmp_path: Path) -> None:
    env = runner_environment(2, {"JETSHARD_BLAS": "0", "PATH": "/usr/bin"})
    assert env == {"JETSHARD_BLAS": "0", "PATH": "/usr/bin"}


def test_a_path_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        blas_candidates({"JETSHARD_BLAS": str(tmp_path / "libnothing.so")})


MULTIPLY = (
    "import mlx.core as mx\n"
    "a = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) / 4096\n"
    "mx.eval(a @ a.T)\n"
    "assert mx.allclose(a @ a.T, mx.sum(a[:, None, :] * a[None, :, :], axis=-1)).item()\n"
    "import os\n"
    "preloaded = os.environ.get('LD_PRELOAD', '').split(':')[0]\n"
    "maps = open('/proc/self/maps').read()\n"
    "print(os.path.basename(preloaded) if preloaded and preloaded in maps else 'reference')\n"
)
"""What a runner does first: a float32 matrix product, and which BLAS computed it (its preload, if mapped)."""

# A cblas_sgemm for row-major products without transposes, and one built for a CPU this is not: both stand
# in for real libraries (a BLAS that runs, one whose kernels this processor lacks) that cannot be had here.
FAKE_BLAS = """
#include <stdlib.h>
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
#ifdef TRAP
  __builtin_trap();
#endif
  if (getenv("FAKE_BLAS_TRAP")) __builtin_trap();
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float sum = 0;
      for (int p = 0; p < k; p++)
        sum += (ta == 112 ? a[p * lda + i] : a[i * lda + p]) * (tb == 112 ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * sum + beta * c[i * ldc + j];
    }
}
"""


def fake_blas(tmp_path: Path, trap: bool = False) -> Path:
    source, library = tmp_path / "fakeblas.c", tmp_path / "libfakeblas.so"
    source.write_text(FAKE_BLAS)
    defines = ["-DTRAP"] if trap else []
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", *defines, "-o", str(library), str(source)], check=True)
    return library


@linux_only
def test_a_runner_multiplies_with_the_packaged_openblas(tmp_path: Path) -> None:
    """The auto choice is scipy-openblas32 (DYNAMIC_ARCH: it runs on any x86-64 or arm64 processor), copied with
    MLX's calls under their plain names; a process started with the runner's environment multiplies with it,
    correctly, on kernels chosen for this processor."""
    [packaged, *_] = blas_candidates({})
    assert packaged.name.startswith("libopenblas-scipy32-")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(packaged)], capture_output=True, text=True, check=True)
    assert {f"T {name}" for name in MLX_BLAS_CALLS} <= {line.split(" ", 1)[1] for line in exported.stdout.splitlines()}
    chosen = runner_blas({})
    assert chosen.library == packaged and chosen.kernels, chosen
    print(f"runner BLAS here: {chosen.describe()}")
    env = runner_environment(1, {"PATH": "/usr/bin:/bin"})
    assert env["LD_PRELOAD"] == str(packaged) and env["OPENBLAS_NUM_THREADS"] == "1"
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == packaged.name


@linux_only
def test_the_renamed_copy_is_made_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    packaged_openblas.cache_clear()
    try:
        made = packaged_openblas()
        assert made is not None and made.parent == tmp_path / "jetshard" / "blas"
        assert [p.name for p in made.parent.iterdir()] == [made.name]  # no half-written copy left beside it
        stamp = made.stat().st_mtime_ns
        packaged_openblas.cache_clear()
        assert packaged_openblas() == made and made.stat().st_mtime_ns == stamp
    finally:
        packaged_openblas.cache_clear()


@linux_only
def test_a_cache_that_cannot_be_written_leaves_the_reference_blas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no directory can be made under it
    packaged_openblas.cache_clear()
    try:
        assert packaged_openblas() is None
        assert "the runners keep the reference BLAS" in caplog.text
    finally:
        packaged_openblas.cache_clear()


@linux_only
def test_a_blas_that_dies_in_its_first_product_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    library = fake_blas(tmp_path)
    trapping = {"PATH": "/usr/bin:/bin", "JETSHARD_BLAS": str(library), "FAKE_BLAS_TRAP": "1"}
    env = runner_environment(1, trapping)
    assert env == trapping
    assert "crashed with SIGILL" in caplog.text
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "reference"

    working = runner_environment(1, {"PATH": "/usr/bin:/bin", "JETSHARD_BLAS": str(library)})
    assert working["LD_PRELOAD"] == str(library)
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=working, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "libfakeblas.so"


@linux_only
def test_auto_skips_a_packaged_blas_that_traps_for_the_next_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of `auto` with real probes: the packaged library stands in for a build whose kernels this
    processor lacks (every product traps); the system's comes next and is the one preloaded."""
    (tmp_path / "trapping").mkdir()
    trapping = fake_blas(tmp_path / "trapping", trap=True)
    working = fake_blas(tmp_path)
    monkeypatch.setattr(blas, "packaged_openblas", lambda: trapping)
    monkeypatch.setattr(blas, "_SYSTEM_CANDIDATES", (str(working),))
    assert blas_candidates({}) == [trapping, working]
    env = runner_environment(1, {"PATH": "/usr/bin:/bin"})
    assert env["LD_PRELOAD"] == str(working)
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "libfakeblas.so"


@linux_only
def test_a_thread_count_the_user_set_is_kept(tmp_path: Path) -> None:
    library = fake_blas(tmp_path)
    env = runner_environment(4, {"OPENBLAS_NUM_THREADS": "3", "JETSHARD_BLAS": str(library)})
    assert env["OPENBLAS_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "4"


THREADS_PER_STEP = (
    "import ctypes\n"
    "from jetshard_worker.engines.mlx.blas_threads import PARALLEL_MIN_TOKENS, BlasThreads\n"
    "get = ctypes.CDLL(None).scipy_openblas_get_num_threads\n"
    "threads = BlasThreads.of_this_process()\n"
    "seen = [get()]\n"
    "for tokens in (1, 8, PARALLEL_MIN_TOKENS, 2048, 4):\n"
    "    threads.fit(tokens)\n"
    "    seen.append(get())\n"
    "print(seen)\n"
)
"""The OpenBLAS thread count a runner's process has as it loads, then after each step of so many tokens."""


@linux_only
def test_a_runner_multiplies_small_steps_on_one_thread_and_long_prompts_on_all(tmp_path: Path) -> None:
    """OpenBLAS's threads spin on sched_yield: on a busy machine a decode step split over two of them waits for
    scheduler slices (ten times slower beside two nice-19 loops). Decode steps run on one, long prompts on all."""
    env = runner_environment(2, {"PATH": "/usr/bin:/bin"})
    done = subprocess.run([sys.executable, "-c", THREADS_PER_STEP], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[2, 1, 1, 2, 2, 1]", done.stdout + done.stderr
