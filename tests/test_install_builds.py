"""Which mlx build an install gets, read from the lock as `uv` would install it (offline: `--frozen`).

mlx's CPU and CUDA builds both install `mlx/lib/libmlx.so`, so one install must never get two of them: the
README's `uv run jetshard up` (and `uv sync`) get the CPU build, the README's GPU command the CUDA one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILDS = re.compile(r"^(mlx-cpu|mlx-cuda-1[23]|mlx-metal)==", re.MULTILINE)


def _uv() -> str:
    """The uv running this suite (`uv run` names itself in `UV`), else the one on PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "no uv: run the suite as the README says (bash tests/run)"
    return found


def _export(*selection: str) -> subprocess.CompletedProcess[str]:
    command = [_uv(), "export", "--frozen", "--offline", "--no-hashes", *selection]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("selection", "builds"),
    [
        ((), ["mlx-cpu", "mlx-metal"]),  # Linux: the CPU build; macOS: Metal (each behind its platform marker)
        (("--no-group", "cpu", "--extra", "cuda13"), ["mlx-cuda-13", "mlx-metal"]),
        (("--no-group", "cpu", "--extra", "cuda12"), ["mlx-cuda-12", "mlx-metal"]),
    ],
)
def test_each_install_gets_exactly_one_mlx_build(selection: tuple[str, ...], builds: list[str]) -> None:
    exported = _export(*selection)
    assert exported.returncode == 0, exported.stderr
    assert sorted(BUILDS.findall(exported.stdout)) == builds


def test_the_readme_install_carries_neither_the_dev_tools_nor_vision() -> None:
    """`uv run jetshard up` installs what serving imports: the dev group (tests, linters, and mlx-vlm with its
    opencv, pandas and pyarrow for the vision tests) comes only with `--group dev`."""
    exported = _export()
    assert exported.returncode == 0, exported.stderr
    installed = set(re.findall(r"^([\w.-]+)==", exported.stdout, re.MULTILINE))
    assert "mlx-lm" in installed
    dev_only = {"pytest", "ruff", "mypy", "playwright", "schemathesis", "mlx-vlm", "opencv-python", "pandas", "pyarrow"}
    assert not installed & dev_only


def test_the_cpu_and_a_cuda_build_together_are_refused_naming_the_conflict() -> None:
    exported = _export("--extra", "cuda13")
    assert exported.returncode != 0
    assert "cuda13" in exported.stderr and "cpu" in exported.stderr


def test_the_docker_image_installs_the_vision_extra(tmp_path: Path) -> None:
    """The Dockerfile's own install command, run as a dry run into a throwaway environment (no Docker engine runs
    here): the image gets mlx-vlm, so its worker serves vision models, and the CPU build of mlx, without the dev
    tools."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (install,) = [line.removeprefix("RUN ").split("&&")[0] for line in dockerfile.splitlines() if "uv sync" in line]
    command = [_uv(), *shlex.split(install)[1:], "--offline", "--dry-run"]
    environment = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")}
    planned = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment)
    assert planned.returncode == 0, planned.stderr
    installed = set(re.findall(r"^ \+ ([\w.-]+)(?:==| @ )", planned.stdout + planned.stderr, re.MULTILINE))
    assert {"mlx-vlm", "mlx-lm", "mlx-cpu", "jetshard-worker", "pillow"} <= installed, planned.stdout + planned.stderr
    assert "pytest" not in installed
