"""`python -m jetshard_worker.engines.llamacpp [all|avx2]`: build (or find cached) and probe llama.cpp, printing
each progress step as one JSON line (`{"phase": …, "percent": …, "detail": …}`) and, last, `{"error": …}` or
`{"ready": <llama-server path>}`. How the worker builds in the background, in a process of its own."""

from __future__ import annotations

import sys

import msgspec

from jetshard_worker.engines.llamacpp.build import BuildError, CpuVariants, Progress
from jetshard_worker.engines.llamacpp.probe import ProbeError, build_and_probe


def _emit(line: object) -> None:
    sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
    sys.stdout.flush()


def main() -> int:
    variants = CpuVariants(sys.argv[1]) if len(sys.argv) > 1 else CpuVariants.ALL

    def on_progress(progress: Progress) -> None:
        _emit(progress)

    try:
        ready = build_and_probe(variants, on_progress)
    except (BuildError, ProbeError) as error:
        _emit({"error": str(error)})
        return 1
    _emit({"ready": str(ready.llama_server)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
