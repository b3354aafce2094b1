"""The BLAS a runner loads, and how runners sharing a machine split its cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jetshard_worker.blas import blas_candidates, blas_threads, runner_environment

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
    env = runner_environment(tmp_path, 2, {"JETSHARD_BLAS": "0", "PATH": "/usr/bin"})
    assert env == {"JETSHARD_BLAS": "0", "PATH": "/usr/bin"}


def test_a_path_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        blas_candidates({"JETSHARD_BLAS": str(tmp_path / "libnothing.so")})


MULTIPLY = (
    "import mlx.core as mx\n"
    "a = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) / 4096\n"
    "mx.eval(a @ a.T)\n"
    "assert mx.allclose(a @ a.T, mx.sum(a[:, None, :] * a[None, :, :], axis=-1)).item()\n"
    "maps = open('/proc/self/maps').read()\n"
    "print(next((name for name in ('openblas', 'libfakeblas.so') if name in maps), 'reference'))\n"
)
"""What a runner does first: a float32 matrix product, and which BLAS computed it."""

# A cblas_sgemm for row-major products without transposes, and one built for a CPU this is not: both stand
# in for real libraries (a BLAS that runs, one whose kernels this processor lacks) that cannot be had here.
FAKE_BLAS = """
#include <stdlib.h>
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
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


def fake_blas(tmp_path: Path) -> Path:
    source, library = tmp_path / "fakeblas.c", tmp_path / "libfakeblas.so"
    source.write_text(FAKE_BLAS)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


@linux_only
def test_a_runner_multiplies_with_the_packaged_openblas_where_it_runs(tmp_path: Path) -> None:
    """The auto choice is the OpenBLAS wheel when its build runs on this processor (its kernels may need
    AVX-512), and a process started with the runner's environment loads it (with the gfortran runtime it
    needs) and multiplies correctly; where it cannot run, the runner multiplies with the next candidate (a
    system OpenBLAS) or the reference BLAS."""
    [packaged, *_] = blas_candidates({})
    assert "cmeel.prefix" in str(packaged)
    env = runner_environment(tmp_path, 1, {"PATH": "/usr/bin:/bin"})
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=env, capture_output=True, text=True, check=True)
    runs_here = subprocess.run(
        [sys.executable, "-c", MULTIPLY], env={**env, "LD_PRELOAD": str(packaged)}, capture_output=True
    )
    print(f"packaged OpenBLAS on this processor: exit {runs_here.returncode}; the runner used {done.stdout}")
    if runs_here.returncode == 0:
        assert env["LD_PRELOAD"] == str(packaged) and done.stdout.strip() == "openblas"
        assert env["OPENBLAS_NUM_THREADS"] == "1" and env["MKL_NUM_THREADS"] == "1"
    else:
        assert str(packaged) not in env.get("LD_PRELOAD", "")
        assert done.stdout.strip() == ("openblas" if "LD_PRELOAD" in env else "reference")


@linux_only
def test_a_blas_that_dies_in_its_first_product_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    library = fake_blas(tmp_path)
    trapping = {"PATH": "/usr/bin:/bin", "JETSHARD_BLAS": str(library), "FAKE_BLAS_TRAP": "1"}
    env = runner_environment(tmp_path, 1, trapping)
    assert env == trapping
    assert "crashed with SIGILL" in caplog.text
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "reference"

    working = runner_environment(tmp_path, 1, {"PATH": "/usr/bin:/bin", "JETSHARD_BLAS": str(library)})
    assert working["LD_PRELOAD"] == str(library)
    done = subprocess.run([sys.executable, "-c", MULTIPLY], env=working, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "libfakeblas.so"


@linux_only
def test_a_thread_count_the_user_set_is_kept(tmp_path: Path) -> None:
    library = fake_blas(tmp_path)
    env = runner_environment(tmp_path, 4, {"OPENBLAS_NUM_THREADS": "3", "JETSHARD_BLAS": str(library)})
    assert env["OPENBLAS_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "4"


@linux_only
def test_without_a_gfortran_runtime_the_runner_still_starts(tmp_path: Path) -> None:
    """The wheel's OpenBLAS placed where no vendored gfortran runtime sits beside it: the environment either
    finds the system's or leaves the preload out, so a process started with it always runs."""
    [packaged, *_] = blas_candidates({})
    lonely = tmp_path / "elsewhere" / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    lonely.parent.mkdir(parents=True)
    lonely.symlink_to(packaged)
    links = tmp_path / "links"
    links.mkdir()
    env = runner_environment(links, 1, {"PATH": "/usr/bin:/bin", "JETSHARD_BLAS": str(lonely)})
    assert "LD_LIBRARY_PATH" not in env
    subprocess.run(
        [sys.executable, "-c", "import mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))"], env=env, check=True
    )
