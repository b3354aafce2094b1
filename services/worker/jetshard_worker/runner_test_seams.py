"""The runner's seams for tests: faults and timings a test sets through the runner's environment, read once.

Production never sets these variables: each default leaves the runner as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

OVERSIZE_CHUNKS_ENV = "JETSHARD_TEST_RUNNER_OVERSIZE_CHUNKS_FROM"


@dataclass(frozen=True)
class RunnerTestSeams:
    oversize_chunks_from: int = -1
    """Pad each chunk from this index on past the server's max_payload, so that the client refuses to publish it
    (MaxPayloadError), as it would a chunk that outgrew the limit; -1: none."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RunnerTestSeams:
        return cls(
            oversize_chunks_from=int(environ.get(OVERSIZE_CHUNKS_ENV, cls.oversize_chunks_from)),
        )

    def oversizes(self, chunk_index: int) -> bool:
        return 0 <= self.oversize_chunks_from <= chunk_index
