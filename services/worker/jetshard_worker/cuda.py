"""What a runner on mlx's CUDA build needs from its environment.

mlx's CUDA wheel (`mlx-cuda-13`, `mlx-cuda-12`) finds the NVIDIA libraries it links (cuBLAS, cuDNN, NCCL,
cuFFT, cuSOLVER, NVRTC) by an RPATH relative to its own site directory, `$ORIGIN/../../nvidia/<library>/lib`.
Where pip put them in another site directory (a virtual environment made with `--system-site-packages` over an
image that carries them, as CUDA PyTorch images do), the loader does not look there and the runner dies
importing mlx (`libcublasLt.so.13: cannot open shared object file`). So a runner is started with every
`nvidia/*/lib` directory of its Python path on `LD_LIBRARY_PATH`.

No optimized CPU BLAS is preloaded there: a runner on the GPU multiplies on the GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def nvidia_library_dirs(search_path: Iterable[str] = sys.path) -> list[Path]:
    """The `nvidia/<library>/lib` directories of the `nvidia-*` wheels on `search_path`, in its order."""
    found: list[Path] = []
    for entry in search_path:
        for library_dir in sorted(Path(entry or ".").glob("nvidia/*/lib")):
            if library_dir.is_dir() and library_dir not in found:
                found.append(library_dir)
    return found


def cuda_runner_environment(
    environ: Mapping[str, str] = os.environ, search_path: Iterable[str] = sys.path
) -> dict[str, str]:
    """`environ` with the NVIDIA wheels' libraries findable ahead of what `LD_LIBRARY_PATH` held."""
    dirs = [str(d) for d in nvidia_library_dirs(search_path)]
    if not dirs:
        return dict(environ)
    return {**environ, "LD_LIBRARY_PATH": os.pathsep.join([*dirs, *filter(None, [environ.get("LD_LIBRARY_PATH")])])}
