"""Runners whose imports are slow, as on a busy machine (mlx and transformers take seconds), from outside the product:
a `sitecustomize` module that the runner's interpreter finds on its PYTHONPATH and that makes importing the runner's
module take as long as a test asks. The runner has armed its lifeline by then (`jetshard_worker.lifeline` imports
the module after), so this holds open exactly the window between a runner's launch and its start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SITECUSTOMIZE = '''
import sys
import time


class SlowRunnerImport:
    """Finds nothing; only sleeps before `jetshard_worker.runner` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "jetshard_worker.runner":
            time.sleep({seconds})
        return None


sys.meta_path.insert(0, SlowRunnerImport())
'''


def slow_runner_imports(directory: Path, seconds: float, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The PYTHONPATH under which a runner's module takes `seconds` to import (its `sitecustomize` goes in
    `directory`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE.format(seconds=seconds))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), environ.get("PYTHONPATH", "")) if p)}
