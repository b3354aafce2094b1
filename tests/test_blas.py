"""The BLAS a runner loads, and how runners sharing a machine split its cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jetshard_worker.blas import blas_preload, blas_threads, runner_environment

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
        blas_preload({"JETSHARD_BLAS": str(tmp_path / "libnothing.so")})


@linux_only
def test_a_runner_multiplies_with_the_packaged_openblas(tmp_path: Path) -> None:
    """The auto choice is the OpenBLAS wheel, and a process started with the runner's environment really
    loads it (with the gfortran runtime it needs) and multiplies correctly."""
    library = blas_preload({})
    assert library is not None and "cmeel.prefix" in str(library)
    env = runner_environment(tmp_path, 1, {"PATH": "/usr/bin:/bin"})
    assert env["OPENBLAS_NUM_THREADS"] == "1" and env["MKL_NUM_THREADS"] == "1"
    script = (
        "import mlx.core as mx\n"
        "a = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) / 4096\n"
        "mx.eval(a @ a.T)\n"
        "assert mx.allclose(a @ a.T, mx.sum(a[:, None, :] * a[None, :, :], axis=-1)).item()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('openblas' if 'libopenblas.so' in maps else 'reference')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "openblas"


@linux_only
def test_a_thread_count_the_user_set_is_kept(tmp_path: Path) -> None:
    env = runner_environment(tmp_path, 4, {"OPENBLAS_NUM_THREADS": "3"})
    assert env["OPENBLAS_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "4"


@linux_only
def test_without_a_gfortran_runtime_the_runner_still_starts(tmp_path: Path) -> None:
    """The wheel's OpenBLAS placed where no vendored gfortran runtime sits beside it: the environment either
    finds the system's or leaves the preload out, so a process started with it always runs."""
    packaged = blas_preload({})
    assert packaged is not None
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
