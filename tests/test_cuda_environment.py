"""A runner on mlx's CUDA build finds the NVIDIA wheels' libraries wherever pip put them.

No GPU exists here, so the library is a stand-in: a real shared object copied to where an `nvidia-*` wheel puts
its own, in a second site directory, as in a virtual environment made with `--system-site-packages` over a CUDA
image. What is tested is real: the dynamic loader of a fresh process finds it by name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import scipy_openblas32
from jetshard_worker.cuda import cuda_runner_environment, nvidia_library_dirs

LIBRARY = "libstandin_cublasLt.so.13"


def _site_with_an_nvidia_library(root: Path) -> Path:
    library_dir = root / "nvidia" / "cublas" / "lib"
    library_dir.mkdir(parents=True)
    any_shared_object = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    shutil.copyfile(any_shared_object, library_dir / LIBRARY)
    (root / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (root / "nvidia" / "README").write_text("not a library directory")
    return root


def _loads(env: dict[str, str]) -> bool:
    probe = f"import ctypes; ctypes.CDLL({LIBRARY!r})"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def test_a_runner_loads_nvidia_libraries_from_another_site_directory(tmp_path: Path) -> None:
    venv_site, system_site = tmp_path / "venv-site", _site_with_an_nvidia_library(tmp_path / "system-site")
    venv_site.mkdir()
    search_path = [str(venv_site), str(system_site), str(system_site)]
    assert nvidia_library_dirs(search_path) == [system_site / "nvidia/cu13/lib", system_site / "nvidia/cublas/lib"]

    base = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/own/lib"}
    assert not _loads(base)  # the RPATH-less case: not found, as exo's runners hit it
    env = cuda_runner_environment(base, search_path)
    assert _loads(env)
    assert env["LD_LIBRARY_PATH"].endswith(":/opt/own/lib")  # the user's own directories stay, after
    assert cuda_runner_environment(base, [str(venv_site)]) == base  # no NVIDIA wheels: nothing changes


def test_the_worker_never_loads_mlx_itself() -> None:
    """Only runners load mlx (with the environment above); a worker that did would die on the CUDA build where the
    NVIDIA libraries sit in another site directory, before it could start any runner."""
    probe = "import sys, jetshard_worker.service; print('mlx.core' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"
